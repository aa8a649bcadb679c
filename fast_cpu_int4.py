# fast_cpu_int4.py: int4 prompts at the speed of bfloat16 dot products. Builds fast_cpu_int4.c with the system C
# compiler (cc, or $CC; the toolchain torch.compile needs anyway) once per machine into ~/.cache/llama-flat, loads it
# with ctypes and registers it as the opaque op llama_flat::int4_mm, which fast_cpu_quant (int4_cpu_mm) calls for the
# products of prompts on ATen's packed int4 layout, the one layout it keeps (weight-only int4; 8da4w's integer
# activations); decode keeps ATen's kernel, as fast there. The kernel runs on torch's own OpenMP threads: built with
# -fopenmp, the library binds to the libgomp.so.1 torch has loaded (threads of its own fought torch's spinning workers
# for the cores). Where it cannot run (no AVX512-BF16, no compiler, a layout other than the one it reads: a self-test
# at load; or LLAMA_FLAT_INT4_KERNEL=0), available() is False and ATen's kernel takes every product (the op too: a
# package that calls it runs anywhere). Delete both files: ATen's kernel, slower, equal up to float rounding.
import ctypes
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import torch

import torch_internals as TI
from common import atomic_path

SOURCE = Path(__file__).with_suffix(".c")
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-shared", "-fPIC", "-fopenmp", "-pipe"]
# From this many tokens per sequence the kernel runs: prompts (2 threads, int4 g32, per product against ATen's kernel:
# 8192x2048 at 2 rows 0.25 against 0.28 ms, 8 rows 0.54 against 0.79, 128 rows 6.0 against 12.9; oneDNN's bfloat16
# GEMM on a bfloat16 copy 6.6; `python fast_cpu_int4.py`). Decode's one token, batched or not, stays on ATen's kernel:
# one row is even (0.26 against 0.25), and compiled decode would reach the kernel through a Python call per product.
ROWS_FROM = 2
_LIB = None  # the kernel's C function (ctypes), once built, loaded and checked
_TRIED = False


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llama-flat"


