# Benchmarks: decode / prefill tok/s, TTFT, achieved GB/s and % of the memory-bandwidth ceiling measured on this
# machine, peak RSS, for every backend and precision. Each row runs in its own process (clean peak memory, no state
# shared between rows); each figure is the median of several runs. Prints a markdown table, writes JSON.
#
#   python bench.py                                  # default rows on the default model
#   python bench.py --rows "eager fp32,compile fp32" --runs 5 --max_new_tokens 128 --json bench.json
#
# A row is a name and the generate.py arguments it runs with; rows whose artifact is missing (a quantized checkpoint,
# an exported package) build it first with the stage's own script.
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent
CK = REPO / "checkpoints" / "SmolLM2-135M-Instruct"
ART = REPO / "checkpoints" / "bench"  # exported artifacts built for the benchmark

# name -> (generate.py arguments, command that builds the artifact if it is missing or None)
ROWS = {
    "eager fp32": ([], None),
    "compile fp32": (["--compile"], None),
    "eager bf16": (["--dtype", "bfloat16"], None),
    "compile bf16": (["--compile", "--dtype", "bfloat16"], None),
    "compile int8": (["--compile", "--checkpoint_path", "{ck}/model_int8.pth"],
                     ["quantize.py", "--checkpoint_path", "{ck}/model.pth", "--mode", "int8"]),
    "compile int4 g32": (["--compile", "--checkpoint_path", "{ck}/model_int4.g32.pth"],
                         ["quantize.py", "--checkpoint_path", "{ck}/model.pth", "--mode", "int4", "--groupsize", "32"]),
    "compile 8da4w g32": (["--compile", "--checkpoint_path", "{ck}/model_8da4w.g32.pth"],
                          ["quantize.py", "--checkpoint_path", "{ck}/model.pth", "--mode", "8da4w", "--groupsize", "32"]),
}
DEFAULT_ROWS = ["eager fp32", "compile fp32", "eager bf16", "compile bf16"]
PROMPT = ("Write a short story about a robot who learns to paint. The robot lives in a small town by the sea and "
          "every morning it watches the fishermen leave the harbour.")


def measure_bandwidth(gib: float = 1.0, runs: int = 7) -> float:
    """Read bandwidth in GB/s: median time of summing a buffer much larger than the caches, with the threads torch
    uses for inference."""
    x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    x.sum()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return x.numel() * 4 / statistics.median(times) / 1e9


def child(args):
    """Run one row in this process and print its measurements as JSON on the last line."""
    import generate as G
    from tokenizer import load_tokenizer

    gargs = G.parse_args(args.gen_args)
    G.resolve_checkpoint(gargs)
    device, dtype = torch.device(gargs.device), getattr(torch, gargs.dtype)
    import tp
    if tp.maybe_init_dist(device) is not None:  # a tensor-parallel row: every rank runs this, rank 0 reports
        tp.rank0_only_output()
    tok = load_tokenizer(gargs.tokenizer_path)
    ids = tok.encode(PROMPT)
    backend = G.load_backend(gargs, device, dtype, 1, len(ids) + args.max_new_tokens)
    model = getattr(backend, "model", None)
    if model is None and gargs.checkpoint_path:  # exported artifact: count the weights of its source checkpoint
        from model import load_model
        model = load_model(gargs.checkpoint_path)
    nbytes = G.weight_bytes(model) if model is not None else None
    runs = []
    for i in range(args.runs + 1):  # run 0 warms up (and compiles)
        out, st = G.generate(backend, [ids], args.max_new_tokens, device, temperature=0.0, stop_ids=())
        if i:
            runs.append(st)
    med = {k: statistics.median(r[k] for r in runs) for k in ("decode_tok_s", "prefill_tok_s", "ttft_s")}
    med.update(weight_bytes=nbytes, peak_rss_mb=G.peak_memory_mb(device), prompt_tokens=len(ids),
               decode_runs=[r["decode_tok_s"] for r in runs])
    print(json.dumps(med))


