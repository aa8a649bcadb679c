# Benchmarks: decode / prefill tok/s, TTFT, GB/s against the measured read bandwidth, peak RSS and file size of every
# backend, precision and decoding mode; each row greedy in its own process (generate.py, a C++ runner, or llama.cpp on
# the same weights), its artifacts built first when missing. Prints the table, writes JSON and, with --markdown PATH,
# the benchmark page (docs/benchmarks.md). --from_json renders earlier runs without running: a page, or with --readme
# README.md the README's one table, a column per run (python bench.py --readme README.md --from_json a.json,b.json).
import argparse
import datetime
import importlib.util
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path
from typing import Optional

import torch

from common import (DEFAULT_CHECKPOINT, REPO, THREADS, ArgumentParser, at_least, cli, peak_memory_mb, vm_hwm_mb,
                    within, write_atomic)

CK = DEFAULT_CHECKPOINT.parent
sys.path.insert(0, str(REPO / "scripts"))  # random_checkpoint, download, bench_server, bench_report
from bench_report import markdown, write_readme  # noqa: E402
PY = sys.executable
PROMPTS = {
    "story": ("Write a short story about a robot who learns to paint. The robot lives in a small town by the sea and "
              "every morning it watches the fishermen leave the harbour."),
    "code": ("class Calculator:\n    def add(self, a, b):\n        return a + b\n\n    def sub(self, a, b):\n"
             "        return a - b\n\n    def mul(self, a, b):\n        return a * b\n\n    def"),
}
# 495 tokens with SmolLM2's tokenizer (4 prefill chunks of 128): hybrid (fixed-length prefill) vs one dynamic forward
PROMPTS["long"] = " ".join([PROMPTS["story"]] * 15)
CB_PROMPTS = ["The history of the printing press begins", "Here is a recipe for a simple tomato soup:", "The three "  # cb
              "laws of motion are", "Once upon a time, in a village at the edge of a forest,", "A good way to learn a new "
              "language is", "The main causes of the French Revolution were", "To change a flat tyre on a bicycle, first",
              "The weather on Mars is"]
# Artifacts: path -> the command that builds it ({ck} the checkpoint directory, {art} {ck}/bench, {j} the threads)
FP, I8, I4, D4, D8 = (f"{{ck}}/model{s}.pth" for s in ("", "_int8", "_int4.g32", "_8da4w.g32", "_8da8w"))
Q = ["quantize.py", "--checkpoint_path", FP, "--mode"]
S256, J = ("--max_seq_length", "256"), ("--threads", "{j}")


def export(name) -> list:
    """The export command of {art}/name, read off the name: PRECISION[.g32][.x86][.fp][.s256|.modes][.j{j}].pte|.pt2.
    x86: --x86_kernels; fp: --fast_prefill; s256: a 256-token context (else 1024); modes: -M modes, chunks of 128;
    j{j}: the bench's threads."""
    p = name.split(".")
    ck = {"fp32": "model.pth", "int8": "model_int8.pth", "8da8w": "model_8da8w.pth"}.get(p[0], f"model_{p[0]}.g32.pth")
    extra = [*(S256 if "s256" in p else ()), *(("--prefill_chunk", "128", "--lookahead") if "modes" in p else ()),
             *(J if "j{j}" in p else ()), *(("--fast_prefill",) if "fp" in p else ()),
             *(("--x86_kernels",) if "x86" in p else ())]
    return [PY, "aoti_export.py" if name.endswith(".pt2") else "et_export.py", "--checkpoint_path", f"{{ck}}/{ck}",
            "--output_path", f"{{art}}/{name}", *extra]


