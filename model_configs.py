# model_configs.py: what a model is, apart from model.py's network: ModelArgs (every family's fields), the rope
# scaling rules those fields name, each family's reading of a Hugging Face config.json, and the named configs of
# published checkpoints. model.py re-exports ModelArgs and transformer_configs.
import math
from dataclasses import dataclass, fields
from typing import Optional

import torch
from torch import Tensor

from validation import check_fields, check_rope_scaling


@dataclass
class ModelArgs:
    block_size: int = 2048            # maximum context the model was trained for
    vocab_size: int = 32000
    n_layer: int = 32
    n_head: int = 32
    dim: int = 4096
    intermediate_size: Optional[int] = None
    n_local_heads: int = -1           # number of KV heads (grouped-query attention); -1 = n_head
    head_dim: Optional[int] = None    # default dim // n_head (Qwen3, Gemma set it explicitly)
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    # rope scaling: Llama-3.1 keys (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings), or
    # {"rope_type": "linear", "factor"} (Gemma 3 global layers), or {"rope_type": "longrope", "short_factor",
    # "long_factor", "original_max_position_embeddings", "attention_factor"} (Phi-3 128k, Phi-4-mini)
    rope_scaling: Optional[dict] = None
    tie_embeddings: bool = False
    attn_bias: bool = False           # bias on q/k/v projections (Qwen2, StarCoder2)
    qk_norm: bool = False             # RMSNorm on each head of q and k before rotary (Qwen3, Gemma 3)
    # family blocks; the defaults are Llama's
    norm_type: str = "rms"            # "rms" | "layer" (LayerNorm with bias: StarCoder2)
    mlp_act: str = "silu"             # "silu" | "gelu_tanh" (Gemma, StarCoder2) | "gelu" (exact erf GELU)
    mlp_gated: bool = True            # act(w1 x) * w3 x (Llama, Gemma) or plain act(w1 x) (StarCoder2)
    mlp_bias: bool = False            # biases on the MLP linears (StarCoder2)
    attn_out_bias: bool = False       # bias on the output projection (StarCoder2)
    embed_scale: bool = False         # embeddings * sqrt(dim), rounded to the model dtype (Gemma)
    sandwich_norm: bool = False       # extra norms on the attention and MLP outputs (Gemma 2/3)
    attn_scale: Optional[float] = None    # softmax scale; default head_dim ** -0.5 (Gemma 2/3: query_pre_attn_scalar)
    attn_softcap: Optional[float] = None  # scores = cap * tanh(scores / cap) before the mask (Gemma 2)
    final_softcap: Optional[float] = None  # the same on the output logits (Gemma 2)
    sliding_window: Optional[int] = None  # a query sees the last sliding_window tokens, itself included
    sliding_layers: Optional[list] = None  # layer indices with the window; None = every layer (when sliding_window)
    rope_local_base: Optional[float] = None  # rope base of the sliding layers, unscaled (Gemma 3); None = rope_base
    rotary_dim: Optional[int] = None  # partial rotary: first rotary_dim dims of each head (Phi-4-mini); None = head_dim
    nope_layers: Optional[list] = None  # layer indices without rotary embedding (SmolLM3)
    n_experts: int = 0                # mixture of experts (Mixtral): 0 = one dense MLP
    n_experts_per_tok: int = 2
    norm_bias: bool = True            # LayerNorm's bias (MPT has none)
    learned_pos: bool = False         # + a learned embedding of each token's position (GPT-2: with nope_layers = all)
    alibi: bool = False               # ALiBi bias on the attention scores (MPT: with nope_layers = all)
    alibi_bias_max: float = 8.0       # ALiBi slopes (alibi_slopes: MPT's formula)
    clip_qkv: Optional[float] = None  # q, k, v clamped to [-clip_qkv, clip_qkv] (MPT)
    parallel_attn: bool = False       # x + attn(norm(x)) + mlp(norm'(x)) (GPT-J, Falcon) instead of one after the other
    parallel_norms: int = 1           # parallel blocks: 1 = norm' is norm (GPT-J, Falcon-7B), 2 = ffn_norm (Falcon-40B)
    output_bias: bool = False         # bias on the output layer (GPT-J)
    family: str = ""                  # the Hugging Face model_type it came from, for messages ("" = not recorded)

    def __post_init__(self):
        """Checks every field (validation.py: types, ranges, rope scaling keys) and fills in the derived defaults;
        a bad field is one ValueError naming it."""
        check_fields(self)
        if self.n_local_heads == -1:
            self.n_local_heads = self.n_head
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_head
        if self.rotary_dim is None:
            self.rotary_dim = self.head_dim
        if self.intermediate_size is None:  # Llama's rule: 2/3 * 4 * dim rounded up to a multiple of 256
            hidden = int(2 * (4 * self.dim) / 3)
            self.intermediate_size = 256 * ((hidden + 255) // 256)
        if self.n_head % self.n_local_heads:
            raise ValueError(f"n_head ({self.n_head}) must be a multiple of n_local_heads ({self.n_local_heads})")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and in 2..head_dim ({self.head_dim})")
        check_rope_scaling(self)

    def is_sliding(self, layer: int) -> bool:
        return bool(self.sliding_window) and (self.sliding_layers is None or layer in self.sliding_layers)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelArgs":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def from_name(cls, name: str) -> "ModelArgs":
        if name in transformer_configs:
            return cls(**transformer_configs[name])
        # fuzzy match on a checkpoint directory name such as "Llama-2-7b-chat-hf": longest known name it contains
        hits = [k for k in transformer_configs if k.lower() in name.lower()]
        if not hits:
            raise ValueError(f"unknown model name {name!r}; known: {', '.join(transformer_configs)}")
        return cls(**transformer_configs[max(hits, key=len)])

    @classmethod
    def from_hf_config(cls, c: dict) -> "ModelArgs":
        """Build from a Hugging Face config.json (model_configs.hf_config_fields: every supported family's keys). A
        feature model.py does not implement raises ValueError naming it (never a silent approximation)."""
        return cls(**hf_config_fields(c))


def rope_frequencies(args: ModelArgs, device=None, local: bool = False, seq_len: int = 0) -> Tensor:
    """Inverse frequencies [rotary_dim / 2]. local: the sliding layers' own base (Gemma 3), unscaled."""
    d = args.rotary_dim
    base = args.rope_local_base if local and args.rope_local_base else args.rope_base
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, device=device, dtype=torch.int64).float() / d))
    s = None if local and args.rope_local_base else args.rope_scaling
    kind = s and s.get("rope_type", "llama3")
    if kind == "linear":
        inv_freq = inv_freq / s["factor"]
    elif kind == "longrope":  # Phi-3: per-frequency divisors, long ones past the pretraining context
        long = seq_len > s["original_max_position_embeddings"]
        ext = torch.tensor(s["long_factor" if long else "short_factor"], dtype=torch.float32, device=device)
        inv_freq = 1.0 / (ext * base ** (torch.arange(0, d, 2, device=device, dtype=torch.int64).float() / d))
    elif kind == "llama3":  # Llama-3.1 frequency-dependent scaling
        old = s["original_max_position_embeddings"]
        low_wl, high_wl = old / s["low_freq_factor"], old / s["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
        scaled = torch.where(wavelen > low_wl, inv_freq / s["factor"], inv_freq)
        mid = (1 - smooth) * inv_freq / s["factor"] + smooth * inv_freq
        inv_freq = torch.where((wavelen >= high_wl) & (wavelen <= low_wl), mid, scaled)
    elif kind:
        raise ValueError(f"unsupported rope scaling {s}")
    return inv_freq


def longrope_attention_factor(args: ModelArgs) -> float:
    s = args.rope_scaling or {}
    if s.get("rope_type") != "longrope":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    orig = s["original_max_position_embeddings"]
    factor = s.get("factor") or args.block_size / orig
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))


