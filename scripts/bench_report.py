"""bench.py's results as text: the benchmark page of one run (docs/benchmarks.md; also what a run prints), the
README's one table of several runs (a column each) and the server clients' table. bench.py renders earlier runs with

    python bench.py --readme README.md --from_json bench.json,bench-1B.json,bench-3B.json
    python bench.py --markdown docs/benchmarks.md --from_json bench.json
"""
import shlex
from pathlib import Path

from common import write_atomic


def measured(res: dict) -> str:
    """The command of a run without the flags that only name output files (--json, --markdown, --readme)."""
    if "command" not in res:
        return "(not recorded)"
    cmd, outputs = shlex.split(res["command"]), ("--json", "--markdown", "--readme", "--from_json")
    return shlex.join(a for i, a in enumerate(cmd) if a not in outputs and (i == 0 or cmd[i - 1] not in outputs))


def markdown(res: dict) -> str:
    """The benchmark page (docs/benchmarks.md; also what a run prints) from a run's results: the dict bench.json holds."""
    m, s, rows = res.get("machine", {}), res.get("settings", {}), res["rows"]
    by_name = {r["name"]: r for r in rows if "error" not in r}
    num = lambda v, f: "-" if v is None else format(v, f)
    ratio = lambda a, b: f"{a / b:.2f}x" if a is not None and b else "-"
    lines = ["# Benchmarks", "", "Written by `bench.py --markdown` from the results of one run of (output flags left out):", "",
             "```", measured(res), "```", "", f"- date: {res.get('date', 'not recorded')}",
             f"- machine: {m.get('cpu_model', 'not recorded')}, {m.get('cpu_count', '?')} cores, "
             f"{m.get('threads', '?')} threads; torch {m.get('torch', '?')}, device {m.get('device', 'cpu')}",
             f"- memory read bandwidth measured by bench.py: {num(m.get('bandwidth_gb_s'), '.1f')} GB/s (a row's "
             "decode ceiling is this bandwidth / the bytes of weights one decode step reads)",
             f"- every row: {s.get('max_new_tokens', '?')} greedy tokens in its own process; the median of "
             f"{s.get('runs', '?')} run(s) per round over {s.get('rounds', 1)} interleaved round(s)", ""]
    lines += [res["note"], ""] if res.get("note") else []  # what a reader should know about this run
    lines += ["| row | decode tok/s | prefill tok/s | TTFT ms | decode vs row | llama.cpp row | decode vs llama.cpp | "
              "prefill vs llama.cpp | % of bandwidth ceiling | peak RSS MB |", "|---" * 10 + "|"]
    for r in rows:
        peer, vs, pct = by_name.get(r.get("peer"), {}), by_name.get(r.get("vs")), r.get("pct_of_ceiling")
        step = f" ({r['tokens_per_step']:.2f} tok/step)" if "tokens_per_step" in r else ""
        ttft = None if r.get("ttft_s") is None else 1000 * r["ttft_s"]
        against = f"{ratio(r.get('decode_tok_s'), vs['decode_tok_s'])} {r['vs']}" if vs else "-"
        lines.append(f"| {r['name']} | {r['error']} | | | | | | | | |" if "error" in r else
                     f"| {r['name']} | {num(r.get('decode_tok_s'), '.2f')}{step} | {num(r.get('prefill_tok_s'), '.1f')} "
                     f"| {num(ttft, '.0f')} | {against} | "
                     f"{r['peer'] if peer else '-'} | {ratio(r.get('decode_tok_s'), peer.get('decode_tok_s'))} | "
                     f"{ratio(r.get('prefill_tok_s'), peer.get('prefill_tok_s'))} | "
                     f"{'-' if pct is None else f'{pct:.0f}%'} | {num(r.get('peak_rss_mb'), '.0f')} |")
    if any(" cb" in r["name"] for r in rows):
        lines += ["", "decode tok/s of a cb row is aggregate: every sequence's tokens after its first / time after the "
                  "first token (the later prompts' prefills included)."]
    if res.get("server"):
        lines += ["", server_table(res["server"], rows, s.get("max_new_tokens", "?"), res.get("server_args") or [])]
    return "\n".join(lines) + "\n"


