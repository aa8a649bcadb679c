# One LLaMA-family transformer (Llama 2/3, Mistral, TinyLlama, SmolLM2, Qwen2.5, Qwen3), gpt-fast style.
#
# Conventions every stage relies on:
#   * forward(idx[B,T], input_pos, batch_index=None, mask=None) -> logits[B,T,V] (float32 for a float model run in
#     float32).
#   * input_pos is [T] (every row at the same positions) or [B,T] (each row its own positions, -1 = padding).
#   * The KV cache lives in buffers made by setup_caches(max_batch_size, max_seq_length). The attention mask is
#     derived from the positions (a query at position p sees cache slots 0..p), so ordinary callers pass none and
#     there is no data-dependent Python branching. A caller that lays out the cache itself passes `mask`: bool
#     (True = may attend) or additive float, shape [B or 1, 1, T, S] with S the length of the cache the layers
#     attend over; it replaces the derived mask in every layer.
#   * Rotary embedding uses the Hugging Face "half-split" layout (rotate_half); converters permute Meta/GGUF/llama2.c
#     Q/K weights (adjacent-pair layout) into it.
#   * Exports and decoding modes replace pieces through documented swap points, by assigning modules (never by
#     patching functions): each layer's `attention.kv_cache` (a module with update(input_pos, k, v, batch_index) ->
#     the keys/values to attend over), `attention.rope` (a module with forward(x, cos, sin); default Rotary) and the
#     RMSNorm modules (attention_norm, ffn_norm, norm, q_norm/k_norm), which may be replaced by any module computing
#     the same function. load_model() keeps the quantization recipe on the model as `model.quantization`.
import json
import math
from dataclasses import asdict, dataclass, fields
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from common import atomic_path, checkpoint_file