# Every supported family: Hugging Face model_type -> its transformers class. The one table of family names
# (scripts/convert_checkpoint.py reads it; hf_config_fields refuses a model_type that is not here).
FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
            "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma": "GemmaForCausalLM",
            "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "gemma3": "Gemma3ForCausalLM",
            "phi3": "Phi3ForCausalLM", "smollm3": "SmolLM3ForCausalLM", "starcoder2": "Starcoder2ForCausalLM",
            "gpt2": "GPT2LMHeadModel", "gptj": "GPTJForCausalLM", "falcon": "FalconForCausalLM", "mpt": "MptForCausalLM"}


def _rope(c: dict, mt: str):
    """(rope_base, rope_scaling, global rope parameters, sliding layers' rope parameters) of a config.json."""
    rp = c.get("rope_parameters") or {}
    if "full_attention" in rp or "sliding_attention" in rp:  # transformers 5: one dict per layer type (Gemma 3)
        glob, local = rp.get("full_attention") or {}, rp.get("sliding_attention") or {}
    else:
        glob, local = rp, {}
    rs = dict(c.get("rope_scaling") or {}) or {k: v for k, v in glob.items()
                                             if k not in ("rope_theta", "partial_rotary_factor")}
    rope_base = float(c.get("rope_theta") or glob.get("rope_theta") or 10000.0)
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        rs = None
    elif kind == "llama3":
        rs = {k: rs[k] for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    elif kind == "linear":
        rs = dict(rope_type="linear", factor=float(rs["factor"]))
    elif kind in ("longrope", "su"):
        orig = c.get("original_max_position_embeddings") or rs.get("original_max_position_embeddings")
        rs = dict(rope_type="longrope", short_factor=list(rs["short_factor"]), long_factor=list(rs["long_factor"]),
                  original_max_position_embeddings=orig, factor=rs.get("factor"),
                  attention_factor=rs.get("attention_factor"))
    else:
        raise ValueError(f"unsupported rope scaling {kind!r} for {mt or 'this model'} ({rs})")
    for sub in (local,):
        if sub.get("rope_type", "default") != "default":
            raise ValueError(f"unsupported rope scaling {sub.get('rope_type')!r} on the sliding layers of {mt}")
    return rope_base, rs, glob, local


def _act(name: str, mt: str) -> str:
    """A Hugging Face activation name -> ModelArgs.mlp_act (gelu_new is GPT-2's tanh GELU)."""
    acts = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
            "gelu_fast": "gelu_tanh", "gelu": "gelu"}
    if name not in acts:
        raise ValueError(f"unsupported activation {name!r} in {mt}")
    return acts[name]


