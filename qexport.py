# qexport.py: the export forms of qops.py's quantized modules, swapped in by the exporters while they trace. For
# et_export.py: XnnpackLinear (torchao's dynamic-activation pattern that ExecuTorch's XNNPACK partitioner lowers),
# X86Linear (8da4w through this repository's AVX2 kernel: --x86_kernels), ETEmbedding (ExecuTorch's quantized
# embedding kernels). For AOT Inductor (aoti_export.py): fast_cpu_quant's kernels fixed per exported model
# (aoti_forms) plus ExportEmbedding. Plain QuantizedLinear modules export as dequantize + F.linear (ExecuTorch's portable kernels).
import contextlib
import logging
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from qops import QuantizedEmbedding, QuantizedLinear, group_sums, on_bf16_grid, unpack_int4

_TORCHAO = None


def torchao_primitives():
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


def xnnpack_kind(m: nn.Module) -> bool:
    """Whether a QuantizedLinear with int8 activations has XnnpackLinear's form: int8 per-channel weights, or 4-bit
    symmetric / 8da4w ones (an asymmetric weight-only int4 has no XNNPACK kernel)."""
    return isinstance(m, QuantizedLinear) and (m.qweight.symmetric or m.qweight.xnnpack)


class XnnpackLinear(QuantizedLinear):
    """QuantizedLinear with dynamic per-token int8 activations (8da4w, 8da8w, and int8 weight-only when et_export.py
    makes its activations int8 too) as the op pattern of torchao's Int8DynamicActivationIntxWeightConfig after
    export, which ExecuTorch's XnnpackPartitioner lowers to its qd8-f32-qb4w GEMM (int8 per-channel weights:
    qd8-f32-qc8w). The ops themselves, not their Python wrappers (those are torch.no_grad()-decorated, and each such
    region costs torch.export a graph split: 18 min instead of seconds for SmolLM2). Same arithmetic as the eager
    module: the weights' operands are q - 8 as int8 with zero points 0, plus x's group sums @ (z + 8 s).T for an
    asymmetric 8da4w weight."""

    def __init__(self, lin: QuantizedLinear):
        super().__init__(lin.qweight, None, "int8")
        self.bias = lin.bias
        qw = lin.qweight
        if qw.bits == 8:
            w, zp = qw.qdata, torch.zeros(qw.out_features, 1, dtype=torch.int8, device=qw.qdata.device)
        else:
            w = unpack_int4(qw.qdata, qw.groupsize).to(torch.int8) - 8
            zp = torch.zeros(qw.scales.shape, dtype=torch.int8, device=qw.qdata.device)
        self.register_buffer("w_int8", w, persistent=False)
        self.register_buffer("zero_point", zp, persistent=False)
        zt = qw.zeros + 8 * qw.scales if qw.bits == 4 and qw.zeros is not None else None
        self.register_buffer("zero_term", zt, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        torchao_primitives()  # registers torch.ops.torchao
        ops, qw = torch.ops.torchao, self.qweight
        zt = F.linear(group_sums(x, qw.groupsize), self.zero_term) if self.zero_term is not None else None
        bs = [1] * (x.dim() - 1) + [x.shape[-1]]
        s, zp = ops.choose_qparams_affine(x, "ASYMMETRIC", bs, torch.int8, -128, 127, None, None, torch.int8)
        xq = ops.quantize_affine(x, bs, s, zp, torch.int8, -128, 127)
        x = ops.dequantize_affine(xq, bs, s, zp, torch.int8, -128, 127, x.dtype)
        if qw.bits == 8:
            w = ops.dequantize_affine(self.w_int8, [1, qw.in_features], qw.scales, self.zero_point, torch.int8,
                                      -127, 127, x.dtype)
        else:
            w = ops.dequantize_affine(self.w_int8, [1, qw.groupsize], qw.scales, self.zero_point, torch.int8, -8, 7,
                                      x.dtype)
        y = F.linear(x, w, self.bias)
        return y if zt is None else y + zt


class X86Linear(QuantizedLinear):
    """An 8da4w QuantizedLinear as one call of llama_flat::q8a4w_mm (fast_cpu_8da4w.c, AVX2; ExecuTorch's kernel in
    runner-et/kernel_ops.cpp): et_export.py --x86_kernels. The eager module's arithmetic (x's per-token int8 values
    times (q - 8) s, plus x's group sums times z + 8 s) up to float rounding. takes(lin): the shapes it multiplies."""

    def __init__(self, lin: QuantizedLinear):
        import fast_cpu_kernels
        super().__init__(lin.qweight, None, "int8")
        self.bias = lin.bias
        qw = lin.qweight
        z8 = (qw.zeros + 8 * qw.scales).float() if qw.zeros is not None else None
        rec, wsum = fast_cpu_kernels.make_8da4w_records(unpack_int4(qw.qdata, qw.groupsize), qw.scales.float(), z8,
                                                        qw.groupsize)
        self.register_buffer("records", rec, persistent=False)
        self.register_buffer("wsum", wsum, persistent=False)

    @staticmethod
    def takes(lin) -> bool:
        qw = getattr(lin, "qweight", None)
        return (isinstance(lin, QuantizedLinear) and lin.act == "int8" and qw.bits == 4 and qw.groupsize % 32 == 0
                and qw.out_features % 16 == 0 and (qw.symmetric or qw.xnnpack)
                and on_bf16_grid(qw.scales))

    def forward(self, x: Tensor) -> Tensor:
        y = torch.ops.llama_flat.q8a4w_mm(x.float(), self.records, self.wsum, self.qweight.groupsize).to(x.dtype)
        return y + self.bias if self.bias is not None else y


def scales_not_bf16(model) -> bool:
    """True when an 8da4w weight (4-bit, XNNPACK's pattern) has scales that bfloat16 cannot hold exactly."""
    return any(isinstance(m, QuantizedLinear) and m.qweight.bits == 4 and xnnpack_kind(m)
               and not on_bf16_grid(m.qweight.scales) for m in model.modules())


class ETEmbedding(nn.Module):
    """QuantizedEmbedding through ExecuTorch's quantized_decomposed::embedding_byte / embedding_4bit
    kernels (their unpacking with shifts has no ExecuTorch kernel, and gathering first keeps the table packed), from
    a copy of the table in their layout: w = (q - zp) * s; 4-bit values stored as q + 8, two per byte, even element
    in the high nibble."""

    def __init__(self, qw):
        super().__init__()
        self.bits, zp = qw.bits, None
        if qw.bits == 8:
            w = qw.qdata.to(torch.int8)
        else:
            q = qw.int_values().to(torch.int32)                       # [N, K] in [0, 15]
            w = ((q[:, 0::2] << 4) | q[:, 1::2]).to(torch.uint8)      # [N, K/2]
            if qw.zeros is not None:  # asymmetric: w = q * s + z = (q - 8 - zp) * s, zp = -8 - z / s (float zero points)
                s = qw.scales
                zp = torch.where(s != 0, -8.0 - qw.zeros / torch.where(s != 0, s, torch.ones_like(s)),
                                 torch.zeros_like(s)).to(s.dtype)
        self.register_buffer("weight", w, persistent=False)
        self.register_buffer("scales", qw.scales, persistent=False)
        self.register_buffer("zeros", zp, persistent=False)

    def forward(self, idx: Tensor) -> Tensor:
        import executorch.exir.passes._quant_patterns_and_replacements  # noqa: F401 - defines quantized_decomposed ops
        ops = torch.ops.quantized_decomposed
        if self.bits == 8:
            return ops.embedding_byte.default(self.weight, self.scales, self.zeros, -128, 127, idx)
        return ops.embedding_4bit.default(self.weight, self.scales, self.zeros, -8, 7, idx)


class ExportEmbedding(QuantizedEmbedding):
    """A QuantizedEmbedding in an AOT Inductor package: an int8 table is gathered from its word layout, the one a tied
    output projection reads (the package stores a tied table once; qdata is not in it); a symmetric int4 table from
    its q - 8 as int8 (a plain gather, no nibble shifts)."""

    def __init__(self, emb: QuantizedEmbedding, words: Optional[Tensor]):
        super().__init__(emb.qweight)
        qw = emb.qweight
        self.words = words
        self.q_int8 = (unpack_int4(qw.qdata, qw.groupsize).to(torch.int8) - 8
                       if words is None and qw.bits == 4 and qw.symmetric else None)

    def forward(self, idx: Tensor) -> Tensor:
        qw = self.qweight
        dtype = qw.scales.dtype
        scales = qw.scales[idx].to(dtype).unsqueeze(-1)
        if self.words is not None:
            # Tensor indices only (idx * 0, not 0): Inductor's freezing folds a select of a constant used elsewhere
            # and then fails to compile
            w = self.words[idx // 16, idx * 0, :, idx % 16]                          # [..., K/4] int32
            q = torch.stack([((w >> (8 * j)) & 255) - 128 for j in range(3)] + [w >> 24], -2).flatten(-2)
            return q.to(dtype) * scales
        if self.q_int8 is not None:
            return (F.embedding(idx, self.q_int8).unflatten(-1, (-1, qw.groupsize)).to(dtype) * scales).flatten(-2)
        return qw.rows(idx)


@contextlib.contextmanager
def swapped(model: nn.Module, replacement):
    """While the block runs, every submodule m of model for which replacement(m) gives a module is replaced by it (the
    exporters' swaps at model.py's swap points); the originals are put back on exit, whatever happens."""
    done = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = replacement(child)
            if new is not None:
                setattr(parent, name, new)
                done.append((parent, name, child))
    try:
        yield model
    finally:
        for parent, name, child in reversed(done):
            setattr(parent, name, child)


def aoti_forms(model: nn.Module, export_rows: str, made: dict):
    """A context (swapped) for exporting one model of an AOT Inductor package: every QuantizedLinear -> fast_cpu_quant's
    FastQuantizedLinear with export_rows fixed ("words": the word kernels for any number of rows, a package's decode
    model; "native" / "bf16": its prompt / long_prompt models); QuantizedEmbedding -> ExportEmbedding. made (the
    caller's, one per package): id(weight) -> its first form, whose layouts the later forms share (a package stores
    each distinct constant once)."""
    from fast_cpu_quant import FastQuantizedLinear
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    for m in linears:
        made.setdefault(id(m.qweight), FastQuantizedLinear(QuantizedLinear(m.qweight, m.bias, m.act)))
    words = {id(m.qweight): made[id(m.qweight)].int8_words for m in linears}

    def form(m):
        if isinstance(m, QuantizedLinear):
            return FastQuantizedLinear(made[id(m.qweight)], export_rows)
        if type(m) is QuantizedEmbedding:
            w = words.get(id(m.qweight))
            if w is None and m.qweight.bits == 8:  # an untied int8 table: its own words (int32, as many bytes; the
                w = FastQuantizedLinear(QuantizedLinear(m.qweight)).int8_words  # package stores them once)
            return ExportEmbedding(m, w)
        return None
    return swapped(model, form)
