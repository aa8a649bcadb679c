# Over 500 lines: export, fp16 clipping, the ONNX Runtime self-check and OnnxBackend belong together (one graph
# contract); splitting them would spread that contract over several files.
# Export model.py's Transformer to ONE ONNX graph shared by prefill and decode (the graph contract Qualcomm's
# QEfficient uses for Cloud AI 100), check it on ONNX Runtime, and run it there (OnnxBackend).
#
#     python export_onnx.py --checkpoint_path checkpoints/SmolLM2-135M-Instruct/model.pth --output_dir out/
#     python export_onnx.py ... --full_batch_size 4          # continuous batching: adds a batch_index input
#     python generate.py --onnx out/model.onnx --tokenizer_path out --prompt "a|b|c"
#
# Graph contract (B = batch_size, S = seq_len, C = ctx_len; all three dynamic):
#   inputs   input_ids [B, S] int64, position_ids [B, S] int64 (-1 = padding),
#            [batch_index [B, 1] int64: the cache slot of each row, only with --full_batch_size],
#            past_key.N / past_value.N [B or full_batch_size, n_kv_heads, C, head_dim] float32, N = 0..n_layer-1
#   outputs  logits [B, 1, vocab] float32 (each row's last valid position, i.e. argmax(position_ids)),
#            past_key.N_RetainedState / past_value.N_RetainedState (the inputs with this call's K/V scattered in)
# The network is model.py's, unchanged. Two of its submodules are swapped for the export only (retained_state()
# puts them back afterwards, so the one loaded model is then the self-check's eager reference):
#   * every Attention.kv_cache (model.KVCache, buffers mutated in place) -> RetainedStateKVCache, whose update() writes
#     the new K/V into the past tensors handed in as graph inputs with one index_put (ONNX ScatterND) at
#     (slot, head, position) and records the result, which becomes the *_RetainedState output;
#   * Transformer.output (the LM head Linear) -> LastPositionHead, which keeps only each row's last valid position
#     before calling that same Linear (what QEfficient does: no [B, S, vocab] logits for a 32-token prompt chunk).
# model.forward derives the attention mask from position_ids and its cache length (set to past_key.0's dim 2 while
# tracing, so ctx_len stays a dynamic axis); there is no mask input. Padding positions (-1) write into the last cache
# slot, which only a query at position C-1 reads, after its own write (model.KVCache's convention).
#
# Exporter: the TorchScript exporter (torch.onnx.export(dynamo=False)) at opset 17 is the default. The dynamo exporter
# (--dynamo) also lowers index_put to a single ScatterND and its graph matches PyTorch as closely, but it only builds
# opset >= 18 and onnx's down-converter cannot take this graph back to 17 ("No Adapter From Version 18 for Split"),
# while the Cloud AI 100 toolchain (QEfficient) exports opset 13/17; it is also ~10x slower to export on a small CPU.
#
# After export every float32 constant is clipped to the float16 range (-65504..65504; -inf kept, as in QEfficient's
# FP16ClipTransform) so that the compiler's -convert-to-fp16 does not overflow; weights go to model.onnx.data
# (external data, always). Metadata (vocab, ctx_len, bos/eos, n_layers, KV shape, tokenizer, ...) is stored in the
# graph's metadata_props (one JSON value per key) and in model.meta.json beside it; the tokenizer files are copied
# next to the graph. Files are written to a temporary directory, checked on ONNX Runtime against model.py's eager
# forward (prefill of a padded batch + decode steps: greedy tokens equal, logits close) and only then moved into place.
#
# Imports model.py, common.py and tokenizer.py only; generate.py imports OnnxBackend from here lazily (a plugin).
import contextlib
import functools
import json
import os
import shutil
import time
import uuid
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn as nn
from torch import Tensor

from common import (ArgumentParser, checkpoint_file, cli, copy_tokenizer_files, has_tokenizer, resolve_checkpoint,
                    temp_dir)
from model import Transformer
from quantize import load_model

FP16_MAX = float(np.finfo(np.float16).max)  # 65504


