# Over 500 lines: the network (~450 lines: every family's blocks, float32's oneDNN product) plus load/save; the named
# configs and the reading of each family's Hugging Face config.json live in model_configs.py (data about published
# checkpoints).
# One transformer for every supported family (Llama 2/3, Mistral/Codestral, Mixtral, TinyLlama, SmolLM2/3, Qwen2.5,
# Qwen3, Gemma 1/2/3, Phi-3/Phi-4-mini, StarCoder2, GPT-2, GPT-J, Falcon, MPT, CodeGen2.5/XGen), gpt-fast style.
# Families differ by ModelArgs fields that pick small named blocks (RMSNorm/LayerNorm with or without bias, gated/plain
# MLP, MoEFeedForward, Rotary/NoRope, learned positions, ALiBi, a per-layer sliding window, soft-capped attention,
# parallel attention + MLP), never by a class per model; checkpoint layouts are scripts/convert_checkpoint.py's
# business.
#
# Conventions every stage relies on:
#   * forward(idx[B,T], input_pos, batch_index=None, mask=None) -> logits[B,T,V] (float32 for a float model run in
#     float32).
#   * input_pos is [T] (every row at the same positions) or [B,T] (each row its own positions, -1 = padding).
#   * The KV cache lives in buffers made by setup_caches(max_batch_size, max_seq_length). The attention mask is
#     derived from the positions (a query at position p sees cache slots 0..p; in a layer with a sliding window W only
#     slots p-W+1..p, as transformers does), so ordinary callers pass none and there is no data-dependent Python
#     branching. The derived mask covers slots 0..(newest position) on CPU outside torch.export (the rest of the static
#     cache is empty; Transformer._attend_filled), all max_seq_length slots elsewhere, and each layer attends over the
#     slots its mask covers. A caller that lays out the cache itself passes `mask`: bool (True = may attend) or additive
#     float, shape [B or 1, 1, T, S] with S the length of the cache the layers attend over; it replaces the derived
#     mask in every layer, and sliding-window layers further hide slots j < p-W+1 (slots j >= max_seq_length, a
#     caller's scratch space, are left as the caller says: they hold the newest tokens).
#   * Rotary embedding uses the Hugging Face "half-split" layout (rotate_half) over the first rotary_dim dims of each
#     head (partial rotary: the rest pass through, the tables hold cos 1 / sin 0 there); converters permute
#     Meta/GGUF/llama2.c Q/K weights (adjacent-pair layout) into it. Rope tables are buffers `rope` (and `rope_local`
#     for the sliding layers of Gemma 3, which use their own base) made by set_rope(); Phi-3's longrope picks its
#     short or long factors from the table length (long when max_seq_length > original_max_position_embeddings: HF
#     switches on the current sequence length, so the two agree for caches up to that length).
#   * Gemma's RMSNorm (x * (1 + w)) is the plain RMSNorm with w + 1 stored by the converter (as llama.cpp does).
#   * Positions without rotary (nope_layers = every layer): GPT-2's learned absolute embeddings
#     (Transformer.pos_embeddings, indexed by input_pos, so padded rows and per-row positions work as with rotary)
#     and MPT's ALiBi, an additive bias -slope_h * (query position - key position) folded into the derived attention
#     mask of every layer, so every exporter that runs this forward gets it for free (a caller's mask is refused:
#     its cache slots need not be positions, as in lookahead decoding).
#     transformers' MPT biases by the key index only; the two differ by a constant per query row, which softmax
#     ignores. GPT-J's interleaved rotary (rotate_every_two on rotary_dim) is turned into the half-split layout by
#     permuting q/k weight rows at conversion (exact, no runtime cost), as for Meta/GGUF checkpoints.
#   * Exports and decoding modes replace pieces through documented swap points, by assigning modules (never by
#     patching functions): each layer's `attention.kv_cache` (a module with update(input_pos, k, v, batch_index) ->
#     the keys/values to attend over), `attention.rope` (a module with forward(x, cos, sin); Rotary, or NoRope in a
#     layer without positions) and the norm modules (attention_norm, ffn_norm, post_attention_norm, post_ffn_norm,
#     norm, q_norm/k_norm: RMSNorm or nn.LayerNorm; ffn_norm is None in a parallel block with one norm), which may
#     be replaced by any module computing the same function. One callable too: `Transformer.prompt_call(module,
#     *args, **kwargs)`, through which forward calls each block and the output projection of a prompt (T > 1) outside
#     torch.compile and torch.export (engine.TorchBackend sets a torch.compile'd one: every layer runs one graph,
#     compiled in seconds, where a dynamic-length graph of the whole model took minutes). load_model() keeps the
#     quantization recipe on the model as `model.quantization`.
#   * Mixture of experts (Mixtral) is computed densely: every expert (nn.Linear, so quantize.py and every exporter take
#     it as is) runs on every token and is weighted by the renormalised top-k routing weights, zero elsewhere. Exact
#     and free of data-dependent control flow, at n_experts / n_experts_per_tok times the MLP FLOPs and weight reads
#     of a gather of the chosen experts (what a fast decode would want; that needs stacked expert weights and their
#     quantized forms). The router is not an nn.Linear, so quantization keeps it float (as llama.cpp does).
import json
import math
from dataclasses import asdict, dataclass, fields
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true

