# fast_cpu_quant.py: faster CPU products for qops.py's quantized weights, swapped in by fast_cpu.swap_in (speed_up):
# FastQuantizedLinear computes what qops.QuantizedLinear does through fast_cpu_kernels', ATen's packed int8 / int4 and
# oneDNN's bfloat16 kernels, generated reductions over word layouts of the integer weights (compiled decode, packages)
# and integer GEMMs for 8da8w, on layouts of its own (made from the stored weight, not saved).
# Delete this file (with fast_cpu.py) and quantized models run qops.py's exact eager products.
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

import torch_internals as TI
from common import release_pages
from qops import (QuantizedLinear, fake_quant_per_token_int8, group_sums, on_bf16_grid, quant_per_token_int8,
                  unpack_int4)

try:  # kernels of our own (int4_cpu_mm, fused_linear); without them, ATen's and Inductor's
    import fast_cpu_kernels
except ImportError:
    fast_cpu_kernels = None

_FORCE_STRIDE = None  # Inductor's prim that materializes its input in a buffer of its own (see fused_linear)


def compile_setup() -> None:
    """Before torch.compile or an export: the compiler's modules (TI.compiler), _FORCE_STRIDE, and freezing told to
    keep the nibble unpacking (>> 4, & 15; words_bf16_t's shifts) in the kernels, not folded into constants."""
    global _FORCE_STRIDE
    TI.compiler()
    TI.dont_constant_fold("bitwise_right_shift.Tensor_Scalar", "__rshift__.Scalar", "bitwise_and.Scalar",
                          "__and__.Scalar", "bitwise_right_shift.Tensor", "__rshift__.Tensor")
    _FORCE_STRIDE = TI.force_stride_order()


def packed_copy(w):
    """w's packed copy (keep_packed_copy) while w has not changed in place since, else None. A copy in oneDNN's
    packed layout is an opaque tensor that a compiled graph cannot take as an input: the graph passes w and an op
    finds its copy here, hung on w itself (freed with it; fast_cpu's float32 copies too)."""
    entry = getattr(w, "_packed_copy", None)
    return entry[1] if entry is not None and entry[0] == w._version else None


def keep_packed_copy(w, copy) -> None:
    w._packed_copy = (w._version, copy)


def _linear_packed(x: Tensor, key: Tensor) -> Tensor:
    """x [M, K] bfloat16 @ the packed bfloat16 copy hung on key (an int8 qdata; pack_prompt)."""
    copy = packed_copy(key)
    if copy is None:  # (compiled graphs take this op only for a weight whose copy was current when traced)
        raise RuntimeError("a quantized weight changed in place after its prompt copy was made: swap it in again")
    return torch.ops.mkldnn._linear_pointwise(x, copy, None, "none", [], "")


# Two opaque ops for compiled prompts. fake_quant_per_token_int8: Inductor would otherwise inline the quantization into
# the matmul kernel that consumes it, recomputing it for every weight (~50x slower per 8da4w layer); not for the word
# kernels (decode), which put x in a buffer of their own (there the op's Python call per product held compiled 8da8w
# decode at 0.65x llama.cpp Q8_0, 1.08x without it). linear_packed: a packed copy cannot be a graph's input.
if not hasattr(torch.ops.llama_flat, "linear_packed"):
    _LIB = torch.library.Library("llama_flat", "FRAGMENT")
    _LIB.define("fake_quant_per_token_int8(Tensor x) -> Tensor")
    _LIB.impl("fake_quant_per_token_int8", fake_quant_per_token_int8, "CompositeExplicitAutograd")
    torch.library.register_fake("llama_flat::fake_quant_per_token_int8", lib=_LIB)(lambda x: torch.empty_like(x))
    _LIB.define("linear_packed(Tensor x, Tensor key) -> Tensor")
    _LIB.impl("linear_packed", _linear_packed, "CPU")
    torch.library.register_fake("llama_flat::linear_packed", lib=_LIB)(
        lambda x, key: x.new_empty((x.shape[0], key.shape[0])))
_FAKE_QUANT_OP = torch.ops.llama_flat.fake_quant_per_token_int8

