# Over 500 lines: the compiler inputs (specializations, custom IO, partition config), the exact qaic-exec command,
# the QPC cache and QpcBackend (the qaicrt session) are one stage; each part is short.
# Compile an export_onnx.py graph for Qualcomm Cloud AI 100 with qaic-exec, and run the QPC (QpcBackend).
#
#     python compile_qaic.py --checkpoint_path checkpoints/SmolLM2-135M-Instruct/model.pth --output_dir out/ \
#         --num_cores 14 --batch_size 1 --prompt_len 32 --ctx_len 128 --mxfp6 [--mxint8] [--mos 1] \
#         [--aic_enable_depth_first] [--device_group 0,1] [--full_batch_size 4] [--dry_run]
#     python generate.py --qpc out/qpc_14cores_1bs_32pl_128cl_-1mos_1devices_mxfp6 --device_group 0 --prompt "a|b"
#
# What it does (the QEfficient flow, without QEfficient):
#   1. <output_dir>/model.onnx from export_onnx.py is used when it was exported from this checkpoint with the same
#      batching kind; otherwise the checkpoint is exported (and checked on ONNX Runtime) first.
#   2. In the cache directory <output_dir>/qpc_<cores>cores_<bs>bs_<pl>pl_<cl>cl_<mos>mos_<n>devices_<mxfp6|fp16>
#      [_mxint8][_<fbs>fbs] it writes specializations.json (prefill: seq_len = prompt_len; decode: seq_len = 1;
#      continuous batching: prefill batch 1, decode batch full_batch_size, both with full_batch_size), custom_io.yaml
#      (float16 or mxint8 for every past_* input and *_RetainedState output: the KV cache stays on the card in that
#      precision) and, for several devices, mdp.json (the multi-device partition config).
#   3. It runs qaic-exec (--qaic_exec, else $QAIC_EXEC, else /opt/qti-aic/exec/qaic-exec, else qaic-exec on PATH) with
#      -aic-binary-dir=<cache>/qpc.tmp and renames that to <cache>/qpc only when the compiler succeeded, then writes
#      qpc_done.json (command + the ONNX export id). A later run with the same command and graph reuses the QPC.
#      --dry_run stops after printing the command. Without a compiler (and without --dry_run) it stops with one
#      error line before exporting or writing anything.
#
# QpcBackend runs the QPC through the Platform SDK's Python runtime (qaicrt), QEfficient's cloud_infer.py way: one
# program, one ExecObj; the KV buffers are skipped so the cache stays on the device as retained state; the batch
# and sequence specialization is picked by the dimensions of the buffers handed in; prompts go in prompt_len chunks.
#
# Imports common.py and export_onnx.py (never generate.py, which imports QpcBackend from here lazily as a plugin).
import argparse
import functools
import importlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

import export_onnx
from common import ArgumentParser, checkpoint_file, cli, first_line, resolve_checkpoint, write_atomic

DEFAULT_QAIC_EXEC = "/opt/qti-aic/exec/qaic-exec"
COMPILER_HINT = ("Cloud AI 100 compiler qaic-exec not found: install the Qualcomm Cloud AI 100 Apps SDK "
                 f"(it provides {DEFAULT_QAIC_EXEC}), or pass --qaic_exec PATH / set QAIC_EXEC "
                 "(--dry_run writes the compiler inputs and prints the command without it)")
RUNTIME_HINT = ("running a QPC needs the Qualcomm Cloud AI 100 Platform SDK's Python runtime (qaicrt in "
                "/opt/qti-aic/dev/lib/<arch>, QAicApi_pb2 in /opt/qti-aic/dev/python): install the Cloud AI 100 "
                "Platform SDK on the host with the card")
DONE_FILE = "qpc_done.json"


# ------------------------------------------------------------------------------------------------- compiler inputs
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


