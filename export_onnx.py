# export_onnx.py: model.py's Transformer as ONE ONNX graph shared by prefill and decode (the retained-state contract
# that Qualcomm's QEfficient uses for Cloud AI 100; io_spec() states it), optionally with every decoder layer as one
# ONNX function (--sub_functions, for qaic-compile -sub-functions), clipped to the fp16 range, checked on ONNX Runtime
# against eager PyTorch, and run there by OnnxBackend (generate.py --onnx).
#
#     python export_onnx.py --checkpoint_path checkpoints/SmolLM2-135M-Instruct/model.pth --output_dir out/
#     python export_onnx.py ... --full_batch_size 4 [--sub_functions]   # continuous batching: a batch_index input
#     python generate.py --onnx out/model.onnx --tokenizer_path out --prompt "a|b|c"
#
# Imports model.py, common.py and tokenizer.py only; generate.py imports OnnxBackend from here lazily (a plugin).
import contextlib
import functools
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from common import (ArgumentParser, at_least, checkpoint_file, cli, copy_tokenizer_files, has_tokenizer,
                    native_output_filtered, release_pages, resolve_checkpoint, temp_dir, within)
import numpy as np
import torch
import torch.nn as nn
from torch import Tensor

from model import Transformer
from quantize import load_model
from onnx_backends import OnnxBackend, graph_context, json_metadata  # noqa: F401 (OnnxBackend: re-exported)

FP16_MAX = float(np.finfo(np.float16).max)  # 65504


# ------------------------------------------------------------------------------------------ the swapped submodules
class RetainedStateKVCache(nn.Module):
    """Drop-in for model.KVCache during export: the cache is an explicit tensor (a graph input), not a buffer.
    update() writes k/v [B, H, T, D] into `past` with one index_put (ONNX ScatterND) at the (slot, head, position)
    indices that the wrapper computed once for all layers (so every decoder layer is the same computation: one ONNX
    function with --sub_functions), keeps the result in new_k/new_v (the *_RetainedState outputs) and returns the rows
    the batch attends over. Padding positions (-1) write into the last slot, which only a query at position C-1
    reads, after its own write (model.KVCache's convention)."""

    def __init__(self):
        super().__init__()
        self.past_k = self.past_v = self.new_k = self.new_v = None
        self.idx: Optional[tuple] = None  # (slots, heads, positions), each [B, H, T]
        self.slots: Optional[Tensor] = None  # [B] with batch_index, else None

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor, batch_index: Optional[Tensor] = None):
        self.new_k = self.past_k.index_put(self.idx, k)  # ONNX ScatterND, indices [B, H, T, 3]
        self.new_v = self.past_v.index_put(self.idx, v)
        if self.slots is None:
            return self.new_k, self.new_v
        return self.new_k[self.slots], self.new_v[self.slots]


class LastPositionHead(nn.Module):
    """Wraps the model's LM head: keeps each row's last valid position (argmax of position_ids), then applies it."""

    def __init__(self, head: nn.Module):
        super().__init__()
        self.head = head
        self.index: Optional[Tensor] = None  # [B, 1], set by the wrapper before each forward

    def forward(self, x: Tensor) -> Tensor:
        rows = torch.arange(x.shape[0], device=x.device).unsqueeze(1)
        return self.head(x[rows, self.index])  # [B, 1, dim] -> [B, 1, vocab]


class RetainedStateWrapper(nn.Module):
    """forward(input_ids, position_ids, [batch_index,] past_key.0, past_value.0, ...) ->
    (logits [B, 1, V], past_key.0_RetainedState, past_value.0_RetainedState, ...). Made by retained_state()."""

    def __init__(self, model: Transformer, continuous_batching: bool, caches: list[RetainedStateKVCache]):
        super().__init__()
        self.model, self.cb, self.caches = model, continuous_batching, caches

    def forward(self, input_ids: Tensor, position_ids: Tensor, *rest: Tensor):
        batch_index = rest[0] if self.cb else None
        past = rest[1:] if self.cb else rest
        (B, T), H, S = input_ids.shape, past[0].shape[1], past[0].shape[2]
        pos = torch.where(position_ids >= 0, position_ids, S - 1)  # padding -> the last slot
        slots = torch.arange(B) if batch_index is None else batch_index.reshape(B)
        idx = (slots.view(B, 1, 1).expand(B, H, T), torch.arange(H).view(1, H, 1).expand(B, H, T),
               pos.view(B, 1, T).expand(B, H, T))
        for i, cache in enumerate(self.caches):
            cache.past_k, cache.past_v = past[2 * i], past[2 * i + 1]
            cache.idx, cache.slots = idx, (None if batch_index is None else slots)
        self.model.max_seq_length = S  # model.forward's mask spans ctx_len, a dynamic axis (no mask input)
        self.model.output.index = position_ids.argmax(1, keepdim=True)
        logits = self.model(input_ids, position_ids, batch_index)
        out = [logits]
        for cache in self.caches:
            out += [cache.new_k, cache.new_v]
        return tuple(out)


