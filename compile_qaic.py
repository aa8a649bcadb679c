# compile_qaic.py: a checkpoint to text on Qualcomm Cloud AI 100 in one command (QEfficient's cloud/infer.py, flat):
# the export_onnx.py graph (exported if needed), the compiler inputs, the QPC from the SDK's compiler (qaic-compile on
# current SDKs, qaic-exec on older ones; reused while compiler, version, flags and graph are the same), then --prompt
# runs it on the card (onnx_backends.QpcBackend). docs/cloud_ai_100.md: which SDK gets which exact command.
#
#     python compile_qaic.py --checkpoint_path checkpoints/SmolLM2-135M-Instruct/model.pth --num_cores 14 \
#         --prompt "My name is|The capital of France is" [--mxfp6] [--mxint8] [--sub_functions] [--device_group 0,1]
#     python compile_qaic.py --checkpoint_path ... --num_cores 14 --dry_run   # any machine: inputs + the command
#     python generate.py --qpc out/qpc_14cores_1bs_32pl_128cl_-1mos_1devices_fp16 --device_group 0 --prompt "a|b"
#
# Imports common.py, export_onnx.py and onnx_backends.py (QpcBackend is re-exported for engine.py); engine.py and
# tokenizer.py only to generate text.
import argparse
import functools
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import export_onnx
from common import ArgumentParser, at_least, checkpoint_file, cli, first_line, resolve_checkpoint, within, write_atomic
from onnx_backends import DONE_FILE, QpcBackend, check_runtime, parse_device_group, read_specializations  # noqa: F401

SDK_EXEC = "/opt/qti-aic/exec"
APPS_VERSION_FILE = "/opt/qti-aic/versions/apps.xml"  # the Apps SDK's version file (QEfficient reads base_version)
ENV = {"qaic-compile": "QAIC_COMPILE", "qaic-exec": "QAIC_EXEC"}
# -aic-hw-version as each CLI spells it: qaic-compile takes the product name (ai100; ai200 for AI 200, which
# QEfficient detects with qaic-util), qaic-exec (SDKs before qaic-compile) the hardware revision of AI 100, 2.0
HW_VERSIONS = {"qaic-compile": {"ai100": "ai100", "2.0": "ai100", "ai200": "ai200"},
               "qaic-exec": {"ai100": "2.0", "2.0": "2.0"}}
COMPILER_HINT = ("Cloud AI 100 compiler not found (neither qaic-compile nor qaic-exec): install the Qualcomm Cloud "
                 f"AI 100 Apps SDK (it provides {SDK_EXEC}/qaic-compile, or {SDK_EXEC}/qaic-exec before it), or pass "
                 "--compiler PATH / set QAIC_COMPILE (--dry_run writes the compiler inputs and prints the command "
                 "without it)")


# ------------------------------------------------------------------------------------------------- the compiler
@dataclass(frozen=True)
class Compiler:
    """A compiler CLI: kind is the spelling it takes ("qaic-compile": current Apps SDKs and QEfficient, which calls
    qaic-exec deprecated; "qaic-exec": older SDKs), path the executable (None: --dry_run without the SDK), version
    what it reports (compiler_version)."""
    kind: str
    path: Optional[str]
    version: str = "none (not installed)"

    @property
    def exe(self) -> str:
        return self.path or f"{SDK_EXEC}/{self.kind}"


def _executable(p) -> bool:
    return Path(p).is_file() and os.access(p, os.X_OK)


def compiler_version(path: str) -> str:
    """`<compiler> -v` (its first line), else the Apps SDK's version file (apps.xml's base_version), else unknown."""
    try:
        r = subprocess.run([path, "-v"], capture_output=True, text=True, timeout=120)
        line = next((ln.strip() for ln in (r.stdout + "\n" + r.stderr).splitlines() if ln.strip()), "")
        if r.returncode == 0 and line:
            return line
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        import xml.etree.ElementTree as ET
        v = ET.parse(APPS_VERSION_FILE).getroot().find(".//base_version")
        if v is not None and (v.text or "").strip():
            return f"Apps SDK {v.text.strip()} ({APPS_VERSION_FILE})"
    except (OSError, ET.ParseError):
        pass
    return "unknown"


