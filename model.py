# model.py: one transformer for every supported family (Llama 2/3, Mistral, Mixtral, SmolLM2/3, Qwen2.5/3, Gemma 1/2/3,
# Phi-3/4-mini, StarCoder2, GPT-2, GPT-J, Falcon, MPT, CodeGen2.5/XGen), gpt-fast style: the network only
# (checkpoint.py reads and writes checkpoints).
# A family is a set of ModelArgs fields that pick small named blocks (norms, gated or plain MLP, MoE, rotary / none /
# learned positions / ALiBi, sliding windows, soft caps, parallel blocks); never a class per model. The network and
# nothing else: faster kernels, packed weights and compiled callers are modules that fast_cpu.py swaps in at the swap
# points Transformer's docstring lists; quantize.py swaps in quantized linears the same way.
import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from model_configs import ModelArgs, rope_frequencies, longrope_attention_factor, transformer_configs  # noqa: F401


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


def make_norm(args: ModelArgs, dim: int) -> nn.Module:
    """The family's norm: RMSNorm, or LayerNorm with bias (StarCoder2, GPT-2, GPT-J, Falcon) or without (MPT)."""
    if args.norm_type == "rms":
        return RMSNorm(dim, args.norm_eps)
    return nn.LayerNorm(dim, eps=args.norm_eps, bias=args.norm_bias)


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu}


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


class SDPA(nn.Module):
    """Attention.attend (a swap point): softmax(q k^T * scale + mask) v with F.scaled_dot_product_attention;
    grouped-query attention shares each KV head among its queries without copying the cache (enable_gqa).
    q [B, H, T, D], k/v [B, Hkv, S, D], mask bool (True = may attend) or additive, [B or 1, 1 or H, T, S]."""

    def __init__(self, scale: Optional[float], gqa: bool):
        super().__init__()
        self.scale, self.gqa = scale, gqa

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=self.gqa)


class SoftcapAttention(nn.Module):
    """Attention.attend of Gemma 2: softmax(cap * tanh(q k^T * scale / cap) + mask) v, grouped-query without copying
    the cache (query heads viewed grouped by their KV head). Same shapes as SDPA."""

    def __init__(self, scale: float, cap: float):
        super().__init__()
        self.scale, self.cap = scale, cap

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        B, H, T, D = q.shape
        Hkv = k.shape[1]
        # (with one KV head, AOT Inductor's frozen graph of this broadcast reads the cache as it was at export: the
        # families' chimera has two; torch.compile, ONNX and eager are exact with one)
        qg = q.view(B, Hkv, H // Hkv, T, D)
        s = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)) * self.scale        # [B, Hkv, r, T, S]
        s = torch.tanh(s / self.cap) * self.cap
        m = mask.unsqueeze(1) if mask.shape[1] == 1 else mask.view(mask.shape[0], Hkv, H // Hkv, *mask.shape[2:])
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m
        p = torch.softmax(s.float(), dim=-1).to(q.dtype)
        return torch.matmul(p, v.unsqueeze(2)).view(B, H, T, D)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int = 0):
        super().__init__()
        self.n_head, self.n_kv, self.head_dim = args.n_head, args.n_local_heads, args.head_dim
        total = (self.n_head + 2 * self.n_kv) * self.head_dim
        self.wqkv = nn.Linear(args.dim, total, bias=args.attn_bias)
        self.wo = nn.Linear(self.n_head * self.head_dim, args.dim, bias=args.attn_out_bias)
        self.q_norm = RMSNorm(self.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, args.norm_eps) if args.qk_norm else None
        nope = layer in (args.nope_layers or ())
        self.rope = NoRope() if nope else Rotary(args.rotary_dim if args.rotary_dim != args.head_dim else None)
        if args.attn_softcap:
            self.attend = SoftcapAttention(args.attn_scale or self.head_dim ** -0.5, args.attn_softcap)
        else:
            self.attend = SDPA(args.attn_scale, self.n_kv != self.n_head)
        self.clip_qkv = args.clip_qkv
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
        y = self.attend(q.transpose(1, 2), k, v, mask)
        return self.wo(y.transpose(1, 2).reshape(B, T, q_size))