# ------------------------------------------------------------------------------------------ the swapped submodules
class RetainedStateKVCache(nn.Module):
    """Drop-in for model.KVCache during export: the cache is an explicit tensor (a graph input), not a buffer.
    update() scatters k/v [B, H, T, D] into `past` at (slot, head, position) and returns the rows the batch attends
    over; the updated tensors are kept in new_k/new_v for the wrapper to return as *_RetainedState outputs."""

    def __init__(self):
        super().__init__()
        self.past_k: Optional[Tensor] = None
        self.past_v: Optional[Tensor] = None
        self.new_k: Optional[Tensor] = None
        self.new_v: Optional[Tensor] = None

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor, batch_index: Optional[Tensor] = None):
        B, H, T, _ = k.shape
        S = self.past_k.shape[2]
        pos = input_pos.expand(B, -1) if input_pos.dim() == 1 else input_pos
        pos = torch.where(pos >= 0, pos, S - 1)  # padding -> last slot (model.KVCache's convention)
        slots = torch.arange(B, device=k.device) if batch_index is None else batch_index.reshape(B)
        idx = (slots.view(B, 1, 1).expand(B, H, T),
               torch.arange(H, device=k.device).view(1, H, 1).expand(B, H, T),
               pos.view(B, 1, T).expand(B, H, T))
        self.new_k = self.past_k.index_put(idx, k)  # ONNX ScatterND, indices [B, H, T, 3]
        self.new_v = self.past_v.index_put(idx, v)
        if batch_index is None:
            return self.new_k, self.new_v
        return self.new_k[slots], self.new_v[slots]


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
        for i, cache in enumerate(self.caches):
            cache.past_k, cache.past_v = past[2 * i], past[2 * i + 1]
        self.model.max_seq_length = past[0].shape[2]  # the mask spans ctx_len, a dynamic axis
        self.model.output.index = position_ids.argmax(1, keepdim=True)
        logits = self.model(input_ids, position_ids, batch_index)
        out = [logits]
        for cache in self.caches:
            out += [cache.new_k, cache.new_v]
        return tuple(out)


@contextlib.contextmanager
def retained_state(model: Transformer, continuous_batching: bool, rope_len: int, longrope_len: Optional[int] = None):
    """Yield the export wrapper around `model` with its swap points taken over (every layer.attention.kv_cache ->
    RetainedStateKVCache, the LM head -> LastPositionHead, rotary tables covering every position the graph may run
    at, ctx_len <= rope_len; Phi-3's longrope factors chosen for a cache of longrope_len, default rope_len), and put
    the model's own modules back on exit: nothing is copied (the wrapper uses the model's weight tensors) and
    afterwards the model runs eagerly as before."""
    tables = ("rope", "rope_local")
    saved = ([layer.attention.kv_cache for layer in model.layers], model.output,
             {t: getattr(model, t) for t in tables if hasattr(model, t)}, model.max_batch_size, model.max_seq_length)
    caches = [RetainedStateKVCache() for _ in model.layers]
    for layer, cache in zip(model.layers, caches):
        layer.attention.kv_cache = cache
    model.output = LastPositionHead(model.output)
    model.set_rope(rope_len, torch.float32, longrope_len=longrope_len)
    model.max_batch_size = -1
    try:
        yield RetainedStateWrapper(model, continuous_batching, caches).eval()
    finally:
        for layer, cache in zip(model.layers, saved[0]):
            layer.attention.kv_cache = cache
        model.output = saved[1]
        for t in tables:
            if hasattr(model, t):
                delattr(model, t)
        for t, v in saved[2].items():
            model.register_buffer(t, v, persistent=False)
        model.max_batch_size, model.max_seq_length = saved[3], saved[4]


# ------------------------------------------------------------------------------------------------- names and shapes
def kv_names(n_layer: int) -> list[str]:
    return [f"past_{kind}.{i}" for i in range(n_layer) for kind in ("key", "value")]