def run_row(name, args, bw, nproc=1):
    gen_args, build = ROWS[name]
    fill = lambda a: [s.format(ck=args.checkpoint_dir) for s in a]
    if build is not None:
        target = Path(fill([a for a in gen_args if "{ck}" in a])[0])
        if not target.exists():
            print(f"[{name}] building {target.name} ...", file=sys.stderr)
            subprocess.run([sys.executable, *fill(build)], cwd=REPO, check=True)
    gen_args = fill(gen_args)
    if "--checkpoint_path" not in gen_args:
        gen_args += ["--checkpoint_path", str(Path(args.checkpoint_dir) / "model.pth")]
    launch = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                  f"--nproc_per_node={nproc}"]
    cmd = [*launch, __file__, "--_child", "--runs", str(args.runs), "--max_new_tokens",
           str(args.max_new_tokens), "--", *gen_args, "--device", args.device]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["?"])[-1]
        print(f"[{name}] failed: {tail}", file=sys.stderr)
        return dict(name=name, error=tail)
    res = json.loads(r.stdout.strip().splitlines()[-1])
    res["name"] = name if nproc == 1 else f"{name} tp{nproc}"
    res["world_size"] = nproc
    if res.get("weight_bytes"):
        res["gb_s"] = res["weight_bytes"] * res["decode_tok_s"] / 1e9
        res["pct_of_ceiling"] = 100 * res["gb_s"] / bw
        res["ceiling_tok_s"] = bw * 1e9 / res["weight_bytes"]
    print(f"[{res['name']}] decode {res['decode_tok_s']:.2f} tok/s", file=sys.stderr)
    return res


def table(results, bw, base_name="eager fp32"):
    base = next((r for r in results if r["name"] == base_name and "error" not in r), None)
    lines = [f"memory bandwidth (measured, read): {bw:.1f} GB/s",
             "",
             "| row | decode tok/s | vs eager fp32 | prefill tok/s | TTFT ms | weights MB | GB/s | % of ceiling | ceiling tok/s | peak RSS MB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['name']} | failed: {r['error']} |||||||||")
            continue
        ratio = f"{r['decode_tok_s'] / base['decode_tok_s']:.2f}x" if base else "-"
        wb = r.get("weight_bytes")
        lines.append(f"| {r['name']} | {r['decode_tok_s']:.2f} | {ratio} | {r['prefill_tok_s']:.1f} | "
                     f"{r['ttft_s'] * 1000:.0f} | {wb / 1e6:.0f} | {r.get('gb_s', 0):.1f} | "
                     f"{r.get('pct_of_ceiling', 0):.0f}% | {r.get('ceiling_tok_s', 0):.1f} | {r['peak_rss_mb']:.0f} |"
                     if wb else f"| {r['name']} | {r['decode_tok_s']:.2f} | {ratio} | {r['prefill_tok_s']:.1f} | "
                     f"{r['ttft_s'] * 1000:.0f} | - | - | - | - | {r['peak_rss_mb']:.0f} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"comma-separated; known: {', '.join(ROWS)}")
    p.add_argument("--checkpoint_dir", default=str(CK))
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default="bench.json")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads per row (default: torch's); 1 gives stable per-core figures on a shared machine")
    p.add_argument("--nproc", default="1", help="tensor-parallel world sizes (torchrun), e.g. 1,2,4")
    p.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("gen_args", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._child:
        return child(args)
    if args.threads:  # rows inherit it through the environment
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.rows.split(",") if n.strip()]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        raise ValueError(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    if not (Path(args.checkpoint_dir) / "model.pth").is_file():
        sys.path.insert(0, str(REPO / "scripts"))
        import download
        download.prepare_default(Path(args.checkpoint_dir))
    bw = measure_bandwidth()
    print(f"measured read bandwidth: {bw:.1f} GB/s ({torch.get_num_threads()} threads)", file=sys.stderr)
    results = [run_row(n, args, bw, int(k)) for n in names for k in args.nproc.split(",")]
    md = table(results, bw)
    print(md)
    out = dict(machine=dict(cpu_count=os.cpu_count(), threads=torch.get_num_threads(), bandwidth_gb_s=bw,
                            torch=torch.__version__, device=args.device),
               settings=dict(runs=args.runs, max_new_tokens=args.max_new_tokens, prompt=PROMPT), rows=results)
    tmp = Path(args.json + ".tmp")
    tmp.write_text(json.dumps(out, indent=1))
    os.replace(tmp, args.json)


if __name__ == "__main__":
    from generate import cli
    cli(main)
