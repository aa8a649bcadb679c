#!/usr/bin/env python
"""Where a step's time goes, in one process: prompts and decode steps of a checkpoint timed after warm-up (no
generate.py loop around them: sampling, streaming), peak RSS after each phase, and with --kernels the compiled decode
step's kernels by self time (Inductor's generated kernels and the ATen / oneDNN calls between them).

    python scripts/profile_step.py --checkpoint_path checkpoints/Llama-3.2-1B-random/model_int4.g32.pth --threads 2
    python scripts/profile_step.py --checkpoint_path ... --kernels         # + the decode step's kernel table

--kernels compiles the decode graph with Inductor's Python launcher (cpp_wrapper off) so that the profiler names each
kernel; its steps are ~0.5 ms slower than the default C++ launcher's. Interleave A / B runs: shared machines are noisy.
"""
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402

from common import THREADS, ArgumentParser, at_least, checkpoint_file, cli, set_threads, vm_hwm_mb  # noqa: E402

DTYPES = ("float32", "bfloat16")


def rss() -> str:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return f"RSS {int(status['VmRSS'].split()[0]) >> 10} MB, peak {vm_hwm_mb():.0f} MB"


def timed(fn, repeat: int) -> float:
    """Median wall time of fn() in ms over `repeat` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv=None):
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint_path", type=Path, required=True, help="model.pth, float or quantized")
    p.add_argument("--dtype", default=None, help=f"one of {DTYPES} (default: the checkpoint's)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: as generate.py picks)", rule=THREADS)
    p.add_argument("--prompt_tokens", default="15,128", help="comma-separated prompt lengths to time")
    p.add_argument("--steps", type=int, default=20, help="decode steps per timing (median of 4)", rule=at_least(1))
    p.add_argument("--max_seq_length", type=int, default=256, rule=at_least(2))
    p.add_argument("--eager", action="store_true", help="time the model without torch.compile")
    p.add_argument("--kernels", action="store_true", help="also print the compiled decode step's kernels")
    a = p.parse_args(argv)
    if a.dtype is not None and a.dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {a.dtype!r}")
    lengths = [int(x) for x in a.prompt_tokens.split(",") if x.strip().isdigit()]
    if not lengths or len(lengths) != len(a.prompt_tokens.split(",")) or min(lengths) < 2:
        raise ValueError(f"--prompt_tokens must be comma-separated lengths >= 2, got {a.prompt_tokens!r}")
    if max(lengths) + 4 * a.steps + 2 > a.max_seq_length:
        raise ValueError(f"--max_seq_length {a.max_seq_length} is too short for a {max(lengths)}-token prompt and "
                         f"{4 * a.steps + 1} decode steps")
    if a.kernels and a.eager:
        raise ValueError("--kernels profiles the compiled decode step; drop --eager")
    checkpoint_file(a.checkpoint_path)
    threads = set_threads(a.threads, log=lambda m: print(m, file=sys.stderr))
    import backends
    import engine
    from quantize import load_model
    dtype = getattr(torch, a.dtype) if a.dtype else None
    backends.check_fits(a.checkpoint_path, dtype, 1, a.max_seq_length)
    if a.kernels and engine.fast_cpu is not None:  # name each kernel: Python's launcher, kernel profiling on
        configure = engine.fast_cpu.configure_inductor
        engine.fast_cpu.configure_inductor = lambda: (configure(), engine.fast_cpu.TI.set_inductor(
            {"cpp_wrapper": False, "cpp.enable_kernel_profile": True}))
    print(f"loading {a.checkpoint_path} ...", file=sys.stderr)
    model = load_model(a.checkpoint_path, device="cpu", dtype=dtype)
    print(f"loaded: {rss()}")
    t0 = time.perf_counter()
    backend = engine.TorchBackend(model, 1, a.max_seq_length, compile=not a.eager)
    vocab = backend.vocab_size
    for L in lengths:  # the first call of each length compiles (dynamic lengths: once for all)
        tokens = torch.randint(0, vocab, (1, L))
        ms = timed(lambda: backend.forward(tokens, torch.arange(L), logits_at=torch.tensor([L - 1])), 3)
        print(f"prompt {L} tokens: {ms:.1f} ms ({L / ms * 1e3:.0f} tok/s), median of 3")
    print(f"prompts: {rss()} ({time.perf_counter() - t0:.0f} s with compilation)")
    x, pos = torch.tensor([[1]]), max(lengths)
    for i in range(pos, pos + 2):  # warm-up (compiles the decode graph)
        backend.forward(x, torch.tensor([i]))
    per_step = []
    for r in range(4):
        start, t0 = pos + 2 + r * a.steps, time.perf_counter()
        for i in range(start, start + a.steps):
            backend.forward(x, torch.tensor([i]))
        per_step.append((time.perf_counter() - t0) / a.steps * 1e3)
    print(f"decode: {statistics.median(per_step):.2f} ms/step ({1e3 / statistics.median(per_step):.1f} tok/s), "
          f"median of 4 x {a.steps} steps after position {pos}; {rss()}; {threads} threads")
    if a.kernels:
        from torch.profiler import profile
        with profile() as prof:
            for i in range(a.steps):
                backend.forward(x, torch.tensor([pos + 1 + i]))
        print(f"\nkernels of {a.steps} decode steps (self time):")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=50))


if __name__ == "__main__":
    cli(main)