def io_spec(n_layer: int, continuous_batching: bool):
    inputs = ["input_ids", "position_ids"] + (["batch_index"] if continuous_batching else []) + kv_names(n_layer)
    outputs = ["logits"] + [n + "_RetainedState" for n in kv_names(n_layer)]
    rows = "full_batch_size" if continuous_batching else "batch_size"
    axes = {"input_ids": {0: "batch_size", 1: "seq_len"}, "position_ids": {0: "batch_size", 1: "seq_len"},
            "logits": {0: "batch_size"}}
    if continuous_batching:
        axes["batch_index"] = {0: "batch_size"}
    for n in kv_names(n_layer):
        axes[n] = axes[n + "_RetainedState"] = {0: rows, 2: "ctx_len"}
    return inputs, outputs, axes


# ------------------------------------------------------------------------------------------------- fp16 clipping
def _all_tensors(graph):
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from _all_tensors(attr.g)
            for g in attr.graphs:
                yield from _all_tensors(g)


def clip_to_fp16_range(model_proto) -> int:
    """Clip every float32 tensor in the graph (initializers, Constant / ConstantOfShape values, subgraphs) to
    [-65504, 65504], keeping -inf (an additive mask stays a mask in float16). Returns how many values changed.
    Tensors must be loaded (not external)."""
    from onnx import TensorProto, numpy_helper
    changed = 0
    for t in _all_tensors(model_proto.graph):
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
def _json_values(pairs) -> dict:
    """metadata_props (key, value) pairs -> dict; values are JSON (strings that are not stay strings)."""
    meta = {}
    for k, v in pairs:
        try:
            meta[k] = json.loads(v)
        except json.JSONDecodeError:
            meta[k] = v
    return meta


def read_metadata(onnx_path) -> dict:
    """The export metadata of a graph written by this script (from its metadata_props)."""
    import onnx
    m = onnx.load(str(onnx_path), load_external_data=False)
    return _json_values((p.key, p.value) for p in m.metadata_props)


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


def _torch_export(wrapper, example, path: Path, n_layer: int, cb: bool, opset: int, dynamo: bool):
    inputs, outputs, axes = io_spec(n_layer, cb)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if not dynamo:
            torch.onnx.register_custom_op_symbolic("aten::scaled_dot_product_attention", _sdpa_symbolic, opset)
            try:
                torch.onnx.export(wrapper, example, str(path), dynamo=False, opset_version=opset, input_names=inputs,
                                  output_names=outputs, dynamic_axes=axes, do_constant_folding=True)
            finally:
                torch.onnx.unregister_custom_op_symbolic("aten::scaled_dot_product_attention", opset)
            return opset
        from torch.export import Dim
        dims = {"batch_size": Dim("batch_size", min=1, max=4096), "seq_len": Dim("seq_len", min=1, max=1 << 20),
                "ctx_len": Dim("ctx_len", min=2, max=1 << 20), "full_batch_size": Dim("full_batch_size", min=1, max=4096)}
        spec = [{k: dims[v] for k, v in axes[n].items()} for n in inputs]
        shapes = (spec[0], spec[1], tuple(spec[2:]))  # forward(input_ids, position_ids, *rest)
        prog = torch.onnx.export(wrapper, example, None, dynamo=True, dynamic_shapes=shapes, input_names=inputs,
                                 output_names=outputs, opset_version=max(opset, 18), verbose=False)
        prog.save(str(path), external_data=True)
        return max(opset, 18)


