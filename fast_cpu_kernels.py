# fast_cpu_kernels.py: quantized (and AVX2's bfloat16) products at the memory's rate (one row) and at the speed of dot
# products (prompts). Builds fast_cpu_kernels.c (AVX-512 + BF16 and AVX2 + FMA kernels; ISA says which run here) and
# runner-aoti/kernel_ops.cpp (its torch ops and int4's C shim) with the system compilers (cc and c++, or $CC and $CXX;
# the toolchain torch.compile needs anyway) once per machine into ~/.cache/llama-flat and loads the library (compiled
# code calls its ops through the dispatcher, packages int4's through a C shim: aoti_shims; no Python):
#   llama_flat::int4_tiles_mm  by this file's tiles (make_tiles), the one int4 layout fast_cpu_quant and packages keep
#                              where the kernels run, read at every length;
#   llama_flat::int8_words_mm  by fast_cpu_quant's int8 word layout, in place (decode; AVX2: every length);
#   llama_flat::bf16_mm        by bfloat16 weights as stored (fast_cpu.Bf16Linear: AVX2, where oneDNN has none);
#   llama_flat::q8a4w_mm       8da4w by fast_cpu_8da4w.c's records (make_8da4w_records; qexport.X86Linear), the op
#                              of et_export.py --x86_kernels, whose ExecuTorch kernel load_et_kernels builds.
# The kernels run on torch's own OpenMP threads: built with -fopenmp, the library binds to the libgomp.so.1 torch has
# loaded (threads of its own fought torch's spinning workers for the cores). Where they cannot run (no AVX2, no
# compiler, a failed self-test, or LLAMA_FLAT_KERNELS=0), available() is False, fast_cpu_quant keeps ATen's layouts
# and kernels and Inductor's word kernels, and bfloat16 linears F.linear. Delete both files and fast_cpu_8da4w.c (and
# kernel_ops.cpp from runner-aoti's CMakeLists.txt): those kernels, slower, equal up to float rounding; runner-et then
# builds without its x86 kernel, and et_export.py --x86_kernels says it cannot.
import ctypes
import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import torch

import torch_internals as TI
from common import atomic_path, first_line
from qops import on_bf16_grid

SOURCE = Path(__file__).with_suffix(".c")
SOURCE_8DA4W = Path(__file__).with_name("fast_cpu_8da4w.c")  # (8da4w's kernel: its torch op, ExecuTorch's)
OPS = Path(__file__).parent / "runner-aoti" / "kernel_ops.cpp"
FLAGS = ["-O3", "-fPIC", "-fopenmp", "-pipe"]  # (each kernel names its ISA: AVX-512 + BF16 or AVX2 + FMA)
_LIB = None  # True once the library is built, loaded and checked (available)
_TRIED = False
_LOADED = None  # whether the library's ops are registered (_load: tried once per process)
_ET = None  # ExecuTorch's kernel library, once loaded (load_et_kernels)
_CDLL = None  # this library, loaded (_load)
ISA = 0  # which kernels the loaded library runs here: 2 AVX-512 (+ BF16), 1 AVX2 (+ FMA), 0 none


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llama-flat"


def _cached_library(name: str, what: str, sources: list, build, older: tuple = ()) -> Path:
    """~/.cache/llama-flat/{name}-{key}.so, keyed by the sources' bytes and `what` (compilers, flags, versions), built
    on first use by the commands build(tmp) returns (common.atomic_path: a killed build leaves no library
    half-written) and the other versions' libraries (and those named older-*.so) removed. RuntimeError with a
    compiler's first error line."""
    key = hashlib.sha256(b"".join(p.read_bytes() for p in sources) + what.encode()).hexdigest()[:16]
    lib = _cache_dir() / f"{name}-{key}.so"
    if not lib.exists():
        try:
            with atomic_path(lib) as tmp:
                for cmd in build(tmp):
                    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as e:
            said = (getattr(e, "stderr", b"") or b"").decode(errors="replace").splitlines()
            said = [line for line in said if "error" in line] or said or [str(e)]
            raise RuntimeError(said[0].strip()) from None
        for old in (p for n in (name, *older) for p in lib.parent.glob(f"{n}-*.so")):
            if old != lib:
                old.unlink(missing_ok=True)
    return lib


