# native_files.py: what native code (AOT Inductor's C++ loader and package writer, the C++ compiler) writes, kept
# in bounds: native_tmpdir gives it a private $TMPDIR, removed however the block ends (with the processes still
# using it), and check_free_space refuses a write that a full disk would turn into an abort. Imports only the
# standard library (torch lazily).
import contextlib
import os
import secrets
import shutil
import signal
import tempfile
import time
from pathlib import Path


def _kill_users_of(d: Path) -> None:
    """SIGKILL every process whose command line names d (a compiler this process started, orphaned when its driver
    was killed: `cc1plus ... -o d/ccXXXX.s`; d's random name is this process's own), then wait (up to 2 s) until they
    are gone, so that none writes into d after it is removed."""
    killed = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError, ValueError):
            if str(d).encode() in cmdline.read_bytes() and int(cmdline.parent.name) != os.getpid():
                os.kill(int(cmdline.parent.name), signal.SIGKILL)
                killed.append(cmdline.parent)
    deadline = time.monotonic() + 2
    while killed and time.monotonic() < deadline:
        killed = [p for p in killed if p.exists() and not (p / "stat").read_text().rsplit(")", 1)[-1].startswith(" Z")]
        time.sleep(0.01)


def _pin_inductor_folders():
    with contextlib.suppress(ImportError):  # Inductor's cache stays put: its default is under $TMPDIR, pinned once
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        cache_dir()
        # and its precompiled headers' folder, fixed from $TMPDIR when codecache is first imported: imported in
        # here, every later compile of the process re-created the removed folder for them (558 MB each)
        import torch._inductor.codecache  # noqa: F401


@contextlib.contextmanager
def native_tmpdir(compiles: bool = True):
    """$TMPDIR, for the block, is a new private folder, so that the temporaries of native code run inside land there:
    AOT Inductor's package loader extracts into $TMPDIR/aotinductor_* (and left two 3.6 MB folders per failed load),
    the C++ compiler writes $TMPDIR/cc*.s. The folder is removed when the block ends; when it fails (an error,
    Ctrl-C, SIGTERM under cli) the processes still writing there (an orphaned cc1plus) are killed first. A package
    loaded inside keeps working: its libraries are mapped and its constants read by then (Linux keeps a removed
    file's data while it is mapped), so nothing waits for this process's exit, which a signal may cut short.
    compiles=False: nothing in the block imports Inductor (a package's load), so its folders need no pinning."""
    if compiles:
        _pin_inductor_folders()
    d = Path(tempfile.gettempdir()) / f"llama-flat-{secrets.token_hex(8)}"  # named before the try: see temp_dir
    saved = os.environ.get("TMPDIR")
    try:
        os.mkdir(d, 0o700)
        os.environ["TMPDIR"], tempfile.tempdir = str(d), None  # tempfile re-reads TMPDIR
        yield d
    except BaseException:
        _kill_users_of(d)
        raise
    finally:
        if saved is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved
        tempfile.tempdir = None
        shutil.rmtree(d, ignore_errors=True)


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