BUILD = {
    "{ck}/model_int8.pth": [PY, *Q, "int8"],
    "{ck}/model_int4.g32.pth": [PY, *Q, "int4", "--groupsize", "32"],
    "{ck}/model_8da4w.g32.pth": [PY, *Q, "8da4w", "--groupsize", "32"],
    "{ck}/model_8da8w.pth": [PY, *Q, "8da8w"],
    **{f"{{art}}/{name}": export(name) for name in (
        "fp32.s256.pte", "fp32.fp.s256.pte", "8da4w.g32.s256.pte", "8da4w.g32.fp.s256.pte", "8da4w.g32.x86.s256.pte",
        "8da8w.s256.pte", "fp32.pte", "8da4w.g32.pte", "fp32.modes.pte", "fp32.s256.j{j}.pt2", "fp32.fp.s256.j{j}.pt2",
        "int8.s256.j{j}.pt2", "int8.fp.s256.j{j}.pt2", "int4.g32.s256.j{j}.pt2", "int4.g32.j{j}.pt2",
        "int4.g32.fp.s256.j{j}.pt2", "8da4w.g32.s256.j{j}.pt2", "8da4w.g32.fp.s256.j{j}.pt2", "8da8w.fp.s256.j{j}.pt2",
        "fp32.modes.j{j}.pt2")},
    "{art}/onnx/model.onnx": [PY, "export_onnx.py", "--checkpoint_path", FP, "--output_dir", "{art}/onnx"],
    "{art}/tokenizer.bin": [PY, "scripts/export_tokenizer_bin.py", "{ck}", "-o", "{art}/tokenizer.bin"],
    **{f"{{art}}/{t}.gguf": [PY, "scripts/llamacpp_peer.py", "write", "--checkpoint_path", FP, "--type", t,
                              "--output", f"{{art}}/{t}.gguf"] for t in ("f32", "f16", "q8_0", "q4_0", "q4_1")},
    **{f"{r}/build/run": ["sh", "-c", f"cmake -S {r} -B {r}/build && cmake --build {r}/build -j2"]
       for r in ("runner-et", "runner-aoti")},
}


def gen(*args, weights="{ck}/model.pth", prompt="story", vs=None, needs=(), peer=None):
    """A generate.py row. weights: the checkpoint whose bytes one decode step reads (for GB/s)."""
    args = list(args)
    if "--checkpoint_path" in args:
        weights = args[args.index("--checkpoint_path") + 1]
    ck = [a for a in args if a.startswith("{ck}/model")]  # a quantized target or draft is built if missing
    return dict(kind="gen", args=args, weights=weights, prompt=prompt, vs=vs, needs=[*ck, *needs], peer=peer)


def runner(binary, artifact, weights, vs=None, peer=None, prompt="story", mode=None):
    """A C++ runner row: ./binary artifact -z tokenizer.bin -i prompt -n N -t 0 -x -j threads [-M mode]."""
    return dict(kind="runner", binary=binary, artifact=artifact, weights=weights, prompt=prompt, vs=vs,
                needs=[artifact, "{art}/tokenizer.bin", binary], peer=peer, mode=mode)


def runner_modes(name, binary, artifact):
    """kv, lookahead (-L 6,1,1) on the code and story prompts, kv, hybrid on the long one; ratios to kv."""
    return {f"{name} {m} {prompt}": runner(binary, artifact, FP, prompt=prompt, mode=m,
                                           vs=None if m == "kv" else f"{name} kv {prompt}")
            for prompt, mode in (("code", "lookahead"), ("story", "lookahead"), ("long", "hybrid"))
            for m in ("kv", mode)}


def artifact_row(flag, artifact, weights, vs=None, peer=None):  # an exported program through generate.py
    return gen(flag, artifact, "--tokenizer_path", "{ck}", weights=weights, vs=vs, needs=[artifact], peer=peer)


def llamacpp(kind):  # llama.cpp on the same weights as a GGUF of this kind (Q4_1: our int4 g32's bytes), same threads
    return dict(kind="peer", gguf=(g := f"{{art}}/{kind}.gguf"), weights=g, prompt="story", vs=None, needs=[g])


RA, RE, F32, F16, Q8, Q4, Q41 = ("runner-aoti/build/run", "runner-et/build/run", "llama.cpp F32", "llama.cpp F16",
                                 "llama.cpp Q8_0", "llama.cpp Q4_0", "llama.cpp Q4_1")