def _refuse(mt: str, **unsupported):
    """One ValueError naming the family and the first config option model.py does not implement (given as True)."""
    for option, bad in unsupported.items():
        if bad:
            raise ValueError(f"{mt}: {option} is not supported")


# GPT-2, GPT-J, Falcon and MPT: their own config.json keys. LayerNorm with bias (MPT: without), plain MLPs.
def _gpt2(c: dict) -> dict:
    _refuse("gpt2", scale_attn_by_inverse_layer_idx=c.get("scale_attn_by_inverse_layer_idx"),
            add_cross_attention=c.get("add_cross_attention"))
    d = c["n_embd"]
    return dict(block_size=c["n_positions"], vocab_size=c["vocab_size"], n_layer=c["n_layer"], n_head=c["n_head"],
                dim=d, intermediate_size=c.get("n_inner") or 4 * d, norm_eps=c.get("layer_norm_epsilon", 1e-5),
                tie_embeddings=bool(c.get("tie_word_embeddings", True)), norm_type="layer",
                mlp_act=_act(c.get("activation_function", "gelu_new"), "gpt2"), mlp_gated=False, mlp_bias=True,
                attn_bias=True, attn_out_bias=True, learned_pos=True, nope_layers=list(range(c["n_layer"])),
                attn_scale=None if c.get("scale_attn_weights", True) else 1.0, family="gpt2")