def find_compiler(choice: Optional[str] = None, required: bool = True) -> Compiler:
    """choice None: qaic-compile first ($QAIC_COMPILE, the SDK's path, PATH), then qaic-exec ($QAIC_EXEC, the SDK's
    path, PATH). choice "qaic-compile" / "qaic-exec": that CLI only. Any other choice is a path: that executable, its
    kind from its name (qaic-exec* spells as qaic-exec, anything else as qaic-compile). Nothing found:
    FileNotFoundError saying what to do, or a Compiler without a path when not required (--dry_run)."""
    kinds = [choice] if choice in ENV else list(ENV)
    if choice and choice not in ENV:
        if not _executable(choice):
            raise FileNotFoundError(f"--compiler {choice} is neither qaic-compile, qaic-exec nor an executable file")
        kind = "qaic-exec" if Path(choice).name.startswith("qaic-exec") else "qaic-compile"
        return Compiler(kind, str(choice), compiler_version(str(choice)))
    for kind in kinds:
        env = os.environ.get(ENV[kind])
        if env and not _executable(env):
            raise FileNotFoundError(f"{ENV[kind]}={env} is not an executable file")
        exe = env or (f"{SDK_EXEC}/{kind}" if _executable(f"{SDK_EXEC}/{kind}") else shutil.which(kind))
        if exe:
            return Compiler(kind, exe, compiler_version(exe))
    if required:
        raise FileNotFoundError(COMPILER_HINT if choice is None else
                                f"{choice} not found (${ENV[choice]}, {SDK_EXEC}/{choice}, PATH): " + COMPILER_HINT)
    return Compiler(kinds[0], None)


# ------------------------------------------------------------------------------------------------- compiler inputs
@dataclass(frozen=True)
class CompileOptions:
    """What to compile; checked on construction (before anything loads), against a compiler by check_for().
    device_group: several devices = one multi-device (tensor-slicing) partition. mos: -mos=N, effort to reduce
    on-chip memory (-1 = not set); mdts_mos: -mdts-mos=N, the same across the devices of a partition (qaic-compile,
    several devices). sub_functions: the graph's decoder layers are ONNX functions, compiled once (-sub-functions,
    qaic-compile). full_batch_size: continuous batching (prefill batch 1, decode full_batch_size)."""
    num_cores: int = 16
    batch_size: int = 1
    prompt_len: int = 32
    ctx_len: int = 128
    mxfp6: bool = False
    mxint8: bool = False
    mos: int = -1
    mdts_mos: int = -1
    aic_enable_depth_first: bool = False
    device_group: tuple = (0,)
    full_batch_size: Optional[int] = None
    sub_functions: bool = False
    aic_hw_version: Optional[str] = None  # None: AI 100, spelled as the compiler expects

    def __post_init__(self):
        object.__setattr__(self, "device_group", tuple(parse_device_group(self.device_group)))
        if min(self.num_cores, self.batch_size, self.prompt_len, self.ctx_len) < 1 or \
                (self.full_batch_size is not None and self.full_batch_size < 1):
            raise ValueError("--num_cores, --batch_size, --prompt_len, --ctx_len and --full_batch_size must be "
                             "positive")
        if self.prompt_len > self.ctx_len:
            raise ValueError(f"--prompt_len {self.prompt_len} is longer than --ctx_len {self.ctx_len}")
        if self.full_batch_size is not None and self.batch_size != 1:
            raise ValueError("with --full_batch_size prompts are prefilled one at a time (batch 1) and decode runs "
                             "full_batch_size rows: leave --batch_size at 1")
        if min(self.mos, self.mdts_mos) < -1:
            raise ValueError("--mos and --mdts_mos must be >= -1 (-1 = not set)")
        if self.mdts_mos > 0 and len(self.device_group) < 2:
            raise ValueError("--mdts_mos splits weights across the devices of a partition: it needs several devices "
                             "(--device_group 0,1,...)")

    def check_for(self, compiler: Compiler) -> None:
        """The options this compiler's CLI has: qaic-exec (older SDKs) compiles neither ONNX functions nor AI 200,
        and has no -mdts-mos."""
        hw, old = self.aic_hw_version or "ai100", compiler.kind == "qaic-exec"
        wants = [("--sub_functions", self.sub_functions and old), ("--mdts_mos", self.mdts_mos > 0 and old),
                 (f"--aic_hw_version {hw}", hw not in HW_VERSIONS[compiler.kind])]
        missing = [flag for flag, used in wants if used]
        if missing:
            raise ValueError(f"{' and '.join(missing)} need{'s' if len(missing) == 1 else ''} qaic-compile (a current "
                             f"Cloud AI 100 Apps SDK); the compiler here is {compiler.kind} ({compiler.exe})")

    def dir_name(self) -> str:
        """The cache directory's name: the shapes and options (the record inside decides whether a QPC is reused)."""
        name = (f"qpc_{self.num_cores}cores_{self.batch_size}bs_{self.prompt_len}pl_{self.ctx_len}cl_{self.mos}mos_"
                f"{len(self.device_group)}devices_{'mxfp6' if self.mxfp6 else 'fp16'}")
        name += "_mxint8" if self.mxint8 else ""
        name += f"_{self.full_batch_size}fbs" if self.full_batch_size else ""
        name += f"_{self.mdts_mos}mdtsmos" if self.mdts_mos > 0 else ""
        return name + ("_subfn" if self.sub_functions else "") + (f"_{self.aic_hw_version}" if
                                                                  self.aic_hw_version == "ai200" else "")