@dataclass
class ModelArgs:
    block_size: int = 2048            # maximum context the model was trained for
    vocab_size: int = 32000
    n_layer: int = 32
    n_head: int = 32
    dim: int = 4096
    intermediate_size: Optional[int] = None
    n_local_heads: int = -1           # number of KV heads (grouped-query attention); -1 = n_head
    head_dim: Optional[int] = None    # default dim // n_head (Qwen3 sets it explicitly)
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    rope_scaling: Optional[dict] = None  # Llama-3.1 style: factor, low_freq_factor, high_freq_factor, original_max_position_embeddings
    tie_embeddings: bool = False
    attn_bias: bool = False           # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False             # RMSNorm on each head of q and k before rotary (Qwen3)

    def __post_init__(self):
        if self.n_local_heads == -1:
            self.n_local_heads = self.n_head
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_head
        if self.intermediate_size is None:  # Llama's rule: 2/3 * 4 * dim rounded up to a multiple of 256
            hidden = int(2 * (4 * self.dim) / 3)
            self.intermediate_size = 256 * ((hidden + 255) // 256)
        if self.n_head % self.n_local_heads:
            raise ValueError(f"n_head ({self.n_head}) must be a multiple of n_local_heads ({self.n_local_heads})")

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
        """Build from a Hugging Face config.json (LlamaForCausalLM, MistralForCausalLM, Qwen2/Qwen3ForCausalLM)."""
        # Sliding-window attention (Mistral v0.1) is not implemented: output is exact up to sliding_window tokens.
        arch = (c.get("architectures") or [""])[0] + c.get("model_type", "")
        rs = c.get("rope_scaling") or c.get("rope_parameters")
        if rs and rs.get("rope_type", rs.get("type")) not in ("llama3",):
            if rs.get("rope_type", rs.get("type")) != "default":
                raise ValueError(f"unsupported rope_scaling {rs}")
            rs = None
        rope_base = c.get("rope_theta", (c.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        return cls(
            block_size=c.get("max_position_embeddings", 2048),
            vocab_size=c["vocab_size"],
            n_layer=c["num_hidden_layers"],
            n_head=c["num_attention_heads"],
            dim=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            n_local_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
            head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
            rope_base=float(rope_base),
            norm_eps=c.get("rms_norm_eps", 1e-5),
            rope_scaling=({k: rs[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                              "original_max_position_embeddings")} if rs else None),
            tie_embeddings=bool(c.get("tie_word_embeddings", False)),
            attn_bias=bool(c.get("attention_bias", False)) or "qwen2" in arch.lower(),
            qk_norm="qwen3" in arch.lower(),
        )


_llama3_scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
_llama32_scaling = dict(_llama3_scaling, factor=32.0)
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
}


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


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.type_as(x)


def rope_frequencies(args: ModelArgs, device=None) -> Tensor:
    inv_freq = 1.0 / (args.rope_base ** (torch.arange(0, args.head_dim, 2, device=device, dtype=torch.float32)
                                         / args.head_dim))
    s = args.rope_scaling
    if s:  # Llama-3.1 frequency-dependent scaling
        old = s["original_max_position_embeddings"]
        low_wl, high_wl = old / s["low_freq_factor"], old / s["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
        scaled = torch.where(wavelen > low_wl, inv_freq / s["factor"], inv_freq)
        mid = (1 - smooth) * inv_freq / s["factor"] + smooth * inv_freq
        inv_freq = torch.where((wavelen >= high_wl) & (wavelen <= low_wl), mid, scaled)
    return inv_freq


def precompute_rope(args: ModelArgs, seq_len: int, dtype=torch.float32) -> Tensor:
    inv_freq = rope_frequencies(args)
    t = torch.arange(seq_len, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)          # half-split layout
    return torch.stack((emb.cos(), emb.sin()), dim=0).to(dtype)  # [2, S, head_dim]


class Rotary(nn.Module):
    """Rotary embedding in the half-split layout (the Attention.rope swap point)."""

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        # x: [B, T, H, D]; cos/sin: [B or 1, T, 1, D]
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_head, self.n_kv, self.head_dim = args.n_head, args.n_local_heads, args.head_dim
        total = (self.n_head + 2 * self.n_kv) * self.head_dim
        self.wqkv = nn.Linear(args.dim, total, bias=args.attn_bias)
        self.wo = nn.Linear(self.n_head * self.head_dim, args.dim, bias=False)
        self.q_norm = RMSNorm(self.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, args.norm_eps) if args.qk_norm else None
        self.rope = Rotary()
        self.kv_cache: Optional[KVCache] = None  # set by setup_caches()

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, input_pos: Tensor, batch_index: Optional[Tensor] = None,
                mask: Optional[Tensor] = None) -> Tensor:
        B, T, _ = x.shape
        q_size, kv_size = self.n_head * self.head_dim, self.n_kv * self.head_dim
        q, k, v = self.wqkv(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(B, T, self.n_head, self.head_dim)
        k = k.view(B, T, self.n_kv, self.head_dim)
        v = v.view(B, T, self.n_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        k, v = self.kv_cache.update(input_pos, k.transpose(1, 2), v.transpose(1, 2), batch_index)  # [B, n_kv, S, D]
        # grouped-query attention without copying the cache (enable_gqa shares each KV head among its query heads)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, enable_gqa=self.n_kv != self.n_head)
        return self.wo(y.transpose(1, 2).reshape(B, T, q_size))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.intermediate_size, bias=False)
        self.w3 = nn.Linear(args.dim, args.intermediate_size, bias=False)
        self.w2 = nn.Linear(args.intermediate_size, args.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, cos, sin, input_pos, batch_index=None, mask=None):
        h = x + self.attention(self.attention_norm(x), cos, sin, input_pos, batch_index=batch_index, mask=mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.config = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layer))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
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
        self.register_buffer("rope", precompute_rope(self.config, max_seq_length, dtype).to(device), persistent=False)

    def forward(self, idx: Tensor, input_pos: Tensor, batch_index: Optional[Tensor] = None,
                mask: Optional[Tensor] = None) -> Tensor:
        """idx [B, T]; input_pos [T] or [B, T] (-1 = padding); batch_index [B] (or [B, 1]): cache slot of each row;
        mask [B or 1, 1, T, S] (bool, True = may attend, or additive float): replaces the position-derived mask."""
        assert self.max_seq_length > 0, "call setup_caches() first"
        B, T = idx.shape
        S = self.max_seq_length
        pos = input_pos.clamp(min=0)  # padding positions (-1) compute garbage that nobody reads, without NaNs
        cs = self.rope[:, pos]  # [2, T, D] or [2, B, T, D]
        rows = 1 if pos.dim() == 1 else B
        cos, sin = cs[0].view(rows, T, 1, -1), cs[1].view(rows, T, 1, -1)
        x = self.tok_embeddings(idx)
        if mask is None:  # a query at position p sees cache slots 0..p
            if pos.dim() == 1:
                allowed = (torch.arange(S, device=idx.device).view(1, S) <= pos.view(T, 1)).view(1, 1, T, S)
            else:
                allowed = (torch.arange(S, device=idx.device).view(1, 1, S) <= pos.view(B, T, 1)).view(B, 1, T, S)
            mask = torch.zeros(allowed.shape, dtype=x.dtype, device=x.device).masked_fill(~allowed, float("-inf"))
        for layer in self.layers:
            x = layer(x, cos, sin, input_pos, batch_index=batch_index, mask=mask)
        return self.output(self.norm(x)).float()


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
        args = ModelArgs.from_dict(json.loads(sd.pop("_config")))
    elif (path.parent / "config.json").is_file():
        args = ModelArgs.from_dict(json.loads((path.parent / "config.json").read_text()))
    else:
        args = ModelArgs.from_name(path.parent.name)
    recipe = sd.pop("_quantization", None)
    with torch.device("meta"):
        model = Transformer(args)
    if recipe:
        import quantize  # only quantized checkpoints need it
        model = quantize.apply_recipe(model, json.loads(recipe))
    model.quantization = json.loads(recipe) if recipe else None
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