@contextlib.contextmanager
def retained_state(model: Transformer, continuous_batching: bool, rope_len: int, longrope_len: Optional[int] = None):
    """Yield the export wrapper around `model` with its swap points taken over (every layer.attention.kv_cache ->
    RetainedStateKVCache, the LM head -> LastPositionHead, which keeps each row's last valid position before calling
    the same Linear, as QEfficient does: no [B, S, vocab] logits for a prompt chunk; rotary tables covering every
    position the graph may run at, ctx_len <= rope_len; Phi-3's longrope factors chosen for a cache of longrope_len,
    default rope_len), and put the model's own modules back on exit: the network is model.py's, nothing is copied
    (the wrapper uses the model's weight tensors) and afterwards the model runs eagerly as before (the self-check's
    reference)."""
    tables = {t: getattr(model, t) for t in ("rope", "rope_local") if hasattr(model, t)}
    saved = ([layer.attention.kv_cache for layer in model.layers], model.output, model.max_batch_size,
             model.max_seq_length)
    caches = [RetainedStateKVCache() for _ in model.layers]
    for layer, cache in zip(model.layers, caches):
        layer.attention.kv_cache = cache
    model.output, model.max_batch_size = LastPositionHead(model.output), -1
    model.set_rope(rope_len, torch.float32, longrope_len=longrope_len)
    try:
        yield RetainedStateWrapper(model, continuous_batching, caches).eval()
    finally:
        for layer, cache in zip(model.layers, saved[0]):
            layer.attention.kv_cache = cache
        model.output, model.max_batch_size, model.max_seq_length = saved[1:]
        for t in ("rope", "rope_local"):
            if hasattr(model, t):
                delattr(model, t)
        for t, v in tables.items():
            model.register_buffer(t, v, persistent=False)


# ------------------------------------------------------------------------------------------------- names and shapes
def kv_names(n_layer: int) -> list[str]:
    return [f"past_{kind}.{i}" for i in range(n_layer) for kind in ("key", "value")]


def io_spec(n_layer: int, continuous_batching: bool):
    """The graph contract (B = batch_size, S = seq_len, C = ctx_len; all three dynamic):
    inputs   input_ids [B, S] int64, position_ids [B, S] int64 (-1 = padding),
             [batch_index [B, 1] int64: the cache slot of each row, only with --full_batch_size],
             past_key.N / past_value.N [B or full_batch_size, n_kv_heads, C, head_dim] float32, N = 0..n_layer-1
    outputs  logits [B, 1, vocab] float32 (each row's last valid position, i.e. argmax(position_ids)),
             past_key.N_RetainedState / past_value.N_RetainedState (the inputs with this call's K/V scattered in).
    The attention mask comes from position_ids; prefill and decode differ only in S. Returns (inputs, outputs,
    dynamic axes)."""
    inputs = ["input_ids", "position_ids"] + (["batch_index"] if continuous_batching else []) + kv_names(n_layer)
    outputs = ["logits"] + [n + "_RetainedState" for n in kv_names(n_layer)]
    rows = {0: "full_batch_size" if continuous_batching else "batch_size", 2: "ctx_len"}
    axes = {"input_ids": {0: "batch_size", 1: "seq_len"}, "position_ids": {0: "batch_size", 1: "seq_len"},
            "logits": {0: "batch_size"}, "batch_index": {0: "batch_size"}}
    axes.update((n, rows) for n in inputs[2:] + outputs[1:] if n != "batch_index")
    return inputs, outputs, {n: axes[n] for n in inputs + outputs}


# ------------------------------------------------------------------------------------------------- fp16 clipping
def _all_tensors(graph):
    yield from getattr(graph, "initializer", ())  # a FunctionProto has nodes only
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            for g in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                yield from _all_tensors(g)


