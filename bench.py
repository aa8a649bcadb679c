# Just over 500 lines: a third of it is the ROWS / BUILD tables (one entry per row and per artifact), kept beside the
# code that builds and runs them so a row and what it needs read together.
# Benchmarks: decode / prefill tok/s, TTFT, achieved GB/s and % of the memory-bandwidth ceiling measured on this
# machine, peak RSS and file size, for every backend, precision and decoding mode. Each row runs in its own process
# (clean peak memory, no state shared between rows); each figure is the median of several runs. Prints a markdown
# table, writes JSON.
#
#   python bench.py                                  # default rows on the default model
#   python bench.py --rows "compile fp32,compile int4 g32" --runs 5 --max_new_tokens 128 --json bench.json
#   python bench.py --rows all --threads 1           # everything; 1 thread gives stable figures on a shared machine
#   python bench.py --rows peer --threads 2 --rounds 5 --runs 1   # against llama.cpp, rows interleaved round by round
#   python bench.py --rows prefill --prompt_tokens 128 --max_new_tokens 8 --threads 2 --rounds 3   # prefill at 128
#
# A row runs generate.py (any backend, any mode) or one of the C++ runners with greedy decoding, so every row of a
# prompt produces the same tokens. Artifacts a row needs (quantized checkpoints, .pte / .pt2 / ONNX files,
# tokenizer.bin, runner binaries) are built first with the stage's own script when missing, in <checkpoint_dir>/bench/.
# "vs" is the row a row is compared with (the issue targets: quantized vs float32, runner-et 8da4w vs float32,
# a decoding mode vs plain decoding); the ratio is shown when both rows ran. The figures of a generate.py row are
# generate.Emitter's (one definition of TTFT, prefill and decode tok/s for every backend and mode). "llama.cpp" rows
# time llama-cpp-python on the same weights written as GGUF (scripts/llamacpp_peer.py; skipped with one line when the
# package is absent); each of our rows shows its ratio to the llama.cpp row of its precision when that row ran.
# --rounds N runs the whole row list N times, interleaved, and reports the median over rounds (a shared machine's
# slow spells then hit every row alike).
import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from common import DEFAULT_CHECKPOINT, REPO, ArgumentParser, cli, peak_memory_mb, write_atomic

CK = DEFAULT_CHECKPOINT.parent
PY = sys.executable

PROMPTS = {
    "story": ("Write a short story about a robot who learns to paint. The robot lives in a small town by the sea and "
              "every morning it watches the fishermen leave the harbour."),
    "code": ("class Calculator:\n    def add(self, a, b):\n        return a + b\n\n    def sub(self, a, b):\n"
             "        return a - b\n\n    def mul(self, a, b):\n        return a * b\n\n    def"),
}
# a ~512-token prompt (495 tokens with SmolLM2's tokenizer: 4 prefill chunks of 128): hybrid (fixed-length prefill)
# vs one dynamic-length forward
PROMPTS["long"] = " ".join([PROMPTS["story"]] * 15)
CB_PROMPTS = [  # continuous batching: more prompts than slots
    "The history of the printing press begins", "Here is a recipe for a simple tomato soup:",
    "The three laws of motion are", "Once upon a time, in a village at the edge of a forest,",
    "A good way to learn a new language is", "The main causes of the French Revolution were",
    "To change a flat tyre on a bicycle, first", "The weather on Mars is",
]

# Artifacts: path -> command that builds it ({ck} the checkpoint directory, {art} ART)
Q = ["quantize.py", "--checkpoint_path", "{ck}/model.pth", "--mode"]
S256, J = ("--max_seq_length", "256"), ("--threads", "{j}")


def export(script, name, checkpoint, *extra) -> dict:
    """{art}/name: the stage script's export of {ck}/checkpoint."""
    return {f"{{art}}/{name}": [PY, script, "--checkpoint_path", f"{{ck}}/{checkpoint}", "--output_path",
                                f"{{art}}/{name}", *extra]}


