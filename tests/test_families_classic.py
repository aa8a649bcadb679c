# GPT-2, GPT-J, Falcon and MPT (issue 15) against Hugging Face transformers, as tests/test_families.py does for the
# newer families: a tiny random model of each transformers class -> save_pretrained -> scripts/convert_checkpoint.py
# (the CLI) -> logits within 1e-4 on prefill and every decode step, 32 identical greedy tokens for a padded batch of
# two prompts; the same from a GGUF named as llama.cpp names them. Falcon comes in its three block layouts (7B: multi-
# query, parallel, one LayerNorm; 40B "new decoder architecture": grouped KV, two LayerNorms; the sequential layout with
# biases), MPT with a non-power-of-two head count (ALiBi slopes) and clip_qkv.
# Backends: every family through ONNX Runtime (export_onnx.py) but Falcon's sequential layout (Llama's block
# order); their blocks (learned positions, ALiBi, parallel attention with two norms, clip_qkv, biased output) are in
# tests/test_families_backends.py's chimera, which runs --compile, AOT Inductor (.pt2 + runner-aoti) and ExecuTorch
# (.pte + runner-et): one export per backend for every family. Multi-query (Falcon-7B) is not in the chimera (see
# there); it runs through ONNX Runtime here.
# CodeGen2.5 / XGen are Llama networks: a converted CodeGen2.5-style directory loads its tiktoken tokenizer and runs.
import json
import re
import sys

import pytest
import torch
from conftest import hf_greedy, make_bpe_tokenizer, run_cli
from test_families import VOCAB, assert_greedy_batch_matches, assert_logits_match
from test_families_backends import MAX_SEQ, PROMPTS, backend_tokens, eager_tokens

from engine import TorchBackend, generate
from model import ModelArgs, Transformer
from quantize import load_model

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "scripts"))
import convert_checkpoint  # noqa: E402

CPU = torch.device("cpu")
_GPT = dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, n_inner=160)
_FALCON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_hidden_size=160)
CLASSIC = {  # name: (transformers config class, model class, config)
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", _GPT),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(_GPT, rotary_dim=8)),  # rotate_every_two on 8 of 16 head dims
    "falcon-7b": ("FalconConfig", "FalconForCausalLM", _FALCON),  # multi_query, parallel_attn: the defaults
    "falcon-40b": ("FalconConfig", "FalconForCausalLM",
                   dict(_FALCON, new_decoder_architecture=True, num_kv_heads=2, tie_word_embeddings=False)),
    "falcon-seq": ("FalconConfig", "FalconForCausalLM",
                   dict(_FALCON, multi_query=False, parallel_attn=False, bias=True)),
    "mpt": ("MptConfig", "MptForCausalLM", dict(d_model=96, n_layers=2, n_heads=6, max_seq_len=256,
                                                attn_config=dict(clip_qkv=0.6))),
}


def classic_hf(name: str, seed: int = 0, **over):
    import transformers
    cfg_cls, model_cls, kw = CLASSIC[name]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_cls)(**dict(kw, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, **over))
    hf = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
    return hf


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """name -> (converted checkpoint dir with a BPE tokenizer of VOCAB tokens beside it, the transformers model)."""
    root, cache = tmp_path_factory.mktemp("classic"), {}

    def get(name):
        if name not in cache:
            hf = classic_hf(name)
            src, out = root / f"{name}-hf", root / name
            hf.save_pretrained(src)
            r = run_cli("scripts/convert_checkpoint.py", src, "--output_dir", out)
            assert r.returncode == 0, r.stderr
            cache[name] = make_bpe_tokenizer(out, VOCAB), hf
        return cache[name]
    return get


@pytest.mark.parametrize("name", list(CLASSIC))
def test_logits_prefill_and_every_decode_step(name, converted, one_thread):
    assert_logits_match(*converted(name))


