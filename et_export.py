# Export model.py's Transformer to an ExecuTorch .pte (XNNPACK delegate by default) and run a .pte from Python.
#
#   python et_export.py --checkpoint_path checkpoints/SmolLM2-135M-Instruct/model.pth --output_path smollm2.pte \
#       [--quantize 8da4w --groupsize 32] [--max_seq_length 1024] [--backend xnnpack|portable|qnn|coreml|mps]
#   python generate.py --pte smollm2.pte --prompt "..."        # PTEBackend below, through ExecuTorch's Python runtime
#
# The .pte contract (generate.py, eval.py and the C++ runner rely on it):
#   * method `forward(tokens: int64[1, T], input_pos: int64[T]) -> float32 logits[1, T, V]`, T dynamic in
#     [1, max_seq_len]; the KV cache is a set of mutable buffers: state persists across calls of one loaded program
#     and starts zeroed (harmless: the attention mask comes from the positions).
#   * constant methods named as ExecuTorch's own LLM runner reads them: get_max_seq_len, get_max_context_len,
#     get_vocab_size, get_bos_id, get_eos_ids, use_kv_cache, enable_dynamic_shape (+ get_n_layers, get_max_batch_size,
#     use_sdpa_with_kv_cache=False).
#   * only standard ATen / quantized_decomposed ops and the XNNPACK delegate: no llama:: custom ops, so a standalone C++
#     runner (portable + optimized + quantized kernels + XNNPACK) loads it.
#   * optional (`--prefill_chunk N`): extra methods `prefill` (tokens [1, N], fixed length) and `decode` (tokens
#     [1, 1]) that share the weights and the KV cache with `forward`; get_prefill_chunk says N.
#
# Export-time swaps (small pieces only; the network itself is model.py's):
#   * each layer's KVCache gets an update() that index_copy_s straight into the whole buffer (batch 1, positions [T]),
#     so the mutation is reinplaced instead of copying the cache (model.py slices [:B] first);
#   * RMSNorm takes its mean over a 4-D view and apply_rope rotates with a constant +-1 matrix (same arithmetic):
#     XNNPACK rejects 3-D means and slices on the dynamic length;
#   * in the exported graph, scaled_dot_product_attention (grouped-query: enable_gqa or repeat_interleave'd k/v)
#     becomes bmm / add-mask / softmax / bmm over head groups, so the cache is never copied per head and every piece
#     lowers to XNNPACK (ATen's own SDPA decomposition adds NaN guards and copies that split the delegate);
#   * reshapes on the dynamic length use -1 instead of a symbolic size (XNNPACK rejects symbolic reshapes).
import argparse
import contextlib
import math
import os
import sys
import time
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

REPO = Path(__file__).resolve().parent
BACKENDS = ("xnnpack", "portable", "qnn", "coreml", "mps")
DEFAULT_MAX_SEQ_LENGTH = 1024


# ------------------------------------------------------------------------------------------------ export-time swaps
def _direct_update(self, input_pos: Tensor, k: Tensor, v: Tensor, batch_index: Optional[Tensor] = None):
    """KVCache.update for export: batch 1, shared positions [T]; writes into the buffers themselves (no [:B] view),
    which ExecuTorch turns into an in-place index_put_ on the mutable buffer."""
    assert batch_index is None and input_pos.dim() == 1, "the .pte takes positions [T] and one sequence"
    self.k_cache.index_copy_(2, input_pos, k.contiguous())  # contiguous: no stride guards on the dynamic length
    self.v_cache.index_copy_(2, input_pos, v.contiguous())
    return self.k_cache, self.v_cache


def _rmsnorm_forward(self, x: Tensor) -> Tensor:
    """RMSNorm.forward with the mean taken over a 4-D view [1, N, 1, D] (dims 2, 3): the same arithmetic, but a mean
    XNNPACK accepts (it only averages the two innermost dims of a 4-D tensor), so norms stay inside the delegate."""
    xf = x.float()
    shape = xf.shape
    ms = xf.pow(2).reshape(1, -1, 1, shape[-1]).mean((2, 3), keepdim=True).reshape(*shape[:-1], 1)
    xf = xf * torch.rsqrt(ms + self.eps)
    return self.weight * xf.type_as(x)


def _rotate_half_weight(d: int) -> Tensor:
    """W with linear(x, W) == cat(-x[..., d/2:], x[..., :d/2]) (rotate_half); entries 0 / +-1: the product is exact."""
    h = d // 2
    r = torch.zeros(d, d)  # x @ r == rotate_half(x)
    r[torch.arange(h) + h, torch.arange(h)] = -1.0
    r[torch.arange(h), torch.arange(h) + h] = 1.0
    return r.t().contiguous()  # linear() multiplies by W^T


