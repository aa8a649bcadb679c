# Every model family of model.py against Hugging Face transformers (code nobody here wrote): a tiny random model of
# each family's transformers class is saved with save_pretrained, converted by scripts/convert_checkpoint.py (the CLI a
# user runs) and must give the same logits (prefill and every decode step, within 1e-4) and the same 32 greedy tokens
# (a batch of two prompts of different lengths). Sliding-window families run past their window (8 tokens here).
import pytest
import torch
from conftest import hf_greedy, run_cli

from generate import TorchBackend, generate
from model import ModelArgs, load_model, transformer_configs

WINDOW = 8
VOCAB = 320  # = conftest.make_bpe_tokenizer's vocabulary, so test_families_backends can use these models with it
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
_rot = 8 // 2  # Phi-3's longrope factors: one per rotary frequency (head_dim 16 * partial 0.5 / 2)
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
    "phi3": ("Phi3Config", "Phi3ForCausalLM",  # Phi-4-mini's partial rotary + Phi-3-128k's longrope, and a window
             dict(pad_token_id=0, sliding_window=WINDOW, original_max_position_embeddings=64,
                  rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.5,
                                       short_factor=[1.0, 1.5, 2.0, 3.0], long_factor=[1.0, 4.0, 9.0, 16.0]))),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(pad_token_id=0, no_rope_layers=[1, 0])),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(intermediate_size=96, num_local_experts=4,
                                                            num_experts_per_tok=2)),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(sliding_window=WINDOW, tie_word_embeddings=True)),
}
assert _rot == 4


def family_hf(name: str, seed: int = 0):
    """A tiny random transformers model of the family, weights scaled so logits are well separated."""
    import transformers
    cfg_cls, model_cls, kw = FAMILIES[name]
    torch.manual_seed(seed)
    hf = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**dict(BASE, **kw))).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
    return hf


def convert_family(name: str, root, seed: int = 0):
    """save_pretrained + convert_checkpoint.py (CLI). Returns (converted checkpoint dir, the transformers model)."""
    hf = family_hf(name, seed)
    src, out = root / f"{name}-hf", root / name
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


@pytest.mark.parametrize("name", list(FAMILIES))
@torch.no_grad()
def test_logits_prefill_and_every_decode_step(name, converted, one_thread):
    d, hf = converted(name)
    model = load_model(d / "model.pth")
    model.setup_caches(1, 48)
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    ref = hf(ids).logits
    got = model(ids[:, :20], torch.arange(20))  # prefill already longer than the window
    assert (got - ref[:, :20]).abs().max() <= 1e-4
    for t in range(20, 40):  # one token at a time through the cache, 5 windows past the start
        got = model(ids[:, t:t + 1], torch.tensor([t]))
        assert (got[:, 0] - ref[:, t]).abs().max() <= 1e-4, f"decode step at position {t}"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_tokens_batch_of_two_prompts(name, converted, cpu, one_thread):
    d, hf = converted(name)
    model = load_model(d / "model.pth")
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (11, 4)]
    expected = [hf_greedy(hf, p, 32) for p in prompts]
    out, _ = generate(TorchBackend(model, max_batch_size=2, max_seq_length=64), prompts, 32, cpu)
    assert out == expected


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
