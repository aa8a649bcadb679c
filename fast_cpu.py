# fast_cpu.py: the CPU accelerator. speed_up(model) assigns faster modules at model.py's swap points (oneDNN products,
# bfloat16 weights held packed or, without oneDNN bfloat16, fast_cpu_kernels' bfloat16 kernel, attention over the
# filled cache slots only, float32 attention for half-precision models) and, for torch.compile, compiled per-layer
# prompt callers with oneDNN-packed prompt weights; it owns every Inductor setting.
# engine.py and aoti_export.py call it. Delete this file and everything still runs: the same tokens, slower.
import contextlib
import ctypes
import itertools
import sys
import threading
import weakref
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

import fast_cpu_quant
from fast_cpu_quant import FastQuantizedLinear
import torch_internals as TI
from common import available_memory, release_pages
from model import SDPA, Attention, Transformer
from qops import QuantizedLinear

# Inductor on CPU (torch.compile and AOT Inductor alike): weights become constants (folded and pre-packed), and
# matrix products may use Inductor's own C++ GEMM template (blocked, OpenMP-parallel over the output, epilogues
# fused) instead of MKL's packed sgemm, which runs a one-row product (decode) on one thread whatever the thread count.
# Autotuning times both where both apply; ATen stays a choice because some products (batched ones) have no template.
# Floating-point contraction lets the C++ compiler fuse a multiply and an add into one FMA: the quantized decode
# reductions (a product and a sum per weight) measured 1.34x (int4 g32) and 1.14x (int8) faster at 1 thread.
INDUCTOR_CPU = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
                "cpp.enable_floating_point_contract_flag": "fast"}
ONEDNN = torch.backends.mkldnn.is_available()


def fixed_mmap_threshold(nbytes: int = 4 << 20) -> None:
    """glibc: serve blocks of nbytes and more by mmap, returned to the system when freed. By default glibc raises
    that threshold to the largest block freed so far, so the layouts' temporaries (fast_cpu_quant) stay in the heap,
    fragmented: a Llama-3.2-1B-shaped int8 model held 4.4 GB after speed_up where 2.4 GB are its weights and layouts."""
    _mallopt(-3, nbytes)  # M_MMAP_THRESHOLD (also turns the raising off)


@contextlib.contextmanager
def heap_blocks(keep: int = 256 << 20):
    """glibc, while a compiled prompt runs: every block from the heap, not mmap; and from the first prompt on, up to
    keep freed bytes stay at the heap's top (M_TRIM_THRESHOLD, for the process: between layers too) for the next
    product. A prompt allocates the same temporaries layer after layer, and fresh pages fault in at ~3 GB/s: a
    Llama-3.2-1B-shaped int8 prompt converts each weight to a bfloat16 temporary of up to 32 MB (above glibc's largest
    mmap threshold), 2 GB in all, which took 380 of a 128-token prompt's 1,060 ms. mmap is back after the prompt: the
    decode graph's compilation would leave its large temporaries in the heap (+840 MB at that size)."""
    global _HEAP_DEPTH
    with _HEAP_LOCK:  # nested or overlapping calls (threads): the outermost sets and restores
        if _HEAP_DEPTH == 0:
            _mallopt(-1, keep)  # M_TRIM_THRESHOLD
            _mallopt(-4, 0)     # M_MMAP_MAX
        _HEAP_DEPTH += 1
    try:
        yield
    finally:
        with _HEAP_LOCK:
            _HEAP_DEPTH -= 1
            if _HEAP_DEPTH == 0:
                _mallopt(-4, 65536)  # glibc's default


def _mallopt(param: int, value: int) -> None:
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL("libc.so.6").mallopt
        except (OSError, AttributeError):  # not glibc
            _LIBC = lambda param, value: 0
    _LIBC(param, value)


_LIBC, _HEAP_DEPTH, _HEAP_LOCK = None, 0, threading.Lock()