def clip_to_fp16_range(model_proto) -> int:
    """Clip every float32 tensor in the graph (initializers, Constant / ConstantOfShape values, subgraphs, function
    bodies) to [-65504, 65504], keeping -inf (an additive mask stays a mask in float16), as QEfficient's
    FP16ClipTransform does. Returns how many values changed. Tensors must be loaded (not external)."""
    from onnx import TensorProto, numpy_helper
    changed = 0
    for t in (t for g in (model_proto.graph, *model_proto.functions) for t in _all_tensors(g)):
        if t.data_type != TensorProto.FLOAT:
            continue
        a = numpy_helper.to_array(t)
        over = (a > FP16_MAX) | ((a < -FP16_MAX) & ~np.isneginf(a))
        if over.any():
            changed += int(over.sum())
            clipped = np.where(np.isneginf(a), a, np.clip(a, -FP16_MAX, FP16_MAX)).astype(np.float32)
            t.CopyFrom(numpy_helper.from_array(clipped, t.name))
    return changed


# ------------------------------------------------------------------------------------------------- metadata
def read_metadata(onnx_path) -> dict:
    """The export metadata of a graph written by this script (from its metadata_props)."""
    import onnx
    m = onnx.load(str(onnx_path), load_external_data=False)
    return json_metadata((p.key, p.value) for p in m.metadata_props)


def _load_tokenizer(ck_dir: Path):
    """The tokenizer beside the checkpoint, or None (tests, bare weights): metadata and self-check go without it."""
    try:
        from tokenizer import load_tokenizer
        return load_tokenizer(ck_dir)
    except Exception:
        return None


# ------------------------------------------------------------------------------------------------- export
def _example_inputs(cfg, continuous_batching: bool):
    # distinct odd sizes so no traced size coincides with another (B=2, S=3, slots=5, ctx=7)
    B, S, C = 2, 3, 7
    rows = 5 if continuous_batching else B
    ids = torch.zeros(B, S, dtype=torch.long)
    pos = torch.arange(S).repeat(B, 1)
    pos[1, -1] = -1
    extra = [torch.tensor([[3], [1]])] if continuous_batching else []
    past = [torch.zeros(rows, cfg.n_local_heads, C, cfg.head_dim) for _ in range(2 * cfg.n_layer)]
    return (ids, pos, *extra, *past)


def _sdpa_symbolic(g, query, key, value, attn_mask=None, dropout_p=None, is_causal=None, scale=None,
                   enable_gqa=None):
    """TorchScript-exporter lowering of F.scaled_dot_product_attention that also takes enable_gqa (torch's own raises
    for it): each KV head is repeated for its group of query heads (Unsqueeze + Expand + Reshape, what QEfficient's
    repeat_kv exports to), then softmax(q k^T * scale + mask) v with plain MatMul / Softmax."""
    from torch.onnx import symbolic_helper as sh
    if not sh._is_none(is_causal) and sh._maybe_get_const(is_causal, "b"):
        raise NotImplementedError("is_causal attention is not exported (model.py passes a mask)")
    q_sizes, k_sizes = sh._get_tensor_sizes(query), sh._get_tensor_sizes(key)
    hq, hkv, d = q_sizes[1], k_sizes[1], q_sizes[-1] or k_sizes[-1] or sh._get_tensor_sizes(value)[-1]
    if None in (hq, hkv, d):
        raise NotImplementedError(f"exporting attention needs static head counts and head_dim (got q {q_sizes}, "
                                  f"k {k_sizes})")
    if hq != hkv:  # grouped-query attention
        group = hq // hkv
        key, value = (g.op("Reshape", g.op("Expand", g.op("Unsqueeze", t, g.op("Constant", value_t=torch.tensor([2]))),
                                           g.op("Constant", value_t=torch.tensor([1, 1, group, 1, 1]))),
                           g.op("Constant", value_t=torch.tensor([0, hq, -1, d])))
                      for t in (key, value))
    s = 1.0 / float(d) ** 0.5 if sh._is_none(scale) else float(sh._maybe_get_const(scale, "f"))
    scores = g.op("Mul", g.op("MatMul", query, g.op("Transpose", key, perm_i=[0, 1, 3, 2])),
                  g.op("Constant", value_t=torch.tensor(s, dtype=torch.float32)))
    if not sh._is_none(attn_mask):
        scores = g.op("Add", scores, attn_mask)
    return g.op("MatMul", g.op("Softmax", scores, axis_i=-1), value)