class FeedForward(nn.Module):
    """w2(act(w1 x) * w3 x) (gated: Llama's SwiGLU, Gemma's GeGLU) or w2(act(w1 x)) (plain: StarCoder2)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.act = args.mlp_act
        self.w1 = nn.Linear(args.dim, args.intermediate_size, bias=args.mlp_bias)
        self.w3 = nn.Linear(args.dim, args.intermediate_size, bias=args.mlp_bias) if args.mlp_gated else None
        self.w2 = nn.Linear(args.intermediate_size, args.dim, bias=args.mlp_bias)

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
    """Mixtral's sparse MoE: softmax over the experts' scores (float32), keep the top k, renormalise. Computed densely:
    every expert (an nn.Linear, so quantize.py and every exporter take it as is) runs on every token, weighted by its
    routing weight, 0 for the experts not chosen: exact and free of data-dependent control flow, at n_experts /
    n_experts_per_tok times the MLP's FLOPs and weight reads of a gather of the chosen experts."""

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
    """forward(idx [B, T], input_pos, batch_index=None, mask=None, logits_at=None) -> float32 logits [B, T, V].

    Positions: input_pos is [T] (every row at the same positions) or [B, T] (each row its own; -1 = padding, whose
    outputs nobody reads). The KV cache lives in buffers made by setup_caches(max_batch_size, max_seq_length); the
    attention mask is derived from the positions (a query at position p sees slots 0..p, in a sliding-window layer
    p-W+1..p, as transformers does), so callers pass none and nothing branches on data. A caller that lays out the
    cache itself passes `mask` (bool, True = may attend, or additive float; [B or 1, 1, T, S]): it replaces the derived
    mask in every layer, and sliding layers further hide slots j < p-W+1 (slots j >= max_seq_length, a caller's
    scratch space, are left as the caller says). Rotary uses the Hugging Face half-split layout over the first
    rotary_dim dims of each head (converters permute Meta / GGUF / llama2.c / GPT-J q/k rows into it); GPT-2's learned
    positions are indexed by input_pos; MPT's ALiBi is folded into the derived mask (a caller's mask is refused).

    Swap points: modules assigned in place of these compute the same function (never patched functions):
      * every nn.Linear (attention.wqkv / wo, feed_forward.w1 / w2 / w3, experts, output) and tok_embeddings:
        quantize.py's QuantizedLinear / QuantizedEmbedding, fast_cpu.py's oneDNN linear, tp.py's shards;
      * attention.kv_cache: update(input_pos, k, v, batch_index) -> the keys / values to attend over;
      * attention.rope: forward(x, cos, sin) (Rotary, or NoRope in a layer without positions);
      * attention.attend: forward(q, k, v, mask) -> [B, H, T, D] (SDPA or SoftcapAttention); it may attend over the
        first mask.shape[-1] slots only;
      * the norms (attention_norm, ffn_norm, post_*_norm, norm, q_norm / k_norm);
      * cache_len: forward(positions, S) -> the number of cache slots the derived mask covers (FullCache: all S);
      * layers[i] and output as whole modules (fast_cpu.py runs prompts through compiled copies of them)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.config = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # GPT-2's learned absolute positions; MPT's ALiBi slopes (a constant list: nothing to load)
        self.pos_embeddings = nn.Embedding(args.block_size, args.dim) if args.learned_pos else None
        self.alibi = alibi_slopes(args) if args.alibi else None
        self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(args.n_layer))
        self.norm = make_norm(args, args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=args.output_bias)
        self.cache_len = FullCache()
        self.max_batch_size = -1
        self.max_seq_length = -1
        self.quantization: Optional[dict] = None  # the recipe quantize.py applied (checkpoint.load_model sets it); None = float
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

    def forward(self, idx: Tensor, input_pos: Tensor, batch_index: Optional[Tensor] = None,
                mask: Optional[Tensor] = None, logits_at: Optional[Tensor] = None) -> Tensor:
        """batch_index [B] (or [B, 1]): the cache slot of each row (continuous batching). logits_at [B] (an index
        along T per row): only those rows' logits, [B, 1, V] (a prompt needs its last token's only)."""
        assert self.max_seq_length > 0, "call setup_caches() first"
        cfg = self.config
        B, T = idx.shape
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
        S = self.cache_len(pos, self.max_seq_length) if mask is None else self.max_seq_length
        masks = self.masks(q_pos, S, x.dtype) if mask is None else self.caller_masks(mask, q_pos)
        if self.alibi is not None:  # MPT: -slope_h * (query position - key position) on every score
            if mask is not None:  # its cache slots need not be positions (lookahead's speculative tokens)
                raise ValueError("ALiBi (MPT) needs the position of every key, which a caller's mask does not give "
                                 "(lookahead decoding is not supported for ALiBi models)")
            dist = (q_pos - torch.arange(S, device=idx.device).view(1, 1, 1, S)).to(x.dtype)  # [rows, 1, T, S]
            bias = -torch.tensor(self.alibi, dtype=x.dtype, device=x.device).view(1, -1, 1, 1) * dist  # [rows,H,T,S]
            masks = {k: m + bias for k, m in masks.items()}
        for layer in self.layers:
            cos, sin = ropes[layer.local_rope]
            x = layer(x, cos, sin, input_pos, batch_index=batch_index, mask=masks[layer.sliding])
        if logits_at is not None:
            x = x.gather(1, logits_at.view(B, 1, 1).expand(B, 1, x.shape[-1]))
        logits = self.output(self.norm(x))
        if cfg.final_softcap:
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits.float()

    def masks(self, q_pos: Tensor, S: int, dtype) -> dict:
        """The derived additive masks over S slots: {False: causal, True: causal within the sliding window}."""
        slot = torch.arange(S, device=q_pos.device).view(1, 1, 1, S)
        allowed = {False: slot <= q_pos}
        if self.config.sliding_window:
            allowed[True] = allowed[False] & (slot > q_pos - self.config.sliding_window)
        return {k: torch.zeros(a.shape, dtype=dtype, device=q_pos.device).masked_fill(~a, float("-inf"))
                for k, a in allowed.items()}

    def caller_masks(self, mask: Tensor, q_pos: Tensor) -> dict:
        """A caller's mask; sliding layers also hide cache slots (= positions) left of the window."""
        masks = {False: mask}
        if self.config.sliding_window:
            slot = torch.arange(mask.shape[-1], device=mask.device).view(1, 1, 1, -1)
            keep = (slot > q_pos - self.config.sliding_window) | (slot >= self.max_seq_length)
            masks[True] = mask & keep if mask.dtype == torch.bool else mask.masked_fill(~keep, float("-inf"))
        return masks


class FullCache(nn.Module):
    """Transformer.cache_len (a swap point): the layers attend over all S slots of the static cache."""

    def forward(self, positions: Tensor, S: int) -> int:
        return S