BUILD = {
    "{ck}/model_int8.pth": [PY, *Q, "int8"],
    "{ck}/model_int4.g32.pth": [PY, *Q, "int4", "--groupsize", "32"],
    "{ck}/model_8da4w.g32.pth": [PY, *Q, "8da4w", "--groupsize", "32"],
    "{ck}/model_8da8w.pth": [PY, *Q, "8da8w"],
    # exported with a 256-token context (the prompt + 128 tokens fit; generate.py sizes its cache the same way). A
    # .pte reads its static cache whole at every step, at 1024 tokens 47 MB per step for this model (the ctx1024
    # rows); torch.compile and AOT Inductor packages read the filled slots only (model.py's _attend_filled)
    **export("et_export.py", "fp32.s256.pte", "model.pth", *S256),
    **export("et_export.py", "fp32.fp.s256.pte", "model.pth", *S256, "--fast_prefill"),
    **export("et_export.py", "8da4w.g32.s256.pte", "model_8da4w.g32.pth", *S256),
    **export("et_export.py", "8da4w.g32.fp.s256.pte", "model_8da4w.g32.pth", *S256, "--fast_prefill"),
    **export("et_export.py", "8da8w.s256.pte", "model_8da8w.pth", *S256),
    **export("et_export.py", "fp32.pte", "model.pth"),
    **export("et_export.py", "8da4w.g32.pte", "model_8da4w.g32.pth"),
    # AOT Inductor's CPU kernels are compiled for a thread count ({j}: the bench's); fp.: + the "prompt" model (ATen
    # GEMMs tuned for prompts, its own copy of the weights)
    **export("aoti_export.py", "fp32.s256.j{j}.pt2", "model.pth", *S256, *J),
    **export("aoti_export.py", "fp32.fp.s256.j{j}.pt2", "model.pth", *S256, *J, "--fast_prefill"),
    **export("aoti_export.py", "int8.s256.j{j}.pt2", "model_int8.pth", *S256, *J),
    **export("aoti_export.py", "int4.g32.s256.j{j}.pt2", "model_int4.g32.pth", *S256, *J),
    **export("aoti_export.py", "int4.g32.j{j}.pt2", "model_int4.g32.pth", *J),  # aoti_export.py's default context
    **export("aoti_export.py", "int8.fp.s256.j{j}.pt2", "model_int8.pth", *S256, *J, "--fast_prefill"),
    **export("aoti_export.py", "int4.g32.fp.s256.j{j}.pt2", "model_int4.g32.pth", *S256, *J, "--fast_prefill"),
    **export("aoti_export.py", "8da4w.g32.s256.j{j}.pt2", "model_8da4w.g32.pth", *S256, *J),
    **export("aoti_export.py", "8da4w.g32.fp.s256.j{j}.pt2", "model_8da4w.g32.pth", *S256, *J, "--fast_prefill"),
    **export("aoti_export.py", "8da8w.fp.s256.j{j}.pt2", "model_8da8w.pth", *S256, *J, "--fast_prefill"),
    "{art}/onnx/model.onnx": [PY, "export_onnx.py", "--checkpoint_path", "{ck}/model.pth", "--output_dir",
                              "{art}/onnx"],
    "{art}/tokenizer.bin": [PY, "scripts/export_tokenizer_bin.py", "{ck}", "-o", "{art}/tokenizer.bin"],
    **{f"{{art}}/{t}.gguf": [PY, "scripts/llamacpp_peer.py", "write", "--checkpoint_path", "{ck}/model.pth",
                              "--type", t, "--output", f"{{art}}/{t}.gguf"] for t in ("f32", "f16", "q8_0", "q4_0")},
    "runner-et/build/run": ["sh", "-c", "cmake -S runner-et -B runner-et/build && cmake --build runner-et/build -j2"],
    "runner-aoti/build/run": ["sh", "-c",
                              "cmake -S runner-aoti -B runner-aoti/build && cmake --build runner-aoti/build -j2"],
    # the runners' decoding modes (-M kv|hybrid|lookahead): one program with every method / model, a 1024-token
    # context (the 512-token prompt + 128 tokens), prefill chunks of 128
    **export("et_export.py", "fp32.modes.pte", "model.pth", "--prefill_chunk", "128", "--lookahead"),
    **export("aoti_export.py", "fp32.modes.j{j}.pt2", "model.pth", "--prefill_chunk", "128", "--lookahead", *J),
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
    """kv / lookahead (6,1,1, the runners' default) on the code and story prompts, kv / hybrid on the long prompt; ratio to kv, same run."""
    rows = {}
    for prompt, modes in (("code", ("lookahead",)), ("story", ("lookahead",)), ("long", ("hybrid",))):
        rows[f"{name} kv {prompt}"] = runner(binary, artifact, "{ck}/model.pth", prompt=prompt, mode="kv")
        for m in modes:
            rows[f"{name} {m} {prompt}"] = runner(binary, artifact, "{ck}/model.pth", prompt=prompt, mode=m,
                                                  vs=f"{name} kv {prompt}")
    return rows


def artifact_row(flag, artifact, weights, vs=None, peer=None):
    return gen(flag, artifact, "--tokenizer_path", "{ck}", weights=weights, vs=vs, needs=[artifact], peer=peer)


def llamacpp(kind):
    """llama.cpp (llama-cpp-python) decoding the same weights as a GGUF of this kind, same prompt and threads."""
    gguf = f"{{art}}/{kind}.gguf"
    return dict(kind="peer", gguf=gguf, weights=gguf, prompt="story", vs=None, needs=[gguf], peer=None)


ROWS = {
    "llama.cpp F32": llamacpp("f32"),
    "llama.cpp F16": llamacpp("f16"),
    "llama.cpp Q8_0": llamacpp("q8_0"),
    "llama.cpp Q4_0": llamacpp("q4_0"),
    "eager fp32": gen(peer="llama.cpp F32"),
    "compile fp32": gen("--compile", vs="eager fp32", peer="llama.cpp F32"),
    "eager bf16": gen("--dtype", "bfloat16", vs="eager fp32"),
    "compile bf16": gen("--compile", "--dtype", "bfloat16", vs="compile fp32", peer="llama.cpp F16"),
    "eager int8": gen("--checkpoint_path", "{ck}/model_int8.pth", vs="eager fp32"),
    "compile int8": gen("--compile", "--checkpoint_path", "{ck}/model_int8.pth", vs="compile fp32",
                        peer="llama.cpp Q8_0"),
    "compile int4 g32": gen("--compile", "--checkpoint_path", "{ck}/model_int4.g32.pth", vs="compile fp32",
                            peer="llama.cpp Q4_0"),
    # the server's and chat's 2048-token context: the layers attend over the filled cache slots only (model.py)
    "compile fp32 ctx2048": gen("--compile", "--max_seq_length", "2048", vs="compile fp32", peer="llama.cpp F32"),
    "compile int4 g32 ctx2048": gen("--compile", "--max_seq_length", "2048", "--checkpoint_path",
                                    "{ck}/model_int4.g32.pth", vs="compile int4 g32", peer="llama.cpp Q4_0"),
    # 8da8w: int8 weights x int8 per-token activations, the arithmetic of llama.cpp's Q8_0 (prompts: torch._int_mm)
    "compile 8da8w": gen("--compile", "--checkpoint_path", "{ck}/model_8da8w.pth", vs="compile int8",
                         peer="llama.cpp Q8_0"),
    "compile 8da4w g32": gen("--compile", "--checkpoint_path", "{ck}/model_8da4w.g32.pth", vs="compile fp32",
                             peer="llama.cpp Q4_0"),
    "compile bf16 int8": gen("--compile", "--dtype", "bfloat16", "--checkpoint_path", "{ck}/model_int8.pth",
                             vs="compile fp32"),
    "compile bf16 int4 g32": gen("--compile", "--dtype", "bfloat16", "--checkpoint_path", "{ck}/model_int4.g32.pth",
                                 vs="compile fp32"),
    # exported programs, through generate.py (Python runtimes) and through the C++ runners
    "aoti fp32": artifact_row("--aoti_package", "{art}/fp32.s256.j{j}.pt2", "{ck}/model.pth", vs="compile fp32",
                              peer="llama.cpp F32"),
    "aoti int8": artifact_row("--aoti_package", "{art}/int8.s256.j{j}.pt2", "{ck}/model_int8.pth", vs="aoti fp32"),
    "runner-aoti fp32": runner("runner-aoti/build/run", "{art}/fp32.s256.j{j}.pt2", "{ck}/model.pth",
                               vs="compile fp32", peer="llama.cpp F32"),
    "runner-aoti fp32 fast_prefill": runner("runner-aoti/build/run", "{art}/fp32.fp.s256.j{j}.pt2", "{ck}/model.pth",
                                            vs="runner-aoti fp32", peer="llama.cpp F32"),
    "runner-aoti int8": runner("runner-aoti/build/run", "{art}/int8.s256.j{j}.pt2", "{ck}/model_int8.pth",
                               vs="runner-aoti fp32", peer="llama.cpp Q8_0"),
    "runner-aoti int4 g32": runner("runner-aoti/build/run", "{art}/int4.g32.s256.j{j}.pt2", "{ck}/model_int4.g32.pth",
                                   vs="runner-aoti fp32", peer="llama.cpp Q4_0"),
    "runner-aoti int4 g32 ctx1024": runner("runner-aoti/build/run", "{art}/int4.g32.j{j}.pt2",
                                           "{ck}/model_int4.g32.pth", vs="runner-aoti int4 g32", peer="llama.cpp Q4_0"),
    "runner-aoti int8 fast_prefill": runner("runner-aoti/build/run", "{art}/int8.fp.s256.j{j}.pt2",
                                            "{ck}/model_int8.pth", vs="runner-aoti int8", peer="llama.cpp Q8_0"),
    "runner-aoti int4 g32 fast_prefill": runner("runner-aoti/build/run", "{art}/int4.g32.fp.s256.j{j}.pt2",
                                                "{ck}/model_int4.g32.pth", vs="runner-aoti int4 g32",
                                                peer="llama.cpp Q4_0"),
    "runner-aoti 8da8w fast_prefill": runner("runner-aoti/build/run", "{art}/8da8w.fp.s256.j{j}.pt2",
                                             "{ck}/model_8da8w.pth", vs="runner-aoti int8 fast_prefill",
                                             peer="llama.cpp Q8_0"),
    "runner-aoti 8da4w g32 fast_prefill": runner("runner-aoti/build/run", "{art}/8da4w.g32.fp.s256.j{j}.pt2",
                                                 "{ck}/model_8da4w.g32.pth", vs="runner-aoti 8da4w g32",
                                                 peer="llama.cpp Q4_0"),
    "runner-aoti 8da4w g32": runner("runner-aoti/build/run", "{art}/8da4w.g32.s256.j{j}.pt2",
                                    "{ck}/model_8da4w.g32.pth", vs="runner-aoti fp32", peer="llama.cpp Q4_0"),
    "pte fp32": artifact_row("--pte", "{art}/fp32.s256.pte", "{ck}/model.pth", vs="eager fp32"),
    "pte 8da4w g32": artifact_row("--pte", "{art}/8da4w.g32.s256.pte", "{ck}/model_8da4w.g32.pth", vs="pte fp32"),
    "runner-et fp32": runner("runner-et/build/run", "{art}/fp32.s256.pte", "{ck}/model.pth", vs="pte fp32",
                             peer="llama.cpp F32"),
    "runner-et fp32 fast_prefill": runner("runner-et/build/run", "{art}/fp32.fp.s256.pte", "{ck}/model.pth",
                                          vs="runner-et fp32", peer="llama.cpp F32"),
    "runner-et 8da4w g32": runner("runner-et/build/run", "{art}/8da4w.g32.s256.pte", "{ck}/model_8da4w.g32.pth",
                                  vs="runner-et fp32", peer="llama.cpp Q4_0"),
    "runner-et 8da4w g32 fast_prefill": runner("runner-et/build/run", "{art}/8da4w.g32.fp.s256.pte",
                                               "{ck}/model_8da4w.g32.pth", vs="runner-et 8da4w g32",
                                               peer="llama.cpp Q4_0"),
    "runner-et 8da8w": runner("runner-et/build/run", "{art}/8da8w.s256.pte", "{ck}/model_8da8w.pth",
                              vs="runner-et fp32", peer="llama.cpp Q8_0"),
    "runner-et fp32 ctx1024": runner("runner-et/build/run", "{art}/fp32.pte", "{ck}/model.pth", vs="runner-et fp32"),
    "runner-et 8da4w g32 ctx1024": runner("runner-et/build/run", "{art}/8da4w.g32.pte", "{ck}/model_8da4w.g32.pth",
                                          vs="runner-et fp32 ctx1024"),
    "onnx fp32": artifact_row("--onnx", "{art}/onnx/model.onnx", "{ck}/model.pth", vs="eager fp32"),
    # decoding modes (issue 7): speedup over plain decoding of the same prompt and precision
    "compile spec int4 k5": gen("--compile", "--draft_checkpoint_path",
                                "{ck}/model_int4.g32.pth", "--speculate_k", "5", vs="compile fp32"),
    "compile spec int8 k6": gen("--compile", "--draft_checkpoint_path", "{ck}/model_int8.pth",
                                "--speculate_k", "6", vs="compile fp32"),
    "eager fp32 code": gen(prompt="code"),
    "eager lookahead code": gen("--lookahead", "5,1,2", prompt="code", vs="eager fp32 code"),  # runs model.py eagerly
    "compile fp32 code": gen("--compile", prompt="code", vs="eager fp32 code"),
    "compile fp32 cb4": gen("--compile", "--full_batch_size", "4", prompt="cb", vs="compile fp32"),
    "eager fp32 cb4": gen("--full_batch_size", "4", prompt="cb", vs="eager fp32"),
    **runner_modes("runner-et", "runner-et/build/run", "{art}/fp32.modes.pte"),
    **runner_modes("runner-aoti", "runner-aoti/build/run", "{art}/fp32.modes.j{j}.pt2"),
}
DEFAULT_ROWS = ["eager fp32", "compile fp32", "eager bf16", "compile bf16"]
GROUPS = {  # --rows shorthands
    "quant": ["compile fp32", "compile int8", "compile int4 g32", "compile 8da4w g32", "compile bf16",
              "compile bf16 int8", "compile bf16 int4 g32"],
    "export": ["compile fp32", "compile int4 g32", "aoti fp32", "runner-aoti fp32", "aoti int8", "runner-aoti int8",
               "pte fp32", "pte 8da4w g32", "runner-et fp32", "runner-et 8da4w g32", "runner-et fp32 ctx1024",
               "runner-et 8da4w g32 ctx1024", "onnx fp32"],
    "et": ["compile int4 g32", "pte fp32", "pte 8da4w g32", "runner-et fp32", "runner-et 8da4w g32",
           "runner-et fp32 ctx1024", "runner-et 8da4w g32 ctx1024"],
    "modes": ["compile fp32", "compile spec int4 k5", "compile spec int8 k6", "eager fp32 code",
              "eager lookahead code", "compile fp32 code", "eager fp32", "eager fp32 cb4",
              "compile fp32 cb4"] + [f"{r} {m} {p}" for r in ("runner-et", "runner-aoti")
                                     for p, ms in (("code", ("kv", "lookahead")), ("story", ("kv", "lookahead")),
                                                   ("long", ("kv", "hybrid"))) for m in ms],
}
GROUPS["peer"] = ["llama.cpp F32", "compile fp32", "aoti fp32", "runner-aoti fp32", "runner-aoti fp32 fast_prefill",
                  "runner-et fp32", "llama.cpp F16", "compile bf16", "llama.cpp Q8_0", "compile int8", "llama.cpp Q4_0",
                  "compile int4 g32", "runner-et 8da4w g32"]
GROUPS["prefill"] = ["llama.cpp F32", "compile fp32", "runner-aoti fp32", "runner-aoti fp32 fast_prefill",
                     "runner-et fp32", "llama.cpp Q8_0", "compile int8", "runner-aoti int8 fast_prefill",
                     "compile 8da8w", "runner-aoti 8da8w fast_prefill", "runner-et 8da8w",
                     "llama.cpp Q4_0", "compile int4 g32", "runner-aoti int4 g32 fast_prefill",
                     "runner-et 8da4w g32"]
GROUPS["all"] = list(ROWS)
# --rows server: server.py under 1, 4 and 8 concurrent clients (scripts/bench_server.py), next to the generate.py
# batch-1 row of the same backend ("compile fp32") in the same run
SERVER_ARGS = ["--compile", "--full_batch_size", "8", "--max_seq_length", "512"]
GROUPS["server"] = ["compile fp32"]


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
    """Run generate.py's main() in this process (run 0 warms up) and print the medians as JSON on the last line."""
    import generate as G
    runs = G.main([*args.gen_args, "--temperature", "0", "--max_new_tokens", str(args.max_new_tokens),
                   "--num_samples", str(args.runs + 1), "--quiet"])[1:]
    med = {k: statistics.median(r[k] for r in runs) for k in ("decode_tok_s", "prefill_tok_s", "ttft_s")}
    med.update(peak_rss_mb=peak_memory_mb(torch.device(G.parse_args(args.gen_args).device)),
               prompt_tokens=runs[0]["prompt_tokens"], new_tokens=runs[0]["new_tokens"],
               decode_runs=[r["decode_tok_s"] for r in runs])
    for k in ("acceptance_rate", "mean_accepted", "tokens_per_step"):
        if k in runs[0]:
            med[k] = runs[0][k]
    print(json.dumps(med))


def run_peer(row, args, fill):
    """llama.cpp through scripts/llamacpp_peer.py: same prompt, token count, threads and number of runs."""
    cmd = [PY, "scripts/llamacpp_peer.py", "time", "--gguf", fill(row["gguf"]), "--tokenizer_path", fill("{ck}"),
           "--threads", str(torch.get_num_threads()), "--prompt", PROMPTS["story"],
           "--max_new_tokens", str(args.max_new_tokens), "--runs", str(args.runs), "--n_ctx", "512", "--quiet"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError((r.stderr.strip().splitlines() or ["?"])[-1])
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_runner(row, args, fill):
    """The C++ runner, runs + 1 times (the first warms the page cache); medians of what it prints on stderr."""
    cmd = [str(REPO / fill(row["binary"])), fill(row["artifact"]), "-z", fill("{art}/tokenizer.bin"), "-i",
           PROMPTS[row["prompt"]], "-n", str(args.max_new_tokens), "-t", "0", "-x",
           "-j", str(torch.get_num_threads())]  # main() applied --threads
    if row.get("mode"):
        cmd += ["-M", row["mode"], "-L", "6,1,1"]
    runs, rss = [], 0.0
    for _ in range(args.runs + 1):
        p = subprocess.run(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        err = p.stderr
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


def build(path_tpl, fill):
    target = Path(fill(path_tpl))
    if not target.is_absolute():
        target = REPO / target
    if target.exists():
        return
    for dep in BUILD[path_tpl]:  # an artifact made from another one (the 8da4w .pte from its checkpoint)
        if dep in BUILD and dep != path_tpl:  # (an export's command names its own output too)
            build(dep, fill)
    print(f"building {target} ...", file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([fill(a) for a in BUILD[path_tpl]], cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0 or not target.exists():
        raise RuntimeError(f"building {target.name} failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")


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
            res = run_peer(row, args, fill)
            size_of = fill(row["gguf"])
        elif row["kind"] == "runner":
            res = run_runner(row, args, fill)
            size_of = fill(row["artifact"])
        else:
            gen_args = [fill(a) for a in row["args"]]
            if not any(a in gen_args for a in ("--checkpoint_path", "--pte", "--aoti_package", "--onnx")):
                gen_args += ["--checkpoint_path", fill(row["weights"])]
            if row["prompt"] == "cb":
                pf = art / "cb_prompts.txt"
                art.mkdir(parents=True, exist_ok=True)
                pf.write_text("\n".join(CB_PROMPTS) + "\n")
                gen_args += ["--prompts_file", str(pf)]
            else:  # a fixed number of tokens for every row (a continuous-batching row needs its sequences to end)
                gen_args += ["--prompt", PROMPTS[row["prompt"]], "--ignore_eos"]
            launch = [PY] if nproc == 1 else [PY, "-m", "torch.distributed.run", "--standalone",
                                               f"--nproc_per_node={nproc}"]
            cmd = [*launch, __file__, "--_child", "--runs", str(args.runs), "--max_new_tokens",
                   str(args.max_new_tokens), "--", *gen_args, "--device", args.device]
            r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError((r.stderr.strip().splitlines() or ["?"])[-1])
            res = json.loads(r.stdout.strip().splitlines()[-1])
            size_of = next((gen_args[i + 1] for i, a in enumerate(gen_args)
                            if a in ("--pte", "--aoti_package", "--onnx", "--checkpoint_path")), None)
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        print(f"[{name}] failed: {e}", file=sys.stderr)
        return dict(name=name, error=f"failed: {e}")
    res["name"] = name if nproc == 1 else f"{name} tp{nproc}"
    res["world_size"], res["vs"], res["peer"] = nproc, row["vs"], row["peer"]
    res["file_mb"] = _file_mb(Path(size_of)) if size_of else None
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
    for k in ("decode_tok_s", "prefill_tok_s", "ttft_s", "gb_s", "pct_of_ceiling"):
        if k in out:
            out[k] = statistics.median(r[k] for r in ok)
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
    """Bytes of the weights one decode step reads: the checkpoint's tensors in the row's dtype (a tied embedding
    counted once, as the output projection; mmap, nothing is read unless the dtype changes)."""
    import engine
    from quantize import load_model
    return engine.weight_bytes(load_model(ck, dtype=getattr(torch, dtype) if dtype else None))


def table(results, bw):
    by_name = {r["name"]: r for r in results if "error" not in r}
    lines = [f"memory bandwidth (measured, read): {bw:.1f} GB/s",
             "",
             "| row | decode tok/s | vs | ratio | vs llama.cpp (decode / prefill) | prefill tok/s | TTFT ms | file MB | "
             "weights MB | GB/s | % of ceiling | ceiling tok/s | peak RSS MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['name']} | {r['error']} ||||||||||||")
            continue
        base = by_name.get(r["vs"])
        ratio = f"{r['decode_tok_s'] / base['decode_tok_s']:.2f}x" if base and base["decode_tok_s"] else "-"
        peer = by_name.get(r.get("peer"))
        ratio += (f" | {r['peer']}: {r['decode_tok_s'] / peer['decode_tok_s']:.2f}x / "
                  f"{r['prefill_tok_s'] / peer['prefill_tok_s']:.2f}x" if peer and peer["decode_tok_s"] else " | -")
        extra = f" ({r['tokens_per_step']:.2f} tok/step)" if "tokens_per_step" in r else ""
        ceil = (f"{r['gb_s']:.1f} | {r['pct_of_ceiling']:.0f}% | {r['ceiling_tok_s']:.1f}" if "gb_s" in r
                else "- | - | -")
        lines.append(f"| {r['name']} | {r['decode_tok_s']:.2f}{extra} | {r['vs'] or '-'} | {ratio} | "
                     f"{r['prefill_tok_s']:.1f} | {r['ttft_s'] * 1000:.0f} | "
                     f"{r['file_mb']:.0f} | {r['weight_bytes'] / 1e6:.0f} | {ceil} | {r['peak_rss_mb']:.0f} |"
                     if r["file_mb"] is not None else
                     f"| {r['name']} | {r['decode_tok_s']:.2f}{extra} | {r['vs'] or '-'} | {ratio} | "
                     f"{r['prefill_tok_s']:.1f} | {r['ttft_s'] * 1000:.0f} | - | {r['weight_bytes'] / 1e6:.0f} | "
                     f"{ceil} | {r['peak_rss_mb']:.0f} |")
    lines.append("")
    lines.append("decode tok/s of a cb row is aggregate: every sequence's tokens after its first / time after the "
                 "first token (the later prompts' prefills included).")
    return "\n".join(lines)


def main():
    p = ArgumentParser(description="Benchmark generate.py's backends and modes and the C++ runners.")
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS),
                   help=f"comma-separated rows or groups ({', '.join(GROUPS)}); rows: {', '.join(ROWS)}")
    p.add_argument("--checkpoint_dir", default=str(CK))
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default="bench.json")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads per row (default: torch's); 1 gives stable per-core figures on a shared machine")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the whole row list this many times, interleaved; report medians over rounds")
    p.add_argument("--nproc", default="1", help="tensor-parallel world sizes (torchrun), e.g. 1,2,4")
    p.add_argument("--prompt_tokens", type=int, default=None,
                   help="the rows' default prompt becomes the first N tokens of the long prompt (prefill at a given "
                        "length, e.g. 15 or 128; our rows and llama.cpp's alike)")
    p.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("gen_args", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args()  # --runs, --rounds, --max_new_tokens, --threads, --json: common.py's rules
    if args._child:
        return child(args)
    if args.threads:  # rows inherit it through the environment
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        torch.set_num_threads(args.threads)
    names = []
    for n in (n.strip() for n in args.rows.split(",") if n.strip()):
        names += [m for m in GROUPS.get(n, [n]) if m not in names]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        raise ValueError(f"unknown rows {unknown}; known: {', '.join(ROWS)} (groups: {', '.join(GROUPS)})")
    if args.prompt_tokens is not None and not 1 <= args.prompt_tokens <= 480:
        raise ValueError(f"--prompt_tokens must be between 1 and 480 (the long prompt's length), got {args.prompt_tokens}")
    if not (Path(args.checkpoint_dir) / "model.pth").is_file():
        sys.path.insert(0, str(REPO / "scripts"))
        import download
        download.prepare_default(Path(args.checkpoint_dir))
    if args.prompt_tokens:  # a text that our tokenizer (and so llama.cpp's rows, fed our ids) reads as exactly N tokens
        from tokenizer import load_tokenizer
        tok = load_tokenizer(Path(args.checkpoint_dir))
        PROMPTS["story"] = tok.decode(tok.encode(PROMPTS["long"])[:args.prompt_tokens])
        n = len(tok.encode(PROMPTS["story"]))
        print(f"prompt: {n} tokens ({PROMPTS['story'][:40]!r}...)", file=sys.stderr)
    bw = measure_bandwidth()
    print(f"measured read bandwidth: {bw:.1f} GB/s ({torch.get_num_threads()} threads)", file=sys.stderr)
    rounds = []
    for i in range(args.rounds):
        if args.rounds > 1:
            print(f"round {i + 1} of {args.rounds}", file=sys.stderr)
        rounds.append([run_row(n, args, bw, int(k)) for n in names for k in args.nproc.split(",")])
    results = [merge_rounds(rs) for rs in zip(*rounds)]
    md = table(results, bw)
    print(md)
    server = None
    if "server" in args.rows.split(","):
        sys.path.insert(0, str(REPO / "scripts"))
        from bench_server import bench_server
        server = bench_server([*SERVER_ARGS, "--checkpoint_path", str(Path(args.checkpoint_dir) / "model.pth"),
                               "--threads", str(torch.get_num_threads())], max_tokens=args.max_new_tokens)
        base = next((r.get("decode_tok_s") for r in results if r["name"] == "compile fp32"), None)
        print(f"\nserver.py {' '.join(SERVER_ARGS)}, {args.max_new_tokens} greedy tokens per request\n")
        print("| clients | aggregate tok/s | vs compile fp32 batch 1 | TTFT p50 ms | TTFT p95 ms "
              "| decode tok/s per request |")
        print("|---|---|---|---|---|---|")
        for r in server:
            ratio = f"{r['aggregate_tok_s'] / base:.2f}x" if base else "-"
            print(f"| {r['clients']} | {r['aggregate_tok_s']:.1f} | {ratio} | {1000 * r['ttft_p50_s']:.0f} | "
                  f"{1000 * r['ttft_p95_s']:.0f} | {r['decode_tok_s']:.1f} |")
    out = dict(machine=dict(cpu_count=os.cpu_count(), threads=torch.get_num_threads(), bandwidth_gb_s=bw,
                            torch=torch.__version__, device=args.device),
               settings=dict(runs=args.runs, rounds=args.rounds, max_new_tokens=args.max_new_tokens, prompts=PROMPTS),
               rows=results, server=server)
    write_atomic(args.json, json.dumps(out, indent=1))


if __name__ == "__main__":
    cli(main)
