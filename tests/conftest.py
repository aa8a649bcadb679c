# Shared test helpers: tiny random Hugging Face models (the independent reference) and their model.py twins.
import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
torch.set_num_threads(min(2, os.cpu_count() or 1))


def tiny_hf(arch: str, seed: int = 0, vocab_size: int = 256, tie: bool = False, **overrides):
    """A small random transformers model of the given family, weights scaled so logits are well separated."""
    import transformers

    kinds = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }
    cfg_cls, model_cls = kinds[arch]
    kw = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rope_theta=5000.0,
              tie_word_embeddings=tie)
    if arch == "qwen3":
        kw["head_dim"] = 24  # deliberately != hidden_size / heads
    kw.update(overrides)
    torch.manual_seed(seed)
    hf = model_cls(cfg_cls(**kw)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
    return hf


def hf_to_model(hf):
    """model.py's Transformer holding the same weights as a transformers Llama/Mistral/Qwen2/Qwen3 model
    (the converter has its own copy of this mapping; this one is deliberately independent of it)."""
    from model import ModelArgs, Transformer

    args = ModelArgs.from_hf_config(hf.config.to_dict())
    sd = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    out = {"tok_embeddings.weight": sd["embed_tokens.weight"], "norm.weight": sd["norm.weight"],
           "output.weight": sd.get("lm_head.weight", sd["embed_tokens.weight"])}
    for i in range(args.n_layer):
        p, a = f"layers.{i}.", f"layers.{i}.self_attn."
        out[p + "attention.wqkv.weight"] = torch.cat([sd[a + f"{n}_proj.weight"] for n in "qkv"])
        if args.attn_bias:
            out[p + "attention.wqkv.bias"] = torch.cat([sd[a + f"{n}_proj.bias"] for n in "qkv"])
        if args.qk_norm:
            out[p + "attention.q_norm.weight"] = sd[a + "q_norm.weight"]
            out[p + "attention.k_norm.weight"] = sd[a + "k_norm.weight"]
        out[p + "attention.wo.weight"] = sd[a + "o_proj.weight"]
        out[p + "feed_forward.w1.weight"] = sd[p + "mlp.gate_proj.weight"]
        out[p + "feed_forward.w3.weight"] = sd[p + "mlp.up_proj.weight"]
        out[p + "feed_forward.w2.weight"] = sd[p + "mlp.down_proj.weight"]
        out[p + "attention_norm.weight"] = sd[p + "input_layernorm.weight"]
        out[p + "ffn_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
    model = Transformer(args)
    model.load_state_dict(out)
    return model.eval().requires_grad_(False)


@torch.no_grad()
def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """Greedy continuation by recomputing the full sequence each step (no cache): slow and obviously right."""
    seq = list(ids)
    for _ in range(n):
        seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


@pytest.fixture
def cpu():
    return torch.device("cpu")
