# Over 500 lines on purpose: one quantized matrix's storage layouts (QuantizedWeight) sit beside every kernel that
# reads them (eager, ATen's packed CPU kernels, oneDNN's bfloat16 GEMM, compiled decode's word kernels, the export
# forms); split further, one layout would be written in one file and decoded in another.
# Quantized weights and the kernels that multiply by them: QuantizedWeight (plain integer tensors, the layouts derived
# from them), QuantizedLinear and QuantizedEmbedding, the modules quantize.py swaps into model.py's Transformer (the
# modes, the rounding, the recipe and the CLI are quantize.py's; gptq.py chooses the values another way).
#
# Kernels. Eager: dequantize (a block of rows at a time), then F.linear; on CPU, ATen's packed kernels for bfloat16 and
# for weight-only int8 / int4 products of more than one row, eager and compiled alike (see native_linear).
# torch.compile, one token (decode): one reduction reading the integer weights directly (nibbles unpacked inside the
# generated kernel); with Inductor's freezing, a plain `F.linear(x, w_int8.to(x.dtype)) * s` would be constant-folded
# back into a float32 weight. torch.export: plain dequantize + linear (int8/int4), or for 8da4w the torchao
# quantize/dequantize_affine pattern that ExecuTorch's XNNPACK partitioner turns into its int8 x int4 GEMM; for AOT
# Inductor (word_kernel_export) the int8/int4 word kernels for any number of rows (8da4w: fake-quantized x into them;
# a package's prompt models: as compiled). Weight-only products of 32 rows or more on a CPU with bfloat16 dot
# products: oneDNN's bfloat16 GEMM (see _BF16_GEMM). 8da4w's products of more than one row, compiled: the activations'
# int8 values through the int4 kernels (int4_act_linear); eager keeps float32 products.
import contextlib
import logging
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true

import torch_internals as TI
from common import keep_packed_copy, packed_copy

# Under torch.compile with freezing, Inductor folds every computation that depends only on weights into a new constant.
# The nibble unpacking (>> 4, & 15) must stay in the kernel, or the packed int4 weights would be folded into two bytes
# per value (the last two: words_bf16_t's shifts). These ops do not occur in model.py's float graph.
TI.dont_constant_fold(*(getattr(getattr(torch.ops.aten, op.split(".")[0]), op.split(".")[1]) for op in (
    "bitwise_right_shift.Tensor_Scalar", "__rshift__.Scalar", "bitwise_and.Scalar", "__and__.Scalar",
    "bitwise_right_shift.Tensor", "__rshift__.Tensor")))
_FORCE_STRIDE = TI.force_stride_order()  # materializes its input (a copy when the strides differ): see fused_linear


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


# fake_quant_per_token_int8 as an opaque custom op, for torch.compile's products of many rows: Inductor otherwise
# inlines the quantization arithmetic into the matmul kernel that consumes it, recomputing it for every weight element
# (measured ~50x slower per 8da4w layer); as an op its output is computed once. Not for the word kernels (compiled
# decode), which put x in a buffer of their own (_FORCE_STRIDE): there the op's Python call per product held
# compiled 8da8w SmolLM2 decode at 0.65x llama.cpp Q8_0 (bench.py; 1.08x without it, README). Registered once
# per process.
if not hasattr(torch.ops.llama_flat, "fake_quant_per_token_int8"):
    _LIB = torch.library.Library("llama_flat", "FRAGMENT")
    _LIB.define("fake_quant_per_token_int8(Tensor x) -> Tensor")
    _LIB.impl("fake_quant_per_token_int8", fake_quant_per_token_int8, "CompositeExplicitAutograd")
    torch.library.register_fake("llama_flat::fake_quant_per_token_int8", lib=_LIB)(lambda x: torch.empty_like(x))
_FAKE_QUANT_OP = torch.ops.llama_flat.fake_quant_per_token_int8


def _linear_packed(x: Tensor, key: Tensor) -> Tensor:
    """x [M, K] bfloat16 @ the packed bfloat16 copy registered for key (a QuantizedWeight's qdata; make_prompt_copy)."""
    copy = packed_copy(key)
    if copy is None:  # (compiled graphs take this op only for a weight whose _prompt_packed is set; rebuild clears it)
        raise RuntimeError("a quantized weight changed in place after its prompt copy was made: call rebuild()")
    return torch.ops.mkldnn._linear_pointwise(x, copy, None, "none", [], "")


# Compiled prompts' products on make_prompt_copy's copy: an opaque op, as that layout cannot be a graph's input.
if not hasattr(torch.ops.llama_flat, "linear_packed"):
    _LIB2 = torch.library.Library("llama_flat", "FRAGMENT")
    _LIB2.define("linear_packed(Tensor x, Tensor key) -> Tensor")
    _LIB2.impl("linear_packed", _linear_packed, "CPU")
    torch.library.register_fake("llama_flat::linear_packed", lib=_LIB2)(
        lambda x, key: x.new_empty((x.shape[0], key.shape[0])))


