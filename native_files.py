# native_files.py: what native code (AOT Inductor's C++ loader and package writer, the C++ compiler) writes, kept
# in bounds: native_tmpdir gives it a private $TMPDIR, removed however the block ends (with the processes still
# using it), and check_free_space refuses a write that a full disk would turn into an abort. Imports only the
# standard library (torch lazily).
import atexit
import contextlib
import os
import shutil
import signal
import tempfile
from pathlib import Path


def _kill_users_of(d: Path) -> None:
    """SIGKILL every process whose command line names d (a compiler this process started, orphaned when its driver
    was killed: `cc1plus ... -o d/ccXXXX.s`; d's random name is this process's own)."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError, ValueError):
            if str(d).encode() in cmdline.read_bytes() and int(cmdline.parent.name) != os.getpid():
                os.kill(int(cmdline.parent.name), signal.SIGKILL)


@contextlib.contextmanager
def native_tmpdir(keep: bool = False):
    """$TMPDIR, for the block, is a new private folder, so that the temporaries of native code run inside land there:
    AOT Inductor's package loader extracts into $TMPDIR/aotinductor_* (and left two 3.6 MB folders per failed load),
    the C++ compiler writes $TMPDIR/cc*.s. When the block fails (an error, Ctrl-C, SIGTERM under cli) the processes
    still using the folder (an orphaned cc1plus) are killed and it is removed at once; when it succeeds, at once, or
    with keep=True (a loaded package may still read its extracted files) when this process exits."""
    with contextlib.suppress(ImportError):  # Inductor's cache stays put: its default is under $TMPDIR, pinned once
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        cache_dir()
    d = Path(tempfile.mkdtemp(prefix="llama-flat-"))
    saved = os.environ.get("TMPDIR")
    os.environ["TMPDIR"], tempfile.tempdir = str(d), None  # tempfile re-reads TMPDIR
    try:
        yield d
    except BaseException:
        _kill_users_of(d)
        shutil.rmtree(d, ignore_errors=True)
        raise
    else:
        if keep:
            atexit.register(shutil.rmtree, d, True)
        else:
            shutil.rmtree(d, ignore_errors=True)
    finally:
        if saved is None:
            del os.environ["TMPDIR"]
        else:
            os.environ["TMPDIR"] = saved
        tempfile.tempdir = None


def check_free_space(output, source, margin: int = 64 << 20) -> None:
    """Before writing `output` from `source` (a checkpoint: its size is what the output and the compiler's
    temporaries each take, about), the output's folder exists and it and $TMPDIR each have that much free space
    plus `margin`. A full disk inside a native writer aborts the process (AOT Inductor: `terminate called after
    throwing c10::Error`), so it is refused before: one ValueError."""
    folder = Path(output).parent
    if not folder.is_dir():
        raise FileNotFoundError(f"output directory does not exist: {folder}")
    need = Path(source).stat().st_size + margin
    for where in dict.fromkeys((folder.resolve(), Path(tempfile.gettempdir()).resolve())):
        free = shutil.disk_usage(where).free
        if free < need:
            raise ValueError(f"not enough free space in {where} to write {output}: {free / 2**20:.0f} MiB free, "
                             f"about {need / 2**20:.0f} MiB needed")
