# onnx_backends.py: the backends that run export_onnx.py's graph (one graph contract: retained-state KV cache,
# position_ids with -1 padding, batch_index slots): on ONNX Runtime (OnnxBackend, generate.py --onnx) and, compiled by
# compile_qaic.py, on Qualcomm Cloud AI 100 through the Platform SDK's Python runtime qaicrt (QaicSession and
# QpcBackend, generate.py --qpc, compile_qaic.py --prompt; QEfficient's generation/cloud_infer.py way). Nothing here
# needs the SDK until a QPC is loaded. Imports nothing from this repo; export_onnx.py and compile_qaic.py re-export
# OnnxBackend and QpcBackend for engine.py.
import importlib
import json
import platform
import sys
from pathlib import Path
from typing import Optional

import numpy as np
import torch

RUNTIME_HINT = ("running a QPC needs the Qualcomm Cloud AI 100 Platform SDK's Python runtime (qaicrt in "
                "/opt/qti-aic/dev/lib/<arch>, QAicApi_pb2 in /opt/qti-aic/dev/python): install the Cloud AI 100 "
                "Platform SDK on the host with the card")
DONE_FILE = "qpc_done.json"  # compile_qaic.py's record of a finished compile, beside qpc/


# ------------------------------------------------------------------------------------------------- ONNX Runtime
def json_metadata(pairs) -> dict:
    """An export_onnx.py graph's metadata_props (key, value) pairs -> dict; values are JSON (others stay strings)."""
    def value(v):
        try:
            return json.loads(v)
        except json.JSONDecodeError:
            return v
    return {k: value(v) for k, v in pairs}


def graph_context(meta: dict, ctx_len: Optional[int] = None) -> int:
    """The context a graph runs with: ctx_len if given, else the one it was exported for (its metadata), else 2048."""
    return int(ctx_len or meta.get("ctx_len") or 2048)


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
        self.meta = json_metadata(self.session.get_modelmeta().custom_metadata_map.items())
        inputs = {i.name: i for i in self.session.get_inputs()}
        self.kv_names = [n for n in inputs if n.startswith("past_")]
        if not self.kv_names or "input_ids" not in inputs or "position_ids" not in inputs:
            raise ValueError(f"{path} is not a graph from export_onnx.py (needs input_ids, position_ids, past_*)")
        self.continuous_batching = "batch_index" in inputs
        self.output_names = ["logits"] + [n + "_RetainedState" for n in self.kv_names]
        shape = inputs[self.kv_names[0]].shape  # [rows, n_kv_heads, ctx_len, head_dim]
        max_ctx = self.meta.get("max_ctx_len")
        self.max_seq_length = graph_context(self.meta, ctx_len)
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


# ------------------------------------------------------------------------------------------------- Cloud AI 100
def check_runtime() -> None:
    """ImportError (one line naming the Platform SDK) unless qaicrt can be imported: compile_qaic.py --prompt asks
    before it exports or compiles anything."""
    _import_runtime()


def parse_device_group(device_group) -> list[int]:
    if isinstance(device_group, (list, tuple)):
        ids = [int(d) for d in device_group]
    else:
        text = str(device_group).strip().strip("[]")
        try:
            ids = [int(d) for d in text.split(",") if d.strip()]
        except ValueError:
            raise ValueError(f"--device_group must be comma-separated device ids such as 0,1; got {device_group!r}")
    if not ids or len(set(ids)) != len(ids) or min(ids) < 0:
        raise ValueError(f"--device_group needs distinct non-negative device ids; got {device_group!r}")
    return ids


