# Every model family of model.py against Hugging Face transformers (code nobody here wrote): a tiny random model of
# each family's transformers class is saved with save_pretrained, converted by scripts/convert_checkpoint.py (the CLI a
# user runs) and must give the same logits (prefill and every decode step, within 1e-4) and the same 32 greedy tokens
# (a batch of two prompts of different lengths). Sliding-window families run past their window (8 tokens here).
import math

import pytest
import torch
from conftest import hf_greedy, run_cli

from engine import TorchBackend, generate
from model import ModelArgs, transformer_configs
from quantize import load_model

WINDOW = 8
VOCAB = 320  # = conftest.make_bpe_tokenizer's vocabulary, so test_families_backends can use these models with it
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
FAMILIES = {  # name: (transformers config class, model class, config overrides)
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=24, tie_word_embeddings=True)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW, attn_logit_softcapping=5.0,
                    final_logit_softcapping=3.0, layer_types=["sliding_attention", "full_attention"])),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW, tie_word_embeddings=True,
                    layer_types=["sliding_attention", "full_attention"],
                    rope_parameters={"full_attention": dict(rope_type="linear", factor=4.0, rope_theta=100000.0),
                                     "sliding_attention": dict(rope_type="default", rope_theta=1000.0)})),
    # Phi-4-mini's partial rotary + Phi-3-128k's longrope (one factor per rotary frequency: 16 * 0.5 / 2), a window
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(pad_token_id=0, sliding_window=WINDOW, original_max_position_embeddings=64,
                  rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.5,
                                       short_factor=[1.0, 1.5, 2.0, 3.0], long_factor=[1.0, 4.0, 9.0, 16.0]))),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(pad_token_id=0, no_rope_layers=[1, 0])),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(intermediate_size=96, num_local_experts=4,
                                                            num_experts_per_tok=2)),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(sliding_window=WINDOW, tie_word_embeddings=True)),
}


def family_hf(name: str, seed: int = 0, layers: int = None):
    """A tiny random transformers model of the family (BASE's layers, or layers), weights scaled so logits are well
    separated."""
    import transformers
    cfg_cls, model_cls, kw = FAMILIES[name]
    torch.manual_seed(seed)
    cfg = {**BASE, **kw, **({"num_hidden_layers": layers} if layers else {})}
    hf = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**cfg)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
    return hf


def convert_family(name: str, root, seed: int = 0, layers: int = None):
    """save_pretrained + convert_checkpoint.py (CLI). Returns (converted checkpoint dir, the transformers model)."""
    hf = family_hf(name, seed, layers)
    tag = f"{name}-{layers}l" if layers else name
    src, out = root / f"{tag}-hf", root / tag
    hf.save_pretrained(src)
    r = run_cli("scripts/convert_checkpoint.py", src, "--output_dir", out)
    assert r.returncode == 0, r.stderr
    return out, hf


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root, cache = tmp_path_factory.mktemp("families"), {}

    def get(name):
        if name not in cache:
            cache[name] = convert_family(name, root)
        return cache[name]
    return get


@torch.no_grad()
def assert_logits_match(d, hf):
    """The converted checkpoint in d against transformers' hf: prefill of 20 tokens, then 20 decode steps through the
    cache, every logit within 1e-4 (tests/test_families_classic.py uses it too)."""
    model = load_model(d / "model.pth")
    model.setup_caches(1, 48)
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    ref = hf(ids).logits
    got = model(ids[:, :20], torch.arange(20))  # prefill already longer than the window
    assert (got - ref[:, :20]).abs().max() <= 1e-4
    for t in range(20, 40):  # one token at a time through the cache, 5 windows past the start
        got = model(ids[:, t:t + 1], torch.tensor([t]))
        assert (got[:, 0] - ref[:, t]).abs().max() <= 1e-4, f"decode step at position {t}"


def assert_greedy_batch_matches(d, hf):
    """A padded batch of two prompts (11 and 4 tokens, per-row positions): 32 greedy tokens each, as transformers'."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (11, 4)]
    expected = [hf_greedy(hf, p, 32) for p in prompts]
    backend = TorchBackend(load_model(d / "model.pth"), max_batch_size=2, max_seq_length=64)
    out, _ = generate(backend, prompts, 32, torch.device("cpu"))
    assert out == expected


@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_prefill_and_every_decode_step(name, converted, one_thread):
    assert_logits_match(*converted(name))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_tokens_batch_of_two_prompts(name, converted, one_thread):
    assert_greedy_batch_matches(*converted(name))


@pytest.mark.parametrize("name", ["mistral", "gemma2"])
@torch.no_grad()
def test_caller_mask_keeps_the_sliding_window(name, converted):
    """Callers that lay out the cache themselves (speculative / lookahead decoding) pass `mask`: sliding layers still
    see only their window, so the plain causal mask gives transformers' logits past the window."""
    d, hf = converted(name)
    model = load_model(d / "model.pth")
    model.setup_caches(1, 48)
    ids = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(5))
    causal = (torch.arange(48).view(1, 48) <= torch.arange(30).view(30, 1)).view(1, 1, 30, 48)
    assert (model(ids, torch.arange(30), mask=causal) - hf(ids).logits).abs().max() <= 1e-4