from common import atomic_path, checkpoint_file, keep_packed_copy, packed_copy
from model_configs import hf_config_fields, transformer_configs  # noqa: F401  (re-exported: model.transformer_configs)


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
        if self.norm_type not in ("rms", "layer") or self.mlp_act not in ACTIVATIONS:
            raise ValueError(f"unknown norm_type {self.norm_type!r} or mlp_act {self.mlp_act!r}")
        if self.parallel_norms not in (1, 2):
            raise ValueError(f"parallel_norms must be 1 or 2, not {self.parallel_norms}")

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


class KVCache(nn.Module):
    """Per-layer cache [B, n_kv_heads, S, head_dim]. Writes at input_pos; padding (-1) writes land in the last slot,
    which is only read by a query at position S-1, and that query's own write overwrites it first."""

    def __init__(self, max_batch_size, max_seq_length, n_heads, head_dim, dtype):
        super().__init__()
        shape = (max_batch_size, n_heads, max_seq_length, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype), persistent=False)

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor, batch_index: Optional[Tensor] = None):
        """k, v: [B, H, T, D]. Returns the cache rows these B sequences attend over. batch_index [B] or [B, 1] maps
        the call's rows to cache slots (continuous batching); by default row b is slot b."""
        B = k.shape[0]
        if batch_index is None and input_pos.dim() == 1:  # shared positions: one index_copy_ along the sequence axis
            kc, vc = self.k_cache[:B], self.v_cache[:B]
            kc.index_copy_(2, input_pos, k)
            vc.index_copy_(2, input_pos, v)
            return kc, vc
        S = self.k_cache.shape[2]
        pos = input_pos.expand(B, -1) if input_pos.dim() == 1 else input_pos
        pos = torch.where(pos >= 0, pos, S - 1)  # [B, T]
        slots = torch.arange(B, device=pos.device) if batch_index is None else batch_index.reshape(B)
        rows = slots.unsqueeze(1).expand_as(pos)
        # cache viewed as [B, S, H, D] so both indices lead; values as [B, T, H, D]
        self.k_cache.transpose(1, 2).index_put_((rows, pos), k.transpose(1, 2))
        self.v_cache.transpose(1, 2).index_put_((rows, pos), v.transpose(1, 2))
        if batch_index is None:
            return self.k_cache[:B], self.v_cache[:B]
        return self.k_cache[slots], self.v_cache[slots]


# float32 products on CPU through oneDNN: ATen's F.linear calls MKL's sgemm there, which ran 1.5-2.2x slower than
# oneDNN's on the project's AMD machine (2 threads: 1x576 @ 576x49152 9.7 against 4.4 ms, 15 rows of 576x1536 338
# against 200 us, 128 rows 1504 against 1082 us), the weights as they are. Inductor lowers oneDNN's
# op for frozen weights only, so a compiled graph whose weights are inputs (torch.compile's prompts) calls it through
# an opaque custom op.
_ONEDNN_F32 = torch.backends.mkldnn.is_available()
# A weight in oneDNN's packed (blocked) layout made products of 15 rows ~25% faster than the plain one (128 rows: ~7%;
# the same values: one row gains nothing), so pack_prompt_weights gives a compiled model's blocks a packed copy for
# their prompts: 53 -> 41 ms for SmolLM2's 15-token prompt, at the cost of a second copy of those weights (+430 MB).
# The graph passes the weight and the op looks its copy up (common.packed_copy: a packed tensor is opaque to it).


