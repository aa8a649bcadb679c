# Weight quantization for model.py's Transformer, gpt-fast style: one scheme per mode, applied by swapping nn.Linear /
# nn.Embedding modules for quantized ones that hold plain integer tensors.
#
#     python quantize.py --checkpoint_path checkpoints/SmolLM2-135M-Instruct/model.pth --mode int8
#     python quantize.py --checkpoint_path ... --mode int4 --groupsize 32
#     python quantize.py --checkpoint_path ... --mode 8da4w --groupsize 32
#     python quantize.py --checkpoint_path ... --mode int4-gptq --groupsize 128 --calibration_file some.txt
#
# Modes (weights of every nn.Linear; activations stay float unless said otherwise):
#   int8       weight-only, symmetric, one scale per output channel          w = q * s,            q in [-127, 127]
#   int4       weight-only, asymmetric, groups of G along in_features        w = q * s + z,        q in [0, 15]
#   8da4w      int4 groupwise weights (as int4, scales on the bfloat16 grid) x int8 dynamic per-token asymmetric
#              activations, for ExecuTorch/XNNPACK. x @ w.T = xq @ ((q - 8) s).T + group_sums(x) @ (z + 8 s).T:
#              XNNPACK's qb4w GEMM (zero point 8 only) on the int8 activations xq, plus a small float GEMM (K/G
#              inputs: 18 for dim 576) of the float activations' group sums. Symmetric weights (z = 0, ExecuTorch's
#              own 8da4w; still loaded) measured +21% perplexity on SmolLM2-135M, whose weights come from an
#              asymmetric 4-bit GGUF; these +1.7%.
#   int4-gptq  int4 (same storage and kernels as int4), weights chosen by GPTQ on calibration text
#              (8da4w with --calibration_file also chooses its int4 weights by GPTQ)
#
# Embeddings (--embedding int8 | int4 | none): by default the token embedding is quantized to int8 (one scale per row)
# in every mode. When the model ties its output projection to the embedding (SmolLM2, Llama 3.2, Qwen) the output
# projection reads the very same quantized table (one copy in memory and in the file), i.e. it is quantized with the
# embedding's scheme; in 8da4w mode it also quantizes its activations (int8 table: XNNPACK's qd8-f32-qc8w GEMM, int4:
# qb4w), so the delegate takes it. int8 is the default because that table is the most sensitive matrix of a small
# model: on SmolLM2-135M an int4 g32 table alone costs ~6% perplexity, int8 ~0.05%, for ~10 MB. --embedding int4
# (groups of --groupsize, symmetric in 8da4w mode) gives the smallest file. A tied table is always rounded to nearest
# (GPTQ would tune it for the output projection alone); an untied output projection gets GPTQ like the other linears.
#
# Storage: every tensor in the file is plain (int8 / uint8 / float), loadable with torch.load(weights_only=True).
# int4 values are packed two per byte: within each group of G, byte j holds element j (high nibble) and element
# j + G/2 (low nibble). Scales and zero points are in the model's float dtype. The file stores its recipe, and
# model.load_model() calls apply_recipe() on a meta-device model before assigning the weights.
#
# Kernels. Eager: dequantize, then F.linear. Under torch.compile, for a single token (decode), the matmul is written as
# a reduction that reads the integer weights directly (int4 nibbles are unpacked inside the generated kernel); with
# Inductor's freezing, a plain `F.linear(x, w_int8.to(x.dtype)) * s` would be constant-folded back into a float32
# weight. The packed ATen kernels (_weight_int8pack_mm, _weight_int4pack_mm_for_cpu) were measured slower than both
# for float32 activations on this CPU. Under torch.export the modules emit plain dequantize + linear (int8/int4) or
# the torchao quantize/dequantize_affine pattern that ExecuTorch's XNNPACK partitioner turns into its
# int8-activation x int4-weight GEMM (8da4w).
import argparse
import contextlib
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

MODES = ("int8", "int4", "8da4w", "int4-gptq")
GROUPSIZES = (32, 64, 128, 256)
EMBEDDINGS = ("int8", "int4", "none")
FORMAT_VERSION = 1

# Under torch.compile with freezing, Inductor folds every computation that depends only on weights into a new constant.
# The nibble unpacking (>> 4, & 15) must stay in the kernel, or the packed int4 weights would be folded into two bytes
# per value. These ops do not occur in model.py's float graph.
try:
    from torch._inductor.constant_folding import add_dont_constant_fold as _add_dont_fold
    for _op in ("bitwise_right_shift.Tensor_Scalar", "__rshift__.Scalar", "bitwise_and.Scalar", "__and__.Scalar"):
        _name, _overload = _op.split(".")
        _add_dont_fold(getattr(getattr(torch.ops.aten, _name), _overload))
except (ImportError, AttributeError):  # pragma: no cover - older/newer torch without this hook: still correct
    pass