# The word kernels (fused_linear) read byte / nibble j of a word in place, `w & mask_j` (its value times 256^j / 16^j),
# not shifted down first: x's part for it comes pre-scaled by 256^-j / 16^-j, a power of two, so every product is the
# same float32 as with shifts (values below 2^24 convert exactly; the outputs are bit-identical) for one integer op
# less per byte / nibble. The top byte / nibble is shifted down (its mask would reach the sign bit).
_BYTE_SCALES = torch.tensor([1.0, 2.0 ** -8, 2.0 ** -16, 1.0]).view(4, 1, 1)
_NIBBLE_SCALES = torch.tensor([16.0 ** -j for j in range(7)] + [1.0]).view(8, 1, 1)


# Products of many rows (compiled and eager int8 prefill, speculative verification; not export) on a CPU with
# bfloat16 dot products (AVX512-BF16 or AMX): the weights go to bfloat16 in one generated kernel reading the word
# layouts (words_bf16_t; exact for int8, int4's q * s + z rounded once to bfloat16), then oneDNN's bfloat16 GEMM, which
# multiplies at about twice float32's rate; ATen's packed weight-only kernels below multiply in float32. 2 threads,
# 1536x576 and 576x1536 int4 g32, compiled: 754 / 840 us against 1461 / 1488 us at 128 rows, 274 / 293 against
# 218 / 242 at 16: the conversion (~100 us per matrix) and the casts around the GEMM cost about what a 16-row product
# does, so products of fewer than _BF16_ROWS rows keep the packed kernels (a compiled prefill graph then guards on
# the length: one recompile when prompts cross it). Eager int8 takes the same GEMM after one cast of qdata; eager int4
# (no --compile) keeps the packed kernels (as ATen ops its conversion is several passes, slower than the product).
_BF16_GEMM = any(getattr(torch.cpu, f, lambda: False)() for f in ("_is_avx512_bf16_supported",
                                                                 "_is_amx_tile_supported"))
_BF16_ROWS = 32
_SHIFTS = {8: torch.tensor([0, 8, 16, 24], dtype=torch.int32).view(4, 1, 1, 1),
           4: torch.arange(0, 32, 4, dtype=torch.int32).view(8, 1, 1, 1, 1, 1)}
_BYTE_OFFSETS = torch.tensor([0, 0, 0, 128], dtype=torch.int32).view(4, 1, 1, 1)  # see words_bf16_t


def group_sums(x: Tensor, G: int) -> Tensor:
    """x [..., K] -> the sums of each group of G columns [..., K/G]. In a .pte this is a portable kernel between two
    XNNPACK calls; the delegated form (a mean over a 4-D view) measured slower: it adds dim-order copies."""
    return x.unflatten(-1, (-1, G)).sum(-1)


# ----------------------------------------------------------------------------------------------------------- modules
# Export swap point (aoti_export.py): under torch.export a quantized product is dequantize + F.linear, the pattern
# ExecuTorch's and ONNX's lowerings take (8da4w: torchao's affine ops). AOT Inductor's freezing would fold that
# dequantize into float32 copies of the weights (an int8 package four times the size, decode at float32's speed), so
# aoti_export.py exports inside word_kernel_export(): fused_linear's word kernels for any number of rows, 8da4w's
# activations fake-quantized into them (bench.py, SmolLM2 int8: a 144 MB package decoding at 1.44x llama.cpp Q8_0,
# int4 g32: 118 MB, 1.13x Q4_0, README's 5-round run; the folded int8 package was 584 MB and 0.38x). Its "prompt"
# model (--fast_prefill, more than one row by its contract) exports inside word_kernel_export("native"): the weight-only
# products of many rows take native_linear's packed kernels, as eager and compiled prefill do (the word kernels redo
# each row's arithmetic: a package prefilled at a third of llama.cpp's rate), int8's as q in bfloat16 (add_export_copy);
# one row (the output projection) stays on the words. Its "long_prompt" model (lengths of _BF16_ROWS and more, on CPUs
# with bfloat16 dot products) exports inside word_kernel_export("bf16"): those products take words_bf16_t and oneDNN's
# bfloat16 GEMM, as compiled prefill does; its length's lower bound decides the choice at export time (a package's
# graph cannot branch on the length).
_WORD_KERNEL_EXPORT = None  # None, "words", "native" or "bf16": word_kernel_export's many_rows


@contextlib.contextmanager
def word_kernel_export(many_rows: str = "words"):
    global _WORD_KERNEL_EXPORT
    saved, _WORD_KERNEL_EXPORT = _WORD_KERNEL_EXPORT, many_rows
    try:
        yield
    finally:
        _WORD_KERNEL_EXPORT = saved


def _exporting_word_kernels() -> bool:
    """True while torch.export traces inside word_kernel_export() (aoti_export.py)."""
    return _WORD_KERNEL_EXPORT is not None and torch.compiler.is_exporting()