ROWS = {
    F32: llamacpp("f32"), F16: llamacpp("f16"), Q8: llamacpp("q8_0"), Q4: llamacpp("q4_0"), Q41: llamacpp("q4_1"),
    "eager fp32": gen(peer=F32), "compile fp32": gen("--compile", vs="eager fp32", peer=F32),
    "eager bf16": gen("--dtype", "bfloat16", vs="eager fp32"),
    "compile bf16": gen("--compile", "--dtype", "bfloat16", vs="compile fp32", peer=F16),
    "eager int8": gen("--checkpoint_path", I8, vs="eager fp32"),
    "compile int8": gen("--compile", "--checkpoint_path", I8, vs="compile fp32", peer=Q8),
    "compile int4 g32": gen("--compile", "--checkpoint_path", I4, vs="compile fp32", peer=Q4),
    # the server's and chat's 2048-token context: the layers attend over the filled cache slots (fast_cpu.FilledSlots)
    "compile fp32 ctx2048": gen("--compile", "--max_seq_length", "2048", vs="compile fp32", peer=F32),
    "compile int4 g32 ctx2048": gen("--compile", "--max_seq_length", "2048", "--checkpoint_path", I4,
                                    vs="compile int4 g32", peer=Q4),
    "compile 8da8w": gen("--compile", "--checkpoint_path", D8, vs="compile int8", peer=Q8),
    "compile 8da4w g32": gen("--compile", "--checkpoint_path", D4, vs="compile fp32", peer=Q4),
    "compile bf16 int8": gen("--compile", "--dtype", "bfloat16", "--checkpoint_path", I8, vs="compile fp32"),
    "compile bf16 int4 g32": gen("--compile", "--dtype", "bfloat16", "--checkpoint_path", I4, vs="compile fp32"),
    # exported programs through generate.py (Python runtimes), then through the C++ runners
    "aoti fp32": artifact_row("--aoti_package", "{art}/fp32.s256.j{j}.pt2", FP, vs="compile fp32", peer=F32),
    "aoti int8": artifact_row("--aoti_package", "{art}/int8.s256.j{j}.pt2", I8, vs="aoti fp32"),
    "runner-aoti fp32": runner(RA, "{art}/fp32.s256.j{j}.pt2", FP, vs="compile fp32", peer=F32),
    "runner-aoti fp32 fast_prefill": runner(RA, "{art}/fp32.fp.s256.j{j}.pt2", FP, vs="runner-aoti fp32", peer=F32),
    "runner-aoti int8": runner(RA, "{art}/int8.s256.j{j}.pt2", I8, vs="runner-aoti fp32", peer=Q8),
    "runner-aoti int4 g32": runner(RA, "{art}/int4.g32.s256.j{j}.pt2", I4, vs="runner-aoti fp32", peer=Q4),
    "runner-aoti int4 g32 ctx1024": runner(RA, "{art}/int4.g32.j{j}.pt2", I4, vs="runner-aoti int4 g32", peer=Q4),
    "runner-aoti int8 fast_prefill": runner(RA, "{art}/int8.fp.s256.j{j}.pt2", I8, vs="runner-aoti int8", peer=Q8),
    "runner-aoti int4 g32 fast_prefill": runner(RA, "{art}/int4.g32.fp.s256.j{j}.pt2", I4, "runner-aoti int4 g32", Q4),
    "runner-aoti 8da8w fast_prefill": runner(RA, "{art}/8da8w.fp.s256.j{j}.pt2", D8, "runner-aoti int8 fast_prefill", Q8),
    "runner-aoti 8da4w g32 fast_prefill": runner(RA, "{art}/8da4w.g32.fp.s256.j{j}.pt2", D4,
                                                 vs="runner-aoti 8da4w g32", peer=Q4),
    "runner-aoti 8da4w g32": runner(RA, "{art}/8da4w.g32.s256.j{j}.pt2", D4, vs="runner-aoti fp32", peer=Q4),
    "pte fp32": artifact_row("--pte", "{art}/fp32.s256.pte", FP, vs="eager fp32"),
    "pte 8da4w g32": artifact_row("--pte", "{art}/8da4w.g32.s256.pte", D4, vs="pte fp32"),
    "runner-et fp32": runner(RE, "{art}/fp32.s256.pte", FP, vs="pte fp32", peer=F32),
    "runner-et fp32 fast_prefill": runner(RE, "{art}/fp32.fp.s256.pte", FP, vs="runner-et fp32", peer=F32),
    "runner-et 8da4w g32": runner(RE, "{art}/8da4w.g32.s256.pte", D4, vs="runner-et fp32", peer=Q4),
    "runner-et 8da4w g32 x86": runner(RE, "{art}/8da4w.g32.x86.s256.pte", D4, vs="runner-et 8da4w g32", peer=Q4),
    "runner-et 8da4w g32 fast_prefill": runner(RE, "{art}/8da4w.g32.fp.s256.pte", D4, "runner-et 8da4w g32", Q4),
    "runner-et 8da8w": runner(RE, "{art}/8da8w.s256.pte", D8, vs="runner-et fp32", peer=Q8),
    "runner-et fp32 ctx1024": runner(RE, "{art}/fp32.pte", FP, vs="runner-et fp32"),  # a .pte reads its whole cache
    "runner-et 8da4w g32 ctx1024": runner(RE, "{art}/8da4w.g32.pte", D4, vs="runner-et fp32 ctx1024"),
    "onnx fp32": artifact_row("--onnx", "{art}/onnx/model.onnx", FP, vs="eager fp32"),
    # decoding modes (issue 7): speedup over plain decoding of the same prompt and precision
    "compile spec int4 k5": gen("--compile", "--draft_checkpoint_path", I4, "--speculate_k", "5", vs="compile fp32"),
    "compile spec int8 k6": gen("--compile", "--draft_checkpoint_path", I8, "--speculate_k", "6", vs="compile fp32"),
    "eager fp32 code": gen(prompt="code"), "compile fp32 code": gen("--compile", prompt="code", vs="eager fp32 code"),
    "eager lookahead code": gen("--lookahead", "5,1,2", prompt="code", vs="eager fp32 code"),  # runs model.py eagerly
    "compile fp32 cb4": gen("--compile", "--full_batch_size", "4", prompt="cb", vs="compile fp32"),
    "eager fp32 cb4": gen("--full_batch_size", "4", prompt="cb", vs="eager fp32"),
    **runner_modes("runner-et", RE, "{art}/fp32.modes.pte"),
    **runner_modes("runner-aoti", RA, "{art}/fp32.modes.j{j}.pt2"),
}
DEFAULT_ROWS = ["eager fp32", "compile fp32", "eager bf16", "compile bf16"]
GROUPS = {  # --rows shorthands
    "quant": ["compile fp32", "compile int8", "compile int4 g32", "compile 8da4w g32", "compile bf16",
              "compile bf16 int8", "compile bf16 int4 g32"],
    "export": ["compile fp32", "compile int4 g32", "aoti fp32", "runner-aoti fp32", "aoti int8", "runner-aoti int8",
               "pte fp32", "pte 8da4w g32", "runner-et fp32", "runner-et 8da4w g32", "runner-et fp32 ctx1024",
               "runner-et 8da4w g32 ctx1024", "onnx fp32"],
    "et": ["compile int4 g32", "pte fp32", "pte 8da4w g32", "runner-et fp32", "runner-et 8da4w g32",
           "runner-et 8da4w g32 x86",
           "runner-et fp32 ctx1024", "runner-et 8da4w g32 ctx1024"],
    "modes": ["compile fp32", "compile spec int4 k5", "compile spec int8 k6", "eager fp32 code", "eager lookahead code",
              "compile fp32 code", "eager fp32", "eager fp32 cb4", "compile fp32 cb4",
              *(name for name, row in ROWS.items() if row.get("mode"))],  # the runners' -M modes
    "peer": [F32, "compile fp32", "aoti fp32", "runner-aoti fp32", "runner-aoti fp32 fast_prefill", "runner-et fp32",
             F16, "compile bf16", Q8, "compile int8", Q4, Q41, "compile int4 g32", "runner-et 8da4w g32",
             "runner-et 8da4w g32 x86"],
    "prefill": [F32, "compile fp32", "runner-aoti fp32", "runner-aoti fp32 fast_prefill", "runner-et fp32", Q8,
                "compile int8", "runner-aoti int8 fast_prefill", "compile 8da8w", "runner-aoti 8da8w fast_prefill",
                "runner-et 8da8w", Q4, "compile int4 g32", "runner-aoti int4 g32 fast_prefill", "runner-et 8da4w g32",
                "runner-et 8da4w g32 x86"],
    "big": ["compile bf16", F16, "compile int8", Q8, "compile int4 g32", "runner-aoti int4 g32 fast_prefill",
            "runner-et 8da4w g32", "runner-et 8da4w g32 x86", Q41, Q4],
    "all": list(ROWS), "server": ["compile fp32"],  # server: + server.py under 1, 4 and 8 clients (bench_server.py)
}
SERVER_ARGS = ["--compile", "--full_batch_size", "8", "--max_seq_length", "512"]