@pytest.mark.parametrize("name", list(CLASSIC))
def test_greedy_tokens_batch_of_two_prompts(name, converted, one_thread):
    """A padded batch (per-row positions: learned position embeddings and ALiBi read them too)."""
    assert_greedy_batch_matches(*converted(name))


@torch.no_grad()
def test_alibi_refuses_a_caller_mask(converted):
    """A caller's mask (lookahead decoding, its exported programs) lays out cache slots that need not be positions:
    ALiBi, which biases by key position, refuses it with one clear error instead of biasing wrongly."""
    d, _ = converted("mpt")
    model = load_model(d / "model.pth")
    model.setup_caches(1, 48)
    causal = (torch.arange(48).view(1, 48) <= torch.arange(2).view(2, 1)).view(1, 1, 2, 48)
    with pytest.raises(ValueError, match="ALiBi.*lookahead"):
        model(torch.tensor([[1, 2]]), torch.arange(2), mask=causal)


def test_from_hf_config_reads_each_family():
    """The fields each family's blocks hang on, read from the transformers configs (not from our converter)."""
    def args(name):
        return ModelArgs.from_hf_config(classic_hf(name).config.to_dict())
    g2, gj, f7, f40, fs, mpt = (args(n) for n in CLASSIC)
    assert (g2.learned_pos, g2.nope_layers, mpt.nope_layers, gj.nope_layers) == (True, [0, 1], [0, 1], None)
    assert (g2.learned_pos, g2.norm_type, g2.mlp_gated, g2.mlp_act, g2.attn_bias, g2.tie_embeddings) == (
        True, "layer", False, "gelu_tanh", True, True)
    assert (gj.parallel_attn, gj.parallel_norms, gj.rotary_dim, gj.output_bias, gj.tie_embeddings) == (
        True, 1, 8, True, False)
    assert (f7.n_local_heads, f7.parallel_attn, f7.parallel_norms, f7.mlp_act, f7.attn_bias) == (
        1, True, 1, "gelu", False)
    assert (f40.n_local_heads, f40.parallel_attn, f40.parallel_norms) == (2, True, 2)
    assert (fs.n_local_heads, fs.parallel_attn, fs.attn_bias, fs.mlp_bias) == (4, False, True, True)
    assert (mpt.alibi, mpt.alibi_bias_max, mpt.clip_qkv, mpt.norm_bias, mpt.mlp_act, mpt.intermediate_size) == (
        True, 8.0, 0.6, False, "gelu", 384)


def test_named_configs_match_the_published_models():
    """Named configs give the published parameter counts (GPT-2's model card sizes, Falcon's and MPT's)."""
    def n_params(name):
        with torch.device("meta"):
            m = Transformer(ModelArgs.from_name(name))
        return sum(p.numel() for p in m.parameters())  # tied output counted once
    assert [n_params(n) for n in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")] == [
        124_439_808, 354_823_168, 774_030_080, 1_557_611_200]
    assert n_params("falcon-7b") == 6_921_720_704
    assert n_params("falcon-40b") == 41_303_293_952
    assert n_params("mpt-7b") == 6_649_286_656
    gj = ModelArgs.from_name("GPT-J-6B")
    assert (gj.rotary_dim, gj.head_dim, gj.parallel_attn, gj.output_bias, gj.vocab_size) == (64, 256, True, True, 50400)
    for name, ctx in (("codegen25-7b-mono", 2048), ("xgen-7b-8k-base", 8192)):
        a = ModelArgs.from_name(name)
        assert (a.vocab_size, a.block_size, a.dim, a.n_layer, a.norm_type, a.mlp_gated) == (
            51200, ctx, 4096, 32, "rms", True)