def _exporting_native_rows() -> bool:
    """True while torch.export traces inside word_kernel_export("native" or "bf16") (a package's prompt models)."""
    return _WORD_KERNEL_EXPORT in ("native", "bf16") and torch.compiler.is_exporting()


def _compiled_single_row(x: Tensor) -> bool:
    """True inside torch.compile (not export) for one row of activations: the decode step (and compiled prefill's
    output projection, for the last token only)."""
    return (torch.compiler.is_compiling() and not torch.compiler.is_exporting()
            and x.numel() == x.shape[-1])


def _static(t: Tensor) -> Tensor:
    """Marks a plain tensor attribute's sizes static for torch.compile: in a dynamic graph (compiled prefill) they
    would be symbols, and Inductor's C++ wrapper then miscompiles the output strides of the word kernels."""
    return TI.mark_static(t)


def _int4_words_bf16_t(w: Tensor, st: Tensor, zt: Optional[Tensor]) -> Tensor:
    """An int4 w.T as bfloat16 [K, N] from its word layouts (QuantizedWeight._int4_words): q * s + z (weight-only) or,
    zt None, (q - 8) * s (8da4w's part without zero offsets), in float32, rounded once (see words_bf16_t). The tiles
    are read as stored, without views: in a package, a view of a constant that another product also reads (8da4w's
    zero term reads st) fails Inductor's freezing (see fused_linear)."""
    N, K = w.shape[0] * 16, w.shape[2] * w.shape[3] * 8      # [N/16, 1, K/G, G/8 or 1, 16]; nibble j of
    q = ((w >> _SHIFTS[4].to(w.device)) & 15).float()        # [t, 0, g, i, c]: q[16t + c, gG + jG/8 + i]; q:
    v = (q - 8) * st if zt is None else q * st + zt          # [8, N/16, 1, K/G, G/8, 16]
    return v.to(torch.bfloat16).permute(3, 0, 4, 1, 2, 5).reshape(K, N)


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
        m.rebuild()
        return m

    def rebuild(self):
        """Re-derives every copy that is not saved (export operands, packed and word layouts) from qdata, scales and
        zeros: after loading, moving, or changing them in place (tp.py's shards)."""
        self._rebuild_export_operands()
        self._rebuild_native()

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
        self.rebuild()

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)  # .to(device / dtype): repack for the new place
        self.rebuild()
        return self

    # bfloat16 on CPU: ATen's packed weight-only kernels (AVX512-BF16) beat everything else (measured ~14 Gparam/s int8,
    # ~35 Gparam/s int4 vs ~1-4 for dequantize + bf16 GEMM). With float32 activations they run a reference loop (int4:
    # ~1 G MAC/s; int8 ~2 G), so a float32 weight-only model casts its activations to bfloat16 for products of more
    # than one row (prefill, batched decode, speculative verification), output back to float32 (int8: scaled after,
    # unit scales inside). 2 threads, 33 / 128 rows of 576x1536: int4 380 / 1454 us, int8 472 / 1561 us, float32
    # sgemm 460 / 1359 us. Dequantizing first cost as much as the product (compiled int4 prefill 3x slower at 15
    # tokens); compiled with freezing, int8's dequantize was constant-folded into a float32 copy of the weights (4 bytes
    # per int8 weight more).
    # Bfloat16 activations are finer than llama.cpp's Q4_0 / Q8_0 paths (8-bit activations); one-row products (decode)
    # keep float32 (fused_linear: as fast, measured). int8 runs on qdata as stored; int4 needs
    # _convert_weight_to_int4pack_for_cpu's blocked layout: a second copy, 0.625 byte per weight with its bfloat16
    # scales and zeros (a plain attribute, not saved, rebuilt whenever the module moves or changes dtype).
    _int4_cpu = None

    _int8_words = None
    _int4_words = None
    _int8_unit = None
    _int8_sums = None
    _prompt_packed = False
    _int8_bf16_t = None  # see add_export_copy

    def _rebuild_native(self):
        self._int4_cpu = None
        self._prompt_packed = False  # see make_prompt_copy: a rebuilt weight has none (compiled prompts guard on it)
        self._int8_bf16_t = None
        self._int8_words = None
        self._int4_words = None
        # int8's unit bfloat16 scales for float32 activations (see native_linear) and its per-channel sums of q (see
        # int8_act_linear): plain attributes, not ops in a package's graph
        self._int8_unit = (_static(torch.ones(self.out_features, dtype=torch.bfloat16, device=self.qdata.device))
                           if self.bits == 8 else None)
        self._int8_sums = _static(self.qdata.sum(1, dtype=torch.int32)) if self.bits == 8 else None
        tiles = self.qdata.device.type == "cpu" and self.out_features % 16 == 0  # the word layouts' 16-channel tiles
        if self.bits == 8 and tiles and self.in_features % 4 == 0:
            # compiled decode reads int8 weights as int32 words in tiles of 16 output channels (see fused_linear):
            # [N/16, 1, K/4, 16] (the 1: the rows of x), byte j of word [t, 0, i, c] holds q[16t + c, j*K/4 + i],
            # plus 128 in bytes 0-2 (read as unsigned), as is in byte 3 (an arithmetic shift by 24 reads it signed).
            # A plain attribute (not saved), rebuilt whenever the module moves.
            N, K = self.qdata.shape
            u = self.qdata.to(torch.int32).view(N // 16, 16, 4, K // 4)
            w = (u[:, :, 0] + 128) | ((u[:, :, 1] + 128) << 8) | ((u[:, :, 2] + 128) << 16) | (u[:, :, 3] << 24)
            self._int8_words = _static(w.transpose(1, 2).contiguous().unsqueeze(1))
        if self.bits == 4 and tiles and self.groupsize % 8 == 0:
            # compiled decode reads int4 weights as int32 words in tiles of 16 output channels (see fused_linear):
            # [N/16, 1, K/G, G/8, 16] (the 1: the rows of x), nibble j (bits 4j..4j+3) of word [t, 0, g, i, c] holds
            # q[16t + c, g*G + j*G/8 + i], so each word's 8 nibbles lie in one group and one tile's words are
            # contiguous; scales and zeros tiled alike ([N/16, 1, K/G, 1, 16]). Plain attributes (not saved), rebuilt
            # whenever the module moves: as many bytes as qdata, plus one float32 per group for each of scales and
            # zeros.
            N, K, G = self.out_features, self.in_features, self.groupsize
            q = unpack_int4(self.qdata, G).to(torch.int32).view(N, K // G, 8, G // 8)
            w = q[:, :, 0]
            for j in range(1, 8):
                w = w | (q[:, :, j] << (4 * j))
            tile = lambda t: _static(t.reshape(N // 16, 16, *t.shape[1:]).movedim(1, -1).contiguous().unsqueeze(1))
            self._int4_words = (tile(w), tile(self.scales.float().unsqueeze(-1)),
                                None if self.zeros is None else tile(self.zeros.float().unsqueeze(-1)))
        if (self.bits == 4 and tiles and hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")
                and (self.scales.dtype == torch.bfloat16 or self.weight_only  # (8da4w: see int4_act_linear)
                     or torch.equal(self.scales.to(torch.bfloat16).to(self.scales.dtype), self.scales))):
            s = self.scales
            z = torch.zeros_like(s) if self.zeros is None or self.xnnpack else self.zeros + 8 * s  # (q - 8) s + z'
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(self.int_values().to(torch.int32), 1)
            sz = torch.stack([s.t(), z.t()], -1).to(torch.bfloat16).contiguous()
            self._int4_cpu = (_static(packed), _static(sz))

    def prompt_copy_bytes(self) -> int:
        """The bytes of make_prompt_copy's copy (0 where it makes none)."""
        return 2 * self.qdata.numel() if self.bits == 8 and _BF16_GEMM and self.qdata.is_cpu else 0

    def make_prompt_copy(self):
        """int8: q as bfloat16 (exact; the scales come after the product), in oneDNN's packed layout, for the products
        of compiled prompts (QuantizedLinear.pack_prompt, _prompt_copy_here): oneDNN's bfloat16 GEMM on it took 80 us
        for 15 rows of 1536x576 (2 threads) where ATen's packed int8 kernel took 194 us (8 rows 53 / 100, 128 rows
        544 / 1556; 2 rows 43 / 35), the same sums of the same products. 2 bytes per weight. Not int4: its weights
        (q s + z, 8da4w's (q - 8) s) are not exact in bfloat16, where ATen's int4 kernel multiplies them exactly; a
        rounded copy made SmolLM2 int4 g32's 15-token compiled prompt 27 ms instead of 31, but its greedy tokens
        parted from eager's within 32 tokens on 1 of 6 prompts (0 of 6 with the kernel)."""
        if self.prompt_copy_bytes() and packed_copy(self.qdata) is None:
            w = self.qdata.to(torch.bfloat16)
            keep_packed_copy(self.qdata, torch.ops.mkldnn._reorder_linear_weight(w, 16))
        self._prompt_packed = packed_copy(self.qdata) is not None

    def add_export_copy(self) -> bool:
        """int8 on a CPU with bfloat16 dot products: q.T as bfloat16 [K, N] (exact), a plain attribute that a package's
        "prompt" model (aoti_export.py --fast_prefill) multiplies by with oneDNN's bfloat16 GEMM at every length, a
        constant of the package (2 bytes per weight; that model no longer reads qdata, 1 byte): 111 us for 15 rows of
        1536x576 against the packed int8 kernel's 194 (2 threads). A cast of qdata inside the graph would be folded by
        Inductor's freezing into a constant the shared package format cannot store (aoti_export.constant_table)."""
        if self.prompt_copy_bytes():
            self._int8_bf16_t = _static(self.qdata.t().to(torch.bfloat16).contiguous())
        return self._int8_bf16_t is not None

    def _prompt_copy_here(self) -> bool:
        """Whether products run on make_prompt_copy's copy (torch.ops.llama_flat.linear_packed): inside a compiled
        prompt (no freezing, not export) of a weight that has one."""
        return (self._prompt_packed and torch.compiler.is_compiling() and not torch.compiler.is_exporting()
                and not TI.freezing())

    @property
    def weight_only(self) -> bool:
        """int4 weight-only (--mode int4, int4-gptq): not 8da4w's layouts."""
        return self.bits == 4 and not (self.symmetric or self.xnnpack)

    def native_linear(self, x: Tensor, offset: bool = True, float_rows: bool = True) -> Optional[Tensor]:
        """x @ w.T with ATen's packed CPU kernels when they apply (CPU; bfloat16 activations and scales, or int8 / int4
        weight-only with more than one row: bfloat16 inside, see above), else None.
        offset False: without the zero offsets of an asymmetric weight (w = (q - 8) * s).
        float_rows False: x must not be rounded to bfloat16 (8da4w's fake-quantized activations)."""
        bf16 = x.dtype == torch.bfloat16 and self.scales.dtype == torch.bfloat16
        rows = float_rows and x.numel() > x.shape[-1] and (self.bits == 8 or self.weight_only)
        if x.device.type != "cpu" or not (bf16 or rows):
            return None
        if self.zeros is not None and offset == self.xnnpack:  # the packed copy holds the other variant
            return None
        x2 = x.reshape(-1, self.in_features)
        if rows and self._prompt_copy_here():  # (int8)
            y = torch.ops.llama_flat.linear_packed(x2.to(torch.bfloat16), self.qdata)
            y = (y.float() * self.scales.float()).to(x.dtype)
        elif rows and (w := self._bf16_weight_t(x2)) is not None:
            y = torch.mm(x2.to(torch.bfloat16), w)
            y = (y.float() * self.scales.float() if self.bits == 8 else y).to(x.dtype)
        elif self.bits == 8 and bf16:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qdata, self.scales)
        elif self.bits == 8:  # unit scales inside (a bfloat16 scale would round each channel), the float ones after
            y = (torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16), self.qdata, self._int8_unit).to(x.dtype)
                 * self.scales.to(x.dtype))
        elif self._int4_cpu is not None:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16), self._int4_cpu[0], self.groupsize,
                                                           self._int4_cpu[1]).to(x.dtype)
        else:
            return None
        return y.reshape(*x.shape[:-1], self.out_features)

    def _bf16_weight_t(self, x2: Tensor) -> Optional[Tensor]:
        """w.T as bfloat16 [K, N] for oneDNN's bfloat16 GEMM of x2 [M, K] (see _BF16_GEMM), or None where the packed
        kernels run: compiled, words_bf16_t; eager int8, one cast of qdata (2.4x faster than the packed kernel at 128
        rows of 1536x576, 1.3x at 32; a transient copy of 2 bytes per weight, 57 MB for SmolLM2's tied table when every
        position's logits are asked for, 2.3x faster there); not eager int4 (as ATen ops its conversion is several
        passes, 500-680 us per 1536x576 matrix, slower than the product)."""
        if not _BF16_GEMM:
            return None
        if torch.compiler.is_exporting():  # a package's prompt models
            if _WORD_KERNEL_EXPORT == "native" and self._int8_bf16_t is not None:  # int8's "prompt": any length
                return self._int8_bf16_t
            many = statically_known_true(x2.shape[0] >= _BF16_ROWS)  # "long_prompt": _BF16_ROWS tokens or more
            return self.words_bf16_t() if _WORD_KERNEL_EXPORT == "bf16" and many else None
        if x2.shape[0] < _BF16_ROWS:
            return None
        if torch.compiler.is_compiling():
            return self.words_bf16_t()
        return self.qdata.t().to(torch.bfloat16) if self.bits == 8 else None

    def words_bf16_t(self) -> Optional[Tensor]:
        """w.T as bfloat16 [K, N] from the word layouts (None without them): int8 its integer values (exact; the
        scales come after the product), weight-only int4 q * s + z in float32, rounded once. One pointwise kernel when
        compiled, vectorized along the 16 output channels of a tile; the shifts take a tensor of amounts, so that
        Inductor's freezing does not fold their outputs into constants (see add_dont_constant_fold above)."""
        N, K = self.out_features, self.in_features
        if self.bits == 8 and self._int8_words is not None:  # byte j of word [t, 0, i, c]: q[16t + c, j K/4 + i]
            w = self._int8_words.squeeze(1)                                         # [N/16, K/4, 16]
            # bytes 0-2 hold q + 128, byte 3 q as is: + 128 there, mod 256, makes it read like the others. (rows()
            # reads the same bytes with scalar shifts, stacked: here that kernel took 10x as long; there, in a package,
            # these shift tensors fail AOT Inductor's build: "references nonexistent attribute _tensor_constant1")
            q = (((w >> _SHIFTS[8].to(w.device)) + _BYTE_OFFSETS.to(w.device)) & 255) - 128   # [4, N/16, K/4, 16]
            # via float32: Inductor's int32 -> bfloat16 conversion is not vectorized (the kernel took 2.5x as long)
            return q.float().to(torch.bfloat16).permute(0, 2, 1, 3).reshape(K, N)
        if self.bits == 4 and self._int4_words is not None:
            w, st, zt = self._int4_words
            return _int4_words_bf16_t(w, st, zt if self.weight_only else None)
        return None

    def int8_act_linear(self, x: Tensor) -> Tensor:
        """x @ w.T for int8 weights with dynamic per-token int8 activations (quant_per_token_int8) as one integer GEMM,
        torch._int_mm (oneDNN's VNNI kernel on x86; 8da8w's prompts): (q - zp) @ qdata.T = q @ qdata.T - zp * sum_k
        qdata, exact in int32, then times both scales in float32. Equals the fake-quantized product up to float
        rounding (which sums the same integers in float32)."""
        x2 = x.reshape(-1, self.in_features)
        q, zp, scale = quant_per_token_int8(x2.float())
        acc = torch._int_mm(q.to(torch.int8), self.qdata.t()) - zp.to(torch.int32) * self._int8_sums
        y = acc.float() * scale * self.scales.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def int4_act_linear(self, x: Tensor) -> Optional[Tensor]:
        """8da4w's x @ ((q - 8) s).T for more than one row of float activations under torch.compile (prompts) and in a
        package's prompt models (word_kernel_export "native" / "bf16"), or None where it does not apply (no packed
        copy, no bfloat16 GEMM): x's per-token int8 values q - zp (integers of at most 255 in magnitude, exact in
        bfloat16) through ATen's packed int4 kernel (fewer than _BF16_ROWS rows: its products are exact, scales on the
        bfloat16 grid, and the output is rounded to bfloat16) or oneDNN's bfloat16 GEMM on words_bf16_t's (q - 8) s
        (weights rounded to bfloat16 once), then times x's scales. The float32 product of the fake-quantized x that it
        replaces dequantized every weight to float32 per call. Eager keeps that product: the reference that the .pte's
        XNNPACK kernels match token for token."""
        if self.bits != 4 or self.weight_only:
            return None
        x2 = x.reshape(-1, self.in_features)
        w = self._bf16_weight_t(x2)
        if w is None and self._int4_cpu is None:
            return None
        q, zp, scale = quant_per_token_int8(x2.float())
        xi = (q - zp).to(torch.bfloat16)
        if w is not None:
            y = torch.mm(xi, w)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xi, self._int4_cpu[0], self.groupsize, self._int4_cpu[1])
        return (y.float() * scale).to(x.dtype).reshape(*x.shape[:-1], self.out_features)

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
        N, K, G = self.out_features, self.in_features, self.groupsize
        if self.bits == 8:  # per-channel scales apply to the output: one pass less over the weights
            def part(i, j):
                return F.linear(x, self.qdata[i:j].to(x.dtype)) * self.scales[i:j].to(x.dtype)
        elif getattr(self, "qdata_int8", None) is not None and (self.zeros is None or not offset):
            def part(i, j):  # (q - 8) s in one pass over the unpacked copy, not the nibble unpacking's several
                w = self.qdata_int8[i:j].view(j - i, K // G, G) * self.scales[i:j, :, None].to(x.dtype)
                return F.linear(x, w.view(j - i, K))
        else:
            def part(i, j):
                return F.linear(x, self.dequantize(x.dtype, i, j, offset))
        if N <= rows:
            return part(0, N)
        return torch.cat([part(i, min(i + rows, N)) for i in range(0, N, rows)], -1)

    def rows(self, idx: Tensor, dtype=None) -> Tensor:
        """Dequantized rows idx (any shape) -> [*idx.shape, K]: an embedding lookup."""
        dtype = dtype or self.scales.dtype
        if self._int8_words is not None and _exporting_word_kernels():
            # from the words the output projection reads: a package stores a tied table once (qdata is not in it).
            # Tensor indices only (idx * 0, not 0): Inductor's freezing folds a select of a constant used elsewhere
            # and then fails to compile (see fused_linear)
            w = self._int8_words[idx // 16, idx * 0, :, idx % 16]                  # [..., K/4] int32
            q = torch.stack([((w >> (8 * j)) & 255) - 128 for j in range(3)] + [w >> 24], -2).flatten(-2)
            return q.to(dtype) * self.scales[idx].to(dtype).unsqueeze(-1)
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

    def fused_linear(self, x: Tensor, offset: bool = True, sums: Optional[Tensor] = None) -> Tensor:
        """x [..., K] @ w.T as one reduction over the integer weights (for torch.compile: a single generated kernel
        that reads each weight byte once; mixed-dtype products keep the weights out of Inductor's constant folding).
        sums [..., K/G] (asymmetric 8da4w, int4 words only): x is the fake-quantized copy of float activations whose
        group sums these are; returns x @ ((q - 8) s).T + sums @ (z + 8 s).T, the eager module's two products."""
        if self.bits == 8:
            w = self._int8_words
            if w is None:
                return (x.unsqueeze(-2) * self.qdata).sum(-1) * self.scales
            # Full-width int32 loads, vectorized along the 16 output channels of a tile (an outer reduction over the
            # tile's contiguous K/4 word rows: no horizontal sums); at AVX2 a partial int8 load goes through a stack
            # buffer (store-forwarding stall per 8 weights, ~8x slower than AVX-512's masked load). x is split into 4
            # contiguous quarters, one per byte. Per word: 3 ands (bytes 0-2 in place, see _BYTE_SCALES), 1 shift,
            # 4 conversions, 4 multiply-adds; the +128 of bytes 0-2 comes off once per row (128 * sum of x's first
            # three quarters), not per weight (measured 1.26x on the 49152x576 output projection, 1 thread; ~40%
            # fewer vector ops than (b & 255) - 128 per byte). Two shifts would sign-extend every byte, but freezing
            # folds `w << n` into new weight copies. float32 throughout: in bfloat16 the offset's rounding would swamp
            # the result.
            # x in a buffer of its own, as for int4 below (a package's 8da4w output projection otherwise wrote the
            # [M, N/16, K/4, 16] products to memory: 28 MB per token)
            K, K4 = self.in_features, self.in_features // 4
            x32 = x.reshape(-1, K).float()
            off = 128 * x32[:, :3 * K4].sum(-1, keepdim=True)
            xq = x32.view(-1, 4, K4, 1) * _BYTE_SCALES.to(x32.device)  # see _BYTE_SCALES: masks, no shifts
            if _FORCE_STRIDE is not None:
                xq = _FORCE_STRIDE(xq, (K, K4, 1, 1))
            t = (xq[:, 0] * (w & 255) + xq[:, 1] * (w & 0xFF00)        # [N/16, M, K/4, 16]: tiles outermost, the
                 + xq[:, 2] * (w & 0xFF0000) + xq[:, 3] * (w >> 24))   # loop Inductor runs in parallel
            y = (t.sum(-2).transpose(0, 1).reshape(-1, self.out_features) - off) * self.scales
            return y.reshape(*x.shape[:-1], self.out_features)
        N, K, G = self.out_features, self.in_features, self.groupsize
        if self._int4_words is not None and (x.numel() == K or _WORD_KERNEL_EXPORT is not None):
            # Vectorized along the 16 output channels of a tile (an outer reduction over the tile's K/8 word rows,
            # tiles in parallel): each tile's words are one contiguous stream, full-width loads of the words and of
            # the tiled scales / zeros, x broadcast from scalars. Reading nibbles per byte instead, Inductor loads 8
            # uint8 lanes of a 32-lane AVX2 vector through a stack buffer (~5x slower); with the words laid out
            # [K/8, N], each tile walks memory with a stride of N words. Any number of rows M (a package's dynamic
            # length, word_kernel_export); torch.compile takes it for one row.
            # Two reductions of 4 nibbles each (one fused loop): 8 terms in one expression exceed Inductor's limits on
            # inlined reads, and it would write the products to memory first.
            w, st, zt = self._int4_words
            x32 = x.reshape(-1, K).float()  # float32 throughout (scales too): bfloat16 loads of 8 lanes are partial
            if _FORCE_STRIDE is not None:  # x in buffers of its own: else its producer (an RMSNorm) is recomputed in
                x32 = _FORCE_STRIDE(x32, (K, 1))  # the kernels that read it (the group sums below, the scaled copy)
            xn = x32.view(-1, K // G, 8, G // 8, 1) * _NIBBLE_SCALES.to(x32.device)  # masks, no shifts: see there
            if _FORCE_STRIDE is not None:  # the main loop reads the scaled copy once per vector of outputs
                xn = _FORCE_STRIDE(xn, (K, G, G // 8, 1, 1))
            xj = xn.movedim(2, 0)                                             # [8, M, K/G, G/8, 1]: x of nibble j
            nib = [w & (15 << (4 * j)) for j in range(7)] + [(w >> 28) & 15]  # q_j * 16^j (the top one: q_7)
            # [N/16, M, 16]: tiles outermost, the loop Inductor runs in parallel (rows outermost, a package's decode
            # step ran on one thread)
            y = sum((sum(xj[j] * nib[j] for j in range(h, h + 4)) * st).sum((2, 3)) for h in (0, 4))
            xs = group_sums(x32, G).view(-1, K // G, 1, 1)                   # [M, K/G, 1, 1]
            if sums is not None:  # 8da4w: + 8 s (sums - xs) + z sums, in the same kernel (a separate product of the
                xf = sums.reshape(-1, K // G, 1, 1).float()  # sums split a package's layer into 9 kernels, not 1)
                term = 8 * (xf - xs) * st + xf * zt
            else:
                if zt is None or not offset:  # w = (q - 8) s; -8 on x's side (on the scales it would be folded anew)
                    xs, zt = -8 * xs, st
                term = xs * zt
            # + zero term (no slice of zt: Inductor's freezing folds a slice of a constant used elsewhere, as st is,
            # and then fails to compile the package with "references nonexistent attribute _tensor_constant1")
            return (y + term.sum((2, 3))).transpose(0, 1).reshape(*x.shape[:-1], N)
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
            if torch.compiler.is_exporting() and not _exporting_word_kernels() and (qw.symmetric or qw.xnnpack):
                return self._forward_dynamic_act_export(x)
            if qw.bits == 8 and self._int_rows(x):
                y = qw.int8_act_linear(x)
                return y + self.bias if self.bias is not None else y
            compiled = torch.compiler.is_compiling() and not torch.compiler.is_exporting()
            many = (compiled or _exporting_native_rows()) and qw.bits == 4 and self._int_rows(x)  # int4_act_linear
            zt = sums = None
            if qw.xnnpack and qw.zeros is not None:  # asymmetric 8da4w: the zero term takes the float activations
                if qw._int4_words is not None and self._word_kernels(x) and not many:
                    sums = group_sums(x, qw.groupsize)  # the word kernel adds it (see fused_linear)
                elif many and qw._int4_words is not None:  # sums x (z + 8 s) from the tiled scales and zeros the
                    # word kernels read (a package stores them for "model"), x's side in every product: Inductor's
                    # freezing would fold a GEMM's constant weight or z + 8 s into new constants (nor views of them:
                    # see fused_linear, whose broadcast this is)
                    _, st, z = qw._int4_words                                        # [N/16, 1, K/G, 1, 16]
                    xs = group_sums(x.float(), qw.groupsize).view(-1, st.shape[2], 1, 1)  # [M, K/G, 1, 1]
                    zt = (xs * z + (8 * xs) * st).sum((2, 3)).transpose(0, 1)       # [M, N/16, 16]
                    zt = zt.reshape(*x.shape[:-1], qw.out_features).to(x.dtype)
                else:
                    zt = F.linear(group_sums(x, qw.groupsize), qw.zero_term.to(x.dtype))
            y = qw.int4_act_linear(x) if many else None
            if y is None:
                if self.act_quant is not None:  # tp.py's row-parallel shards: the range of the whole row
                    x = self.act_quant(x)
                else:
                    x = _FAKE_QUANT_OP(x) if compiled and not self._word_kernels(x) else fake_quant_per_token_int8(x)
                y = self._matmul(x, offset=zt is None, sums=sums)
            y = y if zt is None else y + zt
        else:
            y = self._matmul(x)
        return y + self.bias if self.bias is not None else y

    def prompt_copy_bytes(self) -> int:
        """The bytes of pack_prompt's copy: weight-only int8 only (8da8w's prompts multiply int8 by int8,
        int8_act_linear; int4: see QuantizedWeight.make_prompt_copy)."""
        return 0 if self.act == "int8" else self.qweight.prompt_copy_bytes()

    def pack_prompt(self):
        """Gives the weight its copy for compiled prompts (QuantizedWeight.make_prompt_copy); model.pack_prompt_weights
        calls it for a compiled model's blocks."""
        if self.prompt_copy_bytes():
            self.qweight.make_prompt_copy()

    @staticmethod
    def _native(x: Tensor) -> bool:
        """ATen's CPU kernels (native_linear, int8_act_linear) may run: eager and compiled (not the decode step's one
        row), and in a package's prompt model (word_kernel_export("native"))."""
        return _exporting_native_rows() or not (torch.compiler.is_exporting() or _compiled_single_row(x))

    def _int_rows(self, x: Tensor) -> bool:
        """int8 x int8 products of more than one row on CPU (8da8w's prompts, 8da4w's tied int8 table); not tp.py's
        row-parallel shards (their range is the whole row's)."""
        return x.device.type == "cpu" and x.numel() > x.shape[-1] and self.act_quant is None and self._native(x)

    @staticmethod
    def _word_kernels(x: Tensor) -> bool:
        """Decode under torch.compile (one generated kernel per matmul, fastest measured); AOT Inductor export."""
        return _compiled_single_row(x) or _exporting_word_kernels()

    def _matmul(self, x: Tensor, offset: bool = True, sums: Optional[Tensor] = None) -> Tensor:
        qw = self.qweight
        # ATen's packed CPU kernels: bfloat16, or weight-only products of many rows
        if self._native(x) and (y := qw.native_linear(x, offset, self.act is None)) is not None:
            return y
        if self._word_kernels(x):
            return qw.fused_linear(x, offset, sums).to(x.dtype)
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