def _build():
    """The library's path, compiled on first use into the cache (_cached_library), or None with one line on stderr
    where a compiler fails."""
    tdir = Path(torch.__file__).parent
    cc, cxx = os.environ.get("CC", "cc"), os.environ.get("CXX", "c++")
    cxxflags = ["-O2", "-std=c++17", "-fPIC", "-DLLAMA_FLAT_KERNELS", "-w",
                f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
                f"-I{tdir / 'include'}", f"-I{tdir / 'include' / 'torch' / 'csrc' / 'api' / 'include'}"]

    def commands(tmp):
        print("building the CPU kernels (fast_cpu_kernels.c, once per machine) ...", file=sys.stderr, flush=True)
        c, c8, cpp = tmp.with_suffix(".c.o"), tmp.with_suffix(".8da4w.o"), tmp.with_suffix(".cpp.o")
        return ([cc, *FLAGS, "-c", str(SOURCE), "-o", str(c)], [cc, *FLAGS, "-c", str(SOURCE_8DA4W), "-o", str(c8)],
                [cxx, *cxxflags, "-c", str(OPS), "-o", str(cpp)],
                [cxx, "-shared", "-fopenmp", str(c), str(c8), str(cpp), "-o", str(tmp), f"-L{tdir / 'lib'}", "-lc10",
                 "-ltorch_cpu"])
    try:
        return _cached_library("fast_cpu_kernels", " ".join([cc, cxx, *FLAGS, *cxxflags, torch.__version__]),
                               [SOURCE, SOURCE_8DA4W, OPS], commands, older=("fast_cpu_int4",))
    except RuntimeError as e:
        print(f"note: quantized products use slower kernels: building {SOURCE.name} failed ({e})", file=sys.stderr)
        return None


def load_et_kernels() -> None:
    """Registers ExecuTorch's kernel of llama_flat::q8a4w_mm (runner-et/kernel_ops.cpp over fast_cpu_8da4w.c: the
    8da4w linears of et_export.py --x86_kernels) with the ExecuTorch runtime Python runs, building the library once
    per machine into the cache (runner-et links the same two files). RuntimeError, one line, where it cannot."""
    global _ET
    if _ET is not None:
        return
    if not (sys.platform == "linux" and TI.cpu_has("avx2")):
        raise RuntimeError("the x86 kernels of this .pte need a Linux x86 CPU with AVX2")
    try:
        import executorch
        from executorch.extension.pybindings import _C  # noqa: F401 - loads libexecutorch.so first (see pte_backend)
        from importlib.metadata import version
        et, et_version = Path(list(executorch.__path__)[0]), version("executorch")
    except Exception as e:  # noqa: BLE001 - no executorch, or one that does not load
        raise RuntimeError(f"ExecuTorch's runtime does not load ({type(e).__name__}: {first_line(e)})") from None
    cc, cxx = os.environ.get("CC", "cc"), os.environ.get("CXX", "c++")
    ops = OPS.parent.parent / "runner-et" / "kernel_ops.cpp"
    cxxflags = ["-O2", "-std=c++17", "-fPIC", "-w", "-DC10_USING_CUSTOM_GENERATED_MACROS", "-DET_USE_THREADPOOL",
                f"-I{et / 'include'}", f"-I{et / 'include/executorch/runtime/core/portable_type/c10'}"]

    def commands(tmp):
        print("building ExecuTorch's x86 kernel (runner-et/kernel_ops.cpp, once per machine) ...", file=sys.stderr,
              flush=True)
        c, cpp = tmp.with_suffix(".c.o"), tmp.with_suffix(".cpp.o")
        return ([cc, "-O3", "-fPIC", "-c", str(SOURCE_8DA4W), "-o", str(c)],
                [cxx, *cxxflags, "-c", str(ops), "-o", str(cpp)],
                [cxx, "-shared", str(c), str(cpp), "-o", str(tmp), f"-L{et / 'lib'}", "-lexecutorch",
                 "-lexecutorch_threadpool", f"-Wl,-rpath,{et / 'lib'}"])
    try:
        lib = _cached_library("fast_cpu_et", " ".join([cc, cxx, *cxxflags, str(et), et_version]), [SOURCE_8DA4W, ops],
                              commands)
    except RuntimeError as e:
        raise RuntimeError(f"building runner-et/kernel_ops.cpp failed ({e})") from None
    try:
        _ET = ctypes.CDLL(str(lib), mode=os.RTLD_GLOBAL)
    except OSError as e:
        raise RuntimeError(f"the x86 kernel's library does not load ({first_line(e)})") from None