def configure_inductor() -> None:
    """Settings for torch.compile on CPU: INDUCTOR_CPU, the C++ launcher (less Python per decode step), a cache entry
    per compiled model (a process that builds a draft and a target, or the tests, would hit Dynamo's default of 8),
    and scalar outputs captured (FilledSlots' number of filled slots is a data-dependent size)."""
    fast_cpu_quant.compile_setup()
    TI.set_inductor({**INDUCTOR_CPU, "fx_graph_cache": True, "cpp_wrapper": True})
    TI.dynamo_config.recompile_limit = max(TI.dynamo_config.recompile_limit, 64)
    TI.dynamo_config.capture_scalar_outputs = True


def input_guards_only(entries) -> list[bool]:
    """torch.compile's guard filter for the decode step: keep the guards on the call's inputs and on global state,
    and the identity of the model's own tensors (its rope table: a new one for each model and each setup_caches, so
    a draft model or a re-sized cache never runs another's graph); drop the ~7,000 on the attributes of its
    submodules, which Dynamo would otherwise check on every call (0.8 ms of a 10 ms int4 step at 1 thread). Safe
    because a TorchBackend never changes its model after compiling (speculative.step_caches swaps the caches only
    around calls that pass a mask, which run through the prompt callers)."""
    return [not e.name.startswith("self") or (e.guard_type == "ID_MATCH" and "_modules" not in e.name)
            for e in entries]


def compile_decode(model: nn.Module):
    """The decode step as one graph of the whole model, its weights frozen into constants."""
    configure_inductor()
    return torch.compile(model, fullgraph=True, options={"guard_filter_fn": input_guards_only})


def replace_module(parent: nn.Module, name: str, new: nn.Module) -> None:
    """parent.name = new, keeping the hooks others put on the module it replaces (tp.py's all-reduce)."""
    old = getattr(parent, name)
    for hooks in ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
                  "_forward_pre_hooks_with_kwargs"):
        getattr(new, hooks).update(getattr(old, hooks))
    setattr(parent, name, new)