def export(checkpoint_path, output_dir, *, ctx_len: Optional[int] = None, max_ctx_len: Optional[int] = None,
           full_batch_size: Optional[int] = None, opset: int = 17, dynamo: bool = False, check: bool = True,
           atol: float = 1e-4, check_steps: int = 4, log=functools.partial(print, flush=True)) -> dict:
    """Export, clip, check on ONNX Runtime, then move model.onnx (+ .data, .meta.json, tokenizer files) into
    output_dir. Returns the metadata, with the self-check result under "check". The checkpoint is loaded once: the
    export borrows the model's swap points (retained_state) and gives them back before the self-check runs it."""
    t0 = time.perf_counter()
    ck_file, output_dir = checkpoint_file(checkpoint_path), Path(output_dir)
    if full_batch_size is not None and full_batch_size < 1:
        raise ValueError(f"--full_batch_size must be >= 1, got {full_batch_size}")
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
        log(f"exporting {ck_file} to ONNX ({'dynamo' if dynamo else 'TorchScript'} exporter) ...")
        with torch.no_grad(), retained_state(model, cb, max_ctx, longrope_len=ctx) as wrapper:
            used_opset = _torch_export(wrapper, _example_inputs(cfg, cb), raw / "model.onnx", cfg.n_layer, cb,
                                       opset, dynamo)
        import onnx
        proto = onnx.load(str(raw / "model.onnx"))  # with its weights, wherever the exporter put them
        clipped = clip_to_fp16_range(proto)
        for o in proto.graph.output:  # shape inference cannot tell that the gathered position axis is 1
            if o.name == "logits":
                dims = o.type.tensor_type.shape.dim
                dims[0].dim_param, dims[1].dim_value = "batch_size", 1
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
            model_args=asdict(cfg), **tok_info)
        del proto.metadata_props[:]
        for k, v in meta.items():
            proto.metadata_props.add(key=k, value=json.dumps(v))
        onnx.save_model(proto, str(tmp / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                        location="model.onnx.data", size_threshold=1024)
        del proto
        shutil.rmtree(raw)
        onnx.checker.check_model(str(tmp / "model.onnx"))
        os.chmod(tmp / "model.onnx.data", 0o644)
        log(f"exported {ck_file} -> {output_dir / 'model.onnx'} ({meta['exporter']} exporter, opset {used_opset}, "
            f"{cfg.n_layer} layers, ctx_len {ctx} (dynamic, <= {max_ctx}){', full_batch_size %d' % full_batch_size if cb else ''}; "
            f"{clipped} float values clipped to the fp16 range) in {time.perf_counter() - t0:.1f} s")
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
def self_check(onnx_path, model: Transformer, steps: int = 4, atol: float = 1e-4, tokenizer=None) -> dict:
    """Prefill a padded batch of two prompts of different lengths and decode `steps` greedy tokens on ONNX Runtime
    and in eager PyTorch (model.py's forward with its own KVCache, set up here); both are fed PyTorch's tokens, so
    every step compares. With a continuous-batching graph the rows go to swapped cache slots through batch_index."""
    V = model.config.vocab_size
    ort_b = OnnxBackend(onnx_path, max_batch_size=2)
    room = max(3, ort_b.max_seq_length - steps - 1)  # prompt + decode steps fit the context
    prompts = None
    if tokenizer is not None:
        try:
            prompts = [tokenizer.encode("The capital of France is Paris, and the capital of Italy is")[:room],
                       tokenizer.encode("Hello, my name is")[:room - 1]]
        except Exception:
            prompts = None
    if not prompts or min(map(len, prompts)) == 0 or max(map(max, prompts)) >= V or len(prompts[0]) == len(prompts[1]):
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, V, (min(7, room),), generator=g).tolist(),
                   torch.randint(0, V, (min(4, room - 1),), generator=g).tolist()]
    model.setup_caches(2, ort_b.max_seq_length)

    def eager(tokens, pos):
        with torch.inference_mode():
            return model(tokens, pos)

    B, T = 2, max(len(p) for p in prompts)
    tokens = torch.zeros(B, T, dtype=torch.long)
    pos = torch.full((B, T), -1, dtype=torch.long)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = torch.tensor(p)
        pos[b, :len(p)] = torch.arange(len(p))
    slots = torch.tensor([[1], [0]]) if ort_b.continuous_batching else None
    last = torch.tensor([len(p) - 1 for p in prompts])
    lp = eager(tokens, pos)[torch.arange(B), last]
    lo = ort_b.forward(tokens, pos, batch_index=slots)[:, 0]
    diffs, equal, total = [(lo - lp).abs().max().item()], 0, 0
    for step in range(steps + 1):
        nxt_p, nxt_o = lp.argmax(-1), lo.argmax(-1)
        equal += int((nxt_p == nxt_o).sum())
        total += B
        if step == steps or int(last.max()) + 1 >= ort_b.max_seq_length:
            break
        last = last + 1
        lp = eager(nxt_p.view(B, 1), last.view(B, 1))[:, -1]
        lo = ort_b.forward(nxt_p.view(B, 1), last.view(B, 1), batch_index=slots)[:, 0]
        diffs.append((lo - lp).abs().max().item())
    max_diff = max(diffs)
    passed = equal == total and max_diff <= atol
    summary = (f"ONNX Runtime self-check vs PyTorch: batch of 2 (prompt lengths {len(prompts[0])} and "
               f"{len(prompts[1])}, -1 padding{', batch_index slots [1, 0]' if slots is not None else ''}), "
               f"prefill + {len(diffs) - 1} decode steps: greedy tokens equal {equal}/{total}, "
               f"max |logits diff| {max_diff:.2e} (atol {atol:.0e}): {'PASS' if passed else 'FAIL'}")
    return dict(passed=passed, tokens_equal=equal, tokens_total=total, max_abs_diff=max_diff, atol=atol,
                decode_steps=len(diffs) - 1, summary=summary)