def measure_bandwidth(gib: float = 1.0, runs: int = 7) -> float:
    """Read bandwidth in GB/s: median time of summing a buffer far larger than the caches, on torch's threads."""
    x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    return x.numel() * 4 / statistics.median(timeit.repeat(x.sum, number=1, repeat=runs)) / 1e9


def child(args):
    """Run generate.py's main() in this process (run 0 warms up) and print the medians as JSON on the last line."""
    import generate as G
    runs = G.main([*args.gen_args, "--temperature", "0", "--max_new_tokens", str(args.max_new_tokens),
                   "--num_samples", str(args.runs + 1), "--quiet"])[1:]
    med = {k: statistics.median(r[k] for r in runs) for k in ("decode_tok_s", "prefill_tok_s", "ttft_s")}
    med.update(peak_rss_mb=peak_memory_mb(torch.device(G.parse_args(args.gen_args).device)),
               prompt_tokens=runs[0]["prompt_tokens"], new_tokens=runs[0]["new_tokens"],
               decode_runs=[r["decode_tok_s"] for r in runs])
    med.update({k: runs[0][k] for k in ("acceptance_rate", "mean_accepted", "tokens_per_step") if k in runs[0]})
    print(json.dumps(med))


def run_peer(row, args, fill):
    """llama.cpp through scripts/llamacpp_peer.py: same prompt, token count, threads and number of runs."""
    cmd = [PY, "scripts/llamacpp_peer.py", "time", "--gguf", fill(row["gguf"]), "--tokenizer_path", fill("{ck}"),
           "--threads", str(torch.get_num_threads()), "--prompt", PROMPTS["story"],
           "--max_new_tokens", str(args.max_new_tokens), "--runs", str(args.runs), "--n_ctx", "512", "--quiet"]
    return json.loads(_checked(subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)).splitlines()[-1])