def read_specializations(path) -> dict:
    """specializations.json -> prompt_len, ctx_len, batch_size (prefill), decode_batch_size, full_batch_size."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (compile_qaic.py writes it next to the qpc directory)")
    try:
        specs = json.loads(path.read_text())["specializations"]
        specs = [{k: int(v) for k, v in s.items()} for s in specs]
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: not a specializations file ({type(e).__name__}: {e})") from None
    if not specs or any(k not in s for s in specs for k in ("batch_size", "seq_len", "ctx_len")):
        raise ValueError(f"{path}: every specialization needs batch_size, seq_len and ctx_len")
    prefill = max(specs, key=lambda s: s["seq_len"])
    decode = min(specs, key=lambda s: s["seq_len"])
    if decode["seq_len"] != 1:
        raise ValueError(f"{path}: no decode specialization (seq_len 1)")
    if len({s["ctx_len"] for s in specs}) != 1:
        raise ValueError(f"{path}: the specializations disagree on ctx_len")
    return dict(prompt_len=prefill["seq_len"], ctx_len=prefill["ctx_len"], batch_size=prefill["batch_size"],
                decode_batch_size=decode["batch_size"], full_batch_size=prefill.get("full_batch_size"))


def _import_runtime():
    """qaicrt and QAicApi_pb2 from the Platform SDK (imported only when a QPC is run), from sys.path or the SDK."""
    modules = []
    for name, sdk_dir in (("qaicrt", f"/opt/qti-aic/dev/lib/{platform.machine()}"),
                          ("QAicApi_pb2", "/opt/qti-aic/dev/python")):
        try:
            modules.append(importlib.import_module(name))
        except ImportError:
            sys.path.append(sdk_dir)
            try:
                modules.append(importlib.import_module(name))
            except ImportError:
                raise ImportError(RUNTIME_HINT) from None
    return modules


class QaicSession:
    """One loaded QPC on one device group (after QEfficient's generation/cloud_infer.py QAICInferenceSession):
    buffers are bound by index; a buffer handed in with its dimensions selects the specialization; a buffer set to
    an empty array is skipped (the retained-state KV stays on the card)."""

    def __init__(self, qpc_path, device_ids: list[int]):
        qaicrt, aicapi = _import_runtime()
        self.rt = qaicrt
        self.np_dtype = {getattr(aicapi, name): np.dtype(dt) for name, dt in (
            ("FLOAT_TYPE", np.float32), ("FLOAT_16_TYPE", np.float16), ("INT64_I_TYPE", np.int64),
            ("INT32_I_TYPE", np.int32), ("INT8_Q_TYPE", np.int8), ("UINT8_Q_TYPE", np.uint8),
            ("INT16_Q_TYPE", np.int16), ("INT32_Q_TYPE", np.int32), ("INT8_TYPE", np.int8)) if hasattr(aicapi, name)}
        self.context = qaicrt.Context(qaicrt.QIDList(device_ids))
        self.queue = qaicrt.Queue(self.context, device_ids[0])
        qpc = qaicrt.Qpc(str(qpc_path))
        status, iodesc_data = qpc.getIoDescriptor()
        if status != qaicrt.QStatus.QS_SUCCESS:
            raise RuntimeError(f"cannot read the IO descriptor of {qpc_path}")
        iodesc = aicapi.IoDesc()
        iodesc.ParseFromString(bytes(iodesc_data))
        self.bindings = list(iodesc.selected_set.bindings)
        self.index = {b.name: b.index for b in self.bindings}
        self.input_names = [b.name for b in self.bindings if b.dir == aicapi.BUFFER_IO_TYPE_INPUT]
        self.output_names = [b.name for b in self.bindings if b.dir == aicapi.BUFFER_IO_TYPE_OUTPUT]
        props = qaicrt.QAicProgramProperties()
        props.dataPathTimeoutMs = 60_000
        single = device_ids[0] if len(device_ids) == 1 else None
        if len(device_ids) > 1:
            props.devMapping = ":".join(map(str, device_ids))
        self.program = qaicrt.Program(self.context, single, qpc, props)
        if self.program.load() != qaicrt.QStatus.QS_SUCCESS:
            raise RuntimeError(f"cannot load {qpc_path} on devices {device_ids}")
        self.program.activate()
        self.exec_obj = qaicrt.ExecObj(self.context, self.program)
        self.qbuffers = [qaicrt.QBuffer(bytes(b.size)) for b in self.bindings]
        self.buf_dims = qaicrt.BufferDimensionsVecRef(
            [(self.np_dtype[b.type].itemsize, list(b.dims)) for b in self.bindings])

    def binding_dims(self, name: str) -> list[int]:
        return list(self.bindings[self.index[name]].dims)

    def set_buffers(self, buffers: dict):
        for name, arr in buffers.items():
            i = self.index[name]
            self.qbuffers[i] = self.rt.QBuffer(arr.tobytes())
            self.buf_dims[i] = (arr.itemsize, arr.shape if arr.ndim else (1,))

    def skip_buffers(self, names):
        self.set_buffers({n: np.array([]) for n in names})

    def run(self, inputs: dict) -> dict:
        rt = self.rt
        self.set_buffers(inputs)
        if self.exec_obj.setData(self.qbuffers, self.buf_dims) != rt.QStatus.QS_SUCCESS:
            raise RuntimeError("qaicrt: setData failed")
        if self.queue.enqueue(self.exec_obj) != rt.QStatus.QS_SUCCESS:
            raise RuntimeError("qaicrt: enqueue failed")
        if self.exec_obj.waitForCompletion() != rt.QStatus.QS_SUCCESS:
            shapes = {n: tuple(a.shape) for n, a in inputs.items()}
            raise RuntimeError(f"qaicrt: run failed (no specialization matches the buffers {shapes}?)")
        status, out = self.exec_obj.getData()
        if status != rt.QStatus.QS_SUCCESS:
            raise RuntimeError("qaicrt: getData failed")
        result = {}
        for name in self.output_names:
            i = self.index[name]
            if self.qbuffers[i].size == 0:  # skipped (retained state)
                continue
            result[name] = np.frombuffer(bytes(out[i]), self.np_dtype[self.bindings[i].type]).reshape(
                self.buf_dims[i][1])
        return result


def resolve_qpc(path) -> tuple[Path, Path]:
    """(program dir holding programqpc.bin, cache dir holding specializations.json) for a cache dir or its qpc/."""
    p = Path(path)
    if (p / "qpc" / "programqpc.bin").is_file():
        return p / "qpc", p
    if (p / "programqpc.bin").is_file():
        return p, p.parent
    raise FileNotFoundError(f"no compiled QPC at {p} (expected {p}/qpc/programqpc.bin from compile_qaic.py)")


class QpcBackend:
    """generate.py backend for a compile_qaic.py QPC on Cloud AI 100 (device_group "0" or "0,1", ...).

    max_batch_size is the compiled batch size (or full_batch_size with continuous batching), max_seq_length the
    compiled ctx_len, prefill_chunk the compiled prompt_len: prompts go in chunks of exactly that many tokens (a
    shorter or longer call is padded with position -1 / split here). Fewer rows than compiled are padded with
    position -1 rows. forward(..., batch_index) maps rows to cache slots (continuous-batching QPC: prefill runs one
    row at a time with batch_index [[slot]], decode runs all full_batch_size slots; a QPC without batch_index serves
    rows at their own slots only)."""

    def __init__(self, qpc_dir, device_group="0", session=None):
        self.qpc_path, self.cache_dir = resolve_qpc(qpc_dir)
        spec = read_specializations(self.cache_dir / "specializations.json")
        self.prefill_chunk = spec["prompt_len"]
        self.max_seq_length = spec["ctx_len"]
        self.full_batch_size = spec["full_batch_size"]
        self.batch_size = spec["batch_size"]
        self.max_batch_size = self.full_batch_size or self.batch_size
        self.device_ids = parse_device_group(device_group)
        done = self.cache_dir / DONE_FILE
        self.record = json.loads(done.read_text()) if done.is_file() else {}
        td = self.record.get("tokenizer_dir")
        self.tokenizer_dir = Path(td) if td else None
        self.session = session if session is not None else QaicSession(self.qpc_path, self.device_ids)
        self.vocab_size = self.record.get("vocab_size") or self.session.binding_dims("logits")[-1]
        kv = [n for n in self.session.input_names if n.startswith("past_")]
        kv += [n for n in self.session.output_names if n.endswith("_RetainedState")]
        self.session.skip_buffers(kv)  # the KV cache never leaves the card
        self._logits_rows = None

    def _run(self, tokens: np.ndarray, pos: np.ndarray, slots: Optional[np.ndarray]) -> np.ndarray:
        rows = tokens.shape[0]
        if rows != self._logits_rows:
            self.session.set_buffers({"logits": np.zeros((rows, 1, self.vocab_size), np.float32)})
            self._logits_rows = rows
        inputs = {"input_ids": np.ascontiguousarray(tokens), "position_ids": np.ascontiguousarray(pos)}
        if self.full_batch_size:
            inputs["batch_index"] = slots.reshape(rows, 1).astype(np.int64)
        return self.session.run(inputs)["logits"].reshape(rows, -1)

    def forward(self, tokens, input_pos, batch_index=None):
        tokens = torch.as_tensor(tokens).cpu().numpy().astype(np.int64)
        B, T = tokens.shape
        pos = torch.as_tensor(input_pos).cpu().numpy().astype(np.int64)
        pos = np.broadcast_to(pos, (B, T)).copy() if pos.ndim == 1 else pos.copy()
        if pos.max() >= self.max_seq_length:
            raise ValueError(f"position {int(pos.max())} is outside the compiled context of {self.max_seq_length}")
        slots = np.arange(B) if batch_index is None else \
            torch.as_tensor(batch_index).cpu().numpy().astype(np.int64).reshape(B)
        if B > self.max_batch_size or slots.min() < 0 or slots.max() >= self.max_batch_size:
            raise ValueError(f"rows {B} / slots {slots.tolist()} do not fit the QPC's {self.max_batch_size} slots")
        if not self.full_batch_size and not np.array_equal(slots, np.arange(B)):
            raise ValueError("this QPC was compiled without --full_batch_size: rows can only use their own slots")
        out = np.zeros((B, self.vocab_size), np.float32)
        if T == 1:
            # decode: every compiled row runs; missing rows get position -1 and a free slot
            n = self.full_batch_size or self.batch_size
            free = [s for s in range(n) if s not in set(slots.tolist())]
            tok = np.zeros((n, 1), np.int64)
            p = np.full((n, 1), -1, np.int64)
            tok[:B], p[:B] = tokens, pos
            all_slots = np.concatenate([slots, np.array(free[:n - B], np.int64)])
            out[:] = self._run(tok, p, all_slots)[:B]
        else:
            # prefill in prompt_len chunks; a row's logits come from the chunk holding its last valid position
            L = self.prefill_chunk
            W = -(-T // L) * L
            tok = np.zeros((B, W), np.int64)
            p = np.full((B, W), -1, np.int64)
            tok[:, :T], p[:, :T] = tokens, pos
            last = p.max(1)
            groups = [[b] for b in range(B)] if self.full_batch_size else [list(range(B))]
            for rows in groups:
                n = len(rows) if self.full_batch_size else self.batch_size
                for s in range(0, W, L):
                    ct = np.zeros((n, L), np.int64)
                    cp = np.full((n, L), -1, np.int64)
                    ct[:len(rows)], cp[:len(rows)] = tok[rows, s:s + L], p[rows, s:s + L]
                    if (cp < 0).all():
                        continue
                    logits = self._run(ct, cp, slots[rows])
                    for i, b in enumerate(rows):
                        if last[b] >= 0 and (p[b, s:s + L] == last[b]).any():
                            out[b] = logits[i]
        return torch.from_numpy(out).unsqueeze(1)