def _gptj(c: dict) -> dict:
    d, n_head = c["n_embd"], c["n_head"]
    return dict(block_size=c["n_positions"], vocab_size=c["vocab_size"], n_layer=c["n_layer"], n_head=n_head, dim=d,
                intermediate_size=c.get("n_inner") or 4 * d, norm_eps=c.get("layer_norm_epsilon", 1e-5),
                tie_embeddings=bool(c.get("tie_word_embeddings", False)), norm_type="layer",
                mlp_act=_act(c.get("activation_function", "gelu_new"), "gptj"), mlp_gated=False, mlp_bias=True,
                parallel_attn=True, output_bias=True, rotary_dim=c.get("rotary_dim") or d // n_head, family="gptj")


def _falcon(c: dict) -> dict:
    new, n_head, d = bool(c.get("new_decoder_architecture")), c["num_attention_heads"], c["hidden_size"]
    multi_query, parallel = bool(c.get("multi_query", True)), bool(c.get("parallel_attn", True))
    n_kv = c.get("num_kv_heads") or n_head
    # transformers runs the new architecture (Falcon-40B/180B/2) always in parallel; without parallel_attn it fails
    _refuse("falcon", alibi=c.get("alibi"), **{
        "new_decoder_architecture without parallel_attn": new and not parallel,
        "num_kv_heads != num_attention_heads without multi_query": not new and not multi_query and n_kv != n_head})
    rope_base, rs, _, _ = _rope(c, "falcon")
    bias = bool(c.get("bias", False))
    return dict(block_size=c.get("max_position_embeddings", 2048), vocab_size=c["vocab_size"],
                n_layer=c["num_hidden_layers"], n_head=n_head,
                n_local_heads=n_kv if new else 1 if multi_query else n_head,
                dim=d, intermediate_size=c.get("ffn_hidden_size") or 4 * d, rope_base=rope_base, rope_scaling=rs,
                norm_eps=c.get("layer_norm_epsilon", 1e-5), tie_embeddings=bool(c.get("tie_word_embeddings", True)),
                norm_type="layer", mlp_act=_act(c.get("activation", "gelu"), "falcon"), mlp_gated=False,
                mlp_bias=bias, attn_bias=bias, attn_out_bias=bias, parallel_attn=parallel,
                parallel_norms=(c.get("num_ln_in_parallel_attn") or 2) if new else 1, family="falcon")


def _mpt(c: dict) -> dict:
    a = c.get("attn_config") or {}
    _refuse("mpt", **{"attn_config.attn_type " + str(a.get("attn_type")):
                      a.get("attn_type", "multihead_attention") != "multihead_attention",
                      "attn_config.alibi=false (learned positions)": not a.get("alibi", True),
                      "attn_config.qk_ln": a.get("qk_ln"), "attn_config.prefix_lm": a.get("prefix_lm"),
                      "no_bias=false (linear biases)": not c.get("no_bias", True),
                      "logit_scale": c.get("logit_scale") is not None})
    d, n_layer = c.get("d_model") or c["hidden_size"], c.get("n_layers") or c["num_hidden_layers"]
    n_head = c.get("n_heads") or c["num_attention_heads"]
    scale = a.get("softmax_scale")
    return dict(block_size=c.get("max_seq_len", 2048), vocab_size=c["vocab_size"],
                n_layer=n_layer, n_head=n_head, dim=d,
                intermediate_size=int(c.get("expansion_ratio", 4) * d), norm_eps=c.get("layer_norm_epsilon", 1e-5),
                tie_embeddings=bool(c.get("tie_word_embeddings", True)), norm_type="layer", norm_bias=False,
                mlp_act="gelu", mlp_gated=False, alibi=True, nope_layers=list(range(n_layer)),
                alibi_bias_max=float(a.get("alibi_bias_max", 8)), clip_qkv=a.get("clip_qkv"),
                attn_scale=float(scale) if scale else None, family="mpt")


CLASSIC = {"gpt2": _gpt2, "gptj": _gptj, "falcon": _falcon, "mpt": _mpt}


def hf_config_fields(c: dict) -> dict:
    """ModelArgs fields from a Hugging Face config.json (old and transformers-5 layouts) of LlamaForCausalLM,
    Mistral, Mixtral, Qwen2, Qwen3, Gemma, Gemma2, Gemma3 (text), Phi3, SmolLM3, Starcoder2, GPT2LMHeadModel,
    GPTJForCausalLM, FalconForCausalLM, MptForCausalLM. A feature model.py does not implement raises ValueError
    naming the family and the feature (never a silent approximation)."""
    mt = c.get("model_type", "")
    if mt not in FAMILIES:
        raise ValueError(f"unsupported model_type {mt!r} (supported: {', '.join(FAMILIES)})")
    if mt in CLASSIC:
        return CLASSIC[mt](c)
    family = {"gemma3_text": "gemma3", "gemma3": "gemma3"}.get(mt, mt)
    if mt == "gemma3" and "text_config" in c:
        raise ValueError("Gemma3ForConditionalGeneration (vision) is not supported; convert the text model")
    gemma = family in ("gemma", "gemma2", "gemma3")
    n_layer, n_head = c["num_hidden_layers"], c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // n_head
    rope_base, rs, glob, local = _rope(c, mt)
    partial = c.get("partial_rotary_factor") or glob.get("partial_rotary_factor") or 1.0
    # sliding window: which layers have it
    window = c.get("sliding_window") if c.get("use_sliding_window", True) else None
    types = c.get("layer_types")
    if types is None and family == "gemma2":
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layer)]
    if types is None and family == "gemma3":
        pattern = c.get("sliding_window_pattern") or c.get("_sliding_window_pattern") or 6
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layer)]
    if types is not None and set(types) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"unsupported layer types {sorted(set(types))} in {mt}")
    sliding = None if types is None else [i for i, t in enumerate(types) if t == "sliding_attention"]
    if not window or sliding == []:
        window, sliding = None, None
    elif sliding is not None and len(sliding) == n_layer:
        sliding = None
    if c.get("use_bidirectional_attention"):
        raise ValueError(f"bidirectional attention ({mt}) is not supported")
    act = _act(c.get("hidden_activation") or c.get("hidden_act") or "silu", mt)
    nope = None
    if c.get("no_rope_layers") is not None:  # SmolLM3: 1 = this layer uses rope
        nope = [i for i, use in enumerate(c["no_rope_layers"]) if not use] or None
    n_experts = int(c.get("num_local_experts") or 0)
    if c.get("num_experts") or c.get("n_routed_experts"):
        raise ValueError(f"unsupported mixture-of-experts layout in {mt} (only Mixtral's)")
    bias = bool(c.get("use_bias", False))  # StarCoder2: every linear has a bias
    if c.get("mlp_bias") and not bias:
        raise ValueError(f"unsupported MLP with bias (mlp_bias) in {mt}")
    qpre = c.get("query_pre_attn_scalar") if gemma and family != "gemma" else None
    return dict(
        block_size=c.get("max_position_embeddings", 2048),
        vocab_size=c["vocab_size"],
        n_layer=n_layer,
        n_head=n_head,
        dim=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        n_local_heads=c.get("num_key_value_heads") or n_head,
        head_dim=head_dim,
        rope_base=rope_base,
        norm_eps=c.get("rms_norm_eps", c.get("norm_epsilon", c.get("layer_norm_eps", 1e-5))),
        rope_scaling=rs,
        tie_embeddings=bool(c.get("tie_word_embeddings", gemma or family == "starcoder2")),
        attn_bias=bool(c.get("attention_bias", False)) or family == "qwen2" or bias,
        qk_norm=family in ("qwen3", "gemma3"),
        norm_type="layer" if family == "starcoder2" else "rms",
        mlp_act=act,
        mlp_gated=family != "starcoder2",
        mlp_bias=bias,
        attn_out_bias=bias or bool(c.get("attention_bias", False)),
        embed_scale=gemma,
        sandwich_norm=family in ("gemma2", "gemma3"),
        attn_scale=float(qpre) ** -0.5 if qpre else None,
        attn_softcap=c.get("attn_logit_softcapping") if gemma else None,
        final_softcap=c.get("final_logit_softcapping") if gemma else None,
        sliding_window=window,
        sliding_layers=sliding,
        rope_local_base=float(c.get("rope_local_base_freq") or local.get("rope_theta") or 10000.0)
        if family == "gemma3" else None,
        rotary_dim=int(head_dim * partial),
        nope_layers=nope,
        n_experts=n_experts,
        n_experts_per_tok=int(c.get("num_experts_per_tok", 2)) if n_experts else 2,
        family=family,
    )