@torch.no_grad()
def test_longrope_long_factors_past_the_pretraining_context(converted, one_thread):
    """A cache longer than original_max_position_embeddings (64) uses the long factors, as transformers does for a
    sequence that long."""
    d, hf = converted("phi3")
    model = load_model(d / "model.pth")
    model.setup_caches(1, 128)
    ids = torch.randint(0, VOCAB, (1, 80), generator=torch.Generator().manual_seed(2))
    assert (model(ids, torch.arange(80)) - hf(ids).logits).abs().max() <= 1e-4


def test_from_hf_config_reads_each_family(converted):
    """The fields each family's blocks hang on, read from the transformers config (not from our converter)."""
    def args(name):
        return ModelArgs.from_hf_config(family_hf(name).config.to_dict())
    g2, g3, phi, smol, mix, sc = (args(n) for n in ("gemma2", "gemma3", "phi3", "smollm3", "mixtral", "starcoder2"))
    assert (g2.attn_softcap, g2.final_softcap, g2.sliding_layers, g2.attn_scale) == (5.0, 3.0, [0], 24 ** -0.5)
    assert (g3.rope_local_base, g3.rope_base, g3.rope_scaling, g3.qk_norm) == (1000.0, 100000.0,
                                                                               dict(rope_type="linear", factor=4.0), True)
    assert (phi.rotary_dim, phi.rope_scaling["rope_type"], phi.sliding_window) == (8, "longrope", WINDOW)
    assert smol.nope_layers == [1]
    assert (mix.n_experts, mix.n_experts_per_tok) == (4, 2)
    assert (sc.norm_type, sc.mlp_gated, sc.mlp_bias, sc.attn_out_bias) == ("layer", False, True, True)


def test_named_configs_of_the_families():
    for name in ("gemma-2b", "gemma-7b", "gemma-2-2b", "gemma-2-9b", "gemma-3-1b", "gemma-3-4b",
                 "Phi-3-mini-4k-instruct", "Phi-3-mini-128k-instruct", "Phi-4-mini-instruct", "SmolLM3-3B",
                 "Mistral-7B-Instruct-v0.1", "Codestral-22B", "Mixtral-8x7B", "starcoder2-3b", "starcoder2-7b",
                 "starcoder2-15b"):
        assert name in transformer_configs
    assert ModelArgs.from_name("Mistral-7B-Instruct-v0.1-hf").sliding_window == 4096
    assert ModelArgs.from_name("Mixtral-8x7B-Instruct-v0.1").n_experts == 8
    assert ModelArgs.from_name("gemma-3-1b-it").sliding_layers[:6] == [0, 1, 2, 3, 4, 6]


# ---------------------------------------------------------------- GGUF, named as llama.cpp's convert_hf_to_gguf.py does
GGUF_CASES = {  # family -> (GGUF arch, config overrides: llama.cpp stores no query_pre_attn_scalar / layer pattern)
    "gemma": ("gemma", {}),
    "gemma2": ("gemma2", dict(query_pre_attn_scalar=16)),
    "gemma3": ("gemma3", dict(query_pre_attn_scalar=16, layer_types=None, rope_parameters=None)),  # pattern 6
    "phi3": ("phi3", {}),
    "starcoder2": ("starcoder2", dict(sliding_window=4096)),  # what every StarCoder2 release uses; GGUF omits it
    "mixtral": ("llama", {}),
    # no GGUF key for the NoPE layers: llama.cpp skips rotary on every 4th layer, which SmolLM3-3B does
    "smollm3": ("smollm3", dict(num_hidden_layers=4, no_rope_layers=None, no_rope_layer_interval=4)),
}
_GG = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
       "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv", "mlp.gate_proj": "ffn_gate",
       "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate_up_proj": "ffn_up", "mlp.c_fc": "ffn_up",
       "mlp.c_proj": "ffn_down", "input_layernorm": "attn_norm", "self_attn.q_norm": "attn_q_norm",
       "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp"}