@dataclass(frozen=True)
class ExportKind:
    """How the graph is built. The TorchScript exporter (dynamo=False) at opset 17 is the default: the dynamo exporter
    also lowers index_put to one ScatterND and matches PyTorch as closely, but builds only opset >= 18 (onnx's
    down-converter cannot take this graph back to 17: "No Adapter From Version 18 for Split"), while QEfficient
    exports opset 13/17 for Cloud AI 100; it is also ~10x slower on a small CPU. sub_functions: every decoder layer
    (model.py's block class) becomes a call of one ONNX function, what qaic-compile -sub-functions compiles once for
    all layers (QEfficient's use_onnx_subfunctions, TorchScript exporter only, as there)."""
    n_layer: int
    continuous_batching: bool = False
    opset: int = 17
    dynamo: bool = False
    sub_functions: bool = False


def _without_exporter_chatter():
    """export_modules_as_functions makes the TorchScript exporter's C++ print blank lines and "Skipping module
    attribute 'freeze'" (nn.Embedding) straight to file descriptor 1, logging off or not; other lines pass."""
    return native_output_filtered(("Skipping module attribute",), fd=1, blank=False)


def _name_function_outputs(proto, outputs: list[str]) -> None:
    """With export_modules_as_functions the exporter leaves the graph outputs that a function call produces under
    generated names ("806"): give them their contract names back (by position), and name the function bodies' own
    retained-state values *_InternalRetainedState (QEfficient's spelling), so that only graph outputs carry the
    names that the compiler's -retained-state pairs with the past_* inputs. A flat graph is left as it is."""
    rename = {o.name: n for o, n in zip(proto.graph.output, outputs) if o.name != n}
    taken = {x for node in proto.graph.node for x in node.output} | {i.name for i in proto.graph.input}
    if set(rename.values()) & taken:
        raise RuntimeError(f"cannot name the graph outputs {sorted(rename.values())}: the names are taken")
    for o in proto.graph.output:
        o.name = rename.get(o.name, o.name)
    for f in proto.functions:
        rename.update((x, x.replace("_RetainedState", "_InternalRetainedState")) for x in f.output
                      if x.endswith("_RetainedState"))
    for node in [*proto.graph.node, *(n for f in proto.functions for n in f.node)]:
        node.input[:] = [rename.get(x, x) for x in node.input]
        node.output[:] = [rename.get(x, x) for x in node.output]
    for f in proto.functions:
        f.output[:] = [rename.get(x, x) for x in f.output]


def _torch_export(wrapper, example, path: Path, kind: ExportKind) -> int:
    """Trace `wrapper` to `path`; returns the opset written."""
    inputs, outputs, axes = io_spec(kind.n_layer, kind.continuous_batching)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if not kind.dynamo:
            blocks = {type(b) for b in wrapper.model.layers}  # model.py's block class
            extra = {"export_modules_as_functions": blocks} if kind.sub_functions else {}
            torch.onnx.register_custom_op_symbolic("aten::scaled_dot_product_attention", _sdpa_symbolic, kind.opset)
            # function export leaves hooks on every module (they print while the model runs on): put back the old
            hooks = [(d, dict(d)) for m in wrapper.modules() for d in (m._forward_hooks, m._forward_pre_hooks)]
            try:
                with _without_exporter_chatter() if kind.sub_functions else contextlib.nullcontext():
                    torch.onnx.export(wrapper, example, str(path), dynamo=False, opset_version=kind.opset,
                                      input_names=inputs, output_names=outputs, dynamic_axes=axes,
                                      do_constant_folding=True, **extra)
            finally:
                torch.onnx.unregister_custom_op_symbolic("aten::scaled_dot_product_attention", kind.opset)
                for d, old in hooks:
                    d.clear()
                    d.update(old)
            return kind.opset
        from torch.export import Dim
        dims = {"batch_size": Dim("batch_size", min=1, max=4096), "seq_len": Dim("seq_len", min=1, max=1 << 20),
                "ctx_len": Dim("ctx_len", min=2, max=1 << 20), "full_batch_size": Dim("full_batch_size", min=1, max=4096)}
        spec = [{k: dims[v] for k, v in axes[n].items()} for n in inputs]
        shapes = (spec[0], spec[1], tuple(spec[2:]))  # forward(input_ids, position_ids, *rest)
        prog = torch.onnx.export(wrapper, example, None, dynamo=True, dynamic_shapes=shapes, input_names=inputs,
                                 output_names=outputs, opset_version=max(kind.opset, 18), verbose=False)
        prog.save(str(path), external_data=True)
        return max(kind.opset, 18)