def _build():
    """The kernel's function, compiled on first use into the cache (common.atomic_path: a killed build leaves no
    library half-written; libraries of other versions of the source are removed), or None with one line on stderr
    where the compiler fails."""
    source = SOURCE.read_bytes()
    cc = os.environ.get("CC", "cc")
    key = hashlib.sha256(source + " ".join([cc, *FLAGS]).encode()).hexdigest()[:16]
    lib = _cache_dir() / f"fast_cpu_int4-{key}.so"
    if not lib.exists():
        try:
            with atomic_path(lib) as tmp:
                subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(tmp)], check=True, capture_output=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as e:
            said = (getattr(e, "stderr", b"") or b"").decode(errors="replace").splitlines()
            said = [line for line in said if "error" in line] or said or [str(e)]
            print(f"note: int4 prompts use ATen's kernel: building {SOURCE.name} failed ({said[0].strip()})",
                  file=sys.stderr)
            return None
        for old in lib.parent.glob("fast_cpu_int4-*.so"):
            if old != lib:
                old.unlink(missing_ok=True)
    fn = ctypes.CDLL(str(lib)).llama_flat_int4_mm
    fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_long] * 4 + [ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def int4_mm(x: torch.Tensor, w: torch.Tensor, groupsize: int, sz: torch.Tensor) -> torch.Tensor:
    """aten._weight_int4pack_mm_for_cpu's product, its arguments (x [M, K] bfloat16; w and sz [K/G, N, 2], scale and
    offset, as ATen packs them), in float32: [M, N]. Where the kernel does not run, ATen's kernel."""
    (M, K), N = x.shape, sz.shape[1]
    if not (x.dtype == sz.dtype == torch.bfloat16 and w.dtype == torch.uint8 and groupsize > 0 and K % groupsize == 0
            and sz.shape == (K // groupsize, N, 2) and w.numel() * 2 == N * K):
        raise ValueError(f"int4_mm: unexpected operands x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype}, "
                         f"group size {groupsize}, sz {tuple(sz.shape)} {sz.dtype}")
    if not available():
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, groupsize, sz).float()
    x, w, sz = x.contiguous(), w.contiguous(), sz.contiguous()
    y = torch.empty(M, N, dtype=torch.float32)
    xs = torch.empty(M, K // 32, dtype=torch.float32)
    if _LIB(x.data_ptr(), w.data_ptr(), sz.data_ptr(), y.data_ptr(), xs.data_ptr(), M, N, K, groupsize,
            torch.get_num_threads()):
        raise ValueError(f"int4_mm: unsupported shape {M}x{K} @ {N}x{K}, group size {groupsize}")
    return y


def _self_test() -> bool:
    """The kernel against float64 on a weight packed by ATen here (its layout depends on the CPU's ISA)."""
    g = torch.Generator().manual_seed(0)
    N, K, M, G = 128, 128, 7, 64
    q = torch.randint(0, 16, (N, K), generator=g, dtype=torch.int32)
    sz = (torch.randn(K // G, N, 2, generator=g) * 0.1).to(torch.bfloat16)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    s, z = (sz[..., i].t().double().repeat_interleave(G, 1) for i in (0, 1))
    ref = x.double() @ ((q - 8) * s + z).t()
    y = int4_mm(x, torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), G, sz)
    return torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def takes(out_features: int, groupsize: int) -> bool:
    """Whether the kernel multiplies by such a weight here: whole blocks of 64 channels, groups of whole runs of 32
    (the shapes fast_cpu_int4.c accepts), on a machine where it runs (available)."""
    return out_features % 64 == 0 and groupsize % 32 == 0 and available()


def available() -> bool:
    """Whether int4_mm runs the kernel here (decided once per process: builds, loads and checks it; any failure is
    one line on stderr and ATen's kernel). Call it outside torch.compile's tracing."""
    global _LIB, _TRIED
    if not _TRIED:
        _TRIED = True
        wanted = os.environ.get("LLAMA_FLAT_INT4_KERNEL", "1") != "0" and sys.platform == "linux"
        if wanted and TI.cpu_has("avx512_bf16"):
            try:
                _LIB = _build()
                if _LIB is not None and not _self_test():
                    raise ValueError("its result differs from float64's: ATen's layout is not the one it reads")
            except Exception as e:  # (a missing source, a noexec cache, a library that does not load)
                print(f"note: int4 prompts use ATen's kernel: fast_cpu_int4 does not run here ({e})", file=sys.stderr)
                _LIB = None
    return _LIB is not None


if not hasattr(torch.ops.llama_flat, "int4_mm"):
    _OPS = torch.library.Library("llama_flat", "FRAGMENT")
    _OPS.define("int4_mm(Tensor x, Tensor w, int groupsize, Tensor sz) -> Tensor")
    _OPS.impl("int4_mm", int4_mm, "CPU")
    torch.library.register_fake("llama_flat::int4_mm", lib=_OPS)(
        lambda x, w, groupsize, sz: x.new_empty((x.shape[0], sz.shape[1]), dtype=torch.float32))


def _main() -> None:
    """`python fast_cpu_int4.py [threads]`: the kernel against ATen's and oneDNN's bfloat16 GEMM on a bfloat16 copy,
    per product of Llama-3.2-1B's shapes (median of 10 calls, ms)."""
    import time
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    if not available():
        raise SystemExit("error: the kernel does not run here (see the note above, or the CPU has no AVX512-BF16)")

    def ms(f):
        times = []
        for i in range(13):
            start = time.perf_counter()
            f()
            times.append(time.perf_counter() - start) if i >= 3 else None
        return sorted(times)[5] * 1e3
    print(f"threads {torch.get_num_threads()}; ms per product: ours / ATen's int4 / oneDNN bfloat16")
    for N, K in ((8192, 2048), (2048, 8192), (2048, 2048), (512, 2048)):
        q = torch.randint(0, 16, (N, K), dtype=torch.int32)
        w, sz = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), torch.randn(K // 32, N, 2).bfloat16()
        w16 = torch.randn(K, N).bfloat16()
        for M in (1, 2, 8, 16, 128):
            x = torch.randn(M, K).bfloat16()
            print(f"{N}x{K} {M:4d} rows: {ms(lambda: int4_mm(x, w, 32, sz)):6.2f} / "
                  f"{ms(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, 32, sz)):6.2f} / "
                  f"{ms(lambda: torch.mm(x, w16)):6.2f}")


if __name__ == "__main__":
    _main()