# The word kernels (fused_linear) read byte / nibble j of a word in place, `w & mask_j` (its value times 256^j / 16^j),
# not shifted down first: x's part for it comes pre-scaled by 256^-j / 16^-j, a power of two, so every product is the
# same float32 as with shifts for one integer op less per byte / nibble. The top byte / nibble is shifted down.
_BYTE_SCALES = torch.tensor([1.0, 2.0 ** -8, 2.0 ** -16, 1.0]).view(4, 1, 1)
_NIBBLE_SCALES = torch.tensor([16.0 ** -j for j in range(7)] + [1.0]).view(8, 1, 1)
# Products of many rows on a CPU with bfloat16 dot products (AVX512-BF16 or AMX): the word layouts to bfloat16 in one
# generated kernel (words_bf16_t), then oneDNN's bfloat16 GEMM, about twice ATen's packed kernels' float32 rate
# (1536x576 int4 g32, 2 threads: 754 against 1461 us at 128 rows, 274 against 218 at 16: below BF16_ROWS they stay).
BF16_GEMM = TI.cpu_has("avx512_bf16") or TI.cpu_has("amx_tile")
BF16_ROWS = 32
# Compiled weight-only int8 prompts below this many rows without packed copies (fast_cpu.PROMPT_COPIES_MAX) run the
# word kernels row by row, not every weight to bfloat16 (1B shape, 2 threads, 15 tokens: 143 against 785 ms).
INT8_WORD_ROWS = 64
# Compiled prompts convert word layouts to bfloat16 piece by piece, each piece's GEMM right after it (from the caches)
WORD_PIECE_BYTES = 4 << 20  # int8, 128 tokens, 2 threads, scripts/profile_step.py, 1B: 614-642 -> 508-531 ms
_SHIFTS = {8: torch.tensor([0, 8, 16, 24], dtype=torch.int32).view(4, 1, 1, 1),
           4: torch.arange(0, 32, 4, dtype=torch.int32).view(8, 1, 1, 1, 1, 1),
           2: torch.tensor([4, 0], dtype=torch.uint8).view(1, 1, 2, 1)}  # qdata's high, then low nibbles
_BYTE_OFFSETS = torch.tensor([0, 0, 0, 128], dtype=torch.int32).view(4, 1, 1, 1)  # see words_bf16_t
LAYOUTS = ("int8_words", "int4_words", "int4_cpu", "int8_unit", "int8_sums", "qdata_int8", "int8_bf16_t", "int8_kernel")


def _by_rows(fn, n: int, rows: int = 4096) -> Tensor:  # fn over slices of n rows: small temporaries (1B output)
    return torch.cat([fn(slice(i, i + rows)) for i in range(0, n, rows)])


def _int4_words_bf16_t(w: Tensor, st: Tensor, zt: Optional[Tensor]) -> Tensor:
    """An int4 w.T as bfloat16 [K, N] from its word layout: q * s + z (weight-only) or, zt None, (q - 8) * s, in
    float32, rounded once. The tiles are read as stored, without views: in a package, a view of a constant that another
    product also reads fails Inductor's freezing."""
    N, K = w.shape[0] * 16, w.shape[2] * w.shape[3] * 8      # [N/16, 1, K/G, G/8 or 1, 16]; nibble j of
    q = ((w >> _SHIFTS[4].to(w.device)) & 15).float()        # [t, 0, g, i, c]: q[16t + c, gG + jG/8 + i]
    v = (q - 8) * st if zt is None else q * st + zt          # [8, N/16, 1, K/G, G/8, 16]
    return v.to(torch.bfloat16).permute(3, 0, 4, 1, 2, 5).reshape(K, N)