def make_specializations(batch_size: int, prompt_len: int, ctx_len: int, full_batch_size: Optional[int] = None) -> dict:
    """Prefill (seq_len = prompt_len) and decode (seq_len = 1) shapes of the one graph, keyed by the graph's dynamic
    axes. Every value is a string: the compiler rejects numbers there."""
    if full_batch_size:
        fbs = str(full_batch_size)
        specs = [dict(batch_size="1", seq_len=str(prompt_len), ctx_len=str(ctx_len), full_batch_size=fbs),
                 dict(batch_size=fbs, seq_len="1", ctx_len=str(ctx_len), full_batch_size=fbs)]
    else:
        specs = [dict(batch_size=str(batch_size), seq_len=str(prompt_len), ctx_len=str(ctx_len))]
        if prompt_len != 1:
            specs.append(dict(batch_size=str(batch_size), seq_len="1", ctx_len=str(ctx_len)))
    return {"specializations": [{k: str(v) for k, v in s.items()} for s in specs]}


def make_custom_io(kv_input_names: list[str], precision: str) -> str:
    """custom_io.yaml: every past_* input and its *_RetainedState output in `precision` (float16, or mxint8 for a
    compressed KV cache): the KV cache stays on the card in that precision."""
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


def compiler_command(compiler: Compiler, onnx_path, cache_dir, opts: CompileOptions) -> list[str]:
    """The command, spelled for compiler.kind. Both: -aic-hw -aic-hw-version=<HW_VERSIONS> -m=<graph>
    -retained-state -convert-to-fp16 -aic-num-cores=N -network-specialization-config -custom-IO-list-file
    -aic-binary-dir, then -mxfp6-matmul, -mos=N, -aic-enable-depth-first and, for several devices,
    -allow-mxint8-mdp-io and -mdp-load-partition-config. qaic-exec also needs -compile-only (it would run the
    network otherwise); qaic-compile only compiles (QEfficient dropped -compile-only with it) and adds -mdts-mos=N
    and -sub-functions."""
    cache_dir, new = Path(cache_dir), compiler.kind == "qaic-compile"
    hw = HW_VERSIONS[compiler.kind][opts.aic_hw_version or "ai100"]
    cmd = [compiler.exe, "-aic-hw", f"-aic-hw-version={hw}", f"-m={onnx_path}", *([] if new else ["-compile-only"]),
           "-retained-state", "-convert-to-fp16", f"-aic-num-cores={opts.num_cores}",
           f"-network-specialization-config={cache_dir / 'specializations.json'}",
           f"-custom-IO-list-file={cache_dir / 'custom_io.yaml'}", f"-aic-binary-dir={cache_dir / 'qpc.tmp'}"]
    cmd += ["-mxfp6-matmul"] if opts.mxfp6 else []
    cmd += [f"-mos={opts.mos}"] if opts.mos > 0 else []
    cmd += ["-aic-enable-depth-first"] if opts.aic_enable_depth_first else []
    if len(opts.device_group) > 1:
        cmd += ["-allow-mxint8-mdp-io"] if opts.mxint8 else []
        cmd += [f"-mdp-load-partition-config={cache_dir / 'mdp.json'}"]
        cmd += [f"-mdts-mos={opts.mdts_mos}"] if opts.mdts_mos > 0 else []
    return cmd + (["-sub-functions"] if opts.sub_functions else [])