def _linear_onednn(x: Tensor, w: Tensor, b: Optional[Tensor]) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def _linear_onednn_op(x: Tensor, w: Tensor, b: Optional[Tensor]) -> Tensor:
    if x.numel() > x.shape[-1] and (packed := packed_copy(w)) is not None:
        w = packed
    return _linear_onednn(x, w, b)


def pack_prompt_weights(model: nn.Module, budget: Optional[int] = None) -> tuple[int, bool]:
    """Give the weights of model's blocks (not the output projection: a prompt needs one row of it) packed copies for
    the products of compiled prompts: float32 weights in oneDNN's layout (above), weight-only int8 ones as bfloat16
    (qops.QuantizedLinear.pack_prompt). Returns the copies' bytes and whether they were made: none are where they
    would take more than budget bytes (a prompt's products then run on the weights as they are)."""
    todo = []
    for mod in model.layers.modules():
        if hasattr(mod, "pack_prompt"):  # a qops.QuantizedLinear (model.py does not import qops.py)
            size = mod.prompt_copy_bytes()
        elif type(mod) is Linear and _ONEDNN_F32 and mod.weight.dtype == torch.float32 and mod.weight.is_cpu:
            size = mod.weight.numel() * 4
        else:
            continue
        todo.append((mod, size))
    total = sum(size for _, size in todo)
    if budget is not None and total > budget:
        return total, False
    for mod, _ in todo:
        if hasattr(mod, "pack_prompt"):
            mod.pack_prompt()
        elif packed_copy(w := mod.weight) is None:  # (row hints of 15, 64, 128: as fast; 1 row: no gain)
            keep_packed_copy(w, torch.ops.mkldnn._reorder_linear_weight(w.detach(), 64))
    return total, True


if not hasattr(torch.ops.llama_flat, "linear_onednn"):
    _LIB = torch.library.Library("llama_flat", "FRAGMENT")
    _LIB.define("linear_onednn(Tensor x, Tensor w, Tensor? b) -> Tensor")
    _LIB.impl("linear_onednn", _linear_onednn_op, "CPU")
    torch.library.register_fake("llama_flat::linear_onednn", lib=_LIB)(
        lambda x, w, b: x.new_empty((*x.shape[:-1], w.shape[0])))


class Linear(nn.Linear):
    """nn.Linear; float32 on CPU through oneDNN (_ONEDNN_F32) in eager runs and in compiled graphs whose weights are
    inputs (torch.compile's prompts, compiled without freezing). Not in compiled decode (Inductor's own kernels on
    frozen weights) nor under torch.export / ONNX tracing (a portable aten.linear)."""

    def forward(self, x: Tensor) -> Tensor:
        if (_ONEDNN_F32 and x.dtype == torch.float32 and x.device.type == "cpu" and not torch.jit.is_tracing()
                and not torch.compiler.is_exporting()):
            if not torch.compiler.is_compiling():
                return _linear_onednn(x, self.weight, self.bias)
            if not torch._inductor.config.freezing:
                return torch.ops.llama_flat.linear_onednn(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.type_as(x)


def make_norm(args: ModelArgs, dim: int) -> nn.Module:
    """The family's norm: RMSNorm, or LayerNorm with bias (StarCoder2, GPT-2, GPT-J, Falcon) or without (MPT)."""
    if args.norm_type == "rms":
        return RMSNorm(dim, args.norm_eps)
    return nn.LayerNorm(dim, eps=args.norm_eps, bias=args.norm_bias)


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu}


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