def _checked(r) -> str:  # a finished row process's stdout, or its last stderr line as the row's error
    if r.returncode != 0:
        raise RuntimeError((r.stderr.strip().splitlines() or ["?"])[-1])
    return r.stdout.strip()


def run_runner(row, args, fill):
    """The C++ runner, runs + 1 times (the first warms the page cache); medians of what it prints on stderr."""
    cmd = [str(REPO / fill(row["binary"])), fill(row["artifact"]), "-z", fill("{art}/tokenizer.bin"), "-i",
           PROMPTS[row["prompt"]], "-n", str(args.max_new_tokens), "-t", "0", "-x",
           "-j", str(torch.get_num_threads())]  # main() applied --threads
    if row.get("mode"):
        cmd += ["-M", row["mode"], "-L", "6,1,1"]
    runs, rss = [], 0.0
    for _ in range(args.runs + 1):
        err = (p := subprocess.run(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)).stderr
        if p.returncode != 0:
            raise RuntimeError((err.strip().splitlines() or ["?"])[-1])
        m = re.search(r"TTFT ([\d.]+) ms \| prefill ([\d.]+) tok/s \| decode ([\d.]+) tok/s \((\d+) steps\) \| "
                      r"(\d+) new", err)
        if not m:
            raise RuntimeError(f"no timing line in the runner's output: {err[-200:]!r}")
        runs.append(dict(ttft_s=float(m[1]) / 1000, prefill_tok_s=float(m[2]), decode_tok_s=float(m[3]),
                         new_tokens=int(m[5])))
        m = re.search(r"([\d.]+) tokens/forward", err)  # lookahead: tokens per forward of the program
        if m and row.get("mode") == "lookahead":
            runs[-1]["tokens_per_step"] = float(m[1])
        m = re.search(r"peak memory ([\d.]+) MB", err)  # the runner's own VmHWM (ru_maxrss would count ours)
        rss = max(rss, float(m[1]) if m else 0.0)
    runs = runs[1:]
    med = {k: statistics.median(r[k] for r in runs) for k in ("decode_tok_s", "prefill_tok_s", "ttft_s")
           + (("tokens_per_step",) if "tokens_per_step" in runs[0] else ())}
    med.update(peak_rss_mb=rss, new_tokens=runs[0]["new_tokens"], decode_runs=[r["decode_tok_s"] for r in runs])
    return med


