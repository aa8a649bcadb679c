# qops.py: quantized weights as plain integer tensors, the rounding that makes them, and the exact eager modules over
# them: QuantizedWeight (int8 per channel, int4 per group, symmetric or asymmetric), QuantizedLinear and
# QuantizedEmbedding, which quantize.py (round to nearest) and gptq.py swap into model.py's Transformer. Faster
# products are fast_cpu_quant.py's; export forms are qexport.py's.
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


# ----------------------------------------------------------------------------------------------------------- layouts
def pack_int4(q: Tensor, groupsize: int) -> Tensor:
    """q [N, K] integers in [0, 15] -> uint8 [N, K/2]; in each group, byte j = (q[j] << 4) | q[j + G/2]."""
    N, K = q.shape
    q = q.to(torch.uint8).view(N, K // groupsize, 2, groupsize // 2)
    return ((q[:, :, 0] << 4) | q[:, :, 1]).reshape(N, K // 2)


def unpack_int4(p: Tensor, groupsize: int) -> Tensor:
    """uint8 [..., K/2] -> uint8 [..., K] in [0, 15] (inverse of pack_int4)."""
    lead, half = p.shape[:-1], p.shape[-1]
    p = p.reshape(*lead, half * 2 // groupsize, 1, groupsize // 2)
    hi = torch.div(p, 16, rounding_mode="floor") if torch.compiler.is_exporting() else p >> 4  # >> is not core ATen
    return torch.cat((hi, p & 15), dim=-2).reshape(*lead, half * 2)


def _int4_values(q: Tensor, s: Tensor, z: Optional[Tensor]) -> Tensor:
    return (q - 8) * s[..., None] if z is None else torch.addcmul(z[..., None], q, s[..., None])


def quant_per_token_int8(x: Tensor, row_range: Optional[Callable] = None) -> tuple:
    """Dynamic asymmetric int8 quantization of each row of x (last dim): (q, zp, scale), q and zp integer-valued floats
    in [-128, 127], x ~ (q - zp) * scale. The same arithmetic as torchao's choose_qparams_affine / quantize_affine
    (ASYMMETRIC, int8, zero kept exact). row_range(lo, hi) -> (lo, hi): the range of the whole row when x is a slice
    of it (tp.py's row-parallel shards)."""
    lo = torch.clamp(x.amin(-1, keepdim=True), max=0)
    hi = torch.clamp(x.amax(-1, keepdim=True), min=0)
    if row_range is not None:
        lo, hi = row_range(lo, hi)
    scale = torch.clamp((hi - lo) / 255.0, min=torch.finfo(x.dtype).smallest_normal)
    zp = torch.clamp(-128 - torch.round(lo / scale), -128, 127)
    q = torch.clamp(torch.round(x * (1.0 / scale)) + zp, -128, 127)
    return q, zp, scale


def fake_quant_per_token_int8(x: Tensor, row_range: Optional[Callable] = None) -> Tensor:
    """quant_per_token_int8, then dequantization (torchao's dequantize_affine): what the int8 activations stand for."""
    q, zp, scale = quant_per_token_int8(x, row_range)
    return (q - zp) * scale


def group_sums(x: Tensor, G: int) -> Tensor:
    """x [..., K] -> the sums of each group of G columns [..., K/G]. In a .pte this is a portable kernel between two
    XNNPACK calls; the delegated form (a mean over a 4-D view) measured slower: it adds dim-order copies."""
    return x.unflatten(-1, (-1, G)).sum(-1)


def on_bf16_grid(t: Tensor) -> bool:
    """Whether bfloat16 holds every value of t exactly (8da4w's scales: XNNPACK's qb4w kernels keep them so)."""
    return torch.equal(t.float(), t.to(torch.bfloat16).float())


# ----------------------------------------------------------------------------------------------------------- rounding
_EPS = 1e-10


def _int4_group_params(wg: Tensor, shrink, symmetric: bool):
    """wg [..., G] -> scale [...] and (asymmetric) zero offset [...]; shrink (float or tensor [...]) narrows the range."""
    if symmetric:  # 8da4w: scales on the bfloat16 grid, as XNNPACK's qb4w kernels store them (the .pte == eager)
        return (wg.abs().amax(-1) * shrink / 7.5).clamp(min=_EPS).to(torch.bfloat16).float(), None
    lo, hi = wg.amin(-1), wg.amax(-1)
    mid = (lo + hi) / 2
    lo, hi = mid + (lo - mid) * shrink, mid + (hi - mid) * shrink
    return ((hi - lo) / 15).clamp(min=_EPS), lo


def _int4_round(wg: Tensor, s: Tensor, z: Optional[Tensor]) -> Tensor:
    """Values of wg [..., G] on the int4 grid of per-group s, z [...]: integers in [0, 15] (stored as float)."""
    if z is None:
        return torch.clamp(torch.round(wg / s[..., None]), -8, 7) + 8
    return torch.clamp(torch.round((wg - z[..., None]) / s[..., None]), 0, 15)


SHRINKS = (1.0, 0.97, 0.94, 0.91, 0.88, 0.85, 0.82, 0.79)
SYM_EXTRA = (7.5 / 7,)  # symmetric: amax / 7, so that a positive extreme is not clipped to 7 s


def group_params(w: Tensor, scheme: dict):
    """Per-group scale [N, K/G] and zero offset [N, K/G] (None when symmetric) of a 4-bit scheme for w [N, K]: each
    group's range is scaled by the factor in SHRINKS (+ SYM_EXTRA if symmetric) that gives the least squared error
    (1.0 wins ties, so a source already on an int4 grid, like SmolLM2's Q4_1 GGUF, is reproduced exactly). An xnnpack
    scheme's scales go on the bfloat16 grid (XNNPACK stores them so)."""
    groupsize, symmetric = scheme["groupsize"], scheme["symmetric"]
    N, K = w.shape
    wg = w.float().reshape(N, K // groupsize, groupsize)
    best = torch.ones(wg.shape[:-1], device=w.device)
    rows = max(1, 2**18 // K)  # ~1 MB at a time: the search's temporaries stay in cache (3x faster than 4096 rows)
    for r in range(0, N, rows):
        sub = wg[r:r + rows]
        best_err = None
        for f in SHRINKS + (SYM_EXTRA if symmetric else ()):
            s, z = _int4_group_params(sub, f, symmetric)
            err = (_int4_values(_int4_round(sub, s, z), s, z) - sub).pow(2).sum(-1)
            if best_err is None:
                best_err = err
            else:
                better = err < best_err
                best[r:r + rows][better] = f
                best_err = torch.where(better, err, best_err)
    s, z = _int4_group_params(wg, best, symmetric)
    return (s.to(torch.bfloat16).float() if scheme.get("xnnpack") else s), z


def quantize_tensor(w: Tensor, scheme: dict) -> dict:
    """Round-to-nearest quantization of w [N, K]: {"q": integer values (int8: [-127, 127], int4: [0, 15]) [N, K],
    "scales": ..., "zeros": ... or None}."""
    w = w.detach().float()
    if scheme["bits"] == 8:
        s = (w.abs().amax(-1) / 127).clamp(min=_EPS)
        return {"q": torch.clamp(torch.round(w / s[:, None]), -127, 127), "scales": s, "zeros": None}
    G = scheme["groupsize"]
    s, z = group_params(w, scheme)
    N, K = w.shape
    q = _int4_round(w.reshape(N, K // G, G), s, z).reshape(N, K)
    return {"q": q, "scales": s, "zeros": z}


def quantize_weight(w: Tensor, scheme: dict) -> "QuantizedWeight":
    """w [N, K] rounded to nearest on scheme's grid, as a QuantizedWeight in w's dtype."""
    return QuantizedWeight.from_quantized(quantize_tensor(w, scheme), scheme, w.dtype)


# ----------------------------------------------------------------------------------------------------------- modules
class QuantizedWeight(nn.Module):
    """One quantized [out_features, in_features] matrix in plain tensors (what a checkpoint stores).

    bits 8:  qdata int8 [N, K], scales [N]                     w = qdata * scales
    bits 4:  qdata uint8 [N, K/2] (pack_int4), scales [N, K/G], zeros [N, K/G] (asymmetric: w = q * s + z) or none
             (symmetric: w = (q - 8) * s). xnnpack (8da4w): an asymmetric weight whose products split into
             fake-quantized x @ ((q - 8) s).T plus x's group sums @ (z + 8 s).T, the form ExecuTorch's XNNPACK runs."""

    def __init__(self, out_features: int, in_features: int, scheme: dict, dtype=torch.float32, device=None):
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.bits, self.groupsize, self.symmetric = scheme["bits"], scheme["groupsize"], scheme["symmetric"]
        self.xnnpack = bool(scheme.get("xnnpack"))
        N, K = out_features, in_features
        kw = dict(device=device)
        if self.bits == 8:
            self.register_buffer("qdata", torch.empty(N, K, dtype=torch.int8, **kw))
            self.register_buffer("scales", torch.empty(N, dtype=dtype, **kw))
            self.zeros = None
        else:
            G = self.groupsize
            if K % G or G % 2:
                raise ValueError(f"group size {G} does not divide in_features {K}")
            self.register_buffer("qdata", torch.empty(N, K // 2, dtype=torch.uint8, **kw))
            self.register_buffer("scales", torch.empty(N, K // G, dtype=dtype, **kw))
            if self.symmetric:
                self.zeros = None
            else:
                self.register_buffer("zeros", torch.empty(N, K // G, dtype=dtype, **kw))

    @classmethod
    def from_quantized(cls, qt: dict, scheme: dict, dtype) -> "QuantizedWeight":
        q = qt["q"]
        m = cls(q.shape[0], q.shape[1], scheme, dtype=dtype, device=q.device)
        if m.bits == 8:
            m.qdata = q.to(torch.int8)
        else:
            m.qdata = pack_int4(q.to(torch.uint8), m.groupsize)
        m.scales = qt["scales"].to(dtype)
        if qt["zeros"] is not None:
            m.zeros = qt["zeros"].to(dtype)
        return m

    @property
    def weight_only(self) -> bool:
        """int4 weight-only (--mode int4, int4-gptq): not 8da4w's layouts."""
        return self.bits == 4 and not (self.symmetric or self.xnnpack)

    def int_values(self) -> Tensor:
        """Integer values [N, K] (int8: [-127, 127]; int4: [0, 15]) as int16."""
        if self.bits == 8:
            return self.qdata.to(torch.int16)
        return unpack_int4(self.qdata, self.groupsize).to(torch.int16)

    def dequantize(self, dtype=None, start: int = 0, end: Optional[int] = None, offset: bool = True) -> Tensor:
        """Float weight rows [start, end) (default all): [end - start, K]; offset False: without zero offsets."""
        dtype = dtype or self.scales.dtype
        end = self.out_features if end is None else end
        if self.bits == 8:
            return self.qdata[start:end].to(dtype) * self.scales[start:end].to(dtype)[:, None]
        K, G = self.in_features, self.groupsize
        q = unpack_int4(self.qdata[start:end], G).view(end - start, K // G, G).to(dtype)
        z = None if self.zeros is None or not offset else self.zeros[start:end].to(dtype)
        return _int4_values(q, self.scales[start:end].to(dtype), z).view(end - start, K)

    def chunked_linear(self, x: Tensor, rows: int = 512, offset: bool = True) -> Tensor:
        """Eager x @ w.T that dequantizes `rows` output channels at a time: the float temporaries stay in cache
        (dequantizing a whole matrix first costs a round trip through memory of 4 bytes per weight)."""
        N = self.out_features
        if self.bits == 8:  # per-channel scales apply to the output: one pass less over the weights
            def part(i, j):
                return F.linear(x, self.qdata[i:j].to(x.dtype)) * self.scales[i:j].to(x.dtype)
        else:
            def part(i, j):
                return F.linear(x, self.dequantize(x.dtype, i, j, offset))
        if N <= rows:
            return part(0, N)
        return torch.cat([part(i, min(i + rows, N)) for i in range(0, N, rows)], -1)

    def rows(self, idx: Tensor, dtype=None) -> Tensor:
        """Dequantized rows idx (any shape) -> [*idx.shape, K]: an embedding lookup."""
        dtype = dtype or self.scales.dtype
        q = F.embedding(idx, self.qdata)
        if self.bits == 8:
            return q.to(dtype) * self.scales[idx].to(dtype).unsqueeze(-1)
        G = self.groupsize
        q = unpack_int4(q, G).unflatten(-1, (-1, G)).to(dtype)
        z = None if self.zeros is None else self.zeros[idx].to(dtype)
        return _int4_values(q, self.scales[idx].to(dtype), z).flatten(-2)

    def extra_repr(self):
        g = f", groupsize={self.groupsize}" if self.bits == 4 else ""
        return f"{self.out_features}x{self.in_features}, int{self.bits}{g}, {'symmetric' if self.symmetric else 'asymmetric'}"


class QuantizedLinear(nn.Module):
    """nn.Linear replacement: weight-only (act None) or with dynamic per-token int8 activations (act "int8": x goes
    through fake_quant_per_token_int8 first, or through act_quant where tp.py sets one on its shards). The exact
    eager product: dequantize, then multiply (fast_cpu_quant.FastQuantizedLinear computes the same faster)."""

    act_quant = None

    def __init__(self, qweight: QuantizedWeight, bias: Optional[Tensor] = None, act: Optional[str] = None):
        super().__init__()
        self.in_features, self.out_features = qweight.in_features, qweight.out_features
        self.qweight = qweight
        self.act = act
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    def forward(self, x: Tensor) -> Tensor:
        qw, zt = self.qweight, None
        if self.act == "int8":
            if qw.xnnpack and qw.zeros is not None:  # asymmetric 8da4w: the zero term takes the float activations
                zt = F.linear(group_sums(x, qw.groupsize), (qw.zeros + 8 * qw.scales).to(x.dtype))
            x = (self.act_quant or fake_quant_per_token_int8)(x)
        y = self.product(x, offset=zt is None)
        y = y if zt is None else y + zt
        return y + self.bias if self.bias is not None else y

    def product(self, x: Tensor, offset: bool = True) -> Tensor:
        """x @ w.T (offset False: without an asymmetric weight's zero offsets): compiled or exported, one dequantize
        and one GEMM; eager, a block of rows at a time."""
        if torch.compiler.is_compiling():
            return F.linear(x, self.qweight.dequantize(x.dtype, offset=offset))
        return self.qweight.chunked_linear(x, offset=offset)

    def extra_repr(self):
        return f"act={self.act}" if self.act else ""


class QuantizedEmbedding(nn.Module):
    """nn.Embedding replacement; its output dtype is that of the scales (the model's float dtype)."""

    def __init__(self, qweight: QuantizedWeight):
        super().__init__()
        self.num_embeddings, self.embedding_dim = qweight.out_features, qweight.in_features
        self.qweight = qweight

    def forward(self, idx: Tensor) -> Tensor:
        return self.qweight.rows(idx)