_llama3_scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
_llama32_scaling = dict(_llama3_scaling, factor=32.0)
_gemma = dict(mlp_act="gelu_tanh", embed_scale=True)
_gemma2 = dict(_gemma, vocab_size=256000, block_size=8192, norm_eps=1e-6, tie_embeddings=True, sandwich_norm=True,
               attn_scale=256 ** -0.5, attn_softcap=50.0, final_softcap=30.0, sliding_window=4096)
_gemma3 = dict(_gemma, norm_eps=1e-6, tie_embeddings=True, sandwich_norm=True, qk_norm=True, attn_scale=256 ** -0.5,
               rope_base=1000000.0, rope_local_base=10000.0)
_starcoder2 = dict(vocab_size=49152, block_size=16384, sliding_window=4096, tie_embeddings=True, norm_type="layer",
                   mlp_act="gelu_tanh", mlp_gated=False, mlp_bias=True, attn_bias=True, attn_out_bias=True)
_gpt2 = dict(vocab_size=50257, block_size=1024, tie_embeddings=True, norm_type="layer",
             mlp_act="gelu_tanh", mlp_gated=False, mlp_bias=True, attn_bias=True, attn_out_bias=True, learned_pos=True)
_falcon = dict(vocab_size=65024, block_size=2048, tie_embeddings=True, norm_type="layer",
               mlp_act="gelu", mlp_gated=False, parallel_attn=True)