def build(path_tpl, fill):  # the artifact and what it is made from, each timed, with its own peak RSS
    target = REPO / fill(path_tpl)  # (an absolute path stays as it is)
    if target.exists():
        return
    for dep in BUILD[path_tpl]:  # an artifact made from another one (the 8da4w .pte from its checkpoint)
        if dep in BUILD and dep != path_tpl:  # (an export's command names its own output too)
            build(dep, fill)
    print(f"building {target} ...", file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    start, err, peak = timeit.default_timer(), tempfile.TemporaryFile("w+"), 0
    p = subprocess.Popen([fill(a) for a in BUILD[path_tpl]], cwd=REPO, stdout=subprocess.DEVNULL, stderr=err, text=True)
    while p.poll() is None:  # its own peak (a child's ru_maxrss would count what this process had at the fork)
        peak = max(peak, vm_hwm_mb(p.pid))
        time.sleep(0.5)
    if p.returncode != 0 or not target.exists():
        err.seek(0)
        raise RuntimeError(f"building {target.name} failed: {(err.read().strip().splitlines() or ['?'])[-1]}")
    print(f"built {target.name} in {timeit.default_timer() - start:.0f} s, peak RSS {peak:.0f} MB", file=sys.stderr)


def run_row(name, args, bw, nproc=1):
    row = ROWS[name]
    art = Path(args.checkpoint_dir) / "bench"
    fill = lambda a: a.format(ck=args.checkpoint_dir, art=art, j=torch.get_num_threads())
    if row["kind"] == "peer" and importlib.util.find_spec("llama_cpp") is None:
        print(f"[{name}] skipped: llama-cpp-python is not installed "
              f"(CMAKE_ARGS=\"-DGGML_NATIVE=ON\" pip install llama-cpp-python==0.3.36)", file=sys.stderr)
        return dict(name=name, error="skipped: llama-cpp-python is not installed")
    try:
        for need in row["needs"]:
            build(need, fill)
        if row["kind"] == "peer":
            res, size_of = run_peer(row, args, fill), fill(row["gguf"])
        elif row["kind"] == "runner":
            res, size_of = run_runner(row, args, fill), fill(row["artifact"])
        else:
            gen_args = [fill(a) for a in row["args"]]
            if not any(a in gen_args for a in ("--checkpoint_path", "--pte", "--aoti_package", "--onnx")):
                gen_args += ["--checkpoint_path", fill(row["weights"])]
            if row["prompt"] == "cb":
                art.mkdir(parents=True, exist_ok=True)
                (art / "cb_prompts.txt").write_text("\n".join(CB_PROMPTS) + "\n")
                gen_args += ["--prompts_file", str(art / "cb_prompts.txt")]
            else:  # a fixed number of tokens for every row (a continuous-batching row needs its sequences to end)
                gen_args += ["--prompt", PROMPTS[row["prompt"]], "--ignore_eos"]
            tp = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else []
            cmd = [PY, *tp, __file__, "--_child", "--runs", str(args.runs), "--max_new_tokens",
                   str(args.max_new_tokens), "--", *gen_args, "--device", args.device]
            res = json.loads(_checked(subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)).splitlines()[-1])
            size_of = next((gen_args[i + 1] for i, a in enumerate(gen_args)
                            if a in ("--pte", "--aoti_package", "--onnx", "--checkpoint_path")), None)
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        print(f"[{name}] failed: {e}", file=sys.stderr)
        return dict(name=name, error=f"failed: {e}")
    res.update(name=name if nproc == 1 else f"{name} tp{nproc}", world_size=nproc, vs=row["vs"], peer=row.get("peer"),
               file_mb=_file_mb(Path(size_of)) if size_of else None)
    # a GGUF holds exactly the tensors one step reads (tied embedding once): its size is the weight bytes
    args_ = row.get("args", [])
    dtype = args_[args_.index("--dtype") + 1] if "--dtype" in args_ else None  # a bfloat16 row reads half the bytes
    res["weight_bytes"] = (Path(size_of).stat().st_size if row["kind"] == "peer"
                           else _weight_bytes(fill(row["weights"]), dtype))
    if row["prompt"] != "cb":  # a continuous-batching row reads the weights once per step for several sequences
        res["gb_s"] = res["weight_bytes"] * res["decode_tok_s"] / 1e9
        res["pct_of_ceiling"] = 100 * res["gb_s"] / bw
        res["ceiling_tok_s"] = bw * 1e9 / res["weight_bytes"]
    print(f"[{res['name']}] decode {res['decode_tok_s']:.2f} tok/s", file=sys.stderr)
    return res