def alibi_slopes(args: ModelArgs) -> list[float]:
    """ALiBi slope of each head, MPT's formula: 2^(-alibi_bias_max * h / n) for h = 1..n, n = n_head rounded up to a
    power of two; for other head counts the even-numbered h first, then the odd ones (with alibi_bias_max 8 these are
    the ALiBi paper's and Bloom's slopes)."""
    n = 2 ** math.ceil(math.log2(args.n_head))
    s = [2.0 ** (-args.alibi_bias_max * h / n) for h in range(1, n + 1)]
    return s if n == args.n_head else (s[1::2] + s[::2])[:args.n_head]


def precompute_rope(args: ModelArgs, seq_len: int, dtype=torch.float32, local: bool = False,
                    longrope_len: Optional[int] = None) -> Tensor:
    """[2, seq_len, head_dim]: cos and sin in the half-split layout; dims past rotary_dim get cos 1, sin 0."""
    inv_freq = rope_frequencies(args, local=local, seq_len=longrope_len or seq_len)
    t = torch.arange(seq_len, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)          # half-split layout
    scale = 1.0 if local else longrope_attention_factor(args)
    cos, sin = emb.cos() * scale, emb.sin() * scale
    rest = args.head_dim - args.rotary_dim
    if rest:
        cos = torch.cat((cos, torch.ones(seq_len, rest)), dim=-1)
        sin = torch.cat((sin, torch.zeros(seq_len, rest)), dim=-1)
    return torch.stack((cos, sin), dim=0).to(dtype)  # [2, S, head_dim]


class Rotary(nn.Module):
    """Rotary embedding in the half-split layout over the first rotary_dim dims (the Attention.rope swap point)."""

    def __init__(self, rotary_dim: Optional[int] = None):
        super().__init__()
        self.rotary_dim = rotary_dim

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        # x: [B, T, H, D]; cos/sin: [B or 1, T, 1, D] (cos 1, sin 0 past rotary_dim)
        r = self.rotary_dim or x.shape[-1]
        half = r // 2
        if r == x.shape[-1]:
            rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        else:  # partial rotary: the pass-through dims are multiplied by sin = 0
            rotated = torch.cat((-x[..., half:r], x[..., :half], x[..., r:]), dim=-1)
        return x * cos + rotated * sin


class NoRope(nn.Module):
    """Attention.rope of a layer without positional embedding (SmolLM3's NoPE layers)."""

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return x