# ------------------------------------------------------------------------------------------------- the backend
class OnnxBackend:
    """generate.py backend running an export_onnx.py graph on ONNX Runtime (CPU).

    The KV cache lives here as numpy arrays [slots, n_kv_heads, ctx_len, head_dim] per layer; each call feeds them as
    past_* inputs and keeps the *_RetainedState outputs for the next call. forward(tokens [B, T], input_pos [T] or
    [B, T], batch_index=None or [B] / [B, 1]) returns logits [B, 1, V] (each row's last valid position).
    batch_index maps rows to cache slots (continuous batching); it works with both graph kinds: a graph exported with
    --full_batch_size takes it as an input, for the other kind the rows' slots are gathered and scattered here."""

    prefill_chunk = None  # the graph takes any seq_len

    def __init__(self, path, max_batch_size: int = 1, ctx_len: Optional[int] = None, threads: Optional[int] = None):
        import onnxruntime as ort
        path = Path(path)
        if path.is_dir():
            path = path / "model.onnx"
        if not path.is_file():
            raise FileNotFoundError(f"ONNX graph not found: {path}")
        so = ort.SessionOptions()
        so.log_severity_level = 3
        if threads:
            so.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        self.meta = _json_values(self.session.get_modelmeta().custom_metadata_map.items())
        inputs = {i.name: i for i in self.session.get_inputs()}
        self.kv_names = [n for n in inputs if n.startswith("past_")]
        if not self.kv_names or "input_ids" not in inputs or "position_ids" not in inputs:
            raise ValueError(f"{path} is not a graph from export_onnx.py (needs input_ids, position_ids, past_*)")
        self.continuous_batching = "batch_index" in inputs
        self.output_names = ["logits"] + [n + "_RetainedState" for n in self.kv_names]
        shape = inputs[self.kv_names[0]].shape  # [rows, n_kv_heads, ctx_len, head_dim]
        max_ctx = self.meta.get("max_ctx_len")
        self.max_seq_length = int(ctx_len or self.meta.get("ctx_len") or 2048)
        if max_ctx and self.max_seq_length > max_ctx:
            raise ValueError(f"ctx_len {self.max_seq_length} exceeds the graph's rotary table ({max_ctx} positions)")
        self.max_batch_size = int(max_batch_size)
        self.vocab_size = self.meta.get("vocab_size")
        tdir = self.meta.get("tokenizer_dir")
        self.tokenizer_dir = None if not tdir else (path.parent if tdir == "." else Path(tdir))
        n_kv, head_dim = int(shape[1]), int(shape[3])
        self.past = [np.zeros((self.max_batch_size, n_kv, self.max_seq_length, head_dim), np.float32)
                     for _ in self.kv_names]

    def forward(self, tokens, input_pos, batch_index=None):
        tokens = np.ascontiguousarray(torch.as_tensor(tokens).cpu().numpy(), dtype=np.int64)
        B, T = tokens.shape
        pos = torch.as_tensor(input_pos).cpu().numpy().astype(np.int64)
        pos = np.ascontiguousarray(np.broadcast_to(pos, (B, T)) if pos.ndim == 1 else pos)
        if pos.shape != (B, T):
            raise ValueError(f"input_pos {tuple(pos.shape)} does not match tokens {(B, T)}")
        if pos.max() >= self.max_seq_length:
            raise ValueError(f"position {int(pos.max())} is outside the context of {self.max_seq_length} tokens")
        slots = None
        if batch_index is not None:
            slots = torch.as_tensor(batch_index).cpu().numpy().astype(np.int64).reshape(B)
            if slots.min() < 0 or slots.max() >= self.max_batch_size:
                raise ValueError(f"batch_index {slots.tolist()} outside the {self.max_batch_size} cache slots")
        elif B > self.max_batch_size:
            raise ValueError(f"{B} rows but the backend holds at most {self.max_batch_size} sequences")
        feed = {"input_ids": tokens, "position_ids": pos}
        if self.continuous_batching:  # the graph scatters into the slots itself: hand it every slot
            feed["batch_index"] = (np.arange(B, dtype=np.int64) if slots is None else slots).reshape(B, 1)
        if self.continuous_batching or (slots is None and B == self.max_batch_size):
            feed.update(zip(self.kv_names, self.past))
            out = self.session.run(self.output_names, feed)
            self.past = out[1:]
        else:  # a subset of the rows, or rows mapped to slots: gather them, run, scatter the result back
            rows = np.arange(B) if slots is None else slots
            feed.update((n, p[rows]) for n, p in zip(self.kv_names, self.past))
            out = self.session.run(self.output_names, feed)
            for p, new in zip(self.past, out[1:]):
                p[rows] = new
        return torch.from_numpy(out[0])


