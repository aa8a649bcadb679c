# Graph passes and checks for lowering model.py's exported programs to ExecuTorch (used by et_export.py): explicit
# grouped-query attention in place of SDPA, -1 for the dynamic length in reshapes, dropping state the graph never
# reads, whether the cache writes may be reinplaced, the op summary et_export prints, and XNNPACK's pass list without
# the passes a subgraph gives nothing to rewrite. Imports nothing from this repo.
import contextlib
import copy
import math

import torch


def gqa_attention_pass(gm: torch.fx.GraphModule) -> int:
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


def inferred_view_dims(gm: torch.fx.GraphModule):
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


def drop_unused_state(ep) -> int:
    """Remove weights/buffers/constants the graph never reads (an export form's operands replace the stored ones);
    ExecuTorch would serialize them all. Returns how many were dropped."""
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


def reinplace_is_safe(edge) -> bool:
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


# XNNPACK's preprocess runs its whole pass list (XNNPACKPassManager's default) over each subgraph it takes, and each
# pass re-traces the subgraph under fake tensors: ~2-4% of a 1B model's lowering apiece. The passes below rewrite only
# the ops named beside them (PropagateCustomMeta: nodes with a "custom" meta entry); where the subgraph, as the passes
# before have left it, has none of those, the pass is skipped, and the .pte is the same bytes (tests/test_et_export.py
# checks it). Passes that can act on any graph always run: constant folding, ChannelsLastTaggedReshape (it tags every
# node's layout; the float32 programs' 4-D norms need it) and the clone removal.
_IMAGE_OPS = ("conv", "batch_norm", "upsample", "prelu", "pad", "max_pool", "avg_pool")
PASS_OPS = {"ConvertToUpsampleBilinear2d": _IMAGE_OPS, "FuseBatchNormPass": _IMAGE_OPS, "DecomposeBatchNorm": _IMAGE_OPS,
            "InsertPadQDQPass": _IMAGE_OPS, "Conv1dUnsqueezePass": _IMAGE_OPS, "PReLUReshapePass": _IMAGE_OPS,
            "DimOrderOpsRevertPass": ("dim_order",), "ConvertToLinearPass": ("aten.mm.", "aten.addmm."),
            "FuseActivationPass": ("relu", "hardtanh"), "DecomposeConcatenate": ("aten.cat",),
            "RemoveGetItemPass": ("max_pool2d_with_indices", "aten.max."), "ConvertToSDPAPass": ("softmax",),
            "PropagateCustomMetaPass": ("custom meta",), "RemoveRedundantCopyPass": ("_to_copy",)}


def subgraph_names(gm: torch.fx.GraphModule) -> set:
    """The op names of a graph's calls ("aten.cat.default"), and "custom meta" if a node carries one."""
    names = {getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes if n.op == "call_function"}
    return names | ({"custom meta"} if any("custom" in n.meta for n in gm.graph.nodes) else set())


def pass_needed(p, names: set) -> bool:
    """Whether XNNPACK pass p may change a graph whose subgraph_names are names (False: a PASS_OPS pass without its
    ops)."""
    ops = PASS_OPS.get(p.__name__)
    return ops is None or any(o in name for o in ops for name in names)


@contextlib.contextmanager
def xnnpack_trimmed_passes():
    """While lowering, XNNPACK's preprocess runs its default pass list on each subgraph less the passes that have
    nothing to rewrite there (pass_needed, asked before each pass). Unchanged where ExecuTorch's pass names differ from
    PASS_OPS's, and where preprocess names the passes itself."""
    import executorch.backends.xnnpack.xnnpack_preprocess as prep
    base = prep.XNNPACKPassManager
    try:
        default = list(base(None).passes)
    except Exception:  # noqa: BLE001 - another ExecuTorch: leave it be
        default = []
    if not set(PASS_OPS) <= {p.__name__ for p in default}:
        yield
        return

    class Trimmed(base):
        def transform(self):
            if self.passes != default:
                return super().transform()
            ep = self.exported_program
            for p in self.passes:
                if pass_needed(p, subgraph_names(ep.graph_module)):
                    ep = base(ep, [p]).transform()
            return ep

    prep.XNNPACKPassManager = Trimmed
    try:
        yield
    finally:
        prep.XNNPACKPassManager = base