def write_readme(path: str, runs: list) -> None:
    """README's one table, between <!-- bench.py --> and <!-- /bench.py -->: how each run ran, then a column per run
    (its model) and a line per row (readme_cell)."""
    text, start, end = Path(path).read_text(), "<!-- bench.py -->", "<!-- /bench.py -->"
    if start not in text or end not in text:
        raise ValueError(f"{path} has no '{start}' ... '{end}' block for the table; add one where it goes")
    lines, names = [start], []
    for res in runs:
        m, cmd = res.get("machine", {}), shlex.split(res.get("command", ""))
        page = cmd[cmd.index("--markdown") + 1] if "--markdown" in cmd[:-1] else None
        lines.append(f"- {res['settings'].get('model')}: `{measured(res)}` ({res.get('date')}; {m.get('cpu_model')}, "
                     f"{m.get('threads')} threads, {m.get('bandwidth_gb_s', 0):.1f} GB/s read bandwidth"
                     + (f"; every row: [{page}]({page}))" if page else ")"))
        names += [r["name"] for r in res["rows"]
                  if not (r["name"].startswith("llama.cpp") or "error" in r or r["name"] in names)]
    lines += ["", "Each cell: decode / prefill tok/s; their ratios to llama.cpp at the same precision; peak RSS MB "
              "(llama.cpp's).", "", f"| row | {' | '.join(res['settings'].get('model') for res in runs)} |",
              "|---" * (len(runs) + 1) + "|"]
    lines += [f"| {name} | {' | '.join(readme_cell(res, name) for res in runs)} |" for name in names]
    head, rest = text.split(start, 1)
    write_atomic(path, head + "\n".join([*lines, end]) + rest.split(end, 1)[1])


def readme_cell(res: dict, name: str) -> str:
    """Row `name` of one run: decode / prefill tok/s; their ratios to the llama.cpp row of its precision; peak RSS
    (llama.cpp's); "-" where the run has no such row (or it failed)."""
    by_name = {r["name"]: r for r in res["rows"] if "error" not in r}
    r = by_name.get(name)
    if r is None:
        return "-"
    peer = by_name.get(r.get("peer"))
    if peer is None:
        return f"{r['decode_tok_s']:.1f} / {r['prefill_tok_s']:.0f}; -; {r['peak_rss_mb']:.0f}"
    return (f"{r['decode_tok_s']:.1f} / {r['prefill_tok_s']:.0f}; {r['decode_tok_s'] / peer['decode_tok_s']:.2f}x / "
            f"{r['prefill_tok_s'] / peer['prefill_tok_s']:.2f}x {r['peer'].removeprefix('llama.cpp ')}; "
            f"{r['peak_rss_mb']:.0f} ({peer['peak_rss_mb']:.0f})")


def server_table(server, results, max_new_tokens, server_args) -> str:
    """bench.py --rows server: server.py under 1, 4 and 8 clients against the generate.py batch-1 row of the run."""
    base = (row := next((r for r in results if r["name"] == "compile fp32"), {})).get("decode_tok_s")
    lines = [f"server.py {' '.join(server_args)}, {max_new_tokens} greedy tokens per request", "",
             "| clients | aggregate tok/s | vs compile fp32 batch 1 | TTFT p50 ms | TTFT p95 ms | decode tok/s per "
             "request | load avg |", "|---" * 7 + "|"]
    for r in server:
        lines.append(f"| {r['clients']} | {r['aggregate_tok_s']:.1f} | {format(r['aggregate_tok_s'] / base, '.2f') + 'x' if base else '-'}"
                     f" | {1000 * r['ttft_p50_s']:.0f} | {1000 * r['ttft_p95_s']:.0f} | {r['decode_tok_s']:.1f} | {r.get('load_avg', 0):.1f} |")
    runs = sorted(row.get("decode_runs") or [0])  # 2 spin-waiting OpenMP threads run 5-50x slower while a core is taken
    return "\n".join(lines + [f"\nbatch-1 runs {runs[0]:.1f}-{runs[-1]:.1f} tok/s: busy cores, ratios unreliable"] * (runs[-1] > 1.5 * runs[0]))