def qpc_dir_name(num_cores: int, batch_size: int, prompt_len: int, ctx_len: int, mos: int, n_devices: int,
                 mxfp6: bool, mxint8: bool, full_batch_size: Optional[int] = None) -> str:
    name = (f"qpc_{num_cores}cores_{batch_size}bs_{prompt_len}pl_{ctx_len}cl_{mos}mos_{n_devices}devices_"
            f"{'mxfp6' if mxfp6 else 'fp16'}{'_mxint8' if mxint8 else ''}")
    return name + (f"_{full_batch_size}fbs" if full_batch_size else "")


def check_shapes(num_cores: int, batch_size: int, prompt_len: int, ctx_len: int, full_batch_size: Optional[int]):
    """The compile shapes' checks (main() runs them before any export; each value alone is checked by the parser)."""
    if min(num_cores, batch_size, prompt_len, ctx_len) < 1 or (full_batch_size is not None and full_batch_size < 1):
        raise ValueError("--num_cores, --batch_size, --prompt_len, --ctx_len and --full_batch_size must be positive")
    if prompt_len > ctx_len:
        raise ValueError(f"--prompt_len {prompt_len} is longer than --ctx_len {ctx_len}")
    if full_batch_size is not None and batch_size != 1:
        raise ValueError("with --full_batch_size prompts are prefilled one at a time (batch 1) and decode runs "
                         "full_batch_size rows: leave --batch_size at 1")


def make_specializations(batch_size: int, prompt_len: int, ctx_len: int, full_batch_size: Optional[int] = None) -> dict:
    """Prefill (seq_len = prompt_len) and decode (seq_len = 1) shapes of the one graph; values are strings."""
    if full_batch_size:
        fbs = str(full_batch_size)
        specs = [dict(batch_size="1", seq_len=str(prompt_len), ctx_len=str(ctx_len), full_batch_size=fbs),
                 dict(batch_size=fbs, seq_len="1", ctx_len=str(ctx_len), full_batch_size=fbs)]
    else:
        specs = [dict(batch_size=str(batch_size), seq_len=str(prompt_len), ctx_len=str(ctx_len))]
        if prompt_len != 1:
            specs.append(dict(batch_size=str(batch_size), seq_len="1", ctx_len=str(ctx_len)))
    return {"specializations": specs}


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


def make_custom_io(kv_input_names: list[str], precision: str) -> str:
    """custom_io.yaml: the KV inputs and their retained-state outputs in `precision` (float16 or mxint8)."""
    lines = ["# Model Inputs", ""]
    for n in kv_input_names:
        lines += [f" - IOName: {n}", f"   Precision: {precision}", ""]
    lines += ["# Model Outputs", ""]
    for n in kv_input_names:
        lines += [f" - IOName: {n}_RetainedState", f"   Precision: {precision}", ""]
    return "\n".join(lines)


def make_mdp_config(n_devices: int, num_cores: int) -> dict:
    """Multi-device partition: one partition over logical devices 0..n-1 (the runtime maps them to --device_group)."""
    devices = list(range(n_devices))
    return {"connections": [{"devices": devices, "type": "p2p"}],
            "partitions": [{"name": "Partition0",
                            "devices": [{"deviceId": d, "numCores": num_cores} for d in devices]}]}


def compiler_command(qaic_exec: str, onnx_path, cache_dir, *, num_cores: int, mxfp6: bool, mxint8: bool, mos: int,
                     aic_enable_depth_first: bool, n_devices: int, aic_hw_version: str = "2.0") -> list[str]:
    cache_dir = Path(cache_dir)
    cmd = [qaic_exec, "-aic-hw", f"-aic-hw-version={aic_hw_version}", f"-m={onnx_path}", "-compile-only",
           "-retained-state", "-convert-to-fp16", f"-aic-num-cores={num_cores}",
           f"-network-specialization-config={cache_dir / 'specializations.json'}",
           f"-custom-IO-list-file={cache_dir / 'custom_io.yaml'}", f"-aic-binary-dir={cache_dir / 'qpc.tmp'}"]
    if mxfp6:
        cmd.append("-mxfp6-matmul")
    if mos > 0:
        cmd.append(f"-mos={mos}")
    if aic_enable_depth_first:
        cmd.append("-aic-enable-depth-first")
    if n_devices > 1:
        if mxint8:
            cmd.append("-allow-mxint8-mdp-io")
        cmd.append(f"-mdp-load-partition-config={cache_dir / 'mdp.json'}")
    return cmd