transformer_configs = {
    "stories15M": dict(n_layer=6, n_head=6, dim=288, intermediate_size=768, vocab_size=32000, block_size=256),
    "stories42M": dict(n_layer=8, n_head=8, dim=512, intermediate_size=1376, vocab_size=32000, block_size=1024),
    "stories110M": dict(n_layer=12, n_head=12, dim=768, intermediate_size=2048, vocab_size=32000, block_size=1024),
    "Llama-2-7b": dict(n_layer=32, n_head=32, dim=4096, intermediate_size=11008, block_size=4096),
    "Llama-2-13b": dict(n_layer=40, n_head=40, dim=5120, intermediate_size=13824, block_size=4096),
    "Llama-2-70b": dict(n_layer=80, n_head=64, dim=8192, n_local_heads=8, intermediate_size=28672, block_size=4096),
    "Meta-Llama-3-8B": dict(n_layer=32, n_head=32, n_local_heads=8, dim=4096, intermediate_size=14336,
                            vocab_size=128256, rope_base=500000.0, block_size=8192),
    "Meta-Llama-3-70B": dict(n_layer=80, n_head=64, n_local_heads=8, dim=8192, intermediate_size=28672,
                             vocab_size=128256, rope_base=500000.0, block_size=8192),
    "Llama-3.1-8B": dict(n_layer=32, n_head=32, n_local_heads=8, dim=4096, intermediate_size=14336, vocab_size=128256,
                         rope_base=500000.0, block_size=131072, rope_scaling=_llama3_scaling),
    "Llama-3.1-70B": dict(n_layer=80, n_head=64, n_local_heads=8, dim=8192, intermediate_size=28672, vocab_size=128256,
                          rope_base=500000.0, block_size=131072, rope_scaling=_llama3_scaling),
    "Llama-3.2-1B": dict(n_layer=16, n_head=32, n_local_heads=8, dim=2048, intermediate_size=8192, vocab_size=128256,
                         rope_base=500000.0, block_size=131072, rope_scaling=_llama32_scaling, tie_embeddings=True),
    "Llama-3.2-3B": dict(n_layer=28, n_head=24, n_local_heads=8, dim=3072, intermediate_size=8192, vocab_size=128256,
                         rope_base=500000.0, block_size=131072, rope_scaling=_llama32_scaling, tie_embeddings=True),
    "Mistral-7B": dict(n_layer=32, n_head=32, n_local_heads=8, dim=4096, intermediate_size=14336, vocab_size=32768,
                       rope_base=1000000.0, block_size=32768),
    "TinyLlama-1.1B": dict(n_layer=22, n_head=32, n_local_heads=4, dim=2048, intermediate_size=5632, block_size=2048),
    "SmolLM2-135M": dict(n_layer=30, n_head=9, n_local_heads=3, dim=576, intermediate_size=1536, vocab_size=49152,
                         rope_base=100000.0, block_size=8192, tie_embeddings=True),
    "SmolLM2-360M": dict(n_layer=32, n_head=15, n_local_heads=5, dim=960, intermediate_size=2560, vocab_size=49152,
                         rope_base=100000.0, block_size=8192, tie_embeddings=True),
    "SmolLM2-1.7B": dict(n_layer=24, n_head=32, n_local_heads=32, dim=2048, intermediate_size=8192, vocab_size=49152,
                         rope_base=130000.0, block_size=8192, tie_embeddings=True),
    "Qwen2.5-0.5B": dict(n_layer=24, n_head=14, n_local_heads=2, dim=896, intermediate_size=4864, vocab_size=151936,
                         rope_base=1000000.0, block_size=32768, norm_eps=1e-6, tie_embeddings=True, attn_bias=True),
    "Qwen2.5-1.5B": dict(n_layer=28, n_head=12, n_local_heads=2, dim=1536, intermediate_size=8960, vocab_size=151936,
                         rope_base=1000000.0, block_size=32768, norm_eps=1e-6, tie_embeddings=True, attn_bias=True),
    "Qwen3-0.6B": dict(n_layer=28, n_head=16, n_local_heads=8, dim=1024, head_dim=128, intermediate_size=3072,
                       vocab_size=151936, rope_base=1000000.0, block_size=40960, norm_eps=1e-6, tie_embeddings=True,
                       qk_norm=True),
    "Qwen3-1.7B": dict(n_layer=28, n_head=16, n_local_heads=8, dim=2048, head_dim=128, intermediate_size=6144,
                       vocab_size=151936, rope_base=1000000.0, block_size=40960, norm_eps=1e-6, tie_embeddings=True,
                       qk_norm=True),

    # Gemma (norm weights hold 1 + w, stored so by the converter): embeddings scaled, tanh-GELU gated MLP, head_dim 256
    "gemma-2b": dict(n_layer=18, n_head=8, n_local_heads=1, dim=2048, head_dim=256, intermediate_size=16384,
                     vocab_size=256000, block_size=8192, norm_eps=1e-6, tie_embeddings=True, **_gemma),
    "gemma-7b": dict(n_layer=28, n_head=16, n_local_heads=16, dim=3072, head_dim=256, intermediate_size=24576,
                     vocab_size=256000, block_size=8192, norm_eps=1e-6, tie_embeddings=True, **_gemma),
    "gemma-2-2b": dict(n_layer=26, n_head=8, n_local_heads=4, dim=2304, head_dim=256, intermediate_size=9216,
                       sliding_layers=list(range(0, 26, 2)), **_gemma2),
    "gemma-2-9b": dict(n_layer=42, n_head=16, n_local_heads=8, dim=3584, head_dim=256, intermediate_size=14336,
                       sliding_layers=list(range(0, 42, 2)), **_gemma2),
    "gemma-3-1b": dict(n_layer=26, n_head=4, n_local_heads=1, dim=1152, head_dim=256, intermediate_size=6912,
                       vocab_size=262144, block_size=32768, sliding_window=512,
                       sliding_layers=[i for i in range(26) if (i + 1) % 6], **_gemma3),
    "gemma-3-4b": dict(n_layer=34, n_head=8, n_local_heads=4, dim=2560, head_dim=256, intermediate_size=10240,
                       vocab_size=262208, block_size=131072, sliding_window=1024,
                       sliding_layers=[i for i in range(34) if (i + 1) % 6],
                       rope_scaling=dict(rope_type="linear", factor=8.0), **_gemma3),
    # Phi-3 / Phi-4-mini: fused qkv/gate_up split by the converter. The 128k models' longrope factors come from their
    # config.json (convert_checkpoint.py keeps them); these named configs stop at the 4k pretraining context.
    "Phi-3-mini-4k-instruct": dict(n_layer=32, n_head=32, dim=3072, intermediate_size=8192, vocab_size=32064,
                                   block_size=4096, sliding_window=2047),
    "Phi-3-mini-128k-instruct": dict(n_layer=32, n_head=32, dim=3072, intermediate_size=8192, vocab_size=32064,
                                     block_size=4096),
    "Phi-4-mini-instruct": dict(n_layer=32, n_head=24, n_local_heads=8, dim=3072, intermediate_size=8192,
                                vocab_size=200064, block_size=4096, rotary_dim=96, tie_embeddings=True),
    "SmolLM3-3B": dict(n_layer=36, n_head=16, n_local_heads=4, dim=2048, intermediate_size=11008, vocab_size=128256,
                       rope_base=5000000.0, block_size=65536, norm_eps=1e-6, tie_embeddings=True,
                       nope_layers=list(range(3, 36, 4))),
    "Mistral-7B-Instruct-v0.1": dict(n_layer=32, n_head=32, n_local_heads=8, dim=4096, intermediate_size=14336,
                                     vocab_size=32000, block_size=32768, sliding_window=4096),
    "Codestral-22B": dict(n_layer=56, n_head=48, n_local_heads=8, dim=6144, head_dim=128, intermediate_size=16384,
                          vocab_size=32768, rope_base=1000000.0, block_size=32768),
    "Mixtral-8x7B": dict(n_layer=32, n_head=32, n_local_heads=8, dim=4096, intermediate_size=14336, vocab_size=32000,
                         rope_base=1000000.0, block_size=32768, n_experts=8, n_experts_per_tok=2),
    # StarCoder2: LayerNorm with bias, plain tanh-GELU MLP with bias, biases on every attention linear
    "starcoder2-3b": dict(n_layer=30, n_head=24, n_local_heads=2, dim=3072, intermediate_size=12288,
                          rope_base=999999.4420358813, **_starcoder2),
    "starcoder2-7b": dict(n_layer=32, n_head=36, n_local_heads=4, dim=4608, intermediate_size=18432,
                          rope_base=1000000.0, **_starcoder2),
    "starcoder2-15b": dict(n_layer=40, n_head=48, n_local_heads=4, dim=6144, intermediate_size=24576,
                           rope_base=100000.0, **_starcoder2),
    # GPT-2: learned positions (no rotary), LayerNorm with bias, tanh-GELU MLP, biases everywhere, tied output
    "gpt2": dict(n_layer=12, n_head=12, dim=768, intermediate_size=3072, nope_layers=list(range(12)), **_gpt2),
    "gpt2-medium": dict(n_layer=24, n_head=16, dim=1024, intermediate_size=4096, nope_layers=list(range(24)), **_gpt2),
    "gpt2-large": dict(n_layer=36, n_head=20, dim=1280, intermediate_size=5120, nope_layers=list(range(36)), **_gpt2),
    "gpt2-xl": dict(n_layer=48, n_head=25, dim=1600, intermediate_size=6400, nope_layers=list(range(48)), **_gpt2),
    # GPT-J: parallel attention + MLP under one LayerNorm, rotary on 64 of 256 head dims, biased output layer
    "GPT-J-6B": dict(n_layer=28, n_head=16, dim=4096, intermediate_size=16384, vocab_size=50400, block_size=2048,
                     norm_type="layer", mlp_act="gelu_tanh", mlp_gated=False, mlp_bias=True, parallel_attn=True,
                     output_bias=True, rotary_dim=64),
    # Falcon: parallel attention + MLP; 7B multi-query with one LayerNorm, 40B grouped KV with two
    "falcon-7b": dict(n_layer=32, n_head=71, n_local_heads=1, dim=4544, intermediate_size=18176, **_falcon),
    "falcon-40b": dict(n_layer=60, n_head=128, n_local_heads=8, dim=8192, intermediate_size=32768,
                       parallel_norms=2, **_falcon),
    # MPT: ALiBi (no rotary), LayerNorm without bias, exact-GELU MLP, no linear biases, tied output
    "mpt-7b": dict(n_layer=32, n_head=32, dim=4096, intermediate_size=16384, vocab_size=50432, block_size=2048,
                   norm_type="layer", norm_bias=False, mlp_act="gelu", mlp_gated=False, alibi=True,
                   nope_layers=list(range(32)), tie_embeddings=True),
    # CodeGen2.5 / XGen: Llama networks with tiktoken tokenizers (tokenizer_tiktoken.py)
    "codegen25-7b-mono": dict(n_layer=32, n_head=32, dim=4096, intermediate_size=11008, vocab_size=51200,
                              block_size=2048, norm_eps=1e-6),
    "xgen-7b-8k": dict(n_layer=32, n_head=32, dim=4096, intermediate_size=11008, vocab_size=51200, block_size=8192,
                       norm_eps=1e-6),
}