# ------------------------------------------------------------------------------------------------- CLI
def parse_args(argv=None):
    p = ArgumentParser(description="Export a model.py checkpoint to one ONNX graph (prefill + decode, "
                                   "retained-state KV) and check it on ONNX Runtime.")
    p.add_argument("--checkpoint_path", type=Path, default=None,
                   help="model.pth from scripts/convert_checkpoint.py (default: the SmolLM2-135M-Instruct checkpoint)")
    p.add_argument("--output_dir", type=Path, default=Path("out"), help="where model.onnx (+ .data) go (default: out)")
    p.add_argument("--ctx_len", type=int, default=None,
                   help="context length recorded as the default for runners (the axis stays dynamic); default "
                        "min(1024, max_ctx_len)")
    p.add_argument("--max_ctx_len", type=int, default=None,
                   help="longest context the graph supports (rotary table size); default the model's block_size")
    p.add_argument("--full_batch_size", type=int, default=None,
                   help="continuous batching: add a batch_index input mapping rows to cache slots")
    p.add_argument("--opset", type=int, default=17)
    p.add_argument("--dynamo", action="store_true", help="use the dynamo exporter (opset >= 18) instead of TorchScript")
    p.add_argument("--skip_check", action="store_true", help="do not run the ONNX Runtime self-check")
    p.add_argument("--atol", type=float, default=1e-3, help="self-check: largest allowed |logits difference|")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    resolve_checkpoint(args)  # no --checkpoint_path: the default model
    export(args.checkpoint_path, args.output_dir, ctx_len=args.ctx_len, max_ctx_len=args.max_ctx_len,
           full_batch_size=args.full_batch_size, opset=args.opset, dynamo=args.dynamo, check=not args.skip_check,
           atol=args.atol)
    tok = args.output_dir if has_tokenizer(args.output_dir) else "<tokenizer dir>"
    print(f"run it: python generate.py --onnx {args.output_dir / 'model.onnx'} --tokenizer_path {tok} "
          f"--prompt \"Hello|How are you\"")


if __name__ == "__main__":
    cli(main)
