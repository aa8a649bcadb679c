# server.py under load: N concurrent clients (the real `openai` client, one thread each) send a fixed-length greedy
# completion (ignore_eos, so every request produces exactly max_tokens) to a server started on a free port of this
# machine; each request's prompt starts with its own number, so none finds another's prompt in a slot's cache (prefix
# reuse would make every prefill after the first one token); per N: aggregate tok/s, per-request TTFT p50 / p95 and decode tok/s per request. The __main__ also runs
# generate.py batch 1 on the same backend flags for the comparison (bench.py --rows server calls bench_server()).
#
#   python scripts/bench_server.py --compile --threads 2 --full_batch_size 8        # flags after ours go to server.py
#   python scripts/bench_server.py --clients 1,4,8 --max_tokens 128 --pte smollm2.pte
#   python scripts/bench_server.py --chat_turns 6 --threads 2    # TTFT per turn of one chat (prefix reuse on and off)
import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPT = ("Write a short story about a robot who learns to paint. The robot lives in a small town by the sea and "
          "every morning it watches the fishing boats leave the harbour.")


def start_server(args_for_server: list, timeout: float = 900):
    """server.py on 127.0.0.1 and a free port; returns (process, base URL) once it answers /health."""
    cmd = [sys.executable, str(REPO / "server.py"), "--host", "127.0.0.1", "--port", "0", *map(str, args_for_server)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    found: list = []
    threading.Thread(target=lambda: found.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    deadline = time.time() + timeout
    while not any("http://" in line for line in found):
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"server.py {' '.join(map(str, args_for_server))} did not start")
        time.sleep(0.1)
    url = re.search(r"http://[^ /]+/", next(line for line in found if "http://" in line)).group(0)
    try:
        with urllib.request.urlopen(url + "health", timeout=30) as r:
            if json.loads(r.read())["status"] != "ok":
                raise RuntimeError("server.py is not ready")
    except BaseException:
        proc.kill()
        raise
    return proc, url


def _one(client, model, prompt, max_tokens) -> dict:
    t0 = time.perf_counter()
    first, tokens = None, 0
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text and first is None:
            first = time.perf_counter()
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    first = first or end
    return dict(t0=t0, ttft=first - t0, end=end, tokens=tokens,
                decode_tok_s=(tokens - 1) / (end - first) if tokens > 1 and end > first else 0.0)


def _pct(xs, q):  # nearest-rank percentile
    xs = sorted(xs)
    return xs[max(0, math.ceil(q * len(xs)) - 1)]


def bench_server(args_for_server: list, clients=(1, 4, 8), max_tokens: int = 64, prompt: str = PROMPT,
                 rounds: int = 1) -> list:
    """Start server.py with these flags (give --full_batch_size >= max(clients) for continuous batching of them all),
    warm it up, then for each N in clients run N concurrent greedy completions of exactly max_tokens tokens.
    Returns one dict per N: clients, completion_tokens (all requests), wall_s, aggregate_tok_s (all tokens / wall),
    ttft_p50_s, ttft_p95_s, decode_tok_s (median over requests of each one's tokens after the first / its time after
    the first), load_avg (the 1-minute load average after it: the machine is shared); `rounds` times over."""
    import openai
    proc, url = start_server(args_for_server)
    try:
        client = openai.OpenAI(base_url=url + "v1", api_key="none", max_retries=0, timeout=3600)
        model = client.models.list().data[0].id
        count = iter(range(10**9))
        _one(client, model, f"({next(count)}) {prompt}", max_tokens)  # warm-up
        rows = []
        for n in [n for _ in range(rounds) for n in clients]:
            results: list = [None] * n
            start = threading.Barrier(n)

            def run(i):
                start.wait()
                results[i] = _one(client, model, f"({next(count)}) {prompt}", max_tokens)
            threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = max(r["end"] for r in results) - min(r["t0"] for r in results)
            total = sum(r["tokens"] for r in results)
            ttfts = [r["ttft"] for r in results]
            rows.append(dict(clients=n, completion_tokens=total, wall_s=wall, aggregate_tok_s=total / wall,
                             ttft_p50_s=statistics.median(ttfts), ttft_p95_s=_pct(ttfts, 0.95),
                             decode_tok_s=statistics.median(r["decode_tok_s"] for r in results),
                             load_avg=os.getloadavg()[0]))
        return rows
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


TURNS = ["Hi! Tell me about the sea.", "Why is it salty?", "And why is it blue?", "Which sea is the largest?",
         "How deep is it?", "Thanks! Summarize what you told me."]


def chat_turns(args_for_server: list, turns: int = 6, max_tokens: int = 48) -> list:
    """One chat of `turns` turns (greedy, each turn sent whole with the replies so far, as chat clients do);
    returns per turn: prompt_tokens, ttft_s (streamed) and the prompt tokens the server found in its cache."""
    import openai
    proc, url = start_server(args_for_server)
    try:
        client = openai.OpenAI(base_url=url + "v1", api_key="none", max_retries=0, timeout=3600)
        model = client.models.list().data[0].id
        client.completions.create(model=model, prompt="Hello", max_tokens=4)  # warm-up
        messages, rows = [], []
        for i in range(turns):
            messages.append({"role": "user", "content": TURNS[i % len(TURNS)]})
            before = json.loads(urllib.request.urlopen(url + "health", timeout=30).read())["prompt_tokens_reused"]
            t0, first, reply, usage = time.perf_counter(), None, "", None
            for c in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                    temperature=0, stream=True, stream_options={"include_usage": True}):
                if c.choices and c.choices[0].delta.content:
                    first = first or time.perf_counter()
                    reply += c.choices[0].delta.content
                usage = c.usage or usage
            messages.append({"role": "assistant", "content": reply})
            after = json.loads(urllib.request.urlopen(url + "health", timeout=30).read())["prompt_tokens_reused"]
            rows.append(dict(turn=i + 1, prompt_tokens=usage.prompt_tokens, ttft_s=(first or time.perf_counter()) - t0,
                             reused=after - before))
        return rows
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def generate_batch1(args_for_generate: list, max_tokens: int = 64, prompt: str = PROMPT, runs: int = 3) -> dict:
    """generate.py batch 1 on the same backend flags, greedy, exactly max_tokens: the median decode and TTFT of `runs`
    runs after a discarded one. One run is not a measurement on a shared machine: generate.py --compile --threads 2,
    128 tokens, read 25.9 tok/s on its first run after the warm-up, then 57.2 and 55.1; two consecutive runs in one
    process 54.7 then 1.0 tok/s when another process took a core (OpenMP's spin-waiting threads). This function's
    single run read 1.5 tok/s once, against the server's 27 tok/s for one client."""
    r = subprocess.run([sys.executable, str(REPO / "generate.py"), *map(str, args_for_generate), "--prompt", prompt,
                        "--temperature", "0", "--max_new_tokens", str(max_tokens), "--ignore_eos",
                        "--num_samples", str(runs + 1)], cwd=REPO, capture_output=True, text=True)
    found = re.findall(r"TTFT ([\d.]+) ms .*decode ([\d.]+) tok/s", r.stderr)
    if r.returncode or len(found) != runs + 1:
        raise RuntimeError(f"generate.py failed: {r.stderr[-500:]}")
    found = found[1:]
    return dict(ttft_s=statistics.median(float(t) for t, _ in found) / 1000,
                decode_tok_s=statistics.median(float(d) for _, d in found), decode_runs=[float(d) for _, d in found],
                load_avg=os.getloadavg()[0])