def _et_embedding_operands(qw):
    """quantize.py's QuantizedWeight of an embedding -> (weight, scales, zero_points, bits) in the layout of ExecuTorch's
    quantized_decomposed::embedding_byte / embedding_4bit kernels (w = (q - zp) * s; 4-bit values stored as q + 8,
    two per byte, even element in the high nibble)."""
    if qw.bits == 8:
        return qw.qdata.to(torch.int8), qw.scales, None, 8
    q = qw.int_values().to(torch.int32)                          # [N, K] in [0, 15]
    packed = ((q[:, 0::2] << 4) | q[:, 1::2]).to(torch.uint8)    # [N, K/2]
    if qw.zeros is None:                                          # symmetric: w = (q - 8) * s
        return packed, qw.scales, None, 4
    # asymmetric: w = q * s + z = (q - 8 - zp) * s with zp = -8 - z / s (float zero points, as the kernel takes them)
    s = qw.scales
    zp = torch.where(s != 0, -8.0 - qw.zeros / torch.where(s != 0, s, torch.ones_like(s)), torch.zeros_like(s))
    return packed, s, zp.to(s.dtype), 4


def _quantized_embedding_forward(self, idx: Tensor) -> Tensor:
    """QuantizedEmbedding.forward through ExecuTorch's quantized embedding kernels (their unpacking with shifts has no
    ExecuTorch kernel, and gathering first keeps the table packed)."""
    import executorch.exir.passes._quant_patterns_and_replacements  # noqa: F401 - defines quantized_decomposed ops
    ops = torch.ops.quantized_decomposed
    zp = getattr(self, "_et_zeros", None)
    if self._et_bits == 8:
        return ops.embedding_byte.default(self._et_weight, self._et_scales, zp, -128, 127, idx)
    return ops.embedding_4bit.default(self._et_weight, self._et_scales, zp, -8, 7, idx)


def _linear_kind(m) -> Optional[str]:
    """quantize.py QuantizedLinear -> "8da4w" | "int8" | "int4" (weight-only asymmetric: no ExecuTorch kernel)."""
    qw = getattr(m, "qweight", None)
    if type(m).__name__ != "QuantizedLinear" or qw is None:
        return None
    if qw.bits == 8:
        return "int8"
    return "8da4w" if (getattr(m, "act", None) == "int8" and (qw.symmetric or qw.xnnpack)) else "int4"


_ROPE_OWNER = []  # the module holding the rotation weight as a buffer while export_swaps is active