def find_compiler(explicit=None, required: bool = True) -> Optional[str]:
    """--qaic_exec, $QAIC_EXEC, the SDK path, then PATH. None is found: FileNotFoundError saying what to do, or
    None when not required (--dry_run)."""
    def ok(p):
        return Path(p).is_file() and os.access(p, os.X_OK)
    env = os.environ.get("QAIC_EXEC")
    if explicit:
        exe, why = (str(explicit) if ok(explicit) else None), f"--qaic_exec {explicit} is not an executable file"
    elif env:
        exe, why = (env if ok(env) else None), f"QAIC_EXEC={env} is not an executable file"
    else:
        exe, why = (DEFAULT_QAIC_EXEC if ok(DEFAULT_QAIC_EXEC) else shutil.which("qaic-exec")), COMPILER_HINT
    if exe is None and required:
        raise FileNotFoundError(why)
    return exe


# ------------------------------------------------------------------------------------------------- the ONNX graph
def _graph_kv_names(onnx_path) -> tuple[list[str], bool]:
    import onnx
    try:
        m = onnx.load(str(onnx_path), load_external_data=False)
    except Exception as e:  # protobuf's DecodeError on a file that is no graph: one line, not a traceback
        raise ValueError(f"{onnx_path} is not an ONNX graph ({first_line(e, 200)})") from None
    names = [i.name for i in m.graph.input]
    return [n for n in names if n.startswith("past_")], "batch_index" in names


def ensure_onnx(checkpoint_path, output_dir: Path, onnx_path, full_batch_size, ctx_len,
                log=functools.partial(print, flush=True)) -> Path:
    """The graph to compile: --onnx_path as given, else <output_dir>/model.onnx when it was exported from this
    checkpoint with the same batching kind and a long enough context, else a fresh export there."""
    cb = full_batch_size is not None
    if onnx_path is not None:
        onnx_path = Path(onnx_path)
        if not onnx_path.is_file():
            raise FileNotFoundError(f"ONNX graph not found: {onnx_path}")
        _, has_bi = _graph_kv_names(onnx_path)
        if has_bi != cb:
            raise ValueError(f"{onnx_path} was exported {'with' if has_bi else 'without'} --full_batch_size; "
                             f"re-export it {'with' if cb else 'without'} it to match this compile")
        return onnx_path
    onnx_path = output_dir / "model.onnx"
    ns = argparse.Namespace(checkpoint_path=checkpoint_path)
    resolve_checkpoint(ns)  # no --checkpoint_path: the default model; a missing one is named as such
    ck = checkpoint_file(ns.checkpoint_path)
    reason = "no graph yet"
    if onnx_path.is_file():
        meta = export_onnx.read_metadata(onnx_path)
        _, has_bi = _graph_kv_names(onnx_path)
        st = ck.stat()
        if (meta.get("checkpoint"), meta.get("checkpoint_size"), meta.get("checkpoint_mtime_ns")) != \
                (str(ck.resolve()), st.st_size, st.st_mtime_ns):
            reason = "it was exported from another checkpoint"
        elif has_bi != cb:
            reason = f"it was exported {'with' if has_bi else 'without'} --full_batch_size"
        elif (meta.get("max_ctx_len") or 0) < ctx_len:
            reason = f"its rotary table covers {meta.get('max_ctx_len')} positions, fewer than ctx_len {ctx_len}"
        else:
            log(f"using {onnx_path} (exported from {ck})")
            return onnx_path
    log(f"{onnx_path} needs an export ({reason})")
    export_onnx.export(ck, output_dir, ctx_len=ctx_len, full_batch_size=full_batch_size, atol=1e-3, log=log)
    return onnx_path