SERVER_ONLY = {"--full_batch_size": 1, "--prefill_budget": 1, "--chat_template": 1, "--api_key": 1,
               "--no_prefix_reuse": 0}  # server.py flags generate.py has not (the value count after each)


def generate_args(server_args: list) -> list:
    """The server's flags less the server-only ones: generate.py batch 1 on the same backend, threads, context."""
    out, i = [], 0
    while i < len(server_args):
        a = str(server_args[i])
        if a in SERVER_ONLY:
            i += 1 + SERVER_ONLY[a]
            continue
        out.append(a)
        i += 1
    return out


def main():
    p = argparse.ArgumentParser(description="Benchmark server.py with N concurrent clients; other flags go to server.py.")
    p.add_argument("--clients", default="1,4,8", help="comma-separated client counts")
    p.add_argument("--max_tokens", type=int, default=64)
    p.add_argument("--chat_turns", type=int, default=0, help="instead: TTFT per turn of one chat of N turns")
    p.add_argument("--rounds", type=int, default=1, help="every client count this many times, one row each")
    args, server_args = p.parse_known_args()
    if args.chat_turns:
        on, off = chat_turns(server_args, args.chat_turns), chat_turns(server_args + ["--no_prefix_reuse"],
                                                                         args.chat_turns)
        print(f"server.py {' '.join(server_args)}; one chat, greedy, up to 48 tokens per reply")
        print("| turn | prompt tokens | TTFT, no prefix reuse | TTFT, prefix reuse | prompt tokens reused |")
        print("|---|---|---|---|---|")
        for a, b in zip(off, on):
            print(f"| {b['turn']} | {b['prompt_tokens']} | {a['ttft_s'] * 1000:.0f} ms | {b['ttft_s'] * 1000:.0f} ms "
                  f"| {b['reused']} |")
        return
    clients = [int(c) for c in args.clients.split(",")]
    if "--full_batch_size" not in server_args:
        server_args += ["--full_batch_size", str(max(clients))]
    if "--threads" not in server_args:  # one count for both (each would otherwise pick its own from the busy cores)
        sys.path.insert(0, str(REPO))
        from common import set_threads
        server_args += ["--threads", str(set_threads(None))]
    base = generate_batch1(generate_args(server_args), args.max_tokens)
    rows = bench_server(server_args, clients, args.max_tokens, rounds=args.rounds)
    print(f"server.py {' '.join(server_args)}; {args.max_tokens} greedy tokens per request")
    print("| clients | aggregate tok/s | x generate.py batch 1 | TTFT p50 | TTFT p95 | decode tok/s per request | "
          "load avg |")
    print("|---|---|---|---|---|---|---|")
    print(f"| generate.py batch 1 | {base['decode_tok_s']:.1f} | 1.00 | {base['ttft_s'] * 1000:.0f} ms | | "
          f"{base['decode_tok_s']:.1f} | {base['load_avg']:.1f} |")
    for r in rows:
        print(f"| {r['clients']} | {r['aggregate_tok_s']:.1f} | {r['aggregate_tok_s'] / base['decode_tok_s']:.2f} | "
              f"{r['ttft_p50_s'] * 1000:.0f} ms | {r['ttft_p95_s'] * 1000:.0f} ms | {r['decode_tok_s']:.1f} | "
              f"{r['load_avg']:.1f} |")

if __name__ == "__main__":
    main()