def softcapped_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, cap: float) -> Tensor:
    """softmax(cap * tanh(q k^T * scale / cap) + mask) v (Gemma 2), grouped-query without copying the cache:
    q [B, H, T, D], k/v [B, Hkv, S, D], mask additive or bool [B or 1, 1 or H, T, S] -> [B, H, T, D]."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    # (with one KV head, AOT Inductor's frozen graph of this broadcast reads the cache as it was at export: the
    # families' chimera has two; torch.compile, ONNX and eager are exact with one)
    qg = q.view(B, Hkv, H // Hkv, T, D)                                     # query heads grouped by their KV head
    s = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)) * scale         # [B, Hkv, r, T, S]
    s = torch.tanh(s / cap) * cap
    m = mask.unsqueeze(1) if mask.shape[1] == 1 else mask.view(mask.shape[0], Hkv, H // Hkv, *mask.shape[2:])
    s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m
    p = torch.softmax(s.float(), dim=-1).to(q.dtype)
    return torch.matmul(p, v.unsqueeze(2)).view(B, H, T, D)


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: Optional[float], gqa: bool) -> Tensor:
    """F.scaled_dot_product_attention. On CPU, bfloat16 / float16 attention runs in float32: ATen's half-precision CPU
    kernel does its products with MKL's half-precision GEMV, per call 3.2x (bfloat16) and 5.2x (float16) slower than
    the float32 kernel with the casts included, for one query of SmolLM2's 9 heads over 256 cache slots (2 threads,
    AMD EPYC with AVX-512 BF16; 1.37x / 2.8x faster for 33 queries, 0.78x / 3.1x for 8). Not under torch.export, whose
    graphs ExecuTorch's passes match on the cache tensors themselves (a bfloat16 AOT Inductor package keeps ATen's)."""
    if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16) and not torch.compiler.is_exporting():
        m = mask.float() if mask is not None and mask.is_floating_point() else mask
        y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=m, scale=scale, enable_gqa=gqa)
        return y.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int = 0):
        super().__init__()
        self.n_head, self.n_kv, self.head_dim = args.n_head, args.n_local_heads, args.head_dim
        total = (self.n_head + 2 * self.n_kv) * self.head_dim
        self.wqkv = Linear(args.dim, total, bias=args.attn_bias)
        self.wo = Linear(self.n_head * self.head_dim, args.dim, bias=args.attn_out_bias)
        self.q_norm = RMSNorm(self.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, args.norm_eps) if args.qk_norm else None
        nope = layer in (args.nope_layers or ())
        self.rope = NoRope() if nope else Rotary(args.rotary_dim if args.rotary_dim != args.head_dim else None)
        self.scale, self.softcap, self.clip_qkv = args.attn_scale, args.attn_softcap, args.clip_qkv
        self.kv_cache: Optional[KVCache] = None  # set by setup_caches()

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, input_pos: Tensor, batch_index: Optional[Tensor] = None,
                mask: Optional[Tensor] = None) -> Tensor:
        B, T, _ = x.shape
        q_size, kv_size = self.n_head * self.head_dim, self.n_kv * self.head_dim
        qkv = self.wqkv(x)
        if self.clip_qkv is not None:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(B, T, self.n_head, self.head_dim)
        k = k.view(B, T, self.n_kv, self.head_dim)
        v = v.view(B, T, self.n_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        k, v = self.kv_cache.update(input_pos, k.transpose(1, 2), v.transpose(1, 2), batch_index)  # [B, n_kv, S, D]
        # the slots the mask covers (Transformer._attend_filled); export_onnx.py's trace has fixed shapes
        if not torch.jit.is_tracing() and not statically_known_true(mask.shape[-1] == k.shape[2]):
            k, v = k[:, :, :mask.shape[-1]], v[:, :, :mask.shape[-1]]
        if self.softcap:
            scale = self.scale if self.scale is not None else self.head_dim ** -0.5
            y = softcapped_attention(q.transpose(1, 2), k, v, mask, scale, self.softcap)
        else:  # grouped-query attention without copying the cache (enable_gqa shares each KV head among its queries)
            y = sdpa(q.transpose(1, 2), k, v, mask, self.scale, self.n_kv != self.n_head)
        return self.wo(y.transpose(1, 2).reshape(B, T, q_size))


class FeedForward(nn.Module):
    """w2(act(w1 x) * w3 x) (gated: Llama's SwiGLU, Gemma's GeGLU) or w2(act(w1 x)) (plain: StarCoder2)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.act = args.mlp_act
        self.w1 = Linear(args.dim, args.intermediate_size, bias=args.mlp_bias)
        self.w3 = Linear(args.dim, args.intermediate_size, bias=args.mlp_bias) if args.mlp_gated else None
        self.w2 = Linear(args.intermediate_size, args.dim, bias=args.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        h = ACTIVATIONS[self.act](self.w1(x))
        return self.w2(h * self.w3(x) if self.w3 is not None else h)


class Router(nn.Module):
    """Expert scores x @ weight^T. Not an nn.Linear on purpose: quantization leaves the routing in float."""

    def __init__(self, dim: int, n_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight)


class MoEFeedForward(nn.Module):
    """Mixtral's sparse MoE: softmax over the experts' scores (float32), keep the top k, renormalise; computed densely
    (see the header): every expert runs and is weighted by its routing weight, 0 for the experts not chosen."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.n_experts_per_tok
        self.gate = Router(args.dim, args.n_experts)
        self.experts = nn.ModuleList(FeedForward(args) for _ in range(args.n_experts))

    def forward(self, x: Tensor) -> Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)                  # [B, T, E]
        kth = torch.topk(probs, self.top_k, dim=-1).values[..., -1:]
        w = torch.where(probs >= kth, probs, torch.zeros_like(probs))
        w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
        out = w[..., 0:1] * self.experts[0](x)
        for e in range(1, len(self.experts)):
            out = out + w[..., e:e + 1] * self.experts[e](x)
        return out


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer: int = 0):
        super().__init__()
        self.sliding = args.is_sliding(layer)    # attends over the sliding window (mask "sliding")
        self.local_rope = self.sliding and args.rope_local_base is not None  # uses Transformer.rope_local
        self.attention = Attention(args, layer)
        self.feed_forward = MoEFeedForward(args) if args.n_experts else FeedForward(args)
        self.parallel = args.parallel_attn  # the MLP reads the block's input: ffn_norm(x), or attention_norm(x) if None
        self.attention_norm = make_norm(args, args.dim)
        self.ffn_norm = make_norm(args, args.dim) if not args.parallel_attn or args.parallel_norms == 2 else None
        self.post_attention_norm = make_norm(args, args.dim) if args.sandwich_norm else None
        self.post_ffn_norm = make_norm(args, args.dim) if args.sandwich_norm else None

    def forward(self, x, cos, sin, input_pos, batch_index=None, mask=None):
        n = self.attention_norm(x)
        h = self.attention(n, cos, sin, input_pos, batch_index=batch_index, mask=mask)
        if self.post_attention_norm is not None:
            h = self.post_attention_norm(h)
        if self.parallel:  # GPT-J, Falcon: x + attn(norm(x)) + mlp(norm'(x))
            out = self.feed_forward(n if self.ffn_norm is None else self.ffn_norm(x))
            if self.post_ffn_norm is not None:
                out = self.post_ffn_norm(out)
            return x + (h + out)
        h = x + h
        out = self.feed_forward(self.ffn_norm(h))
        if self.post_ffn_norm is not None:
            out = self.post_ffn_norm(out)
        return h + out


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.config = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # GPT-2's learned absolute positions; MPT's ALiBi slopes (a constant list: nothing to load)
        self.pos_embeddings = nn.Embedding(args.block_size, args.dim) if args.learned_pos else None
        self.alibi = alibi_slopes(args) if args.alibi else None
        self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(args.n_layer))
        self.norm = make_norm(args, args.dim)
        self.output = Linear(args.dim, args.vocab_size, bias=args.output_bias)
        self.max_batch_size = -1
        self.max_seq_length = -1
        self.quantization: Optional[dict] = None  # the recipe quantize.py applied (load_model sets it); None = float
        self.tie_weights()

    def tie_weights(self):
        if self.config.tie_embeddings and isinstance(self.output, nn.Linear) and isinstance(self.tok_embeddings, nn.Embedding):
            self.output.weight = self.tok_embeddings.weight

    def setup_caches(self, max_batch_size: int, max_seq_length: int, dtype: Optional[torch.dtype] = None):
        """Allocate the KV cache and rotary tables. max_seq_length is capped at the model's block_size."""
        max_seq_length = min(max_seq_length, self.config.block_size)
        if dtype is None:
            dtype = self.norm.weight.dtype
        device = self.norm.weight.device
        self.max_batch_size, self.max_seq_length = max_batch_size, max_seq_length
        for layer in self.layers:
            layer.attention.kv_cache = KVCache(max_batch_size, max_seq_length, self.config.n_local_heads,
                                               self.config.head_dim, dtype).to(device)
        self.set_rope(max_seq_length, dtype, device)

    def set_rope(self, seq_len: int, dtype=torch.float32, device=None, longrope_len: Optional[int] = None):
        """(Re)make the rope tables for positions 0..seq_len-1: `rope` and, with a local base, `rope_local`.
        longrope_len (default seq_len): the cache length that picks Phi-3's short or long factors."""
        self.register_buffer("rope", precompute_rope(self.config, seq_len, dtype, longrope_len=longrope_len).to(device),
                             persistent=False)
        if self.config.rope_local_base is not None:
            self.register_buffer("rope_local", precompute_rope(self.config, seq_len, dtype, local=True).to(device),
                                 persistent=False)

    prompt_call = None  # swap point (see the top of this file): None calls the modules as they are

    export_attend_filled = False  # under torch.export: aoti_export.py sets it (AOT Inductor takes the dynamic size)

    def _attend_filled(self, idx: Tensor) -> bool:
        """Whether the layers attend over the cache slots up to the newest position only (the derived mask's length;
        Attention cuts the keys to it) rather than all max_seq_length slots, most of them still empty while decoding:
        reading the static cache whole cost SmolLM2 half its compiled decode speed at 2048 slots (the server's and
        chat's context; bench.py's `compile int4 g32 ctx2048` row, README). On CPU, eager and torch.compile
        (the length is a data-dependent size there: Dynamo must capture scalar outputs, engine.configure_inductor);
        under torch.export only where the exporter says so (export_attend_filled: AOT Inductor; ExecuTorch, ONNX and
        Cloud AI 100 need fixed shapes); not on GPUs (CUDA graphs need fixed shapes too)."""
        if idx.device.type != "cpu":
            return False
        if torch.jit.is_tracing():  # export_onnx.py
            return False
        if torch.compiler.is_exporting():
            return self.export_attend_filled
        return not torch.compiler.is_compiling() or torch._dynamo.config.capture_scalar_outputs

    def forward(self, idx: Tensor, input_pos: Tensor, batch_index: Optional[Tensor] = None,
                mask: Optional[Tensor] = None, logits_at: Optional[Tensor] = None) -> Tensor:
        """idx [B, T]; input_pos [T] or [B, T] (-1 = padding); batch_index [B] (or [B, 1]): cache slot of each row;
        mask [B or 1, 1, T, S] (bool, True = may attend, or additive float): replaces the position-derived mask.
        Returns logits [B, T, V]; with logits_at [B] (an index along T per row), only those rows' logits, [B, 1, V]:
        a prompt needs only its last token's, and the output projection is ~20% of a small model's prefill."""
        assert self.max_seq_length > 0, "call setup_caches() first"
        cfg = self.config
        B, T = idx.shape
        S = self.max_seq_length
        pos = input_pos.clamp(min=0)  # padding positions (-1) compute garbage that nobody reads, without NaNs
        rows = 1 if pos.dim() == 1 else B

        def cos_sin(table):
            cs = table[:, pos]  # [2, T, D] or [2, B, T, D]
            return cs[0].view(rows, T, 1, -1), cs[1].view(rows, T, 1, -1)

        ropes = {False: cos_sin(self.rope)}
        if cfg.rope_local_base is not None:
            ropes[True] = cos_sin(self.rope_local)
        x = self.tok_embeddings(idx)
        if cfg.embed_scale:  # Gemma: sqrt(dim) rounded to the model dtype, as transformers does
            x = x * torch.tensor(cfg.dim ** 0.5, dtype=x.dtype)
        if self.pos_embeddings is not None:  # GPT-2: + the embedding of each token's position
            x = x + self.pos_embeddings(pos)
        q_pos = pos.view(rows, 1, T, 1)
        masks = {}
        if mask is None and S > 1 and self._attend_filled(idx):  # slots 0..newest position only (_attend_filled)
            last = pos.max().clamp(min=1).item()  # at least 2 slots (the mask hides the second at position 0): a
            torch._check(last >= 1)               # compiled graph cannot tell a size of 1 (broadcast) from others
            torch._check(last < S)
            S = last + 1
        if mask is None:  # a query at position p sees cache slots 0..p (sliding: p-W+1..p)
            slot = torch.arange(S, device=idx.device).view(1, 1, 1, S)
            allowed = slot <= q_pos
            masks[False] = torch.zeros(allowed.shape, dtype=x.dtype, device=x.device).masked_fill(~allowed, float("-inf"))
            if cfg.sliding_window:
                allowed = allowed & (slot > q_pos - cfg.sliding_window)
                masks[True] = torch.zeros(allowed.shape, dtype=x.dtype, device=x.device).masked_fill(~allowed, float("-inf"))
        else:  # the caller's mask; sliding layers also hide cache slots (= positions) left of the window
            masks[False] = mask
            if cfg.sliding_window:
                slot = torch.arange(mask.shape[-1], device=idx.device).view(1, 1, 1, -1)
                keep = (slot > q_pos - cfg.sliding_window) | (slot >= S)
                masks[True] = mask & keep if mask.dtype == torch.bool else mask.masked_fill(~keep, float("-inf"))
        if self.alibi is not None:  # MPT: -slope_h * (query position - key position) on every score
            if mask is not None:  # its cache slots need not be positions (lookahead's speculative tokens)
                raise ValueError("ALiBi (MPT) needs the position of every key, which a caller's mask does not give "
                                 "(lookahead decoding is not supported for ALiBi models)")
            dist = (q_pos - torch.arange(S, device=idx.device).view(1, 1, 1, S)).to(x.dtype)  # [rows, 1, T, S]
            bias = -torch.tensor(self.alibi, dtype=x.dtype, device=x.device).view(1, -1, 1, 1) * dist  # [rows,H,T,S]
            masks = {k: m + bias for k, m in masks.items()}
        call = call_module
        if T > 1 and self.prompt_call is not None and not torch.compiler.is_compiling():
            call = self.prompt_call
        for layer in self.layers:
            cos, sin = ropes[layer.local_rope]
            x = call(layer, x, cos, sin, input_pos, batch_index=batch_index, mask=masks[layer.sliding])
        if logits_at is not None:
            x = x.gather(1, logits_at.view(B, 1, 1).expand(B, 1, x.shape[-1]))
        logits = call(self.output, self.norm(x))
        if cfg.final_softcap:
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits.float()


def call_module(module: nn.Module, *args, **kwargs):
    """Transformer.forward's default way to call its blocks (see prompt_call)."""
    return module(*args, **kwargs)


def _json_object(value, key: str, path) -> dict:
    """A checkpoint's JSON field (_config, _quantization, config.json) as a dict, or one clear ValueError."""
    try:
        obj = json.loads(value) if isinstance(value, (str, bytes)) else None
    except json.JSONDecodeError:
        obj = None
    if not isinstance(obj, dict):
        raise ValueError(f"checkpoint {path}: {key} is not a JSON object string (got {type(value).__name__})")
    return obj


def load_model(checkpoint_path, device="cpu", dtype: Optional[torch.dtype] = None) -> Transformer:
    """Load a checkpoint written by scripts/convert_checkpoint.py or quantize.py, safely (weights_only, mmap).

    The file carries its own config under "_config" (a JSON string of ModelArgs) and, when quantized, its recipe
    under "_quantization" (JSON, applied by quantize.py before the weights are assigned): no flag, no filename
    parsing. Older files without "_config" fall back to config.json beside them, then to the directory's name."""
    path = checkpoint_file(checkpoint_path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        sd = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise ValueError(f"cannot read checkpoint {path}: not a valid PyTorch weights file ({type(e).__name__})") from None
    if not isinstance(sd, dict):
        raise ValueError(f"checkpoint {path} does not hold a state dict")
    if "_config" in sd:
        args = ModelArgs.from_dict(_json_object(sd.pop("_config"), "_config", path))
    elif (path.parent / "config.json").is_file():
        args = ModelArgs.from_dict(_json_object((path.parent / "config.json").read_text(), "config.json", path))
    else:
        args = ModelArgs.from_name(path.parent.name)
    recipe = sd.pop("_quantization", None)
    recipe = None if recipe is None else _json_object(recipe, "_quantization", path)
    with torch.device("meta"):
        model = Transformer(args)
    if recipe:
        import quantize  # only quantized checkpoints need it
        model = quantize.apply_recipe(model, recipe)
    model.quantization = recipe or None
    if args.tie_embeddings:
        sd.pop("output.weight", None)
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    missing = [k for k in missing if not (args.tie_embeddings and k == "output.weight")]
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match its config: missing {missing[:3]}, unexpected {unexpected[:3]}")
    model.tie_weights()
    if dtype is not None:
        model = model.to(dtype=dtype)  # casts floating-point tensors only; quantized integer weights stay as they are
    return model.to(device).eval().requires_grad_(False)


def checkpoint_state(model: Transformer, quantization: Optional[dict] = None) -> dict:
    """The dict that load_model() reads back: weights (tied output dropped) + config (+ quantization recipe)."""
    sd = {k: v for k, v in model.state_dict().items() if not (model.config.tie_embeddings and k == "output.weight")}
    sd["_config"] = json.dumps(asdict(model.config))
    if quantization:
        sd["_quantization"] = json.dumps(quantization)
    return sd


def save_checkpoint(sd: dict, path) -> None:
    """Write atomically (common.atomic_path), so no half-written checkpoint is left behind."""
    with atomic_path(path) as tmp:
        torch.save(sd, str(tmp))