def write_family_gguf(hf, arch: str, path):
    """The tiny transformers model as an F32 GGUF: metadata keys and tensor names of llama.cpp's converter (Gemma
    norms stored as 1 + w, Q/K permuted to adjacent pairs for arch llama, experts stacked [E, ...])."""
    import gguf
    import numpy as np
    c, sd = hf.config, {k: v.float() for k, v in hf.state_dict().items()}
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    if arch == "starcoder2":
        w.add_layer_norm_eps(c.norm_epsilon)
    else:
        w.add_layer_norm_rms_eps(c.rms_norm_eps)
    post = {"gemma2": "post_attention_norm", "gemma3": "post_attention_norm"}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "model.norm.bias": "output_norm.bias", "lm_head.weight": "output.weight"}
    for i in range(c.num_hidden_layers):
        layer = dict(_GG)
        layer["post_attention_layernorm"] = post.get(arch, "ffn_norm")
        layer.update({"pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"})
        for hf_name, g in layer.items():
            for suffix in ("weight", "bias"):
                names[f"model.layers.{i}.{hf_name}.{suffix}"] = f"blk.{i}.{g}.{suffix}"
    if arch == "gemma2":
        w.add_sliding_window(c.sliding_window)
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    if arch == "gemma3":
        w.add_sliding_window(c.sliding_window)
    if arch == "phi3":
        w.add_sliding_window(c.sliding_window)
        w.add_rope_dimension_count(int(head_dim * rope["partial_rotary_factor"]))
        orig = c.original_max_position_embeddings
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(c.max_position_embeddings / orig) / math.log(orig)))
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    if arch == "llama" and getattr(c, "num_local_experts", 0):
        w.add_expert_count(c.num_local_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        for i in range(c.num_hidden_layers):
            x = f"model.layers.{i}.mlp.experts."  # transformers 5 holds the experts fused: [E, 2I, D], [E, D, I]
            gate, up = sd.pop(x + "gate_up_proj").chunk(2, dim=1)
            for t, theirs in ((gate, "ffn_gate_exps"), (up, "ffn_up_exps"), (sd.pop(x + "down_proj"), "ffn_down_exps")):
                w.add_tensor(f"blk.{i}.{theirs}.weight", t.contiguous().numpy())
    for hf_name, t in sd.items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        g = names[hf_name]
        if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            t = t + 1
        if arch in ("llama", "smollm3") and (".q_proj." in hf_name or ".k_proj." in hf_name):  # -> adjacent pairs
            n = c.num_attention_heads if ".q_proj." in hf_name else c.num_key_value_heads
            t = t.reshape(n, 2, head_dim // 2, -1).transpose(1, 2).reshape(t.shape)
        w.add_tensor(g, t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("name", list(GGUF_CASES))
@torch.no_grad()
def test_gguf_of_each_family(name, tmp_path, one_thread):
    arch, over = GGUF_CASES[name]
    cfg_cls, model_cls, kw = FAMILIES[name]
    saved = FAMILIES[name]
    FAMILIES[name] = (cfg_cls, model_cls, {k: v for k, v in dict(kw, **over).items() if v is not None})
    try:
        hf = family_hf(name, seed=4)
    finally:
        FAMILIES[name] = saved
    write_family_gguf(hf, arch, tmp_path / "m.gguf")
    r = run_cli("scripts/convert_checkpoint.py", tmp_path / "m.gguf", "--output_dir", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    model = load_model(tmp_path / "out" / "model.pth")
    model.setup_caches(1, 48)
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(3))
    assert (model(ids, torch.arange(40)) - hf(ids).logits).abs().max() <= 1e-4


def test_unimplemented_config_feature_is_refused_by_name(converted, tmp_path):
    """A config feature model.py does not implement (here yarn rope scaling) is one error line naming the family and
    the feature, never a silent conversion."""
    import json
    import shutil

    from conftest import assert_clean_error
    d, _ = converted("mistral")
    src = tmp_path / "yarn"
    shutil.copytree(d.parent / "mistral-hf", src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["rope_parameters"] = dict(rope_type="yarn", factor=4.0, rope_theta=10000.0, original_max_position_embeddings=64)
    (src / "config.json").write_text(json.dumps(cfg))
    r = run_cli("scripts/convert_checkpoint.py", src, "--output_dir", tmp_path / "out")
    assert_clean_error(r, "MistralForCausalLM.*yarn")
    assert not (tmp_path / "out" / "model.pth").exists()