# ------------------------------------------------------------------------------------------------- the ONNX graph
def graph_info(onnx_path) -> dict:
    """past_* input names, whether there is a batch_index input, and the graph's ONNX functions (sub-functions)."""
    import onnx
    try:
        m = onnx.load(str(onnx_path), load_external_data=False)
    except Exception as e:  # protobuf's DecodeError on a file that is no graph: one line, not a traceback
        raise ValueError(f"{onnx_path} is not an ONNX graph ({first_line(e, 200)})") from None
    names = [i.name for i in m.graph.input]
    return dict(kv=[n for n in names if n.startswith("past_")], batch_index="batch_index" in names,
                functions=[f.name for f in m.functions])


def _mismatch(info: dict, opts: CompileOptions) -> Optional[str]:
    """How a graph's kind differs from what opts compile, or None."""
    for flag, has, wants in (("--full_batch_size", info["batch_index"], opts.full_batch_size is not None),
                             ("--sub_functions", bool(info["functions"]), opts.sub_functions)):
        if has != wants:
            return f"it was exported {'with' if has else 'without'} {flag}"
    return None


def ensure_onnx(checkpoint_path, output_dir: Path, onnx_path, opts: CompileOptions,
                log=functools.partial(print, flush=True)) -> Path:
    """The graph to compile: --onnx_path as given (its kind must match), else <output_dir>/model.onnx when it was
    exported from this checkpoint with the same kind (batch_index, sub-functions) and a long enough rotary table,
    else a fresh export there (checked on ONNX Runtime first)."""
    if onnx_path is not None:
        onnx_path = Path(onnx_path)
        if not onnx_path.is_file():
            raise FileNotFoundError(f"ONNX graph not found: {onnx_path}")
        why = _mismatch(graph_info(onnx_path), opts)
        if why:
            raise ValueError(f"{onnx_path} does not match this compile: {why}; re-export it (export_onnx.py) to match")
        return onnx_path
    onnx_path = Path(output_dir) / "model.onnx"
    ns = argparse.Namespace(checkpoint_path=checkpoint_path)
    resolve_checkpoint(ns)  # no --checkpoint_path: the default model; a missing one is named as such
    ck = checkpoint_file(ns.checkpoint_path)
    reason = "no graph yet"
    if onnx_path.is_file():
        meta, st = export_onnx.read_metadata(onnx_path), ck.stat()
        if (meta.get("checkpoint"), meta.get("checkpoint_size"), meta.get("checkpoint_mtime_ns")) != \
                (str(ck.resolve()), st.st_size, st.st_mtime_ns):
            reason = "it was exported from another checkpoint"
        elif (meta.get("max_ctx_len") or 0) < opts.ctx_len:
            reason = f"its rotary table covers {meta.get('max_ctx_len')} positions, fewer than ctx_len {opts.ctx_len}"
        else:
            reason = _mismatch(graph_info(onnx_path), opts)
            if reason is None:
                log(f"using {onnx_path} (exported from {ck})")
                return onnx_path
    log(f"{onnx_path} needs an export ({reason})")
    export_onnx.export(ck, output_dir, ctx_len=opts.ctx_len, full_batch_size=opts.full_batch_size, atol=1e-3,
                       sub_functions=opts.sub_functions, log=log)
    return onnx_path