@pytest.mark.parametrize("name, option, pattern", [
    ("falcon-7b", dict(alibi=True), "falcon.*alibi"),
    ("mpt", dict(attn_config=dict(qk_ln=True)), "mpt.*qk_ln"),
    ("gpt2", dict(scale_attn_by_inverse_layer_idx=True), "gpt2.*scale_attn_by_inverse_layer_idx"),
])
def test_unsupported_option_is_one_error_line(name, option, pattern, converted, tmp_path, capsys):
    """An option model.py does not implement is refused at conversion, naming the family and the option."""
    import shutil
    d, _ = converted(name)
    src = tmp_path / "src"
    shutil.copytree(d.parent / f"{name}-hf", src)
    cfg = json.loads((src / "config.json").read_text())
    for k, v in option.items():
        cfg[k] = dict(cfg[k], **v) if isinstance(v, dict) else v
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SystemExit) as e:  # in process (a subprocess costs seconds): main() is what the CLI runs
        convert_checkpoint.main([str(src), "--output_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert e.value.code == 1 and "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and re.search(pattern, lines[0], re.I), err
    assert not (tmp_path / "out" / "model.pth").exists()


# ---------------------------------------------------------------- GGUF, named as llama.cpp's convert_hf_to_gguf.py does
GGUF_ARCH = {"gpt2": "gpt2", "gptj": "gptj", "falcon-7b": "falcon", "falcon-40b": "falcon", "mpt": "mpt"}


def write_classic_gguf(hf, arch: str, path):
    """The tiny transformers model as an F32 GGUF with llama.cpp's metadata keys and tensor names: GPT-2's Conv1D
    weights transposed, Falcon's query_key_value reordered to q, k, v (convert_hf_to_gguf.py's FalconModel), GPT-J's
    q/k as transformers holds them (rotate_every_two)."""
    import gguf
    c, sd = hf.config, {k: v.float() for k, v in hf.state_dict().items()}
    d, H = c.hidden_size, c.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(c.max_position_embeddings if arch != "mpt" else c.max_seq_len)
    w.add_embedding_length(d)
    w.add_block_count(c.num_hidden_layers)
    w.add_head_count(H)
    w.add_layer_norm_eps(c.layer_norm_epsilon)
    w.add_feed_forward_length(c.n_inner if arch in ("gpt2", "gptj") else 4 * d if arch == "mpt" else c.ffn_hidden_size)
    if arch == "falcon":
        w.add_head_count_kv(c.num_kv_heads if c.new_decoder_architecture else 1)
    if arch == "gptj":
        w.add_rope_dimension_count(c.rotary_dim)
    if arch == "mpt":
        w.add_clamp_kqv(c.attn_config.clip_qkv)
        w.add_max_alibi_bias(8.0)
    names = {"wte": "token_embd", "word_embeddings": "token_embd", "wpe": "position_embd", "ln_f": "output_norm",
             "norm_f": "output_norm", "ln_1": "attn_norm", "ln_2": "ffn_norm", "input_layernorm": "attn_norm",
             "ln_attn": "attn_norm", "ln_mlp": "attn_norm_2", "norm_1": "attn_norm", "norm_2": "ffn_norm",
             "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down",
             "attn.q_proj": "attn_q", "attn.k_proj": "attn_k", "attn.v_proj": "attn_v", "attn.out_proj": "attn_output",
             "mlp.fc_in": "ffn_up", "mlp.fc_out": "ffn_down", "self_attention.query_key_value": "attn_qkv",
             "self_attention.dense": "attn_output", "mlp.dense_h_to_4h": "ffn_up", "mlp.dense_4h_to_h": "ffn_down",
             "attn.Wqkv": "attn_qkv", "ffn.up_proj": "ffn_up", "ffn.down_proj": "ffn_down"}
    for name, t in sd.items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        parts = name.split(".")
        if name.startswith("lm_head."):
            g = "output." + parts[-1]
        elif parts[1] in ("h", "blocks"):
            g = f"blk.{parts[2]}.{names['.'.join(parts[3:-1])]}.{parts[-1]}"
        else:
            g = f"{names[parts[1]]}.{parts[-1]}"
        if arch == "gpt2" and name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            t = t.t()
        if arch == "falcon" and "query_key_value" in name:
            kv = c.num_kv_heads if c.new_decoder_architecture else 1
            qkv = t.reshape(kv, H // kv + 2, d // H, *t.shape[1:])
            t = torch.cat([qkv[:, :-2].reshape(-1, *t.shape[1:]), qkv[:, -2].reshape(-1, *t.shape[1:]),
                           qkv[:, -1].reshape(-1, *t.shape[1:])])
        w.add_tensor(g, t.contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("name", list(GGUF_ARCH))
@torch.no_grad()
def test_gguf_of_each_family(name, tmp_path, one_thread):
    hf = classic_hf(name, seed=4)
    write_classic_gguf(hf, GGUF_ARCH[name], tmp_path / "m.gguf")
    convert_checkpoint.convert(tmp_path / "m.gguf", tmp_path / "out")  # in process: the CLI is tested above
    model = load_model(tmp_path / "out" / "model.pth")
    model.setup_caches(1, 48)
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(3))
    assert (model(ids, torch.arange(40)) - hf(ids).logits).abs().max() <= 1e-4


# ------------------------------------------------------------------------------------------------------- backends
@pytest.mark.parametrize("name", [n for n in CLASSIC if n != "falcon-seq"])
def test_onnx_runtime_every_family(name, converted, one_thread):
    import export_onnx
    d, _ = converted(name)
    out = d.parent / f"{name}-onnx"
    meta = export_onnx.export(d / "model.pth", out, ctx_len=MAX_SEQ, atol=1e-4, log=lambda *a: None)
    assert meta["check"]["passed"], meta["check"]["summary"]
    want = eager_tokens(d / "model.pth")
    assert backend_tokens(lambda: export_onnx.OnnxBackend(out / "model.onnx", 1, MAX_SEQ)) == want
    batch, _ = generate(export_onnx.OnnxBackend(out / "model.onnx", 2, MAX_SEQ), PROMPTS, 24, CPU)
    assert batch == want


# ------------------------------------------------------------------------------ CodeGen2.5 / XGen: Llama + tiktoken
@pytest.mark.parametrize("which", ["codegen25", "xgen"])
def test_tiktoken_family_checkpoint_end_to_end(which, tmp_path, monkeypatch, one_thread):
    """A CodeGen2.5 / XGen-style Hugging Face directory (LlamaForCausalLM, tokenizer_config.json naming the
    tokenization_*.py class, no ranks shipped) converts with its tokenizer: the converted directory encodes and
    decodes as the `tiktoken` Encoding those classes build, and its network runs as transformers' does. tiktoken's
    base ranks (a download) are a tiny trained stand-in here, given to tiktoken.get_encoding."""
    import tiktoken
    import transformers
    from test_family_tokenizers import family_texts, tiktoken_family

    import tokenizer_tiktoken as TT
    from tokenizer import load_tokenizer
    enc, base = tiktoken_family(which, tmp_path / "standin")
    cls = "CodeGen25Tokenizer" if which == "codegen25" else "Xgen15BTokenizer"
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: base if name == TT.SALESFORCE[cls][0] else None)
    src = tmp_path / "hf"
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=enc.n_vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
    hf.save_pretrained(src)
    (src / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": cls, "auto_map": {"AutoTokenizer": [f"tokenization_{which}.{cls}", None]}}))
    convert_checkpoint.convert(src, tmp_path / "out")
    tok = load_tokenizer(tmp_path / "out")
    for t in family_texts(enc._special_tokens)[:60] + ["def f(x):\n\t\treturn x  # café 🤖\n" + " " * 40 + "end"]:
        ids = enc.encode(t, allowed_special="all")
        assert tok.encode(t) == ids, t
        assert tok.decode(ids) == t
    prompt = tok.encode("def hello():\n    ")
    out, _ = generate(TorchBackend(load_model(tmp_path / "out" / "model.pth"), 1, 64), [prompt], 16, CPU)
    assert out == [hf_greedy(hf, prompt, 16)]