def export(checkpoint_path, output_dir, *, ctx_len: Optional[int] = None, max_ctx_len: Optional[int] = None,
           full_batch_size: Optional[int] = None, opset: int = 17, dynamo: bool = False, check: bool = True,
           atol: float = 1e-4, check_steps: int = 4, sub_functions: bool = False,
           log=functools.partial(print, flush=True)) -> dict:
    """Export (ExportKind), clip every float32 constant to the fp16 range (clip_to_fp16_range: the compiler's
    -convert-to-fp16 must not overflow), check on ONNX Runtime against model.py's eager forward (self_check: greedy
    tokens equal, logits close), then move model.onnx + model.onnx.data (external weights, always), model.meta.json
    and the tokenizer files into output_dir (the old graph goes first, the new one last; a failure publishes
    nothing). The metadata (vocab, ctx_len, bos/eos, n_layers, KV shape, tokenizer, sub_functions: the function
    names, ...) is also stored in the graph's metadata_props, one JSON value per key. Returns it, with the
    self-check under "check". The checkpoint is loaded once: the export borrows the model's swap points
    (retained_state) and gives them back before the self-check runs it."""
    t0 = time.perf_counter()
    ck_file, output_dir = checkpoint_file(checkpoint_path), Path(output_dir)
    if full_batch_size is not None and full_batch_size < 1:
        raise ValueError(f"--full_batch_size must be >= 1, got {full_batch_size}")
    if sub_functions and dynamo:
        raise ValueError("--sub_functions needs the TorchScript exporter (QEfficient's subfunction export); "
                         "leave out --dynamo")
    cb = full_batch_size is not None
    model = load_model(ck_file, dtype=torch.float32)
    cfg = model.config
    max_ctx = min(max_ctx_len or cfg.block_size, cfg.block_size)
    ctx = min(ctx_len or min(1024, max_ctx), max_ctx)
    tok = _load_tokenizer(ck_file.parent)

    output_dir.mkdir(parents=True, exist_ok=True)
    with temp_dir(output_dir, ".export-tmp-") as tmp:
        raw = tmp / "raw"
        raw.mkdir()
        log(f"exporting {ck_file} to ONNX ({'dynamo' if dynamo else 'TorchScript'} exporter"
            f"{', decoder layers as functions' if sub_functions else ''}) ...")
        kind = ExportKind(cfg.n_layer, cb, opset, dynamo, sub_functions)
        with torch.no_grad(), retained_state(model, cb, max_ctx, longrope_len=ctx) as wrapper:
            used_opset = _torch_export(wrapper, _example_inputs(cfg, cb), raw / "model.onnx", kind)
        release_weights(model)  # (the self-check reads them again, from the checkpoint)
        import onnx
        proto = onnx.load(str(raw / "model.onnx"))  # with its weights, wherever the exporter put them
        _name_function_outputs(proto, io_spec(cfg.n_layer, cb)[1])
        functions = [f.name for f in proto.functions]
        if sub_functions and not functions:
            raise RuntimeError("the exporter wrote no ONNX functions for the decoder layers")
        clipped = clip_to_fp16_range(proto)
        dims = proto.graph.output[0].type.tensor_type.shape.dim  # logits: shape inference cannot tell that the
        dims[0].dim_param, dims[1].dim_value = "batch_size", 1   # gathered position axis is 1
        # the tokenizer travels with the graph: --tokenizer_path <output_dir> works
        has_tok = bool(copy_tokenizer_files(ck_file.parent, tmp))
        tok_info = dict(bos_id=None, eos_id=None, stop_ids=[]) if tok is None else dict(
            bos_id=tok.bos_id, eos_id=tok.eos_id, stop_ids=sorted(tok.stop_ids))
        tok_info["tokenizer_dir"] = "." if has_tok else (str(ck_file.parent) if tok is not None else None)
        meta = dict(
            format="export_onnx/1", export_id=uuid.uuid4().hex, exporter="dynamo" if dynamo else "torchscript",
            opset=used_opset, checkpoint=str(ck_file.resolve()), checkpoint_size=ck_file.stat().st_size,
            checkpoint_mtime_ns=ck_file.stat().st_mtime_ns, vocab_size=cfg.vocab_size, ctx_len=ctx,
            max_ctx_len=max_ctx, n_layers=cfg.n_layer, n_heads=cfg.n_head, n_kv_heads=cfg.n_local_heads,
            head_dim=cfg.head_dim, kv_shape=[full_batch_size or "batch_size", cfg.n_local_heads, "ctx_len", cfg.head_dim],
            kv_dtype="float32", full_batch_size=full_batch_size, fp16_clipped_values=clipped,
            sub_functions=functions, model_args=asdict(cfg), **tok_info)
        del proto.metadata_props[:]
        for k, v in meta.items():
            proto.metadata_props.add(key=k, value=json.dumps(v))
        onnx.save_model(proto, str(tmp / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                        location="model.onnx.data", size_threshold=1024)
        del proto, dims  # (dims too: a part of a message keeps all of it, the weights included: 4.5 GB at 1B)
        shutil.rmtree(raw)
        onnx.checker.check_model(str(tmp / "model.onnx"))
        os.chmod(tmp / "model.onnx.data", 0o644)
        log(f"exported {ck_file} -> {output_dir / 'model.onnx'} ({meta['exporter']} exporter, opset {used_opset}, "
            f"{cfg.n_layer} layers{' as calls of ' + ', '.join(functions) if functions else ''}, ctx_len {ctx} "
            f"(dynamic, <= {max_ctx}){', full_batch_size %d' % full_batch_size if cb else ''}; {clipped} float "
            f"values clipped to the fp16 range) in {time.perf_counter() - t0:.1f} s")
        if check:
            t1 = time.perf_counter()
            log("checking the graph on ONNX Runtime against model.py ...")
            res = self_check(tmp / "model.onnx", model, steps=check_steps, atol=atol, tokenizer=tok)
            meta["check"] = res
            log(f"{res['summary']} ({time.perf_counter() - t1:.1f} s)")
            if not res["passed"]:
                raise RuntimeError(f"ONNX Runtime self-check failed: {res['summary']}")
        (tmp / "model.meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        # publish: the old graph goes first, the new one last, so model.onnx never points at foreign weights
        (output_dir / "model.onnx").unlink(missing_ok=True)
        for f in sorted(tmp.iterdir(), key=lambda p: p.name == "model.onnx"):
            os.replace(f, output_dir / f.name)
    return meta


# ------------------------------------------------------------------------------------------------- self-check
def release_weights(model: nn.Module) -> None:
    """Give back the resident pages of model's weights where they map its checkpoint (a float32 file loaded as
    float32), so that the graph's copy of them (the loaded ONNX graph, then ONNX Runtime's) is the only one in memory:
    a 1B float32 export peaked at 13.7 GB, now 5.9. Read again, they come back from the file."""
    for t in {t.data_ptr(): t for t in model.state_dict().values()}.values():  # (a tied table once)
        release_pages(t)


def self_check(onnx_path, model: Transformer, steps: int = 4, atol: float = 1e-4, tokenizer=None) -> dict:
    """Prefill a padded batch of two prompts of different lengths and decode `steps` greedy tokens on ONNX Runtime
    and in eager PyTorch (model.py's forward with its own KVCache, set up here); both are fed PyTorch's tokens, so
    every step compares. With a continuous-batching graph the rows go to swapped cache slots through batch_index."""
    V, S = model.config.vocab_size, graph_context(read_metadata(onnx_path))
    room = max(3, S - steps - 1)  # prompt + decode steps fit the context
    try:
        prompts = [tokenizer.encode("The capital of France is Paris, and the capital of Italy is")[:room],
                   tokenizer.encode("Hello, my name is")[:room - 1]]
    except Exception:  # no tokenizer (None), or one that fails on plain text
        prompts = None
    if not prompts or min(map(len, prompts)) == 0 or max(map(max, prompts)) >= V or len(prompts[0]) == len(prompts[1]):
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, V, (min(7, room),), generator=g).tolist(),
                   torch.randint(0, V, (min(4, room - 1),), generator=g).tolist()]
    model.setup_caches(2, S)
    eager = torch.inference_mode()(lambda tokens, pos: model(tokens, pos))
    B, T = 2, max(len(p) for p in prompts)
    tokens = torch.zeros(B, T, dtype=torch.long)
    pos = torch.full((B, T), -1, dtype=torch.long)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = torch.tensor(p)
        pos[b, :len(p)] = torch.arange(len(p))
    # PyTorch's steps first, then ONNX Runtime's on the same tokens: the model's weights go (their pages given back
    # where they map the checkpoint) before ONNX Runtime loads its copy (1B float32: 13.7 GB with both)
    last = torch.tensor([len(p) - 1 for p in prompts])
    feeds, ref = [(tokens, pos)], [eager(tokens, pos)[torch.arange(B), last]]
    while len(ref) <= steps and int(last.max()) + 1 < S:
        last = last + 1
        feeds.append((ref[-1].argmax(-1).view(B, 1), last.view(B, 1)))
        ref.append(eager(*feeds[-1])[:, -1])
    release_weights(model)
    ort_b = OnnxBackend(onnx_path, max_batch_size=2)
    slots = torch.tensor([[1], [0]]) if ort_b.continuous_batching else None
    diffs, equal, total = [], 0, 0
    for (x, p), lp in zip(feeds, ref):
        lo = ort_b.forward(x, p, batch_index=slots)[:, 0]
        diffs.append((lo - lp).abs().max().item())
        equal += int((lp.argmax(-1) == lo.argmax(-1)).sum())
        total += B
    max_diff = max(diffs)
    passed = equal == total and max_diff <= atol
    summary = (f"ONNX Runtime self-check vs PyTorch: batch of 2 (prompt lengths {len(prompts[0])} and "
               f"{len(prompts[1])}, -1 padding{', batch_index slots [1, 0]' if slots is not None else ''}), "
               f"prefill + {len(diffs) - 1} decode steps: greedy tokens equal {equal}/{total}, "
               f"max |logits diff| {max_diff:.2e} (atol {atol:.0e}): {'PASS' if passed else 'FAIL'}")
    return dict(passed=passed, tokens_equal=equal, tokens_total=total, max_abs_diff=max_diff, atol=atol,
                decode_steps=len(diffs) - 1, summary=summary)