# ------------------------------------------------------------------------------------------------- compile
def compile_qpc(onnx_path, output_dir, opts: CompileOptions, compiler: Compiler, dry_run: bool = False,
                log=functools.partial(print, flush=True)) -> Path:
    """Write specializations.json, custom_io.yaml and (several devices) mdp.json into the cache directory
    <output_dir>/<opts.dir_name()>, then compile into <cache>/qpc.tmp and rename it to <cache>/qpc only when the
    compiler succeeded and wrote programqpc.bin (QEfficient's mark of a finished QPC); qpc_done.json records the
    compiler, its version, the command, the inputs and the graph's export id. A QPC whose record matches all of
    them is reused. dry_run stops after printing the command. Returns the cache directory."""
    if compiler.path is None and not dry_run:
        compiler = find_compiler(compiler.kind)  # or the one-line hint
    opts.check_for(compiler)
    onnx_path = Path(onnx_path).resolve()
    meta, info = export_onnx.read_metadata(onnx_path), graph_info(onnx_path)
    if meta.get("max_ctx_len") and opts.ctx_len > meta["max_ctx_len"]:
        raise ValueError(f"--ctx_len {opts.ctx_len} exceeds what {onnx_path} supports "
                         f"({meta['max_ctx_len']} positions)")
    if not info["kv"]:
        raise ValueError(f"{onnx_path} has no past_* inputs: not a retained-state graph from export_onnx.py")
    why = _mismatch(info, opts)
    if why:
        raise ValueError(f"{onnx_path} does not match this compile: {why}")

    cache = Path(output_dir).resolve() / opts.dir_name()
    cache.mkdir(parents=True, exist_ok=True)
    specs = make_specializations(opts.batch_size, opts.prompt_len, opts.ctx_len, opts.full_batch_size)
    inputs = {"specializations.json": json.dumps(specs, indent=4) + "\n",
              "custom_io.yaml": make_custom_io(info["kv"], "mxint8" if opts.mxint8 else "float16")}
    if len(opts.device_group) > 1:
        inputs["mdp.json"] = json.dumps(make_mdp_config(len(opts.device_group), opts.num_cores), indent=4) + "\n"
    else:
        (cache / "mdp.json").unlink(missing_ok=True)
    for name, text in inputs.items():
        write_atomic(cache / name, text)

    cmd = compiler_command(compiler, onnx_path, cache, opts)
    qpc, done = cache / "qpc", cache / DONE_FILE
    record = dict(compiler=compiler.kind, compiler_path=compiler.exe, compiler_version=compiler.version,
                  command=cmd[1:], inputs_sha256=hashlib.sha256("".join(inputs.values()).encode()).hexdigest(),
                  export_id=meta.get("export_id"), onnx=str(onnx_path), options=asdict(opts),
                  vocab_size=meta.get("vocab_size"), n_layers=meta.get("n_layers"), sub_functions=info["functions"],
                  kv_precision="mxint8" if opts.mxint8 else "float16", tokenizer_dir=_tokenizer_dir(meta, onnx_path),
                  specializations=specs["specializations"])
    key = ("compiler", "compiler_version", "command", "inputs_sha256", "export_id")
    if (qpc / "programqpc.bin").is_file() and done.is_file():
        try:
            old = json.loads(done.read_text())
        except json.JSONDecodeError:
            old = {}
        if all(old.get(k) == record[k] for k in key):
            log(f"reusing {qpc} (compiled earlier by {compiler.kind} {compiler.version}, same command and graph)")
            return cache
    log("compiler command:\n  " + shlex.join(cmd))
    if dry_run:
        log(f"dry run: compiler inputs written to {cache}; the compiler was not run")
        return cache
    tmp = cache / "qpc.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.perf_counter()
    log(f"compiling {onnx_path.name} with {compiler.kind} for Cloud AI 100 (minutes for a real model; the "
        f"compiler's own progress follows) ...")
    try:  # qpc.tmp goes whatever happens (failure, Ctrl-C, SIGTERM under cli()): only a finished QPC is kept
        try:
            r = subprocess.run(cmd, stdout=None, stderr=subprocess.PIPE, text=True)
        except OSError as e:
            raise RuntimeError(f"could not run {compiler.exe}: {e}") from None
        if r.stderr:
            sys.stderr.write(r.stderr if r.stderr.endswith("\n") else r.stderr + "\n")
        if r.returncode != 0 or not (tmp / "programqpc.bin").is_file():
            why = f"exited with code {r.returncode}" if r.returncode else "wrote no programqpc.bin"
            last = next((ln.strip() for ln in reversed((r.stderr or "").splitlines()) if ln.strip()), "")
            raise RuntimeError(f"{compiler.kind} {why}; no QPC was written{': ' + last if last else ''}")
        done.unlink(missing_ok=True)
        shutil.rmtree(qpc, ignore_errors=True)
        os.replace(tmp, qpc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    write_atomic(done, json.dumps(record, indent=2) + "\n")
    log(f"QPC written to {qpc} in {time.perf_counter() - t0:.1f} s")
    return cache


def _tokenizer_dir(meta: dict, onnx_path: Path) -> Optional[str]:
    t = meta.get("tokenizer_dir")
    return None if not t else str(onnx_path.parent if t == "." else Path(t))


# ------------------------------------------------------------------------------------------------- run
def generate_text(cache, prompts: list[str], max_new_tokens: int, device_group=(0,), tokenizer_path=None,
                  log=functools.partial(print, file=sys.stderr, flush=True)) -> list[str]:
    """Greedy text for `prompts` from a compiled QPC on the card (QEfficient's infer does greedy decoding too):
    batch_size prompts at a time, or continuous batching on a --full_batch_size QPC. Prints each prompt with its
    completion and the timing; returns the texts."""
    import torch
    import engine
    from tokenizer import load_tokenizer
    backend = QpcBackend(cache, device_group=",".join(map(str, device_group)))
    tok = load_tokenizer(tokenizer_path or backend.tokenizer_dir)
    ids = [tok.encode(p) for p in prompts]
    if any(len(x) == 0 for x in ids):
        raise ValueError("empty prompt (and the tokenizer adds no BOS): nothing to condition on")
    log(f"running {len(ids)} prompt{'s' if len(ids) > 1 else ''} on Cloud AI 100 device(s) {list(device_group)} ...")
    cpu, n = torch.device("cpu"), backend.max_batch_size
    if backend.full_batch_size:
        out, st = engine.generate_continuous(backend, ids, max_new_tokens, cpu, n, stop_ids=tok.stop_ids)
    else:  # rounds of the compiled batch size
        out, st = [], None
        for i in range(0, len(ids), n):
            o, st = engine.generate(backend, ids[i:i + n], max_new_tokens, cpu, stop_ids=tok.stop_ids)
            out += o
    texts = [p + tok.decode(o) for p, o in zip(prompts, out)]
    for t in texts:
        print(t + "\n" + "-" * 40, flush=True)
    log(f"TTFT {st['ttft_s'] * 1000:.1f} ms | decode {st['decode_tok_s']:.2f} tok/s | {st['new_tokens']} new tokens")
    return texts


# ------------------------------------------------------------------------------------------------- CLI
def parse_args(argv=None):
    p = ArgumentParser(description="Checkpoint to text on Qualcomm Cloud AI 100: export, compile (qaic-compile or "
                                   "qaic-exec), run.")
    p.add_argument("--checkpoint_path", type=Path, default=None, help="model.pth (exported first if needed)")
    p.add_argument("--onnx_path", type=Path, default=None, help="compile this graph instead of <output_dir>/model.onnx")
    p.add_argument("--output_dir", type=Path, default=Path("out"), help="graph and QPC cache directory (default: out)")
    p.add_argument("--num_cores", type=int, default=16, help="AI cores per device", rule=within(1, 16))
    p.add_argument("--batch_size", type=int, default=1, rule=at_least(1))
    p.add_argument("--prompt_len", type=int, default=32, help="prefill chunk length", rule=at_least(1))
    p.add_argument("--ctx_len", type=int, default=128, help="KV cache length", rule=at_least(1))
    p.add_argument("--mxfp6", action="store_true", help="MXFP6 weights for the matmuls (-mxfp6-matmul)")
    p.add_argument("--mxint8", action="store_true", help="MXINT8 KV cache (custom IO precision)")
    p.add_argument("--mos", type=int, default=-1, help="-mos=N (effort to reduce on-chip memory); -1 = not set", rule=(">= -1 (-1 = not set)", lambda v: v >= -1))
    p.add_argument("--mdts_mos", type=int, default=-1,
                   help="-mdts-mos=N (the same across a multi-device partition; qaic-compile); -1 = not set")
    p.add_argument("--aic_enable_depth_first", action="store_true")
    p.add_argument("--device_group", default="0", help="device ids, e.g. 0 or 0,1 (several = multi-device partition)")
    p.add_argument("--full_batch_size", type=int, default=None, help="continuous batching with this many slots", rule=at_least(1))
    p.add_argument("--sub_functions", action="store_true",
                   help="export decoder layers as ONNX functions and compile them once (-sub-functions; qaic-compile)")
    p.add_argument("--aic_hw_version", default=None, choices=["ai100", "ai200", "2.0"],
                   help="default AI 100: ai100 for qaic-compile, 2.0 for qaic-exec")
    p.add_argument("--compiler", default=None, metavar="qaic-compile|qaic-exec|PATH",
                   help=f"default: qaic-compile ($QAIC_COMPILE, {SDK_EXEC}, PATH), else qaic-exec ($QAIC_EXEC, ...)")
    p.add_argument("--qaic_exec", default=None, metavar="PATH", help="an older SDK's qaic-exec at PATH")
    p.add_argument("--dry_run", action="store_true", help="write the compiler inputs and print the command only")
    p.add_argument("--prompt", default=None, help="then generate from these prompts ('|' separates) on the card")
    p.add_argument("--max_new_tokens", type=int, default=None, help="with --prompt (default: up to ctx_len)", rule=at_least(1))
    args = p.parse_args(argv)
    if args.compiler and args.qaic_exec:
        raise ValueError("choose one of --compiler and --qaic_exec")
    return args


def main(argv=None):
    args = parse_args(argv)  # flag values, --onnx_path (an ONNX graph) and --output_dir checked here
    opts = CompileOptions(args.num_cores, args.batch_size, args.prompt_len, args.ctx_len, args.mxfp6, args.mxint8,
                          args.mos, args.mdts_mos, args.aic_enable_depth_first, args.device_group,
                          args.full_batch_size, args.sub_functions, args.aic_hw_version)
    if args.qaic_exec:
        if not _executable(args.qaic_exec):
            raise FileNotFoundError(f"--qaic_exec {args.qaic_exec} is not an executable file")
        compiler = Compiler("qaic-exec", args.qaic_exec, compiler_version(args.qaic_exec))
    else:  # before minutes of export: one line without the SDK
        compiler = find_compiler(args.compiler, required=not args.dry_run)
    opts.check_for(compiler)
    if args.prompt is not None and not args.dry_run:
        check_runtime()  # running needs the Platform SDK too: say so before exporting or compiling
    print(f"compiler: {compiler.exe} ({compiler.kind}, version: {compiler.version})", flush=True)
    onnx_path = ensure_onnx(args.checkpoint_path, args.output_dir, args.onnx_path, opts)
    cache = compile_qpc(onnx_path, args.output_dir, opts, compiler, dry_run=args.dry_run)
    if args.dry_run:
        return cache
    devices = ",".join(map(str, opts.device_group))
    if args.prompt is None:
        print(f"run it: python compile_qaic.py <the same flags> --prompt \"Hello|How are you\", or python generate.py "
              f"--qpc {cache} --device_group {devices} --prompt \"Hello|How are you\"")
        return cache
    generate_text(cache, args.prompt.split("|"), args.max_new_tokens or opts.ctx_len, opts.device_group)
    return cache


if __name__ == "__main__":
    cli(main)