class FastQuantizedLinear(QuantizedLinear):
    """qops.QuantizedLinear (the same weight, bias and activation mode) with CPU kernels. Which product runs:
      * eager and compiled prompts (more than one row), weight-only: ATen's packed int8 / int4 kernels on bfloat16
        activations (their float32 path is a reference loop), or from BF16_ROWS rows oneDNN's bfloat16 GEMM on
        bfloat16 weights (int8: a copy of q, exact; int4: q s + z rounded once); a compiled prompt multiplies an int8
        weight by its packed bfloat16 copy where fast_cpu.pack_prompt_weights made one (pack_prompt);
      * 8da8w, more than one row: one integer GEMM (torch._int_mm); 8da4w compiled prompts: the activations' int8
        values through the int4 kernels (int4_act_linear); eager 8da4w: qops' float32 products (the .pte's reference);
      * compiled decode (one row), weight-only int8 prompts of fewer than INT8_WORD_ROWS rows without packed copies:
        one generated reduction over the word layouts (fused_linear);
      * weight-only int4: one layout at every length (int4_cpu_mm): fast_cpu_kernels' tiles and kernel where it runs,
        else ATen's packed layout and kernel; weight-only int8 on AVX2: the words at every length (int8_kernel "all").
    export_rows (qexport.py's AOT Inductor forms; torch.export only): "words" the word kernels for any number of rows;
    "native" a package's prompt model (the packed kernels, int8 on its bfloat16 copy); "bf16" its long_prompt model."""

    def __init__(self, lin: QuantizedLinear, export_rows: Optional[str] = None, words: bool = True):
        super().__init__(lin.qweight, None, lin.act)
        self.bias, self.act_quant, self.export_rows = lin.bias, lin.act_quant, export_rows
        self.prompt_packed = getattr(lin, "prompt_packed", False)
        if isinstance(lin, FastQuantizedLinear):  # another form of the same weight: the same layouts (made on lin,
            if words:                               # which the other forms share)
                lin.add_words()
            for name in LAYOUTS:
                setattr(self, name, getattr(lin, name))
        else:
            self._make_layouts(words)

    def add_words(self):  # the word layouts (compiled decode's), where the module was made without them
        self._make_words() if self.int8_words is None and self.int4_words is None else None

    def _make_layouts(self, words: bool = True):
        """The kernels' layouts from qdata, scales and zeros (plain attributes: not saved, not moved); words: also the
        word layouts, which only compiled code reads (an eager 1B int8 model would hold 1 GB more for nothing);
        int4_cpu: (fast_cpu_kernels' tiles, None) where its kernels run, else (ATen's blocked layout, its scales)."""
        qw, static, N = self.qweight, TI.mark_static, self.qweight.out_features
        for name in LAYOUTS:
            setattr(self, name, None)
        if qw.bits == 8:  # unit bfloat16 scales for float32 activations (native_linear); per-channel sums of q
            self.int8_unit = static(torch.ones(N, dtype=torch.bfloat16, device=qw.qdata.device))
            self.int8_sums = static(_by_rows(lambda r: qw.qdata[r].sum(1, dtype=torch.int32), N))
        elif (qw.symmetric or qw.xnnpack) and not words:  # q - 8 as int8 [N, K]: eager (q - 8) s in one pass
            self.qdata_int8 = unpack_int4(qw.qdata, qw.groupsize).to(torch.int8) - 8
        if (qw.bits == 4 and qw.qdata.is_cpu and N % 16 == 0
                and (qw.weight_only or on_bf16_grid(qw.scales))):  # (8da4w: see int4_act_linear)
            s = qw.scales  # bfloat16 scales and offsets: (q - 8) s + z'
            z = torch.zeros_like(s) if qw.zeros is None or qw.xnnpack else qw.zeros + 8 * s
            kernel = fast_cpu_kernels is not None and fast_cpu_kernels.takes(N, qw.groupsize)  # (see int4_cpu_mm)
            q, G = (lambda r: unpack_int4(qw.qdata[r], qw.groupsize)), qw.groupsize  # (by rows: slices concatenate)
            if kernel:
                self.int4_cpu = static(_by_rows(lambda r: fast_cpu_kernels.make_tiles(q(r), s[r], z[r], G), N)), None
            else:
                pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu
                self.int4_cpu = (static(_by_rows(lambda r: pack(q(r).to(torch.int32), 1), N)),
                                 static(torch.stack([s.t(), z.t()], -1).to(torch.bfloat16)))
        if words:
            self._make_words()

    def _make_words(self):
        """The word layouts of the compiled decode kernels (fused_linear), in tiles of 16 output channels. Not for
        weight-only int4 with a packed layout (int4_cpu), read at every length: one layout, not two."""
        qw, static = self.qweight, TI.mark_static
        N, K, G = qw.out_features, qw.in_features, qw.groupsize
        if not (qw.qdata.is_cpu and N % 16 == 0) or (self.int4_cpu is not None and qw.weight_only):
            return
        if qw.bits == 8 and K % 4 == 0:
            # int32 words [N/16, 1, K/4, 16] (the 1: the rows of x): byte j of word [t, 0, i, c] holds
            # q[16t + c, j*K/4 + i], plus 128 in bytes 0-2 (read as unsigned), as is in byte 3 (read signed)
            w = torch.empty(N // 16, K // 4, 16, dtype=torch.int32)
            for t in range(0, N // 16, 256):  # 4096 channels at a time: the temporaries stay small
                u = qw.qdata[16 * t:16 * (t + 256)].to(torch.int32).view(-1, 16, 4, K // 4)
                w[t:t + 256] = ((u[:, :, 0] + 128) | ((u[:, :, 1] + 128) << 8) | ((u[:, :, 2] + 128) << 16)
                                | (u[:, :, 3] << 24)).transpose(1, 2)
            self.int8_words = static(w.unsqueeze(1))
            self.int8_kernel = (fast_cpu_kernels is not None and fast_cpu_kernels.available()  # (fused_linear)
                                and ("all" if fast_cpu_kernels.ISA == 1 else "row"))
        if qw.bits == 4 and G % 8 == 0:
            # int32 words [N/16, 1, K/G, G/8, 16]: nibble j of word [t, 0, g, i, c] holds q[16t + c, g*G + j*G/8 + i],
            # so each word's 8 nibbles lie in one group and a tile's words are contiguous; scales and zeros tiled alike
            q = unpack_int4(qw.qdata, G).to(torch.int32).view(N, K // G, 8, G // 8)
            w = q[:, :, 0]
            for j in range(1, 8):
                w = w | (q[:, :, j] << (4 * j))
            tile = lambda t: static(t.reshape(N // 16, 16, *t.shape[1:]).movedim(1, -1).contiguous().unsqueeze(1))
            self.int4_words = (tile(w), tile(qw.scales.float().unsqueeze(-1)),
                               None if qw.zeros is None else tile(qw.zeros.float().unsqueeze(-1)))

    # ------------------------------------------------------------------------------------------------- prompt copies
    def prompt_copy_bytes(self) -> int:
        """The bytes of pack_prompt's copy: weight-only int8 only (8da8w's prompts multiply int8 by int8; int4's are
        not exact in bfloat16: a rounded copy parted SmolLM2's greedy tokens from eager on 1 of 6 prompts)."""
        qw = self.qweight
        return 2 * qw.qdata.numel() if self.act is None and qw.bits == 8 and BF16_GEMM and qw.qdata.is_cpu else 0

    def pack_prompt(self):
        """q as bfloat16 (exact; the scales come after the product) in oneDNN's packed layout, hung on qdata, for the
        products of compiled prompts: 80 us for 15 rows of 1536x576 (2 threads) where ATen's int8 kernel took 194."""
        qdata = self.qweight.qdata
        if self.prompt_copy_bytes() and packed_copy(qdata) is None:
            keep_packed_copy(qdata, torch.ops.mkldnn._reorder_linear_weight(qdata.to(torch.bfloat16), 16))
            if self.reads_words_only():
                release_pages(qdata)  # (read again for the copy: see fast_cpu.swap_in)
        self.prompt_packed = packed_copy(qdata) is not None

    def add_export_copy(self) -> bool:
        """int8 with bfloat16 dot products: q.T as bfloat16 [K, N] (exact), a constant of a package's "prompt" model
        for oneDNN's bfloat16 GEMM at every length (15 rows of 1536x576: 111 us, the int8 kernel 194). A cast inside
        the graph would be folded by freezing into a constant that the shared package format cannot store."""
        if self.prompt_copy_bytes():
            self.int8_bf16_t = TI.mark_static(self.qweight.qdata.t().to(torch.bfloat16).contiguous())
        return self.int8_bf16_t is not None

    def reads_words_only(self) -> bool:
        """The products read this module's own layouts alone, never qdata (nor int4's scales and zeros): compiled
        weight-only int8 with bfloat16 GEMMs (words; prompts: words_bf16_t or the packed copy), weight-only int4 with
        int4_cpu, compiled 8da4w (words, int4_cpu); swap_in / pack_prompt give their pages back."""
        qw = self.qweight
        if qw.bits == 8:
            return self.int8_words is not None and self.act is None and (BF16_GEMM or self.int8_kernel == "all")
        return self.int4_cpu is not None and (qw.weight_only or self.int4_words is not None)

    # ------------------------------------------------------------------------------------------------- dispatch
    def _exporting(self) -> bool:  # an AOT Inductor form under torch.export
        return self.export_rows is not None and torch.compiler.is_exporting()

    def _native(self, x: Tensor) -> bool:
        """ATen's CPU kernels may run: eager and compiled prompts (not compiled decode), packages' prompt models."""
        if self._exporting():
            return self.export_rows in ("native", "bf16") or self._int4_blocked_only()
        return not (torch.compiler.is_exporting() or self._word_rows(x)
                    or (self._compiled_row(x) and not self._int4_blocked_only()))

    def _int4_blocked_only(self) -> bool:  # weight-only int4 with int4_cpu alone: see _make_words
        return self.int4_cpu is not None and self.int4_words is None and self.qweight.weight_only

    @staticmethod
    def _compiled_row(x: Tensor) -> bool:  # one row under torch.compile (not export): decode, a prompt's last token
        return torch.compiler.is_compiling() and not torch.compiler.is_exporting() and x.numel() == x.shape[-1]

    def _words(self, x: Tensor) -> bool:  # the word kernels (fused_linear): compiled decode, AOTI forms left over
        return self._compiled_row(x) or self._word_rows(x) or self._exporting()

    def _word_rows(self, x: Tensor) -> bool:  # compiled weight-only int8, < INT8_WORD_ROWS rows, no packed copy
        return (self.int8_words is not None and self.act is None and not self.prompt_packed and x.numel() > x.shape[-1]
                and torch.compiler.is_compiling() and not torch.compiler.is_exporting()
                and x.numel() < INT8_WORD_ROWS * x.shape[-1])

    def _int_rows(self, x: Tensor) -> bool:
        """int8 x int8 products of several rows (8da8w's prompts, 8da4w's tied int8 table); not tp.py's shards."""
        return x.is_cpu and x.numel() > x.shape[-1] and self.act_quant is None and self._native(x)

    def forward(self, x: Tensor) -> Tensor:
        qw = self.qweight
        if self.act != "int8":
            y = self.product(x)
            return y + self.bias if self.bias is not None else y
        if qw.bits == 8 and self._int_rows(x):
            y = self.int8_act_linear(x)
            return y + self.bias if self.bias is not None else y
        compiled = torch.compiler.is_compiling() and not torch.compiler.is_exporting()
        many = (compiled or self._exporting()) and qw.bits == 4 and self._int_rows(x)  # int4_act_linear
        zt = sums = None
        if qw.xnnpack and qw.zeros is not None:  # asymmetric 8da4w: the zero term takes the float activations
            if self.int4_words is not None and self._words(x) and not many:
                sums = group_sums(x, qw.groupsize)  # the word kernel adds it (see fused_linear)
            elif many and self.int4_words is not None:  # x (z + 8 s) from the tiled scales and zeros the word
                _, st, z = self.int4_words           # kernels read (Inductor's freezing would fold z + 8 s anew)
                xs = group_sums(x.float(), qw.groupsize).view(-1, st.shape[2], 1, 1)   # [M, K/G, 1, 1]
                zt = (xs * z + (8 * xs) * st).sum((2, 3)).transpose(0, 1)           # [M, N/16, 16]
                zt = zt.reshape(*x.shape[:-1], qw.out_features).to(x.dtype)
            else:
                zt = F.linear(group_sums(x, qw.groupsize), (qw.zeros + 8 * qw.scales).to(x.dtype))
        y = self.int4_act_linear(x) if many else None
        if y is None:
            if self.act_quant is not None:  # tp.py's row-parallel shards: the range of the whole row
                x = self.act_quant(x)
            else:
                x = _FAKE_QUANT_OP(x) if compiled and not self._words(x) else fake_quant_per_token_int8(x)
            y = self.product(x, offset=zt is None, sums=sums)
        y = y if zt is None else y + zt
        return y + self.bias if self.bias is not None else y

    def product(self, x: Tensor, offset: bool = True, sums: Optional[Tensor] = None) -> Tensor:
        if self.int8_kernel == "all" and self.act is None and not (BF16_GEMM or torch.compiler.is_exporting()):
            return self.fused_linear(x).to(x.dtype)  # (the words alone, at every length)
        if self._native(x) and (y := self.native_linear(x, offset, self.act is None)) is not None:
            return y
        if self._words(x):  # (several rows: x rounded to bfloat16, as the GEMMs of longer prompts and eager round it)
            return self.fused_linear(x.to(torch.bfloat16) if self._word_rows(x) else x, offset, sums).to(x.dtype)
        if torch.compiler.is_compiling():  # compiled batched decode, export: one dequantize, one GEMM
            return F.linear(x, self.qweight.dequantize(x.dtype, offset=offset))
        if self.qdata_int8 is not None and (self.qweight.zeros is None or not offset):
            return self._chunked_int8(x)
        return self.qweight.chunked_linear(x, offset=offset)

    def _chunked_int8(self, x: Tensor, rows: int = 512) -> Tensor:
        """Eager (q - 8) s in one pass over the unpacked copy, not the nibble unpacking's several (as chunked_linear)."""
        qw = self.qweight
        N, K, G = qw.out_features, qw.in_features, qw.groupsize
        part = lambda i, j: F.linear(x, (self.qdata_int8[i:j].view(j - i, K // G, G)
                                         * qw.scales[i:j, :, None].to(x.dtype)).view(j - i, K))
        return part(0, N) if N <= rows else torch.cat([part(i, min(i + rows, N)) for i in range(0, N, rows)], -1)

    # ------------------------------------------------------------------------------------------------- kernels
    def native_linear(self, x: Tensor, offset: bool = True, float_rows: bool = True) -> Optional[Tensor]:
        """x @ w.T with packed CPU kernels (int4: int4_cpu_mm) or oneDNN's bfloat16 GEMM when they apply (CPU; bfloat16
        activations and scales, or int8 / int4 weight-only with more than one row: bfloat16 inside), else None.
        offset False: without the zero offsets of an asymmetric weight (w = (q - 8) * s).
        float_rows False: x must not be rounded to bfloat16 (8da4w's fake-quantized activations)."""
        qw = self.qweight
        bf16 = x.dtype == torch.bfloat16 and qw.scales.dtype == torch.bfloat16
        rows = float_rows and (x.numel() > x.shape[-1] and (qw.bits == 8 or qw.weight_only)
                               or self._int4_blocked_only())
        if not x.is_cpu or not (bf16 or rows):
            return None
        if qw.zeros is not None and offset == qw.xnnpack:  # the packed copy holds the other variant
            return None
        x2 = x.reshape(-1, qw.in_features)
        prompt_copy = self.prompt_packed and torch.compiler.is_compiling() and not torch.compiler.is_exporting() \
            and not TI.freezing()
        if rows and prompt_copy:  # (int8)
            y = torch.ops.llama_flat.linear_packed(x2.to(torch.bfloat16), qw.qdata)
            y = (y.float() * qw.scales.float()).to(x.dtype)
        elif rows and (w := self._bf16_weight_t(x2)) is not None:
            y = self._mm_bf16(x2.to(torch.bfloat16), w)
            y = (y.float() * qw.scales.float() if qw.bits == 8 else y).to(x.dtype)
        elif qw.bits == 8 and bf16:
            y = torch.ops.aten._weight_int8pack_mm(x2, qw.qdata, qw.scales)
        elif qw.bits == 8:  # unit scales inside (a bfloat16 scale would round each channel), the float ones after
            y = (torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16), qw.qdata, self.int8_unit).to(x.dtype)
                 * qw.scales.to(x.dtype))
        elif self.int4_cpu is not None:
            y = self.int4_cpu_mm(x2.to(torch.bfloat16)).to(x.dtype)
        else:
            return None
        return y.reshape(*x.shape[:-1], qw.out_features)

    def int4_cpu_mm(self, x2: Tensor) -> Tensor:
        """x2 [M, K] bfloat16 @ w.T, float32 or bfloat16: fast_cpu_kernels' tiles and kernel at every length, else
        ATen's blocked layout and kernel."""
        packed, sz = self.int4_cpu
        if sz is None:
            return torch.ops.llama_flat.int4_tiles_mm(x2, packed, self.qweight.groupsize)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed, self.qweight.groupsize, sz)

    def _bf16_weight_t(self, x2: Tensor):
        """w.T as bfloat16 [K, N] for oneDNN's GEMM of x2 [M, K] (_mm_bf16), or None where the packed kernels run:
        compiled, the function words_bf16_t (pieces; exported: the whole); eager int8, one cast of qdata (2.4x the
        packed kernel at 128 rows of 1536x576, 1.3x at 32); not eager int4 (its conversion outlasts the product)."""
        if not BF16_GEMM:
            return None
        if torch.compiler.is_exporting():  # a package's prompt models
            if self.export_rows == "native" and self.int8_bf16_t is not None:  # int8's "prompt": any length
                return self.int8_bf16_t
            many = TI.statically_known_true(x2.shape[0] >= BF16_ROWS)  # "long_prompt": BF16_ROWS tokens or more
            if self.export_rows != "bf16" or not many:
                return None
            return self.words_bf16_t() if not self._int4_blocked_only() else self._qdata_bf16_t()
        int8, many = self.qweight.bits == 8, x2.shape[0] >= BF16_ROWS
        if torch.compiler.is_compiling():  # int8 without a packed copy at any length (it reads words: release_pages)
            layout = self.int8_words if int8 else self.int4_words
            return self.words_bf16_t if layout is not None and (many or int8 and not self.prompt_packed) else None
        return self.qweight.qdata.t().to(torch.bfloat16) if int8 and many else None

    def _mm_bf16(self, x2: Tensor, w) -> Tensor:  # w [K, N], or words_bf16_t itself: by pieces (WORD_PIECE_BYTES)
        if not callable(w):
            return torch.mm(x2, w)
        N, K = self.qweight.out_features, self.qweight.in_features
        step = max(16, WORD_PIECE_BYTES // (2 * K) // 16 * 16)
        return torch.cat([torch.mm(x2, w(lo, min(lo + step, N))) for lo in range(0, N, step)], -1)

    def words_bf16_t(self, lo: int = 0, hi: Optional[int] = None) -> Optional[Tensor]:
        """w.T as bfloat16 [K, hi - lo] for output channels lo..hi - 1 (multiples of 16; default all) from the word
        layouts (None without them): int8 its integer values (exact; the scales come after the product), int4
        q s + z in float32 rounded once. One pointwise kernel when compiled; the shifts take a tensor of amounts, so
        that freezing does not fold their outputs into constants."""
        qw = self.qweight
        hi = qw.out_features if hi is None else hi
        N, K, t0, t1 = hi - lo, qw.in_features, lo // 16, hi // 16
        if qw.bits == 8 and self.int8_words is not None:  # byte j of word [t, 0, i, c]: q[16t + c, j K/4 + i]
            w = self.int8_words.squeeze(1)[t0:t1]                                    # [N/16, K/4, 16]
            q = (((w >> _SHIFTS[8].to(w.device)) + _BYTE_OFFSETS.to(w.device)) & 255) - 128   # [4, N/16, K/4, 16]
            # via float32: Inductor's int32 -> bfloat16 conversion is not vectorized (2.5x as long)
            return q.float().to(torch.bfloat16).permute(0, 2, 1, 3).reshape(K, N)
        if qw.bits == 4 and self.int4_words is not None:
            w, st, zt = self.int4_words
            return _int4_words_bf16_t(w[t0:t1], st[t0:t1], zt[t0:t1] if qw.weight_only else None)
        return None

    def _qdata_bf16_t(self) -> Tensor:
        """Weight-only int4 w.T as bfloat16 [K, N] from qdata, scales and zeros (q s + z in float32, rounded once): a
        package's long_prompt model, where this int4 has no word layouts (shifts by a tensor: freezing folds none)."""
        qw = self.qweight
        N, K, G = qw.out_features, qw.in_features, qw.groupsize
        q = (qw.qdata.view(N, K // G, 1, G // 2) >> _SHIFTS[2].to(qw.qdata.device)) & 15  # [N, K/G, 2, G/2]
        s = qw.scales.float()[:, :, None, None]
        v = q.float() * s + (qw.zeros.float()[:, :, None, None] if qw.zeros is not None else -8 * s)
        return v.to(torch.bfloat16).reshape(N, K).t()

    def int8_act_linear(self, x: Tensor) -> Tensor:
        """x @ w.T for int8 weights with per-token int8 activations as one integer GEMM, torch._int_mm (oneDNN's VNNI
        kernel on x86; 8da8w's prompts): (q - zp) @ qdata.T = q @ qdata.T - zp * sum_k qdata, exact in int32, then
        times both scales in float32: the fake-quantized product up to float rounding."""
        qw = self.qweight
        x2 = x.reshape(-1, qw.in_features)
        q, zp, scale = quant_per_token_int8(x2.float())
        acc = torch._int_mm(q.to(torch.int8), qw.qdata.t()) - zp.to(torch.int32) * self.int8_sums
        y = acc.float() * scale * qw.scales.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], qw.out_features)

    def int4_act_linear(self, x: Tensor) -> Optional[Tensor]:
        """8da4w's x @ ((q - 8) s).T for more than one row under torch.compile and in a package's prompt models, or
        None where it does not apply: x's per-token int8 values q - zp (exact in bfloat16) through fast_cpu_kernels'
        kernel where it runs (any length; exact products), else the packed int4 kernels (int4_cpu_mm: fewer than
        BF16_ROWS rows; scales on the bfloat16 grid) or oneDNN's bfloat16 GEMM on words_bf16_t's (q - 8) s rounded,
        then times x's scales (not a float32 product dequantizing every weight per call)."""
        qw = self.qweight
        if qw.bits != 4 or qw.weight_only:
            return None
        x2 = x.reshape(-1, qw.in_features)
        w = None if self.int4_cpu is not None and self.int4_cpu[1] is None else self._bf16_weight_t(x2)
        if w is None and self.int4_cpu is None:
            return None
        q, zp, scale = quant_per_token_int8(x2.float())
        xi = (q - zp).to(torch.bfloat16)
        if w is not None:
            y = self._mm_bf16(xi, w)
        else:
            y = self.int4_cpu_mm(xi)
        return (y.float() * scale).to(x.dtype).reshape(*x.shape[:-1], qw.out_features)

    def fused_linear(self, x: Tensor, offset: bool = True, sums: Optional[Tensor] = None) -> Tensor:
        """x [..., K] @ w.T as one reduction over the integer weights (for torch.compile: one generated kernel that
        reads each weight byte once; mixed-dtype products keep the weights out of Inductor's constant folding).
        sums [..., K/G] (asymmetric 8da4w, int4 words only): x is the fake-quantized copy of float activations whose
        group sums these are; returns x @ ((q - 8) s).T + sums @ (z + 8 s).T, the eager module's two products."""
        qw = self.qweight
        N, K, G = qw.out_features, qw.in_features, qw.groupsize
        if qw.bits == 8:
            w = self.int8_words
            if w is None:
                return (x.unsqueeze(-2) * qw.qdata).sum(-1) * qw.scales
            if self.int8_kernel and (x.numel() == K or self.int8_kernel == "all") \
                    and not torch.compiler.is_exporting():  # the kernel: decode's one row (prefetching what
                y = torch.ops.llama_flat.int8_words_mm(x.reshape(-1, K).float(), w, qw.scales.float())  # follows);
                return y.reshape(*x.shape[:-1], N)  # AVX2's at every length (AVX-512's, several rows: the
            # reduction below keeps each word for all rows)
            # Full-width int32 loads, vectorized along a tile's 16 output channels (an outer reduction over its
            # contiguous K/4 word rows: no horizontal sums). x is split into 4 quarters, one per byte: per word 3 ands,
            # 1 shift, 4 conversions, 4 multiply-adds; the +128 of bytes 0-2 comes off once per row (128 * the sum of
            # x's first three quarters). float32 throughout: in bfloat16 that offset's rounding would swamp the result.
            K4 = K // 4
            x32 = x.reshape(-1, K).float()
            off = 128 * x32[:, :3 * K4].sum(-1, keepdim=True)
            xq = x32.view(-1, 4, K4, 1) * _BYTE_SCALES.to(x32.device)  # masks, no shifts (see _BYTE_SCALES)
            if _FORCE_STRIDE is not None:  # x in a buffer of its own (else the products were written to memory)
                xq = _FORCE_STRIDE(xq, (K, K4, 1, 1))
            t = (xq[:, 0] * (w & 255) + xq[:, 1] * (w & 0xFF00)        # [N/16, M, K/4, 16]: tiles outermost, the
                 + xq[:, 2] * (w & 0xFF0000) + xq[:, 3] * (w >> 24))   # loop Inductor runs in parallel
            y = (t.sum(-2).transpose(0, 1).reshape(-1, N) - off) * qw.scales
            return y.reshape(*x.shape[:-1], N)
        if self.int4_words is not None and (x.numel() == K or self.export_rows is not None):
            # Vectorized along a tile's 16 output channels (an outer reduction over its K/8 word rows, tiles in
            # parallel), full-width loads of words and tiled scales / zeros, x broadcast from scalars. Two reductions of
            # 4 nibbles each (one fused loop): 8 terms in one expression exceed Inductor's limits on inlined reads.
            w, st, zt = self.int4_words
            x32 = x.reshape(-1, K).float()  # float32 throughout (scales too): bfloat16 loads of 8 lanes are partial
            if _FORCE_STRIDE is not None:  # x in buffers of its own: else its producer (an RMSNorm) is recomputed in
                x32 = _FORCE_STRIDE(x32, (K, 1))  # the kernels that read it (the group sums below, the scaled copy)
            xn = x32.view(-1, K // G, 8, G // 8, 1) * _NIBBLE_SCALES.to(x32.device)  # masks, no shifts
            if _FORCE_STRIDE is not None:
                xn = _FORCE_STRIDE(xn, (K, G, G // 8, 1, 1))
            xj = xn.movedim(2, 0)                                             # [8, M, K/G, G/8, 1]: x of nibble j
            nib = [w & (15 << (4 * j)) for j in range(7)] + [(w >> 28) & 15]  # q_j * 16^j (the top one: q_7)
            # [N/16, M, 16]: tiles outermost, the loop Inductor runs in parallel (rows outermost ran on one thread)
            y = sum((sum(xj[j] * nib[j] for j in range(h, h + 4)) * st).sum((2, 3)) for h in (0, 4))
            xs = group_sums(x32, G).view(-1, K // G, 1, 1)                   # [M, K/G, 1, 1]
            if sums is not None:  # 8da4w: + 8 s (sums - xs) + z sums, in the same kernel
                xf = sums.reshape(-1, K // G, 1, 1).float()
                term = 8 * (xf - xs) * st + xf * zt
            else:
                if zt is None or not offset:  # w = (q - 8) s; -8 on x's side (on the scales it would be folded anew)
                    xs, zt = -8 * xs, st
                term = xs * zt
            # (no slice of zt: Inductor's freezing folds a slice of a constant used elsewhere, then fails the package)
            return (y + term.sum((2, 3))).transpose(0, 1).reshape(*x.shape[:-1], N)
        xg = x.reshape(*x.shape[:-1], 1, K // G, 2, G // 2)        # [..., 1, K/G, 2, G/2]
        p = qw.qdata.view(N, K // G, G // 2)                      # [N, K/G, G/2]
        x_hi, x_lo = xg[..., 0, :], xg[..., 1, :]
        t = x_hi * (p >> 4) + x_lo * (p & 15)                      # [..., N, K/G, G/2]
        if qw.zeros is None or not offset:
            t = (t - 8 * (x_hi + x_lo)) * qw.scales.unsqueeze(-1)
        else:
            t = t * qw.scales.unsqueeze(-1) + (x_hi + x_lo) * qw.zeros.unsqueeze(-1)
        return t.sum((-2, -1))