# ----------------------------------------------------------------------------------------------------------- schemes
def _scheme(bits: int, groupsize: Optional[int] = None, symmetric: bool = False, xnnpack: bool = False) -> dict:
    """xnnpack (4-bit, 8da4w): scales on the bfloat16 grid and export operands in XNNPACK's qb4w pattern."""
    d = {"bits": bits, "groupsize": groupsize if bits == 4 else None, "symmetric": bool(symmetric or bits == 8)}
    if xnnpack and bits == 4:
        d["xnnpack"] = True
    return d


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


def _int4_values(q: Tensor, s: Tensor, z: Optional[Tensor]) -> Tensor:
    return (q - 8) * s[..., None] if z is None else torch.addcmul(z[..., None], q, s[..., None])


SHRINKS = (1.0, 0.97, 0.94, 0.91, 0.88, 0.85, 0.82, 0.79)
SYM_EXTRA = (7.5 / 7,)  # symmetric: amax / 7, so that a positive extreme is not clipped to 7 s


def int4_group_params(w: Tensor, groupsize: int, symmetric: bool, search: bool = True):
    """Per-group scale [N, K/G] and zero offset [N, K/G] (None when symmetric) for w [N, K]. With search, each group's
    range is scaled by the factor in SHRINKS (+ SYM_EXTRA if symmetric) that gives the least squared error (1.0 wins
    ties, so a source that is already on an int4 grid, like SmolLM2's Q4_1 GGUF, is reproduced exactly)."""
    N, K = w.shape
    wg = w.float().reshape(N, K // groupsize, groupsize)
    if not search:
        return _int4_group_params(wg, 1.0, symmetric)
    best = torch.ones(wg.shape[:-1], device=w.device)
    for r in range(0, N, 4096):  # bounded temporaries for big embedding tables
        sub = wg[r:r + 4096]
        best_err = None
        for f in SHRINKS + (SYM_EXTRA if symmetric else ()):
            s, z = _int4_group_params(sub, f, symmetric)
            err = (_int4_values(_int4_round(sub, s, z), s, z) - sub).pow(2).sum(-1)
            if best_err is None:
                best_err = err
            else:
                better = err < best_err
                best[r:r + 4096][better] = f
                best_err = torch.where(better, err, best_err)
    return _int4_group_params(wg, best, symmetric)


def group_params(w: Tensor, scheme: dict, search: bool = True):
    """int4_group_params for a scheme; an xnnpack scheme's scales go on the bfloat16 grid (XNNPACK stores them so)."""
    s, z = int4_group_params(w, scheme["groupsize"], scheme["symmetric"], search)
    return (s.to(torch.bfloat16).float() if scheme.get("xnnpack") else s), z


def quantize_tensor(w: Tensor, scheme: dict, search: bool = True) -> dict:
    """Round-to-nearest quantization of w [N, K]: {"q": integer values (int8: [-127, 127], int4: [0, 15]) [N, K],
    "scales": ..., "zeros": ... or None}."""
    w = w.detach().float()
    if scheme["bits"] == 8:
        s = (w.abs().amax(-1) / 127).clamp(min=_EPS)
        return {"q": torch.clamp(torch.round(w / s[:, None]), -127, 127), "scales": s, "zeros": None}
    G = scheme["groupsize"]
    s, z = group_params(w, scheme, search)
    N, K = w.shape
    q = _int4_round(w.reshape(N, K // G, G), s, z).reshape(N, K)
    return {"q": q, "scales": s, "zeros": z}


def fake_quant_per_token_int8(x: Tensor) -> Tensor:
    """Dynamic asymmetric int8 quantization of each row of x (last dim), then dequantization: the same arithmetic as
    torchao's choose_qparams_affine / quantize_affine / dequantize_affine (ASYMMETRIC, int8, zero kept exact)."""
    lo = torch.clamp(x.amin(-1, keepdim=True), max=0)
    hi = torch.clamp(x.amax(-1, keepdim=True), min=0)
    scale = torch.clamp((hi - lo) / 255.0, min=torch.finfo(x.dtype).smallest_normal)
    zp = torch.clamp(-128 - torch.round(lo / scale), -128, 127)
    q = torch.clamp(torch.round(x * (1.0 / scale)) + zp, -128, 127)
    return (q - zp) * scale


# fake_quant_per_token_int8 as an opaque custom op, for torch.compile: Inductor otherwise inlines the quantization
# arithmetic into the matmul kernel that consumes it, recomputing it for every weight element (measured ~50x slower
# per 8da4w layer); as an op its output is computed once. Registered once per process (quantize.py may be imported
# both as __main__ and as a module).
if not hasattr(torch.ops.llama_flat, "fake_quant_per_token_int8"):
    _LIB = torch.library.Library("llama_flat", "FRAGMENT")
    _LIB.define("fake_quant_per_token_int8(Tensor x) -> Tensor")
    _LIB.impl("fake_quant_per_token_int8", fake_quant_per_token_int8, "CompositeExplicitAutograd")
    torch.library.register_fake("llama_flat::fake_quant_per_token_int8", lib=_LIB)(lambda x: torch.empty_like(x))
_FAKE_QUANT_OP = torch.ops.llama_flat.fake_quant_per_token_int8


def group_sums(x: Tensor, G: int) -> Tensor:
    """x [..., K] -> the sums of each group of G columns [..., K/G]. In a .pte this is a portable kernel between two
    XNNPACK calls; the delegated form (a mean over a 4-D view) measured slower: it adds dim-order copies."""
    return x.unflatten(-1, (-1, G)).sum(-1)


# ----------------------------------------------------------------------------------------------------------- modules
def _compiled_single_row(x: Tensor) -> bool:
    """True inside torch.compile (not export) for one row of activations: the decode step."""
    return (torch.compiler.is_compiling() and not torch.compiler.is_exporting()
            and x.numel() == x.shape[-1])


class QuantizedWeight(nn.Module):
    """One quantized [out_features, in_features] matrix in plain tensors.

    bits 8:  qdata int8 [N, K], scales [N]                     w = qdata * scales   (+ zero_point int8 zeros [N, 1],
             not saved: the dequantize_affine operand for a dynamically quantized export)
    bits 4:  qdata uint8 [N, K/2] (pack_int4), scales [N, K/G], zeros [N, K/G] (asymmetric: w = q * s + z) or none
             (symmetric: w = (q - 8) * s). Symmetric weights also keep qdata_int8 [N, K] (q - 8, int8) and
             zero_point (int8 zeros [N, K/G]), not saved, rebuilt at load: the operands of the dequantize_affine
             pattern that ExecuTorch's XNNPACK partitioner packs into its own 4-bit layout."""

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
            self.register_buffer("zero_point", torch.empty(N, 1, dtype=torch.int8, **kw), persistent=False)
        else:
            G = self.groupsize
            if K % G or G % 2:
                raise ValueError(f"group size {G} does not divide in_features {K}")
            self.register_buffer("qdata", torch.empty(N, K // 2, dtype=torch.uint8, **kw))
            self.register_buffer("scales", torch.empty(N, K // G, dtype=dtype, **kw))
            if self.symmetric or self.xnnpack:
                self.register_buffer("qdata_int8", torch.empty(N, K, dtype=torch.int8, **kw), persistent=False)
                self.register_buffer("zero_point", torch.empty(N, K // G, dtype=torch.int8, **kw), persistent=False)
            if self.symmetric:
                self.zeros = None
            else:
                self.register_buffer("zeros", torch.empty(N, K // G, dtype=dtype, **kw))
                if self.xnnpack:
                    self.register_buffer("zero_term", torch.empty(N, K // G, dtype=dtype, **kw), persistent=False)

    @property
    def scheme(self) -> dict:
        return _scheme(self.bits, self.groupsize, self.symmetric, self.xnnpack)

    @classmethod
    def from_float(cls, w: Tensor, scheme: dict, search: bool = True) -> "QuantizedWeight":
        return cls.from_quantized(quantize_tensor(w, scheme, search), scheme, w.dtype)

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
        m._rebuild_export_operands()
        m._rebuild_native()
        return m

    def _rebuild_export_operands(self):
        if self.qdata.device.type == "meta" or not (self.symmetric or self.xnnpack):
            return
        if self.bits == 8:
            self.zero_point = torch.zeros(self.out_features, 1, dtype=torch.int8, device=self.qdata.device)
        else:
            self.qdata_int8 = (unpack_int4(self.qdata, self.groupsize).to(torch.int8) - 8)
            self.zero_point = torch.zeros(self.scales.shape, dtype=torch.int8, device=self.qdata.device)
            if self.zeros is not None:
                self.zero_term = self.zeros + 8 * self.scales

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._rebuild_export_operands()
        self._rebuild_native()

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)  # .to(device / dtype): repack for the new place
        self._rebuild_export_operands()
        self._rebuild_native()
        return self

    # bfloat16 on CPU: ATen's packed weight-only kernels (AVX512-BF16) beat everything else (measured ~14 Gparam/s int8,
    # ~35 Gparam/s int4 vs ~1-4 for dequantize + bf16 GEMM); in float32 they are slower than the alternatives. int8 runs
    # on qdata as stored; int4 needs _convert_weight_to_int4pack_for_cpu's blocked layout: a second copy (a plain
    # attribute, not saved, rebuilt whenever the module moves or changes dtype).
    _int4_cpu = None

    def _rebuild_native(self):
        self._int4_cpu = None
        if (self.bits == 4 and self.qdata.device.type == "cpu" and self.scales.dtype == torch.bfloat16
                and hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")):
            s = self.scales
            z = torch.zeros_like(s) if self.zeros is None or self.xnnpack else self.zeros + 8 * s  # (q - 8) s + z'
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(self.int_values().to(torch.int32), 1)
            self._int4_cpu = (packed, torch.stack([s.t(), z.t()], -1).contiguous())

    def native_linear(self, x: Tensor, offset: bool = True) -> Optional[Tensor]:
        """x @ w.T with ATen's packed CPU kernels when they apply (bfloat16 activations, CPU), else None.
        offset False: without the zero offsets of an asymmetric weight (w = (q - 8) * s)."""
        if x.dtype != torch.bfloat16 or x.device.type != "cpu" or self.scales.dtype != torch.bfloat16:
            return None
        if self.zeros is not None and offset == self.xnnpack:  # the packed copy holds the other variant
            return None
        x2 = x.reshape(-1, self.in_features)
        if self.bits == 8:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qdata, self.scales)
        elif self._int4_cpu is not None:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self._int4_cpu[0], self.groupsize, self._int4_cpu[1])
        else:
            return None
        return y.reshape(*x.shape[:-1], self.out_features)

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
        if self.symmetric and torch.compiler.is_exporting():  # the unpacked copy kept for export: a plain gather
            return (F.embedding(idx, self.qdata_int8).unflatten(-1, (-1, G)).to(dtype)
                    * self.scales[idx].to(dtype).unsqueeze(-1)).flatten(-2)
        q = unpack_int4(q, G).unflatten(-1, (-1, G)).to(dtype)
        z = None if self.zeros is None else self.zeros[idx].to(dtype)
        return _int4_values(q, self.scales[idx].to(dtype), z).flatten(-2)

    def fused_linear(self, x: Tensor, offset: bool = True) -> Tensor:
        """x [..., K] @ w.T as one reduction over the integer weights (for torch.compile: a single generated kernel
        that reads each weight byte once; mixed-dtype products keep the weights out of Inductor's constant folding)."""
        if self.bits == 8:
            return (x.unsqueeze(-2) * self.qdata).sum(-1) * self.scales
        N, K, G = self.out_features, self.in_features, self.groupsize
        xg = x.reshape(*x.shape[:-1], 1, K // G, 2, G // 2)        # [..., 1, K/G, 2, G/2]
        p = self.qdata.view(N, K // G, G // 2)                    # [N, K/G, G/2]
        x_hi, x_lo = xg[..., 0, :], xg[..., 1, :]
        t = x_hi * (p >> 4) + x_lo * (p & 15)                      # [..., N, K/G, G/2]
        if self.zeros is None or not offset:
            t = (t - 8 * (x_hi + x_lo)) * self.scales.unsqueeze(-1)
        else:
            t = t * self.scales.unsqueeze(-1) + (x_hi + x_lo) * self.zeros.unsqueeze(-1)
        return t.sum((-2, -1))

    def extra_repr(self):
        g = f", groupsize={self.groupsize}" if self.bits == 4 else ""
        return f"{self.out_features}x{self.in_features}, int{self.bits}{g}, {'symmetric' if self.symmetric else 'asymmetric'}"


class QuantizedLinear(nn.Module):
    """nn.Linear replacement: weight-only (act None) or with dynamic per-token int8 activations (act "int8")."""

    act_quant = None  # act "int8": a replacement for fake_quant_per_token_int8 (tp.py sets one on its shards)

    def __init__(self, qweight: QuantizedWeight, bias: Optional[Tensor] = None, act: Optional[str] = None):
        super().__init__()
        self.in_features, self.out_features = qweight.in_features, qweight.out_features
        self.qweight = qweight
        self.act = act
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    def forward(self, x: Tensor) -> Tensor:
        qw = self.qweight
        if self.act == "int8":
            if torch.compiler.is_exporting() and (qw.symmetric or qw.xnnpack):
                return self._forward_dynamic_act_export(x)
            zt = None
            if qw.xnnpack and qw.zeros is not None:  # asymmetric 8da4w: the zero term takes the float activations
                zt = F.linear(group_sums(x, qw.groupsize), qw.zero_term.to(x.dtype))
            compiled = torch.compiler.is_compiling() and not torch.compiler.is_exporting()
            if self.act_quant is not None:  # tp.py's row-parallel shards: the range of the whole row
                x = self.act_quant(x)
            else:
                x = _FAKE_QUANT_OP(x) if compiled else fake_quant_per_token_int8(x)
            y = self._matmul(x, offset=zt is None)
            y = y if zt is None else y + zt
        else:
            y = self._matmul(x)
        return y + self.bias if self.bias is not None else y

    def _matmul(self, x: Tensor, offset: bool = True) -> Tensor:
        qw = self.qweight
        if _compiled_single_row(x):  # decode under torch.compile: one generated kernel per matmul (fastest measured)
            return qw.fused_linear(x, offset).to(x.dtype)
        if (y := None if torch.compiler.is_exporting() else qw.native_linear(x, offset)) is not None:
            return y  # ATen's packed bfloat16 CPU kernels
        if torch.compiler.is_compiling():  # compiled prefill / batched decode, export: one dequantize, one GEMM
            return F.linear(x, qw.dequantize(x.dtype, offset=offset))
        return qw.chunked_linear(x, offset=offset)

    def _forward_dynamic_act_export(self, x: Tensor) -> Tensor:
        """The op pattern of torchao's Int8DynamicActivationIntxWeightConfig(int4, PerGroup(G)) after export, which
        ExecuTorch's XnnpackPartitioner lowers to its qd8-f32-qb4w GEMM (int8 per-channel weights: qd8-f32-qc8w)."""
        _torchao_primitives()  # registers torch.ops.torchao; the ops themselves, not their Python wrappers: those are
        ops = torch.ops.torchao  # torch.no_grad()-decorated, and each such region costs torch.export a graph split
        qw = self.qweight       # (18 min instead of seconds for SmolLM2)
        zt = F.linear(group_sums(x, qw.groupsize), qw.zero_term) if qw.bits == 4 and qw.zeros is not None else None
        bs = [1] * (x.dim() - 1) + [x.shape[-1]]
        s, zp = ops.choose_qparams_affine(x, "ASYMMETRIC", bs, torch.int8, -128, 127, None, None, torch.int8)
        xq = ops.quantize_affine(x, bs, s, zp, torch.int8, -128, 127)
        x = ops.dequantize_affine(xq, bs, s, zp, torch.int8, -128, 127, x.dtype)
        if qw.bits == 8:
            w = ops.dequantize_affine(qw.qdata, [1, qw.in_features], qw.scales, qw.zero_point, torch.int8, -127, 127,
                                      x.dtype)
        else:
            w = ops.dequantize_affine(qw.qdata_int8, [1, qw.groupsize], qw.scales, qw.zero_point, torch.int8, -8, 7,
                                      x.dtype)
        y = F.linear(x, w, self.bias)
        return y if zt is None else y + zt

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


_TORCHAO = None


def _torchao_primitives():
    """torchao's quant primitives (their import logs warnings about optional CUDA libraries: silenced)."""
    global _TORCHAO
    if _TORCHAO is None:
        loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
        levels = [lg.level for lg in loggers]
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        try:
            import torchao.quantization.quant_primitives as qp
        finally:
            for lg, lv in zip(loggers, levels):
                lg.setLevel(lv)
        _TORCHAO = qp
    return _TORCHAO


# ----------------------------------------------------------------------------------------------------------- recipes
def _set_module(root: nn.Module, name: str, new: nn.Module):
    parent, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, attr, new)


def _note(notes: list, msg: str, log=True):
    notes.append(msg)
    if log:
        print(f"note: {msg}", file=sys.stderr)


def make_recipe(model: nn.Module, mode: str, groupsize: Optional[int] = 32, embedding: Optional[str] = None,
                log: bool = True) -> dict:
    """Validate the arguments against the model and decide what gets quantized how (no weights touched)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    four_bit = mode != "int8"
    if four_bit and groupsize not in GROUPSIZES:
        raise ValueError(f"--groupsize must be one of {', '.join(map(str, GROUPSIZES))} for {mode}, got {groupsize}")
    G = groupsize if four_bit else None
    linear = _scheme(8) if mode == "int8" else _scheme(4, G, xnnpack=(mode == "8da4w"))
    act = "int8" if mode == "8da4w" else None
    if embedding in (None, "auto", "default"):
        embedding = "int8"  # see the header: the table is also the output projection of tied models
    if embedding is False:
        embedding = "none"
    if embedding not in EMBEDDINGS:
        raise ValueError(f"--embedding must be one of {', '.join(EMBEDDINGS)}, got {embedding!r}")
    notes, skip = [], []
    emb = getattr(model, "tok_embeddings", None)
    emb_scheme = None
    if embedding != "none" and isinstance(emb, nn.Embedding):
        emb_scheme = _scheme(8) if embedding == "int8" else _scheme(4, groupsize or 32, symmetric=(mode == "8da4w"))
        if emb_scheme["bits"] == 4 and emb.embedding_dim % emb_scheme["groupsize"]:
            _note(notes, f"embedding dim {emb.embedding_dim} is not a multiple of {emb_scheme['groupsize']}: "
                         f"embedding quantized to int8 instead", log)
            emb_scheme = _scheme(8)
    tied = bool(getattr(getattr(model, "config", None), "tie_embeddings", False)) and isinstance(emb, nn.Embedding)
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear) or (tied and name == "output"):
            continue
        if four_bit and m.in_features % G:
            if mode == "8da4w":
                skip.append(name)
                _note(notes, f"{name}: in_features {m.in_features} is not a multiple of {G}: kept float", log)
            else:
                raise ValueError(f"--groupsize {G} does not divide in_features {m.in_features} of {name}; "
                                 f"try a smaller group size")
    return {"format": FORMAT_VERSION, "mode": mode, "groupsize": G, "linear": linear, "act": act,
            "embedding": emb_scheme, "tied_output": tied,
            "output_act": act if (tied and emb_scheme) else None,  # 8da4w: dynamic int8 activations, int8/int4 table
            "skip": skip, "notes": notes}


def _targets(model: nn.Module, recipe: dict) -> list:
    skip = set(recipe["skip"])
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in skip
            and not (recipe["tied_output"] and n == "output")]


def apply_recipe(model: nn.Module, recipe: dict) -> nn.Module:
    """Swap modules for the quantized ones a checkpoint's recipe names (shapes only: typically on the meta device,
    before load_state_dict(assign=True) brings the stored tensors)."""
    if not isinstance(recipe, dict) or recipe.get("format") != FORMAT_VERSION:
        raise ValueError(f"unsupported quantization recipe (format {recipe.get('format') if isinstance(recipe, dict) else recipe!r}); "
                         f"this quantize.py reads format {FORMAT_VERSION}")
    ref = model.norm.weight
    dtype, device = ref.dtype, ref.device
    for name in _targets(model, recipe):
        lin = model.get_submodule(name)
        qw = QuantizedWeight(lin.out_features, lin.in_features, recipe["linear"], dtype, device)
        bias = torch.empty(lin.out_features, dtype=dtype, device=device) if lin.bias is not None else None
        _set_module(model, name, QuantizedLinear(qw, bias, recipe["act"]))
    if recipe["embedding"]:
        emb = model.tok_embeddings
        qw = QuantizedWeight(emb.num_embeddings, emb.embedding_dim, recipe["embedding"], dtype, device)
        model.tok_embeddings = QuantizedEmbedding(qw)
        if recipe["tied_output"]:
            model.output = QuantizedLinear(qw, None, recipe["output_act"])
    return model


def _calibration_batches(calibration_ids, seq_len: int) -> Tensor:
    ids = torch.as_tensor(calibration_ids, dtype=torch.long)
    if ids.dim() == 2:
        return ids
    if ids.dim() != 1 or ids.numel() < 2:
        raise ValueError("calibration_ids must be a list of token ids (at least 2) or a [n, seq_len] tensor")
    n = ids.numel() // seq_len
    return ids[: n * seq_len].view(n, seq_len) if n else ids.view(1, -1)


@torch.no_grad()
def quantize_model(model: nn.Module, mode: str, groupsize: int = 32, calibration_ids=None, embedding=None, *,
                   act_order: bool = False, damp: float = 0.1, calibration_seq_length: int = 512,
                   log: bool = True) -> dict:
    """Quantize a float model in place; returns the recipe to store with checkpoint_state(model, quantization=...).

    mode: int8 | int4 | 8da4w | int4-gptq (needs calibration_ids: token ids, 1-D or [n, seq_len]).
    embedding: None (the mode's default), "int8", "int4" or "none"."""
    recipe = make_recipe(model, mode, groupsize, embedding, log=log)
    if any(isinstance(m, (QuantizedLinear, QuantizedEmbedding)) for m in model.modules()):
        raise ValueError("model is already quantized")
    if mode == "int4-gptq" and calibration_ids is None:
        raise ValueError("int4-gptq needs calibration data (calibration_ids / --calibration_file)")
    gptq = mode == "int4-gptq" or (mode == "8da4w" and calibration_ids is not None)
    emb_qw = None
    if recipe["embedding"]:  # first: GPTQ calibrates the layers on the embedding the model will really use
        emb = model.tok_embeddings
        emb_qw = QuantizedWeight.from_float(emb.weight, recipe["embedding"])
        model.tok_embeddings = QuantizedEmbedding(emb_qw)
        if recipe["tied_output"]:
            model.output = QuantizedLinear(emb_qw, None, recipe["output_act"])
    targets = _targets(model, recipe)
    if gptq:
        calib = _calibration_batches(calibration_ids, min(calibration_seq_length, model.config.block_size))
        _gptq_model(model, recipe, targets, calib, act_order=act_order, damp=damp, log=log)
    for name in targets:
        lin = model.get_submodule(name)
        if isinstance(lin, nn.Linear):
            qw = QuantizedWeight.from_float(lin.weight, recipe["linear"])
            _set_module(model, name, QuantizedLinear(qw, lin.bias, recipe["act"]))
    if gptq:
        recipe["gptq"] = {"act_order": act_order, "damp": damp, "calibration_tokens": int(calib.numel())}
    return recipe


# ----------------------------------------------------------------------------------------------------------- GPTQ
def gptq_quantize(W: Tensor, H: Tensor, scheme: dict, act_order: bool = False, damp: float = 0.1,
                  blocksize: int = 128) -> dict:
    """GPTQ (Frantar et al. 2022) for one [N, K] weight given the Hessian H = 2 X^T X / n of its inputs [n, K]:
    columns are rounded one at a time and each rounding error is spread over the not-yet-rounded columns by the
    inverse Hessian. Groupwise int4 with the same storage as round-to-nearest (groups of contiguous input columns);
    with act_order, columns go in decreasing Hessian-diagonal order and each group's scale/zero comes from the
    unmodified weights ("static groups"), so the stored layout stays the same."""
    G, sym = scheme["groupsize"], scheme["symmetric"]
    W = W.detach().float().clone()
    H = H.float().clone()
    N, K = W.shape
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    scales = torch.zeros(N, K // G, device=W.device)
    zeros = None if sym else torch.zeros(N, K // G, device=W.device)
    perm = None
    if act_order:
        s0, z0 = group_params(W, scheme)
        scales.copy_(s0)
        if zeros is not None:
            zeros.copy_(z0)
        perm = torch.argsort(torch.diag(H), descending=True)
        W, H = W[:, perm], H[perm][:, perm]
    H += damp * torch.mean(torch.diag(H)) * torch.eye(K, device=H.device)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    Q = torch.zeros_like(W)
    bs = max(blocksize // G, 1) * G
    for i1 in range(0, K, bs):
        i2 = min(i1 + bs, K)
        W1, Hinv1 = W[:, i1:i2].clone(), Hinv[i1:i2, i1:i2]
        Err1 = torch.zeros_like(W1)
        for i in range(i2 - i1):
            col = i1 + i
            if act_order:
                g = int(perm[col]) // G
            else:
                g = col // G
                if col % G == 0:  # group parameters from the weights as updated so far
                    s, z = group_params(W1[:, i:i + G], scheme)
                    scales[:, g] = s[:, 0]
                    if zeros is not None:
                        zeros[:, g] = z[:, 0]
            s = scales[:, g]
            z = None if zeros is None else zeros[:, g]
            w = W1[:, i]
            q = _int4_round(w[:, None], s, z)[:, 0]
            Q[:, col] = q
            err = (w - _int4_values(q[:, None], s, z)[:, 0]) / Hinv1[i, i]
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    if act_order:
        Q = Q[:, torch.argsort(perm)]
    return {"q": Q, "scales": scales, "zeros": zeros}


class _Stop(Exception):
    pass


class _HessianHook:
    def __init__(self, K: int, device):
        self.H = torch.zeros(K, K, device=device)
        self.n = 0

    def __call__(self, module, inputs, output):
        x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).float()
        m = x.shape[0]
        self.H *= self.n / (self.n + m)
        self.n += m
        x = x * math.sqrt(2 / self.n)
        self.H += x.T @ x


def _gptq_model(model, recipe, targets, calib: Tensor, act_order=False, damp=0.1, batch=4, log=True):
    """Layer by layer: collect each linear's input Hessian on the calibration tokens (inputs computed with the
    layers before it already quantized), GPTQ all the linears of the layer, then run the quantized layer to get the
    next layer's inputs. An untied output projection is done last, on the final norm's output."""
    device = model.norm.weight.device
    calib = calib.to(device)
    n, L = calib.shape
    prev = (model.max_batch_size, model.max_seq_length)
    model.setup_caches(min(batch, n), L)
    pos = torch.arange(L, device=device)
    inputs = []

    def grab(mod, args, kwargs):
        inputs.append((args, kwargs))
        raise _Stop

    h = model.layers[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        for i in range(0, n, batch):
            try:
                model(calib[i:i + batch], pos)
            except _Stop:
                pass
    finally:
        h.remove()
    t0 = time.perf_counter()
    wanted = set(targets)

    def run(mod, inputs):
        return [mod(*a, **k) for a, k in inputs]

    def gptq_modules(root, prefix, inputs, call):
        lins = {n: m for n, m in root.named_modules() if isinstance(m, nn.Linear) and f"{prefix}{n}" in wanted}
        hooks = {n: _HessianHook(m.in_features, device) for n, m in lins.items()}
        handles = [lins[n].register_forward_hook(hk) for n, hk in hooks.items()]
        try:
            call(inputs)
        finally:
            for hd in handles:
                hd.remove()
        for n, m in lins.items():
            qt = gptq_quantize(m.weight, hooks[n].H, recipe["linear"], act_order=act_order, damp=damp)
            qw = QuantizedWeight.from_quantized(qt, recipe["linear"], m.weight.dtype)
            _set_module(root, n, QuantizedLinear(qw, m.bias, recipe["act"]))

    for li, layer in enumerate(model.layers):
        gptq_modules(layer, f"layers.{li}.", inputs, lambda inp: run(layer, inp))
        outs = run(layer, inputs)
        inputs = [((o,) + tuple(a[1:]), k) for o, (a, k) in zip(outs, inputs)]
        if log:
            print(f"\rGPTQ: layer {li + 1}/{len(model.layers)} ({time.perf_counter() - t0:.0f} s)", end="",
                  file=sys.stderr, flush=True)
    if "output" in wanted and isinstance(model.output, nn.Linear):
        gptq_modules(model, "", [((model.norm(a[0]),), {}) for a, _ in inputs], lambda inp: run(model.output, inp))
    if log:
        print(file=sys.stderr)
    for layer in model.layers:
        layer.attention.kv_cache = None
    model.max_batch_size, model.max_seq_length = -1, -1
    if prev[1] > 0:
        model.setup_caches(*prev)


# ----------------------------------------------------------------------------------------------------------- CLI
def output_path(checkpoint: Path, mode: str, groupsize: Optional[int]) -> Path:
    """model.pth -> model_int8.pth, model_int4.g32.pth, model_8da4w.g32.pth, model_int4-gptq.g128.pth"""
    suffix = f".g{groupsize}" if mode != "int8" else ""
    return checkpoint.with_name(f"{checkpoint.stem}_{mode}{suffix}.pth")


def _file_bytes(model) -> int:
    seen, total = set(), 0
    for t in model.state_dict().values():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Quantize a model.py checkpoint (writes model_<mode>[.g<G>].pth beside it).")
    p.add_argument("--checkpoint_path", type=Path, default=None, help="float checkpoint (default: the default model)")
    p.add_argument("--mode", required=True, help=f"one of {', '.join(MODES)}")
    p.add_argument("--groupsize", type=int, default=32, help=f"int4 modes: one of {GROUPSIZES} (default 32)")
    p.add_argument("--embedding", default=None,
                   help="int8 | int4 | none (default int8; a tied output projection shares the quantized table)")
    p.add_argument("--calibration_file", type=Path,
                   help="int4-gptq (required) and 8da4w (optional): text to calibrate GPTQ on")
    p.add_argument("--calibration_tokens", type=int, default=16384, help="GPTQ: at most this many tokens")
    p.add_argument("--calibration_seq_length", type=int, default=512, help="GPTQ: tokens per sequence")
    p.add_argument("--act_order", action="store_true", help="GPTQ: quantize columns by decreasing Hessian diagonal")
    p.add_argument("--damp", type=float, default=0.1, help="GPTQ: Hessian dampening (fraction of mean diagonal)")
    p.add_argument("--tokenizer_path", type=Path, default=None, help="GPTQ: default the checkpoint's directory")
    p.add_argument("--output", type=Path, default=None, help="default: beside the input, model_<mode>[.g<G>].pth")
    p.add_argument("--device", default="cpu", help="where to run GPTQ (cpu, cuda)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.mode not in MODES:
        raise ValueError(f"unknown mode {args.mode!r}; choose one of {', '.join(MODES)}")
    if args.mode != "int8" and args.groupsize not in GROUPSIZES:
        raise ValueError(f"--groupsize must be one of {', '.join(map(str, GROUPSIZES))}, got {args.groupsize}")
    if args.embedding is not None and args.embedding not in EMBEDDINGS:
        raise ValueError(f"--embedding must be one of {', '.join(EMBEDDINGS)}, got {args.embedding!r}")
    if args.mode == "int4-gptq" and args.calibration_file is None:
        raise ValueError("--mode int4-gptq needs --calibration_file (a text file to calibrate on)")
    if args.calibration_file is not None:
        if args.mode not in ("int4-gptq", "8da4w"):
            raise ValueError(f"--calibration_file is for --mode int4-gptq or 8da4w (GPTQ), not {args.mode}")
        if not args.calibration_file.is_file():
            raise FileNotFoundError(f"calibration file not found: {args.calibration_file}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but no CUDA device is available")
    from model import load_model, checkpoint_state, save_checkpoint
    if args.checkpoint_path is None:
        from generate import DEFAULT_CHECKPOINT
        args.checkpoint_path = DEFAULT_CHECKPOINT
    ck = args.checkpoint_path / "model.pth" if args.checkpoint_path.is_dir() else args.checkpoint_path
    if not ck.is_file():
        raise FileNotFoundError(f"checkpoint not found: {ck}")
    t0 = time.perf_counter()
    model = load_model(ck, device=args.device)
    if any(isinstance(m, (QuantizedLinear, QuantizedEmbedding)) for m in model.modules()):
        raise ValueError(f"{ck} is already quantized; start from a float checkpoint")
    before = _file_bytes(model)
    calib = None
    if args.calibration_file is not None:
        from tokenizer import load_tokenizer
        tok = load_tokenizer(args.tokenizer_path or ck.parent)
        calib = tok.encode(args.calibration_file.read_text(encoding="utf-8", errors="replace"))[:args.calibration_tokens]
        if len(calib) < 16:
            raise ValueError(f"calibration file {args.calibration_file} has only {len(calib)} tokens")
        print(f"calibrating on {len(calib)} tokens of {args.calibration_file}", file=sys.stderr)
    recipe = quantize_model(model, args.mode, args.groupsize, calibration_ids=calib, embedding=args.embedding,
                            act_order=args.act_order, damp=args.damp,
                            calibration_seq_length=args.calibration_seq_length)
    out = args.output or output_path(ck, args.mode, recipe["groupsize"])
    save_checkpoint(checkpoint_state(model.to("cpu"), quantization=recipe), out)
    after = _file_bytes(model)
    print(f"{args.mode}: {before / 1e6:.1f} MB -> {after / 1e6:.1f} MB of weights in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    print(out)


if __name__ == "__main__":
    from generate import cli
    cli(main)