def make_tiles(q: torch.Tensor, s: torch.Tensor, z: torch.Tensor, groupsize: int) -> torch.Tensor:
    """The tiles of fast_cpu_kernels.c (its header) from q [N, K] (integers in [0, 15]) and s, z [N, K/groupsize]
    (w = (q - 8) s + z, rounded to bfloat16): uint8 [N/16, K/groupsize, groupsize / 32 * 256 + 64]; N % 16 == 0,
    groupsize % 32 == 0. The tiles of a slice of rows (of 16) are a slice of the tiles."""
    (N, K), G, R = q.shape, q.shape[1] // groupsize, groupsize // 32
    t = q.to(torch.int32).view(N // 16, 16, G, R, 4, 4, 2).permute(0, 2, 3, 4, 1, 6, 5)  # [t, g, r, i, c, h, j]
    lanes = (t[..., 0] | (t[..., 1] << 4) | (t[..., 2] << 8) | (t[..., 3] << 12)).to(torch.int16)  # [t, g, r, i, c, h]
    tile = lambda v: v.to(torch.bfloat16).view(N // 16, 16, G).transpose(1, 2).contiguous().view(torch.uint8)
    return torch.cat([lanes.contiguous().view(torch.uint8).view(N // 16, G, R * 256), tile(s), tile(z)], -1)


def make_8da4w_records(q: torch.Tensor, s: torch.Tensor, z8: Optional[torch.Tensor], groupsize: int):
    """fast_cpu_8da4w.c's weight from 8da4w's q [N, K] (integers in [0, 15]), s [N, K/groupsize] (on the bfloat16
    grid) and z8 = z + 8 s (float32, asymmetric weights; None for symmetric ones): (records uint8 [N/16, K/groupsize,
    groupsize / 32 * 256 + 32 (+ 64)], wsum float32 [N] = sum_k (q - 8) s). N % 16 == 0, groupsize % 32 == 0."""
    N, G = q.shape[0], q.shape[1] // groupsize
    if not on_bf16_grid(s):
        raise ValueError("8da4w's kernel takes scales on the bfloat16 grid (quantize.py's 8da4w)")
    lanes = make_tiles(q, s, torch.zeros_like(s), groupsize)[..., :groupsize // 32 * 256]
    tile = lambda v, dt: v.to(dt).view(N // 16, 16, G).transpose(1, 2).contiguous().view(torch.uint8)
    parts = [lanes, tile(s, torch.bfloat16)] + ([tile(z8, torch.float32)] if z8 is not None else [])
    wsum = ((q.float() - 8).view(N, G, groupsize).sum(-1) * s.float()).sum(-1)
    return torch.cat(parts, -1).contiguous(), wsum.contiguous()


def _self_test() -> bool:
    """The ops against float64: int4 on tiles, int8 on words, AVX2's bfloat16 on a bfloat16 weight."""
    g = torch.Generator().manual_seed(0)
    N, K, G = 128, 128, 64
    q = torch.randint(0, 16, (N, K), generator=g, dtype=torch.int32)
    sz = (torch.randn(K // G, N, 2, generator=g) * 0.1).to(torch.bfloat16)
    s, z = (sz[..., i].t().double().repeat_interleave(G, 1) for i in (0, 1))
    tiles = make_tiles(q, sz[..., 0].t(), sz[..., 1].t(), G)
    q8 = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int32)  # int8 words (fast_cpu_quant._make_words)
    b = (q8.view(N // 16, 16, 4, K // 4) + torch.tensor([128, 128, 128, 0]).view(4, 1)) & 255
    words = (b[:, :, 0] | b[:, :, 1] << 8 | b[:, :, 2] << 16 | b[:, :, 3] << 24).int().transpose(1, 2).unsqueeze(1)
    wb = torch.randn(N, K, generator=g).to(torch.bfloat16)
    for M in (1, 7):
        x = torch.randn(M, K, generator=g).to(torch.bfloat16)
        for y, ref in ((torch.ops.llama_flat.int4_tiles_mm(x, tiles, G), x.double() @ ((q - 8) * s + z).t()),
                       (torch.ops.llama_flat.int8_words_mm(x.float(), words.contiguous(), s[:, 0].float()),
                        x.double() @ (q8 * s[:, :1]).t()),
                       (torch.ops.llama_flat.bf16_mm(x, wb), x.double() @ wb.double().t())):
            tol = 1e-5 if ISA == 2 else 1e-4  # (AVX2's int4: x as int16 per run of 32, 2e-5 of its largest)
            if not torch.allclose(y.double(), ref, rtol=tol, atol=tol * ref.abs().max().item()):
                return False
    return True


def takes(out_features: int, groupsize: int) -> bool:
    """Whether the kernel multiplies by such a weight here: whole blocks of 64 channels, groups of whole runs of 32
    (the shapes fast_cpu_kernels.c accepts), on a machine where it runs (available)."""
    return out_features % 64 == 0 and groupsize % 32 == 0 and available()


def _wanted() -> bool:
    return os.environ.get("LLAMA_FLAT_KERNELS", "1") != "0" and sys.platform == "linux" and TI.cpu_has("avx2")


def _load() -> bool:
    """Loads the library (its ops), building it first where the cache lacks it; False where it cannot be."""
    global _LOADED, ISA, _CDLL
    if _LOADED is None:
        _LOADED = False
        try:
            lib = _build()
            if lib is not None:
                _CDLL = ctypes.CDLL(str(lib), mode=os.RTLD_GLOBAL)  # (global: packages' C shims, kernel_ops.cpp)
                ISA = _CDLL.llama_flat_kernels_isa()
                torch.ops.load_library(str(lib))
                _LOADED = True
        except Exception as e:  # (a missing source, a noexec cache, a library that does not load)
            print(f"note: quantized products use slower kernels: fast_cpu_kernels does not load ({e})",
                  file=sys.stderr)
    return _LOADED


def available() -> bool:
    """Whether the ops run the kernel here (decided once per process: builds, loads and checks it; any failure is one
    line on stderr, and ATen's layout and kernels). Call it outside torch.compile's tracing."""
    global _LIB, _TRIED
    if not _TRIED:
        _TRIED = True
        if _wanted() and _load():
            try:
                if not _self_test():
                    raise ValueError("its result differs from float64's")
                _LIB = True
            except Exception as e:
                print(f"note: quantized products use slower kernels: fast_cpu_kernels does not run here ({e})",
                      file=sys.stderr)
                _LIB = None
    return _LIB is not None


def isa_8da4w() -> int:
    """Which 8da4w kernel llama_flat::q8a4w_mm runs here: 2 AVX-512 VNNI (kept only if it gave the AVX2 kernel's bits
    on fast_cpu_8da4w.c's own check), 1 AVX2, 0 none."""
    return _CDLL.llama_flat_8da4w_isa() if available() else 0


def aoti_shims() -> dict:
    """AOT Inductor settings under which a package calls int4_tiles_mm through kernel_ops.cpp's C shim, as it calls
    ATen's ops (no proxy executor: ~18 us a call, 2 ms of a 1B decode step; its int8 products stay Inductor's
    reduction, fast_cpu_quant.fused_linear). The package's library then needs the symbol at load: this library
    (loaded globally) or runner-aoti (which exports it). Empty where the kernels do not run (no tiles are made)."""
    if not available():
        return {}
    ops, t = torch.ops.llama_flat, "AtenTensorHandle"
    return {"aot_inductor.custom_ops_to_c_shims": {
        ops.int4_tiles_mm.default: [f"AOTITorchError aoti_torch_cpu_int4_tiles_mm({t}, {t}, int64_t, {t}*)"]}}


_OPS = torch.library.Library("llama_flat", "FRAGMENT")
if not (_wanted() and _load()) and not hasattr(torch.ops.llama_flat, "int4_tiles_mm"):
    _OPS.define("int4_tiles_mm(Tensor x, Tensor w, int groupsize) -> Tensor")  # (never called: no tiles are made)
    _OPS.define("int8_words_mm(Tensor x, Tensor w, Tensor s) -> Tensor")  # (nor these)
    _OPS.define("bf16_mm(Tensor x, Tensor w) -> Tensor")
    _OPS.define("q8a4w_mm(Tensor x, Tensor w, Tensor wsum, int groupsize) -> Tensor")  # (an export's .pte names it)
    _OPS.define("q8a4w_mm.out(Tensor x, Tensor w, Tensor wsum, int groupsize, *, Tensor(a!) out) -> Tensor(a!)")
for _name, _fake in (("int4_tiles_mm", lambda x, w, gs: x.new_empty((x.shape[0], 16 * w.shape[0]), dtype=torch.float)),
                     ("int8_words_mm", lambda x, w, s: x.new_empty((x.shape[0], 16 * w.shape[0]))),
                     ("bf16_mm", lambda x, w: x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float)),
                     ("q8a4w_mm", lambda x, w, ws, gs: x.new_empty((*x.shape[:-1], 16 * w.shape[0]),
                                                                     dtype=torch.float))):
    try:
        torch.library.register_fake(f"llama_flat::{_name}", lib=_OPS)(_fake)
    except RuntimeError:  # (registered already: this file imported again, under another name)
        pass


def _main() -> None:
    """`python fast_cpu_kernels.py [threads]`: per product of Llama-3.2-1B's shapes (ms, median of 9), the kernel on the
    tiles, ATen's int4 kernel (on its own layout), oneDNN's bfloat16 GEMM on a bfloat16 copy (ATen's where oneDNN
    has none), AVX2's bfloat16 kernel on that copy as stored; one row streams 24 copies of the weight from memory
    (as decode reads a model's weights), more rows repeat one (prompts)."""
    import time
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    if not available():
        raise SystemExit("error: the kernels do not run here (see the note above, or the CPU has no AVX2)")

    def ms(f, n):
        times = []
        for i in range(12):
            start = time.perf_counter()
            f()
            times.append(time.perf_counter() - start) if i >= 3 else None
        return sorted(times)[4] * 1e3 / n
    print(f"threads {torch.get_num_threads()}; ms per product: tiles / ATen's int4 / oneDNN bfloat16 (ATen's where"
          f" oneDNN has none) / AVX2's bfloat16 kernel on w as stored")
    for N, K in ((8192, 2048), (2048, 8192), (2048, 2048)):
        q = torch.randint(0, 16, (N, K), dtype=torch.int32)
        sz = torch.randn(K // 32, N, 2).bfloat16()
        w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        tiles, w16 = make_tiles(q, sz[..., 0].t(), sz[..., 1].t(), 32), torch.randn(N, K).bfloat16()
        for M in (1, 2, 8, 128):
            n = 24 if M == 1 else 1
            x, copies = torch.randn(M, K).bfloat16(), [(tiles.clone(), w.clone(), sz.clone(), w16.clone())
                                                       for _ in range(n)]
            run = lambda f: ms(lambda: [f(*c) for c in copies], n)
            aten, ops = torch.ops.aten._weight_int4pack_mm_for_cpu, torch.ops.llama_flat
            onednn, bf16 = run(lambda t, w, s, w16: x @ w16.t()), run(lambda t, w, s, w16: ops.bf16_mm(x, w16))
            print(f"{N}x{K} {M:4d} rows: {run(lambda t, w, s, w16: ops.int4_tiles_mm(x, t, 32)):6.3f}"
                  f" / {run(lambda t, w, s, w16: aten(x, w, 32, s)):6.3f} / {onednn:6.3f} / {bf16:6.3f}")


if __name__ == "__main__":
    _main()