def merge_rounds(rs: tuple) -> dict:
    """One row's results from several interleaved rounds: medians over the rounds, every run's decode tok/s kept."""
    ok = [r for r in rs if "error" not in r]
    if len(ok) < len(rs):
        return next(r for r in rs if "error" in r)
    out = dict(ok[0])
    out.update({k: statistics.median(r[k] for r in ok)
                for k in ("decode_tok_s", "prefill_tok_s", "ttft_s", "gb_s", "pct_of_ceiling") if k in out})
    out["peak_rss_mb"] = max(r["peak_rss_mb"] for r in ok)
    out["decode_runs"] = [x for r in ok for x in r["decode_runs"]]
    return out


def _file_mb(p: Path) -> float:
    """Size of a checkpoint or an exported artifact (with its external data files, e.g. ONNX's)."""
    files = [p] if p.is_file() else []
    if p.suffix == ".onnx":
        files += [f for f in p.parent.iterdir() if f.is_file() and f != p and not f.name.endswith(".json")]
    return sum(f.stat().st_size for f in files) / 2**20


def _weight_bytes(ck: str, dtype: Optional[str] = None) -> int:
    """Bytes of the weights one decode step reads, in the row's dtype (a tied embedding once; mmap, nothing read)."""
    import engine
    import quantize
    return engine.weight_bytes(quantize.load_model(ck, dtype=getattr(torch, dtype) if dtype else None))


def cpu_model() -> str:  # /proc/cpuinfo's "model name", as lscpu shows it (else the platform's processor name)
    info = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []
    return next((x.split(":", 1)[1].strip() for x in info if x.startswith("model name")), platform.processor())