def swap_in(model: nn.Module, words: bool = True) -> None:
    """Replace every qops.QuantizedLinear in model with a FastQuantizedLinear over the same weight (idempotent).
    words: with the word layouts that compiled code reads (torch.compile; an eager model goes without them)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is QuantizedLinear:
                replace_module(parent, name, child := FastQuantizedLinear(child, words=words))
            elif words and isinstance(child, FastQuantizedLinear):
                child.add_words()
            if isinstance(child, FastQuantizedLinear) and child.reads_words_only():
                qw = child.qweight  # one weight's qdata and words at a time at most; int4's layouts hold their own
                for t in (qw.qdata, *((qw.scales, qw.zeros) if qw.bits == 4 else ())):  # scales and zeros too
                    release_pages(t) if t is not None else None


# ----------------------------------------------------------------------------------------------------------- products
# ATen's F.linear calls MKL's sgemm for float32 on CPU, 1.5-2.2x slower than oneDNN's on the project's AMD machine
# (2 threads: 1x576 @ 576x49152 9.7 against 4.4 ms, 15 rows of 576x1536 338 against 200 us). Inductor lowers oneDNN's
# op for frozen weights only, so a compiled prompt (weights as graph inputs) calls it through an opaque op, which
# multiplies by the weight's oneDNN-packed copy where pack_prompt_weights made one (15-row products ~25% faster).
def _linear_onednn(x: Tensor, w: Tensor, b: Optional[Tensor]) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def _linear_onednn_op(x: Tensor, w: Tensor, b: Optional[Tensor]) -> Tensor:
    if x.numel() > x.shape[-1] and (packed := fast_cpu_quant.packed_copy(w)) is not None:
        w = packed
    return _linear_onednn(x, w, b)


if not hasattr(torch.ops.llama_flat, "linear_onednn"):
    _LIB = torch.library.Library("llama_flat", "FRAGMENT")
    _LIB.define("linear_onednn(Tensor x, Tensor w, Tensor? b) -> Tensor")
    _LIB.impl("linear_onednn", _linear_onednn_op, "CPU")
    torch.library.register_fake("llama_flat::linear_onednn", lib=_LIB)(
        lambda x, w, b: x.new_empty((*x.shape[:-1], w.shape[0])))
    _LIB.define("linear_held_packed(Tensor x, Tensor key, Tensor? b, int n) -> Tensor")
    _LIB.impl("linear_held_packed", lambda x, key, b, n: _linear_onednn(x, _PACKED[int(key)], b), "CPU")
    torch.library.register_fake("llama_flat::linear_held_packed", lib=_LIB)(
        lambda x, key, b, n: x.new_empty((*x.shape[:-1], n)))


class OneDNNLinear(nn.Linear):
    """nn.Linear, float32 on CPU through oneDNN: eager, and compiled graphs whose weights are inputs (prompts, through
    the opaque op). Compiled decode (frozen weights: Inductor's own kernels) and exports keep F.linear."""

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32 and x.is_cpu and not torch.compiler.is_exporting():
            if not torch.compiler.is_compiling():
                return _linear_onednn(x, self.weight, self.bias)
            if not TI.freezing():
                return torch.ops.llama_flat.linear_onednn(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class Bf16Linear(nn.Linear):
    """A bfloat16 nn.Linear where oneDNN has no bfloat16 products (AVX2 without AVX-512): fast_cpu_kernels' kernel on
    the weight as stored (llama_flat::bf16_mm: float32 products and sums, rounded to bfloat16 as F.linear's are),
    eager and compiled. ATen's bfloat16 product there runs ~11 GFLOP/s at every length (a 1B-shaped 128-token prompt
    at 0.30x llama.cpp F16), and Inductor's frozen decode graph peaked at 8.7 GB for 2.1 GB of weights. Exports keep
    F.linear (a package's own kernels)."""

    def forward(self, x: Tensor) -> Tensor:
        if torch.compiler.is_exporting():
            return F.linear(x, self.weight, self.bias)
        y = torch.ops.llama_flat.bf16_mm(x.reshape(-1, self.in_features), self.weight)
        y = y if self.bias is None else y + self.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


def bf16_kernel_takes(lin: nn.Linear) -> bool:
    """Whether Bf16Linear runs lin here: bfloat16, no oneDNN bfloat16, the kernels loaded, shapes they read."""
    kernels = fast_cpu_quant.fast_cpu_kernels
    return (lin.weight.dtype == torch.bfloat16 and not TI.onednn_bf16() and kernels is not None
            and kernels.available() and lin.out_features % 4 == 0 and lin.in_features % 16 == 0)


# A bfloat16 weight in oneDNN's packed layout (an opaque tensor) multiplies one row at ~1.4x the rate of F.linear on
# the weight as stored: 2 threads, Llama-3.2-1B shape, compiled decode 34 against 35-52 ms per step (Inductor's own
# packed copy; interleaved runs, bimodal), 128-token prompts 324 against 350-400 ms. PackedLinear holds it instead of
# the stored weight and every product reads it, eager and compiled, decode and prompts: before, Inductor's freezing
# packed a copy for the decode graph beside the weights the prompts read, twice the weights in memory. A compiled
# graph cannot take an opaque tensor as an input: it passes a key (the weight's number in _PACKED) to an opaque op.
_PACKED: "weakref.WeakValueDictionary[int, Tensor]" = weakref.WeakValueDictionary()
_KEYS = itertools.count()


class PackedLinear(nn.Module):
    """A bfloat16 nn.Linear (and a compiled model's float32 ones from FLOAT32_PACKED_FROM bytes) whose weight is held
    in oneDNN's packed layout only (the stored layout is freed: a model given to speed_up is for running, not saving).
    An output projection tied to the embedding gets a packed copy (the embedding keeps the stored weight): oneDNN on
    the stored weight took 7 of the 1B shape's 40 ms decode step, for the copy's 201 MB; Inductor's freezing made the
    same copy before."""

    def __init__(self, lin: nn.Linear):
        super().__init__()
        self.in_features, self.out_features, self.bias = lin.in_features, lin.out_features, lin.bias
        self.register_buffer("weight_packed", torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach(), 1),
                             persistent=False)
        key = next(_KEYS)
        _PACKED[key] = self.weight_packed
        self.register_buffer("key", torch.tensor([key]), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        if not torch.compiler.is_compiling():
            return _linear_onednn(x, self.weight_packed, self.bias)
        return torch.ops.llama_flat.linear_held_packed(x, self.key, self.bias, self.out_features)


# The packed prompt copies are made for models whose copies take at most this (and half of the free memory): SmolLM2's
# (float32 406 MB, int8 213 MB), not a 1B model's (float32 3.9 GB, int8 1.9 GB), whose prompts then run on the weights
# as stored, within the memory a user moving from llama.cpp expects (issue: weights + KV cache + ~600 MB).
PROMPT_COPIES_MAX = 512 << 20
# From this many bytes of float32 linear weights a compiled model holds them as bfloat16's are, packed once
# (PackedLinear), not beside the copy Inductor's freezing makes for the decode graph, whose C++ template decodes
# faster: SmolLM2 (538 MB) 16.6 against 21 ms per step; Llama-3.2-1B's shape (4.3 GB) 107-116 against 126-137 ms, for
# a peak of 13,250 against 4,840 MB (2 threads, in-process).
FLOAT32_PACKED_FROM = 1 << 30


def pack_prompt_weights(model: Transformer, budget: Optional[int] = None) -> tuple[int, bool]:
    """Give the weights of the blocks (not the output projection: a prompt needs one row of it) packed copies for the
    products of compiled prompts: float32 weights in oneDNN's layout, weight-only int8 ones as bfloat16
    (FastQuantizedLinear.pack_prompt). A copy hangs on its weight (fast_cpu_quant.keep_packed_copy): freed with it,
    ignored once the weight changes in place. Returns the copies' bytes and whether they were made: none are where they
    would take more than budget bytes (a prompt's products then run on the weights as they are)."""
    todo = []
    for mod in model.layers.modules():
        if hasattr(mod, "pack_prompt"):  # a FastQuantizedLinear
            todo.append((mod, mod.prompt_copy_bytes()))
        elif isinstance(mod, OneDNNLinear) and mod.weight.dtype == torch.float32:
            todo.append((mod, mod.weight.numel() * 4))
    total = sum(size for _, size in todo)
    if budget is not None and total > budget:
        return total, False
    for mod, _ in todo:
        if hasattr(mod, "pack_prompt"):
            mod.pack_prompt()
        elif fast_cpu_quant.packed_copy(w := mod.weight) is None:  # (row hints of 15, 64, 128: as fast; 1 row: no gain)
            fast_cpu_quant.keep_packed_copy(w, torch.ops.mkldnn._reorder_linear_weight(w.detach(), 64))
    return total, True


# ----------------------------------------------------------------------------------------------------------- attention
class FilledSlots(nn.Module):
    """Transformer.cache_len: the layers attend over slots 0..newest position only, not the whole static cache, most
    of it still empty while decoding (reading it whole cost SmolLM2 half its compiled decode speed at 2048 slots:
    bench.py's `compile int4 g32 ctx2048` row). At least 2 slots: a compiled graph cannot tell a size of 1
    (broadcast) from the others. A data-dependent size: torch.compile must capture scalar outputs."""

    def forward(self, positions: Tensor, S: int):
        if S <= 1:
            return S
        last = positions.max().clamp(min=1).item()
        torch._check(last >= 1)
        torch._check(last < S)
        return last + 1


class FilledSlotsAttention(nn.Module):
    """Attention.attend over the slots the mask covers (FilledSlots), the model's own attend module inside. On CPU,
    bfloat16 / float16 SDPA runs in float32: ATen's half-precision CPU kernel does its products with MKL's half
    GEMV, 3.2x (bfloat16) and 5.2x (float16) slower per call than the float32 kernel with the casts included (one
    query of SmolLM2's 9 heads over 256 slots, 2 threads). Not under torch.export (a package keeps ATen's)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        S = mask.shape[-1]
        k, v = k[:, :, :S], v[:, :, :S]
        sdpa = self.inner
        if isinstance(sdpa, SDPA) and q.dtype in (torch.bfloat16, torch.float16) and not torch.compiler.is_exporting():
            m = mask.float() if mask.is_floating_point() else mask
            y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=m, scale=sdpa.scale,
                                               enable_gqa=sdpa.gqa)
            return y.to(q.dtype)
        return sdpa(q, k, v, mask)


# ----------------------------------------------------------------------------------------------------------- prompts
def _call(module: nn.Module, *args, **kwargs):
    return module(*args, **kwargs)


class CompiledPrompt(nn.Module):
    """layers[i] / output of a compiled model: outside torch.compile (prompts and lookahead's masked steps; the decode
    step is one compiled graph of the whole model), the module runs through `run`, one torch.compile'd graph with
    dynamic lengths shared by every layer (its weights are graph inputs, not constants), compiled in seconds where a
    dynamic-length graph of the whole model took about a minute per length range. In-process, 2 threads, SmolLM2
    int4 g32, 15 / 128 tokens: 30.6 / 113 ms; the whole model as one graph 26.7 / 111 ms after a first call of 111 s."""

    def __init__(self, inner: nn.Module, run):
        super().__init__()
        self.inner, self.run = inner, run
        self.sliding, self.local_rope = getattr(inner, "sliding", False), getattr(inner, "local_rope", False)

    def __getattr__(self, name: str):  # the wrapped module's attributes read through (layers[0].attention)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["inner"], name)

    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return self.inner(*args, **kwargs)
        with TI.no_freezing(), heap_blocks():
            return self.run(self.inner, *args, **kwargs)


# ----------------------------------------------------------------------------------------------------------- entry
def speed_up(model: Transformer, compile: bool = False, export: bool = False) -> Transformer:
    """Assign the faster modules (in place; returns the model). On CPU only (elsewhere the model is left as is):
      * cache_len -> FilledSlots and each attention.attend -> FilledSlotsAttention;
      * export (aoti_export.py): nothing more; Inductor's own kernels take the products;
      * else qops.QuantizedLinear -> FastQuantizedLinear, bfloat16 nn.Linear -> PackedLinear (Bf16Linear where
        oneDNN has no bfloat16 products), float32
        ones -> OneDNNLinear (compiled, from FLOAT32_PACKED_FROM bytes: PackedLinear), and with
        compile the layers and the output projection run prompts through CompiledPrompt, the blocks' weights get
        packed prompt copies (pack_prompt_weights) unless they would take more than half of the free memory (one
        line on stderr says so).
    Call it once the model is loaded and its caches are set up; a model given to it is for running, not saving (the
    compiled callers wrap layers[i] and output)."""
    if model.norm.weight.device.type != "cpu":
        return model
    fixed_mmap_threshold()
    if compile:  # (first: the layouts made below are marked static for it)
        configure_inductor()
    if not isinstance(model.cache_len, FilledSlots):
        model.cache_len = FilledSlots()
    for attn in (m for m in model.modules() if isinstance(m, Attention)):
        if not isinstance(attn.attend, FilledSlotsAttention):
            attn.attend = FilledSlotsAttention(attn.attend)
    if export:
        return model
    swap_in(model, words=compile)
    float32 = sum(m.weight.numel() * 4 for m in model.modules()
                  if type(m) is nn.Linear and m.weight.dtype == torch.float32)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            if bf16_kernel_takes(child):
                cls = Bf16Linear
            elif not ONEDNN:
                continue
            elif (child.weight.dtype == torch.bfloat16 and TI.onednn_bf16()) or (
                    compile and child.weight.dtype == torch.float32 and float32 >= FLOAT32_PACKED_FROM):
                replace_module(parent, name, PackedLinear(child))
                release_pages(child.weight)  # where it maps its checkpoint (loaded without a cast), pages too
                child.weight = None  # (freed now, not when the loop ends; a tied output's stays the embedding's)
                continue
            else:
                cls = OneDNNLinear
            fast = cls(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
            fast.weight, fast.bias = child.weight, child.bias
            replace_module(parent, name, fast)
    if compile and not isinstance(model.output, CompiledPrompt):
        run = torch.compile(_call, dynamic=True, fullgraph=True)
        model.layers = nn.ModuleList(CompiledPrompt(layer, run) for layer in model.layers)
        model.output = CompiledPrompt(model.output, run)
        free = available_memory()
        budget = PROMPT_COPIES_MAX if free is None else min(PROMPT_COPIES_MAX, free // 2)
        size, made = pack_prompt_weights(model, budget)
        if not made:
            print(f"prompts run on the weights as stored: their packed copies ({size / 2**20:.0f} MB) would take "
                  f"more than {budget / 2**20:.0f} MB (PROMPT_COPIES_MAX, or half of the free memory)", file=sys.stderr)
    return model