# ------------------------------------------------------------------------------------------------- CLI
def parse_args(argv=None):
    p = ArgumentParser(description="Export a model.py checkpoint to one ONNX graph (prefill + decode, "
                                   "retained-state KV) and check it on ONNX Runtime.")
    p.add_argument("--checkpoint_path", type=Path, default=None,
                   help="model.pth from scripts/convert_checkpoint.py (default: the SmolLM2-135M-Instruct checkpoint)")
    p.add_argument("--output_dir", type=Path, default=Path("out"), help="where model.onnx (+ .data) go (default: out)")
    p.add_argument("--ctx_len", type=int, default=None, help="context length recorded as the default for runners "
                   "(the axis stays dynamic); default min(1024, max_ctx_len)", rule=at_least(1))
    p.add_argument("--max_ctx_len", type=int, default=None,
                   help="longest context the graph supports (rotary table size); default the model's block_size", rule=at_least(1))
    p.add_argument("--full_batch_size", type=int, default=None, help="continuous batching: a batch_index input", rule=at_least(1))
    p.add_argument("--opset", type=int, default=17, rule=within(7, 23))
    kind = p.add_mutually_exclusive_group()  # subfunction export is the TorchScript exporter's
    kind.add_argument("--dynamo", action="store_true", help="the dynamo exporter (opset >= 18), not TorchScript")
    kind.add_argument("--sub_functions", action="store_true", help="decoder layers as calls of one ONNX function")
    p.add_argument("--skip_check", action="store_true", help="do not run the ONNX Runtime self-check")
    p.add_argument("--atol", type=float, default=1e-3, help="self-check: largest allowed |logits difference|", rule=("> 0", lambda v: v > 0))
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    resolve_checkpoint(args)  # no --checkpoint_path: the default model
    export(args.checkpoint_path, args.output_dir, ctx_len=args.ctx_len, max_ctx_len=args.max_ctx_len,
           full_batch_size=args.full_batch_size, opset=args.opset, dynamo=args.dynamo, check=not args.skip_check,
           atol=args.atol, sub_functions=args.sub_functions)
    tok = args.output_dir if has_tokenizer(args.output_dir) else "<tokenizer dir>"
    print(f"run it: python generate.py --onnx {args.output_dir / 'model.onnx'} --tokenizer_path {tok} "
          f"--prompt \"Hello|How are you\"")


if __name__ == "__main__":
    cli(main)