def main():
    p = ArgumentParser(description="Benchmark generate.py's backends and modes and the C++ runners.")
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS),
                   help=f"comma-separated rows or groups ({', '.join(GROUPS)}); rows: {', '.join(ROWS)}")
    p.add_argument("--checkpoint_dir", default=str(CK))
    p.add_argument("--model", help="with --random_weights: a named config's shape (Llama-3.2-1B), seeded weights")
    p.add_argument("--random_weights", action="store_true", help="scripts/random_checkpoint.py's NAME-random")
    p.add_argument("--runs", type=int, default=5, rule=at_least(1))
    p.add_argument("--max_new_tokens", type=int, default=128, rule=at_least(1))
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default="bench.json")
    p.add_argument("--threads", type=int, help="CPU threads per row (default: torch's)", rule=THREADS)
    p.add_argument("--rounds", type=int, default=1, help="the rows N times, interleaved; medians", rule=at_least(1))
    p.add_argument("--nproc", default="1", help="tensor-parallel world sizes (torchrun), e.g. 1,2,4")
    p.add_argument("--prompt_tokens", type=int, help="prefill at N tokens: the first N of the long prompt, every row",
                   rule=within(1, 480))
    p.add_argument("--markdown", default=None, help="also write the benchmark page (e.g. docs/benchmarks.md)")
    p.add_argument("--readme", default=None, help="with --from_json: write the README's table from those runs")
    p.add_argument("--from_json", default=None, help="render bench.json files (--readme: several, comma-separated; "
                   "--markdown: one), run nothing")
    p.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("gen_args", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._child:
        return child(args)
    if args.markdown and Path(args.markdown).is_dir():  # (common.OUTPUT_FILES covers output, json)
        raise ValueError(f"--markdown {args.markdown} is a folder; name the file to write")
    if args.readme and not (Path(args.readme).is_file() and args.from_json):
        raise ValueError(f"--readme {args.readme} needs an existing README and --from_json RUN.json[,RUN.json...]")
    if args.from_json:  # render earlier runs' results; run nothing
        files = args.from_json.split(",")
        if not (args.markdown or args.readme) or (args.markdown and len(files) > 1):
            raise ValueError(f"--from_json needs --markdown PATH (one file) or --readme PATH, got {args.from_json}")
        runs = []
        for f in files:
            res = json.loads(Path(f).read_text()) if Path(f).is_file() else None
            if not isinstance(res, dict) or not isinstance(res.get("rows"), list):
                raise ValueError(f"{f} is not a bench.py results file (no list of rows)")
            runs.append(res)
        if args.markdown:
            write_atomic(args.markdown, markdown(runs[0]))
        return write_readme(args.readme, runs) if args.readme else None
    started = datetime.datetime.now().astimezone()
    if args.threads:  # rows inherit it through the environment
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        torch.set_num_threads(args.threads)
    names = []
    for n in (n.strip() for n in args.rows.split(",") if n.strip()):
        names += [m for m in GROUPS.get(n, [n]) if m not in names]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        raise ValueError(f"unknown rows {unknown}; known: {', '.join(ROWS)} (groups: {', '.join(GROUPS)})")
    if bool(args.model) != args.random_weights:
        raise ValueError("--model NAME and --random_weights go together (a real checkpoint: --checkpoint_dir)")
    if args.model:  # (speed and memory do not depend on the weights' values)
        from random_checkpoint import random_checkpoint
        args.checkpoint_dir = str(REPO / "checkpoints" / f"{args.model}-random")
        random_checkpoint(args.model, Path(args.checkpoint_dir), log=lambda m: print(m, file=sys.stderr))
    if not (Path(args.checkpoint_dir) / "model.pth").is_file():
        import download
        download.prepare_default(Path(args.checkpoint_dir))
    if args.prompt_tokens:  # a text that our tokenizer (and so llama.cpp's rows, fed our ids) reads as exactly N tokens
        from tokenizer import load_tokenizer
        tok = load_tokenizer(Path(args.checkpoint_dir))
        PROMPTS["story"] = tok.decode(tok.encode(PROMPTS["long"])[:args.prompt_tokens])
    bw = measure_bandwidth()
    print(f"measured read bandwidth: {bw:.1f} GB/s ({torch.get_num_threads()} threads)", file=sys.stderr)
    rounds = []
    for i in range(args.rounds):
        print(f"round {i + 1} of {args.rounds}", file=sys.stderr)
        rounds.append([run_row(n, args, bw, int(k)) for n in names for k in args.nproc.split(",")])
    results = [merge_rounds(rs) for rs in zip(*rounds)]
    server = None
    if "server" in args.rows.split(","):
        from bench_server import bench_server
        server = bench_server([*SERVER_ARGS, "--checkpoint_path", str(Path(args.checkpoint_dir) / "model.pth"),
                               "--threads", str(torch.get_num_threads())], max_tokens=args.max_new_tokens)
    date = f"{started:%Y-%m-%d %H:%M} - {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}"
    out = dict(command=shlex.join(["python", "bench.py", *sys.argv[1:]]), date=date,
               machine=dict(cpu_model=cpu_model(), cpu_count=os.cpu_count(), threads=torch.get_num_threads(),
                            bandwidth_gb_s=bw, torch=torch.__version__, device=args.device),
               settings=dict(runs=args.runs, rounds=args.rounds, max_new_tokens=args.max_new_tokens, prompts=PROMPTS,
                             model=Path(args.checkpoint_dir).name), rows=results, server=server,
               server_args=SERVER_ARGS if server else None)
    write_atomic(args.json, json.dumps(out, indent=1))
    print(markdown(out))
    if args.markdown:
        write_atomic(args.markdown, markdown(out))


if __name__ == "__main__":
    cli(main)