# ------------------------------------------------------------------------------------------------- compile
def compile_qpc(onnx_path, output_dir, *, num_cores: int = 16, batch_size: int = 1, prompt_len: int = 32,
                ctx_len: int = 128, mxfp6: bool = False, mxint8: bool = False, mos: int = -1,
                aic_enable_depth_first: bool = False, device_group=(0,), full_batch_size: Optional[int] = None,
                qaic_exec: Optional[str] = None, dry_run: bool = False, aic_hw_version: str = "2.0",
                log=functools.partial(print, flush=True)) -> Path:
    """Write the compiler inputs into the cache directory and compile (or reuse) <cache>/qpc. Returns the cache dir.
    Without a compiler (unless dry_run) it raises before writing anything."""
    exe = find_compiler(qaic_exec, required=not dry_run)
    onnx_path = Path(onnx_path).resolve()
    devices = parse_device_group(device_group)
    check_shapes(num_cores, batch_size, prompt_len, ctx_len, full_batch_size)
    meta = export_onnx.read_metadata(onnx_path)
    if meta.get("max_ctx_len") and ctx_len > meta["max_ctx_len"]:
        raise ValueError(f"--ctx_len {ctx_len} exceeds what {onnx_path} supports ({meta['max_ctx_len']} positions)")
    kv, has_bi = _graph_kv_names(onnx_path)
    if not kv:
        raise ValueError(f"{onnx_path} has no past_* inputs: not a retained-state graph from export_onnx.py")
    if has_bi != (full_batch_size is not None):
        raise ValueError(f"{onnx_path} was exported {'with' if has_bi else 'without'} a batch_index input; "
                         f"compile it {'with' if has_bi else 'without'} --full_batch_size")

    cache = Path(output_dir).resolve() / qpc_dir_name(num_cores, batch_size, prompt_len, ctx_len, mos, len(devices),
                                                      mxfp6, mxint8, full_batch_size)
    cache.mkdir(parents=True, exist_ok=True)
    specs = make_specializations(batch_size, prompt_len, ctx_len, full_batch_size)
    write_atomic(cache / "specializations.json", json.dumps(specs, indent=4) + "\n")
    write_atomic(cache / "custom_io.yaml", make_custom_io(kv, "mxint8" if mxint8 else "float16"))
    if len(devices) > 1:
        write_atomic(cache / "mdp.json", json.dumps(make_mdp_config(len(devices), num_cores), indent=4) + "\n")
    else:
        (cache / "mdp.json").unlink(missing_ok=True)

    cmd = compiler_command(exe or DEFAULT_QAIC_EXEC, onnx_path, cache, num_cores=num_cores, mxfp6=mxfp6,
                           mxint8=mxint8, mos=mos, aic_enable_depth_first=aic_enable_depth_first,
                           n_devices=len(devices), aic_hw_version=aic_hw_version)
    qpc, done = cache / "qpc", cache / DONE_FILE
    record = dict(command=cmd[1:], export_id=meta.get("export_id"), onnx=str(onnx_path), device_group=devices,
                  vocab_size=meta.get("vocab_size"), n_layers=meta.get("n_layers"),
                  kv_precision="mxint8" if mxint8 else "float16", tokenizer_dir=_abs_tokenizer_dir(meta, onnx_path),
                  specializations=specs["specializations"])
    if (qpc / "programqpc.bin").is_file() and done.is_file():
        try:
            old = json.loads(done.read_text())
        except json.JSONDecodeError:
            old = {}
        if old.get("command") == record["command"] and old.get("export_id") == record["export_id"]:
            log(f"reusing {qpc} (compiled earlier with the same command and graph)")
            return cache
    log("compiler command:\n  " + shlex.join(cmd))
    if dry_run:
        log(f"dry run: compiler inputs written to {cache}; the compiler was not run")
        return cache
    tmp = cache / "qpc.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.perf_counter()
    log(f"compiling {onnx_path.name} with qaic-exec for Cloud AI 100 (minutes for a real model) ...")
    try:  # qpc.tmp goes whatever happens (failure, Ctrl-C, SIGTERM under cli()): only a finished QPC is kept
        try:
            r = subprocess.run(cmd, stdout=None, stderr=subprocess.PIPE, text=True)
        except OSError as e:
            raise RuntimeError(f"could not run {exe}: {e}") from None
        if r.stderr:
            sys.stderr.write(r.stderr if r.stderr.endswith("\n") else r.stderr + "\n")
        if r.returncode != 0 or not (tmp / "programqpc.bin").is_file():
            why = f"exited with code {r.returncode}" if r.returncode else "wrote no programqpc.bin"
            last = next((ln.strip() for ln in reversed((r.stderr or "").splitlines()) if ln.strip()), "")
            raise RuntimeError(f"qaic-exec {why}; no QPC was written{': ' + last if last else ''}")
        done.unlink(missing_ok=True)
        shutil.rmtree(qpc, ignore_errors=True)
        os.replace(tmp, qpc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    write_atomic(done, json.dumps(record, indent=2) + "\n")
    log(f"QPC written to {qpc} in {time.perf_counter() - t0:.1f} s")
    return cache


def _abs_tokenizer_dir(meta: dict, onnx_path: Path) -> Optional[str]:
    t = meta.get("tokenizer_dir")
    return None if not t else str(onnx_path.parent if t == "." else Path(t))


# ------------------------------------------------------------------------------------------------- runtime
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


# ------------------------------------------------------------------------------------------------- CLI
def parse_args(argv=None):
    p = ArgumentParser(description="Compile an export_onnx.py graph for Qualcomm Cloud AI 100 (qaic-exec).")
    p.add_argument("--checkpoint_path", type=Path, default=None, help="model.pth (exported first if needed)")
    p.add_argument("--onnx_path", type=Path, default=None, help="compile this graph instead of <output_dir>/model.onnx")
    p.add_argument("--output_dir", type=Path, default=Path("out"), help="graph and QPC cache directory (default: out)")
    p.add_argument("--num_cores", type=int, default=16, help="AI cores per device")
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--prompt_len", type=int, default=32, help="prefill chunk length")
    p.add_argument("--ctx_len", type=int, default=128, help="KV cache length")
    p.add_argument("--mxfp6", action="store_true", help="MXFP6 weights for the matmuls (-mxfp6-matmul)")
    p.add_argument("--mxint8", action="store_true", help="MXINT8 KV cache (custom IO precision)")
    p.add_argument("--mos", type=int, default=-1, help="-mos=N (effort to reduce on-chip memory); -1 = not set")
    p.add_argument("--aic_enable_depth_first", action="store_true")
    p.add_argument("--device_group", default="0", help="device ids, e.g. 0 or 0,1 (several = multi-device partition)")
    p.add_argument("--full_batch_size", type=int, default=None, help="continuous batching with this many slots")
    p.add_argument("--aic_hw_version", default="2.0")
    p.add_argument("--qaic_exec", default=None, help=f"compiler (default: $QAIC_EXEC, {DEFAULT_QAIC_EXEC}, PATH)")
    p.add_argument("--dry_run", action="store_true", help="write the compiler inputs and print the command only")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)  # flag values, --onnx_path (an ONNX graph) and --output_dir checked here
    devices = parse_device_group(args.device_group)
    check_shapes(args.num_cores, args.batch_size, args.prompt_len, args.ctx_len, args.full_batch_size)
    find_compiler(args.qaic_exec, required=not args.dry_run)  # before minutes of export: one line without the SDK
    onnx_path = ensure_onnx(args.checkpoint_path, args.output_dir, args.onnx_path, args.full_batch_size, args.ctx_len)
    cache = compile_qpc(onnx_path, args.output_dir, num_cores=args.num_cores, batch_size=args.batch_size,
                        prompt_len=args.prompt_len, ctx_len=args.ctx_len, mxfp6=args.mxfp6, mxint8=args.mxint8,
                        mos=args.mos, aic_enable_depth_first=args.aic_enable_depth_first, device_group=devices,
                        full_batch_size=args.full_batch_size, qaic_exec=args.qaic_exec, dry_run=args.dry_run,
                        aic_hw_version=args.aic_hw_version)
    if not args.dry_run:
        print(f"run it: python generate.py --qpc {cache} --device_group {','.join(map(str, devices))} "
              f"--prompt \"Hello|How are you\"")
    return cache


if __name__ == "__main__":
    cli(main)