def _apply_rope_linear(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """model.apply_rope with rotate_half as a linear with a constant +-1 permutation weight: slices on the dynamic
    length do not lower to XNNPACK, a linear with a constant weight does. The weight is a buffer of the model (read at
    trace time, so export sees it as model state rather than a lifted constant)."""
    w = _ROPE_OWNER[-1]._et_rotate_half
    return x * cos + torch.nn.functional.linear(x, w.to(x.dtype)) * sin


@contextlib.contextmanager
def export_swaps(model, int8_dynamic: bool = True):
    """Swap small helpers for export-friendly equivalents while exporting; everything is restored afterwards.
      * each KVCache.update index_copy_s straight into its whole buffer (batch 1, positions [T]), so the mutation is
        reinplaced on the mutable buffer instead of copying the cache through a [:B] view;
      * RMSNorm.forward takes its mean over a 4-D view and model.apply_rope rotates with a constant matmul, so both
        stay inside the XNNPACK delegate (same arithmetic);
      * quantize.py's QuantizedEmbedding gathers through quantized_decomposed::embedding_byte / embedding_4bit (the
        kernels of ExecuTorch's quantized library) from a repacked copy of its table;
      * with int8_dynamic, int8 weight-only QuantizedLinears quantize their activations per token like 8da4w ones, so
        that XNNPACK takes them (for the portable backend they stay weight-only)."""
    import model as model_py
    patched, extras = [], []
    for m in model.modules():
        if isinstance(m, model_py.KVCache):
            m.update = _direct_update.__get__(m)
            patched.append((m, "update"))
        elif isinstance(m, model_py.RMSNorm):
            m.forward = _rmsnorm_forward.__get__(m)
            patched.append((m, "forward"))
        elif type(m).__name__ == "QuantizedEmbedding" and hasattr(m, "qweight"):  # quantize.py
            w, sc, zp, bits = _et_embedding_operands(m.qweight)
            m.register_buffer("_et_weight", w, persistent=False)
            m.register_buffer("_et_scales", sc, persistent=False)
            if zp is not None:
                m.register_buffer("_et_zeros", zp, persistent=False)
            m._et_bits = bits
            m.forward = _quantized_embedding_forward.__get__(m)
            patched.append((m, "forward"))
            extras.append((m, ("_et_weight", "_et_scales", "_et_zeros"), ("_et_bits",)))
        elif int8_dynamic and _linear_kind(m) == "int8" and m.act is None:
            # XNNPACK has no float x int8 weight-only GEMM: the .pte quantizes activations per token too (quantize.py's
            # 8da4w export pattern, qd8-f32-qc8w), which differs from eager int8 by that rounding only; without it
            # portable kernels would dequantize every weight on every call. 8da4w linears export that pattern already.
            m.forward = m._forward_dynamic_act_export
            patched.append((m, "forward"))
    rope = model_py.apply_rope
    model.register_buffer("_et_rotate_half", _rotate_half_weight(model.config.head_dim).to(model.norm.weight.device),
                          persistent=False)
    _ROPE_OWNER.append(model)
    model_py.apply_rope = _apply_rope_linear
    try:
        yield model
    finally:
        model_py.apply_rope = rope
        _ROPE_OWNER.remove(model)
        del model._buffers["_et_rotate_half"]
        for m, name in patched:
            m.__dict__.pop(name, None)
        for m, buffers, attrs in extras:
            for b in buffers:
                m._buffers.pop(b, None)
            for a in attrs:
                m.__dict__.pop(a, None)


def prepare_for_export(model, max_seq_length: int):
    """eval, no grad, setup_caches(1, max_seq_length) (capped at block_size); returns the model (changed in place)."""
    model.eval().requires_grad_(False)
    model.setup_caches(1, max_seq_length)
    return model


def _gqa_attention_pass(gm: torch.fx.GraphModule) -> int:
    """Rewrite sdpa(q, repeat_interleave(k, r, 1), repeat_interleave(v, r, 1), mask), sdpa(q, k, v, mask,
    enable_gqa=True) with r = H / Hkv, and plain sdpa (r = 1) into
    explicit grouped attention: q [1, H, T, D] -> [Hkv, r*T, D]; scores = bmm(q, k^T) * scale; view [Hkv, r, T, S]
    + mask; softmax; view back; bmm with v -> [1, H, T, D]. Exactly the same math (every query sees position 0, so no
    all -inf rows), no per-head copy of the cache, and only ops XNNPACK takes. Returns the number rewritten."""
    aten = torch.ops.aten
    g = gm.graph
    n = 0
    for node in list(g.nodes):
        if node.op != "call_function" or node.target != aten.scaled_dot_product_attention.default:
            continue
        args = list(node.args) + [None] * (8 - len(node.args))
        q, k, v, mask, dropout, causal, scale = args[:7]
        mask = node.kwargs.get("attn_mask", mask)
        dropout = node.kwargs.get("dropout_p", dropout) or 0.0
        causal = node.kwargs.get("is_causal", causal) or False
        scale = node.kwargs.get("scale", scale)
        gqa = bool(node.kwargs.get("enable_gqa", args[7] if len(node.args) > 7 else False))
        if dropout or causal or mask is None:
            continue
        qv, mv = q.meta.get("val"), mask.meta.get("val")
        if qv is None or mv is None or qv.dim() != 4 or mv.dim() != 4 or qv.shape[0] != 1:
            continue

        def unrepeat(x):
            if (x.op == "call_function" and x.target == aten.repeat_interleave.self_int
                    and (x.args[2] if len(x.args) > 2 else x.kwargs.get("dim")) in (1, -3)):
                return x.args[0], int(x.args[1])
            return x, 1

        (k0, rk), (v0, rv) = unrepeat(k), unrepeat(v)
        kval = k0.meta.get("val")
        if rk != rv or kval is None:
            continue
        H, D = int(qv.shape[1]), int(qv.shape[3])
        Hkv, S = int(kval.shape[1]), int(kval.shape[2])
        if gqa and rk == 1 and Hkv and H % Hkv == 0:  # sdpa(..., enable_gqa=True): KV head h serves H/Hkv query heads
            rk = H // Hkv
        if Hkv * rk != H:
            continue
        if scale is None:
            scale = 1.0 / math.sqrt(D)
        with g.inserting_before(node):  # batch 1: everything as 3-D bmm over the Hkv groups
            qg = g.call_function(aten.reshape.default, (q, [Hkv, -1, D]))             # [Hkv, r*T, D]
            k3 = g.call_function(aten.reshape.default, (k0, [Hkv, S, D]))
            v3 = g.call_function(aten.reshape.default, (v0, [Hkv, S, D]))
            kt = g.call_function(aten.permute.default, (k3, [0, 2, 1]))              # [Hkv, D, S]
            s = g.call_function(aten.bmm.default, (qg, kt))                          # [Hkv, r*T, S]
            s = g.call_function(aten.mul.Tensor, (s, float(scale)))
            s = g.call_function(aten.reshape.default, (s, [Hkv, rk, -1, S]))          # [Hkv, r, T, S]
            m = mask
            if int(mv.shape[1]) != 1:  # a per-head mask [1, H, T, S] -> [Hkv, r, T, S]
                m = g.call_function(aten.reshape.default, (mask, [Hkv, rk, -1, S]))
            s = g.call_function(aten.add.Tensor, (s, m))                             # mask [1, 1, T, S] broadcasts
            p = g.call_function(aten.softmax.int, (s, -1))
            p = g.call_function(aten.reshape.default, (p, [Hkv, -1, S]))              # [Hkv, r*T, S]
            o = g.call_function(aten.bmm.default, (p, v3))                            # [Hkv, r*T, D]
            o = g.call_function(aten.reshape.default, (o, [1, H, -1, D]))            # [1, H, T, D]
        node.replace_all_uses_with(o)
        g.erase_node(node)
        n += 1
    g.eliminate_dead_code()
    gm.recompile()
    return n


def _inferred_view_dims(gm: torch.fx.GraphModule):
    """Edge pass: a view_copy whose target shape holds exactly one symbolic size (the dynamic length) gets -1 there
    instead. Same result, but XNNPACK takes reshapes with one inferred dim and rejects symbolic ones, so without this
    every view on the dynamic length splits the delegate."""
    from torch.fx.passes.infra.pass_base import PassResult
    changed = False
    for node in gm.graph.nodes:
        if node.op != "call_function" or "view_copy" not in str(node.target) or len(node.args) < 2:
            continue
        shape = list(node.args[1])
        sym = [i for i, d in enumerate(shape) if not isinstance(d, int)]
        if len(sym) == 1 and -1 not in shape:
            shape[sym[0]] = -1
            node.args = (node.args[0], shape) + tuple(node.args[2:])
            changed = True
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return PassResult(gm, changed)


def _drop_unused_state(ep) -> int:
    """Remove weights/buffers/constants the graph never reads (quantize.py keeps packed copies that only eager uses);
    ExecuTorch would serialize them all. Returns how many were dropped."""
    import copy
    from torch.export.graph_signature import InputKind
    placeholders = {n.name: n for n in ep.graph_module.graph.nodes if n.op == "placeholder"}
    mutated = set(ep.graph_signature.buffers_to_mutate.values())
    drop = [s for s in ep.graph_signature.input_specs
            if s.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
            and s.target not in mutated and not placeholders[s.arg.name].users]
    if drop:
        sig = copy.deepcopy(ep.graph_signature)
        for spec in drop:
            sig.input_specs.remove(spec)
            ep.graph_module.graph.erase_node(placeholders[spec.arg.name])
            ep._state_dict.pop(spec.target, None)
            ep._constants.pop(spec.target, None)
        ep._graph_signature = sig
        ep.graph_module.recompile()
    return len(drop)


# ------------------------------------------------------------------------------------------------ export
class _Forward(torch.nn.Module):
    """forward(tokens [1, T], input_pos [T]) -> logits [1, T, V] (the .pte signature, batch_index dropped)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens: Tensor, input_pos: Tensor) -> Tensor:
        return self.model(tokens, input_pos)


def export_programs(model, max_seq_length: int, prefill_chunk: Optional[int] = None,
                    backend: str = "xnnpack") -> dict:
    """torch.export the prepared model: {"forward": dynamic T} (+ "prefill": T = prefill_chunk, "decode": T = 1).
    All share one module, so the lowered program shares weights and (with share_mutable_buffers) the cache."""
    from torch.export import Dim, export
    S = model.max_seq_length
    wrapper = _Forward(model)
    progs = {}
    with torch.no_grad(), export_swaps(model, int8_dynamic=backend == "xnnpack"):
        seq = Dim("seq", min=1, max=S)
        T = min(4, S)
        ex = (torch.zeros(1, T, dtype=torch.long), torch.arange(T))
        progs["forward"] = export(wrapper, ex, dynamic_shapes=({1: seq}, {0: seq}), strict=False)
        if prefill_chunk:
            if not 1 < prefill_chunk <= S:
                raise ValueError(f"--prefill_chunk must be in 2..{S}")
            ex = (torch.zeros(1, prefill_chunk, dtype=torch.long), torch.arange(prefill_chunk))
            progs["prefill"] = export(wrapper, ex, strict=False)
            progs["decode"] = export(wrapper, (torch.zeros(1, 1, dtype=torch.long), torch.tensor([0])), strict=False)
    for name, ep in progs.items():
        _drop_unused_state(ep)
        if not _gqa_attention_pass(ep.graph_module):
            print(f"note: {name}: attention left to ATen's SDPA decomposition (pattern not recognised)", file=sys.stderr)
    return progs


def _backend_partitioners(backend: str) -> list:
    """Partitioners for a backend name; a clear error naming what to install when a vendor SDK is missing."""
    if backend == "portable":
        return []
    if backend == "xnnpack":
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
        return [XnnpackPartitioner()]
    if backend == "qnn":
        root = os.environ.get("QNN_SDK_ROOT", "")
        if not root or not Path(root).is_dir():
            raise RuntimeError("--backend qnn needs the Qualcomm AI Engine Direct (QNN) SDK: install it from "
                               "https://www.qualcomm.com/developer/software/qualcomm-ai-engine-direct-sdk and set "
                               "QNN_SDK_ROOT to its directory (and LD_LIBRARY_PATH to $QNN_SDK_ROOT/lib/x86_64-linux-clang)")
        try:
            import executorch.backends.qualcomm.partition.qnn_partitioner  # noqa: F401
        except Exception as e:
            raise RuntimeError(f"--backend qnn: executorch's Qualcomm backend does not load ({type(e).__name__}: "
                               f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}); build executorch with "
                               "-DEXECUTORCH_BUILD_QNN=ON against the QNN SDK in QNN_SDK_ROOT") from None
        raise NotImplementedError("--backend qnn: the QNN SDK is present, but this script does not set up QNN compile "
                                  "specs (SoC model, HTP options) yet; use --backend xnnpack")
    if backend == "coreml":
        if sys.platform != "darwin":
            raise RuntimeError("--backend coreml needs macOS (Core ML compiles and runs only on Apple platforms, with "
                               "coremltools installed); use --backend xnnpack here")
        from executorch.backends.apple.coreml.partition import CoreMLPartitioner
        return [CoreMLPartitioner()]
    if backend == "mps":
        if sys.platform != "darwin":
            raise RuntimeError("--backend mps needs macOS with Xcode and an executorch build with "
                               "-DEXECUTORCH_BUILD_MPS=ON (the pip wheel has no MPS backend); use --backend xnnpack here")
        try:
            from executorch.backends.apple.mps.partition import MPSPartitioner
        except ImportError:
            raise RuntimeError("--backend mps: executorch.backends.apple.mps is missing; build executorch from "
                               "source with -DEXECUTORCH_BUILD_MPS=ON") from None
        from executorch.exir.backend.compile_spec_schema import CompileSpec
        return [MPSPartitioner([CompileSpec("use_fp16", bytes([False]))])]
    raise ValueError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")


def op_summary(edge) -> dict:
    """Per method: delegate calls, ops inside delegates, ops left to the portable/quantized kernels (by name)."""
    from executorch.exir.lowered_backend_module import LoweredBackendModule
    out = {}
    for name in edge.methods:
        gm = edge.exported_program(name).graph_module
        delegated, portable, calls = 0, {}, 0
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            t = str(getattr(node.target, "__name__", node.target))
            if "executorch_call_delegate" in t:
                calls += 1
                lowered = getattr(gm, node.args[0].target)
                if isinstance(lowered, LoweredBackendModule):
                    delegated += sum(1 for x in lowered.original_module.graph.nodes
                                     if x.op == "call_function" and "getitem" not in str(x.target))
                continue
            if "getitem" in t or t in ("sym_size.int", "sym_size"):
                continue
            t = t.replace("aten.", "").split(".")[0] if "." in t else t
            portable[t] = portable.get(t, 0) + 1
        out[name] = dict(delegate_calls=calls, delegated_ops=delegated, portable_ops=sum(portable.values()),
                         portable=dict(sorted(portable.items(), key=lambda kv: -kv[1])))
    return out


def _reinplace_is_safe(edge) -> bool:
    """Whether to_executorch may turn the cache writes (index_put) into in-place index_put_ on the mutable buffers,
    which saves copying every layer's cache twice per call. Only when no view outside a delegate reads a written cache:
    ExecuTorch 1.5's memory planning gives such a view its own storage instead of the buffer's (reads garbage; seen
    with --backend portable). With XNNPACK, the reads of the cache are inside the delegate."""
    for name in edge.methods:
        for node in edge.exported_program(name).graph.nodes:
            if node.op == "call_function" and "index_put" in str(node.target):
                if any("view" in str(u.target) for u in node.users):
                    return False
    return True


def lower(progs: dict, backend: str, constant_methods: dict, verbose: bool = False):
    """to_edge_transform_and_lower + to_executorch with mutable-buffer-preserving memory planning.
    Returns (ExecutorchProgramManager, op summary)."""
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass
    from executorch.exir.passes.sym_shape_eval_pass import ConstraintBasedSymShapeEvalPass
    partitioners = _backend_partitioners(backend)
    edge = to_edge_transform_and_lower(progs, transform_passes=[_inferred_view_dims], partitioner=partitioners,
                                       constant_methods=constant_methods,
                                       compile_config=EdgeCompileConfig(_check_ir_validity=False,
                                                                        _skip_dim_order=True))
    summary = op_summary(edge)
    reinplace = _reinplace_is_safe(edge)
    config = ExecutorchBackendConfig(
        memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False, share_mutable_buffers=len(progs) > 1),
        sym_shape_eval_pass=ConstraintBasedSymShapeEvalPass(),
        emit_mutable_buffer_names=True,
        run_reinplace_pass=reinplace,
    )
    import warnings
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Mutation on a buffer")
        et = edge.to_executorch(config)
    return et, summary


def _token_ids(tokenizer_path, bos_id, eos_ids):
    """bos / eos ids for the constant methods: explicit flags, else the tokenizer beside the checkpoint."""
    if bos_id is not None and eos_ids:
        return bos_id, list(eos_ids)
    tok = None
    if tokenizer_path is not None:
        try:
            from tokenizer import load_tokenizer
            tok = load_tokenizer(tokenizer_path)
        except Exception as e:  # noqa: BLE001 - a missing tokenizer only costs the defaults below
            print(f"note: no tokenizer at {tokenizer_path} ({type(e).__name__}); ", end="", file=sys.stderr)
    if tok is not None:
        tb = getattr(tok, "bos_id", None)
        te = sorted({i for i in [getattr(tok, "eos_id", None), *getattr(tok, "stop_ids", ())] if i is not None})
    else:
        tb, te = None, []
    bos = bos_id if bos_id is not None else (tb if tb is not None else 1)
    eos = list(eos_ids) if eos_ids else (te or [2])
    if tok is None and (bos_id is None or not eos_ids):
        print(f"using bos {bos}, eos {eos} (pass --bos_id / --eos_ids to override)", file=sys.stderr)
    return bos, eos


def export_pte(model, output_path, max_seq_length: int = DEFAULT_MAX_SEQ_LENGTH, backend: str = "xnnpack",
               bos_id: int = 1, eos_ids=(2,), prefill_chunk: Optional[int] = None, quantization: Optional[dict] = None,
               verbose: bool = True) -> dict:
    """Lower a model.py Transformer (float or quantized in place by quantize.py) to a .pte at output_path, written
    atomically. Returns info: size, method names, op summary, times."""
    log = (lambda *a: print(*a, file=sys.stderr)) if verbose else (lambda *a: None)
    output_path = Path(output_path)
    _backend_partitioners(backend)  # fail fast, before the slow export, on a backend that cannot work here
    if any(_linear_kind(m) == "int4" for m in model.modules()):
        raise ValueError("int4 / int4-gptq weights (asymmetric, weight-only) have no ExecuTorch kernel; quantize with "
                         "--quantize 8da4w (or int8) for ExecuTorch")
    if backend == "xnnpack" and _scales_not_bf16(model):
        log("note: XNNPACK stores 4-bit group scales as bfloat16; this model's scales are not bf16 values, so the .pte's "
            "logits differ slightly from the eager quantized model's")
    t0 = time.perf_counter()
    prepare_for_export(model, max_seq_length)
    S = model.max_seq_length
    progs = export_programs(model, S, prefill_chunk, backend)
    t1 = time.perf_counter()
    cfg = model.config
    constant_methods = {
        "get_max_seq_len": S, "get_max_context_len": S, "get_vocab_size": cfg.vocab_size,
        "get_bos_id": int(bos_id), "get_eos_ids": [int(e) for e in eos_ids],
        "use_kv_cache": True, "enable_dynamic_shape": True, "use_sdpa_with_kv_cache": False,
        "get_n_layers": cfg.n_layer, "get_max_batch_size": 1,
    }
    if prefill_chunk:
        constant_methods["get_prefill_chunk"] = int(prefill_chunk)
    et, summary = lower(progs, backend, constant_methods)
    t2 = time.perf_counter()
    output_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = output_path.with_name(output_path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            et.write_to_file(f)
        os.replace(tmp, output_path)
    finally:
        tmp.unlink(missing_ok=True)
    size = output_path.stat().st_size
    log(f"exported in {t1 - t0:.1f} s, lowered to {backend} in {t2 - t1:.1f} s")
    for name, s in summary.items():
        top = ", ".join(f"{k} {v}" for k, v in list(s["portable"].items())[:8])
        log(f"  {name}: {s['delegated_ops']} ops in {s['delegate_calls']} {backend} delegate call(s), "
            f"{s['portable_ops']} portable ops ({top})")
    log(f"wrote {output_path} ({size / 2**20:.1f} MiB; max_seq_len {S}, vocab {cfg.vocab_size}"
        f"{', quantized ' + quantization.get('mode', '') if quantization else ''})")
    return dict(path=str(output_path), size=size, methods=list(progs), summary=summary,
                export_s=t1 - t0, lower_s=t2 - t1)


# ------------------------------------------------------------------------------------------------ running a .pte
def _check_pte_file(path: Path):
    """Cheap structural check so a truncated or foreign file gives a one-line error instead of a runtime abort."""
    if not path.is_file():
        raise FileNotFoundError(f".pte not found: {path}")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(64)
    if len(head) < 40 or head[4:6] != b"ET":
        raise ValueError(f"{path} is not an ExecuTorch program (.pte): no 'ET' flatbuffer identifier")
    if head[8:12] == b"eh00":
        program_size = int.from_bytes(head[16:24], "little")
        seg_base = int.from_bytes(head[24:32], "little")
        seg_size = int.from_bytes(head[32:40], "little") if int.from_bytes(head[12:16], "little") >= 32 else 0
        need = max(program_size, seg_base + seg_size if seg_base else 0)
        if size < need:
            raise ValueError(f"{path} is truncated: {size} bytes, the program says {need} (re-run et_export.py)")


class PTEBackend:
    """generate.py backend over an ExecuTorch .pte, through ExecuTorch's Python runtime.
    forward(tokens [1, T], input_pos [T]) -> logits [1, T, V]; one sequence; any prompt length in one call."""

    max_batch_size = 1
    prefill_chunk = None

    def __init__(self, path, method: str = "forward"):
        path = Path(path)
        _check_pte_file(path)
        try:
            import executorch.kernels.quantized  # noqa: F401 - registers quantized_decomposed kernels (embeddings)
        except Exception:  # noqa: BLE001 - only quantized programs need them; loading says so if they do
            pass
        from executorch.runtime import Runtime
        try:
            self.program = Runtime.get().load_program(path)
            names = self.program.method_names
        except Exception as e:  # noqa: BLE001 - the runtime raises RuntimeError with multi-line details
            raise ValueError(f"cannot load {path}: not a valid ExecuTorch program, truncated or corrupt "
                             f"({type(e).__name__})") from None
        if method not in names:
            raise ValueError(f"{path} has no method {method!r} (methods: {', '.join(sorted(names))})")
        self.path = path
        self.method_names = names
        self.constants = {}
        for name in sorted(names):
            if name.startswith(("get_", "use_", "enable_")):
                try:
                    vals = list(self.program.load_method(name).execute([]))
                except Exception as e:  # noqa: BLE001
                    raise ValueError(f"cannot run constant method {name} of {path} ({type(e).__name__})") from None
                vals = [v.item() if isinstance(v, Tensor) and v.numel() == 1 else v for v in vals]
                self.constants[name] = vals if name == "get_eos_ids" else vals[0]
        if "get_max_seq_len" not in self.constants:
            raise ValueError(f"{path} has no get_max_seq_len method: not exported by et_export.py")
        self.max_seq_length = int(self.constants["get_max_seq_len"])
        self.vocab_size = self.constants.get("get_vocab_size")
        try:
            self.method = self.program.load_method(method)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"cannot load method {method!r} of {path}: {type(e).__name__}: "
                             f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}") from None

    def forward(self, tokens: Tensor, input_pos: Tensor) -> Tensor:
        if tokens.dim() != 2 or tokens.shape[0] != 1:
            raise ValueError(f"the .pte runs one sequence: tokens must be [1, T], got {list(tokens.shape)}")
        if input_pos.dim() != 1:
            if input_pos.dim() == 2 and input_pos.shape[0] == 1 and bool((input_pos >= 0).all()):
                input_pos = input_pos[0]
            else:
                raise ValueError("the .pte takes shared positions input_pos [T] (no padding)")
        T = tokens.shape[1]
        if int(input_pos[-1]) >= self.max_seq_length or T > self.max_seq_length:
            raise ValueError(f"position {int(input_pos[-1])} is beyond the .pte's max_seq_len {self.max_seq_length}")
        out = self.method.execute([tokens.to(torch.long).contiguous(), input_pos.to(torch.long).contiguous()])
        return out[0]


# ------------------------------------------------------------------------------------------------ CLI
def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Export a LLaMA-family checkpoint to an ExecuTorch .pte.")
    p.add_argument("--checkpoint_path", type=Path, default=None,
                   help="model.pth from scripts/convert_checkpoint.py or quantize.py "
                        "(default: checkpoints/SmolLM2-135M-Instruct/model.pth)")
    p.add_argument("--output_path", type=Path, required=True, help="the .pte to write")
    p.add_argument("--quantize", default=None, help="quantize a float checkpoint first with quantize.py (int8, 8da4w, ...)")
    p.add_argument("--groupsize", type=int, default=32, help="group size for --quantize")
    p.add_argument("--max_seq_length", type=int, default=DEFAULT_MAX_SEQ_LENGTH,
                   help="KV cache length = longest prompt + generation (capped at the model's block_size)")
    p.add_argument("--backend", default="xnnpack", choices=BACKENDS, help="portable = no delegate (debugging)")
    p.add_argument("--prefill_chunk", type=int, default=None,
                   help="also add fixed-length `prefill` (N tokens) and `decode` (1 token) methods")
    p.add_argument("--tokenizer_path", type=Path, default=None, help="for bos/eos ids (default: checkpoint directory)")
    p.add_argument("--bos_id", type=int, default=None)
    p.add_argument("--eos_ids", type=int, nargs="+", default=None)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    from model import load_model
    ckpt = args.checkpoint_path
    if ckpt is None:
        from generate import DEFAULT_CHECKPOINT
        ckpt = DEFAULT_CHECKPOINT
    if args.max_seq_length < 2:
        raise ValueError("--max_seq_length must be at least 2")
    _backend_partitioners(args.backend)  # a missing vendor SDK is reported before the checkpoint is even read
    model = load_model(ckpt, dtype=torch.float32)
    quantization = {"mode": "(as stored in the checkpoint)"} if _is_quantized(model) else None
    if args.quantize:
        if quantization:
            raise ValueError(f"{ckpt} is already quantized; export it without --quantize")
        import quantize
        recipe = quantize.quantize_model(model, args.quantize, groupsize=args.groupsize)
        model.requires_grad_(False)
        quantization = recipe if isinstance(recipe, dict) else {"mode": args.quantize}
    tok_path = args.tokenizer_path or (Path(ckpt) if Path(ckpt).is_dir() else Path(ckpt).parent)
    bos, eos = _token_ids(tok_path, args.bos_id, args.eos_ids)
    export_pte(model, args.output_path, args.max_seq_length, args.backend, bos, eos, args.prefill_chunk,
               quantization=quantization)


def _scales_not_bf16(model) -> bool:
    """True when an 8da4w weight (quantize.py keeps qdata_int8 for the XNNPACK pattern) has scales that bfloat16
    cannot hold exactly."""
    for m in model.modules():
        if hasattr(m, "qdata_int8") and isinstance(getattr(m, "scales", None), Tensor):
            s = m.scales.float()
            if not torch.equal(s, s.to(torch.bfloat16).float()):
                return True
    return False


def _is_quantized(model) -> bool:
    """True for a model holding quantize.py's modules (a quantized checkpoint loaded by load_model)."""
    return any(type(m).__name__ in ("QuantizedLinear", "QuantizedEmbedding", "QuantizedWeight") for m in model.modules())


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    from generate import cli
    cli(main)
