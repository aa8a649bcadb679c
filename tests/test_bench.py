# bench.py end to end on a tiny random model: generate.py rows of each kind (plain, lookahead, continuous batching)
# run, report figures consistent with their own runs, and build a missing quantized checkpoint. Speeds are not
# asserted (benchmarks measure them; tests only keep the harness working).
import json

from conftest import hf_to_model, make_bpe_tokenizer, run_cli, tiny_hf
from checkpoint import checkpoint_state, save_checkpoint
from tokenizer import load_tokenizer


def test_bench_rows_run_and_report(tmp_path):
    d = make_bpe_tokenizer(tmp_path / "tiny")
    hf = tiny_hf("llama", seed=5, vocab_size=load_tokenizer(d).vocab_size, max_position_embeddings=512)
    save_checkpoint(checkpoint_state(hf_to_model(hf)), d / "model.pth")
    rows = ["eager fp32", "eager fp32 code", "eager lookahead code", "eager fp32 cb4", "eager int8"]
    out = tmp_path / "bench.json"
    r = run_cli("bench.py", "--checkpoint_dir", d, "--rows", ",".join(rows), "--runs", "2", "--max_new_tokens", "8",
                "--json", out, "--threads", "1")
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["machine"]["bandwidth_gb_s"] > 0
    by = {x["name"]: x for x in res["rows"]}
    assert list(by) == rows and not any("error" in x for x in by.values()), res["rows"]
    for x in by.values():
        assert x["decode_tok_s"] > 0 and len(x["decode_runs"]) == 2 and x["peak_rss_mb"] > 0
        assert min(x["decode_runs"]) <= x["decode_tok_s"] <= max(x["decode_runs"])
    assert (d / "model_int8.pth").is_file()  # built by the row
    assert by["eager int8"]["weight_bytes"] < by["eager fp32"]["weight_bytes"] / 2
    assert by["eager fp32"]["file_mb"] == (d / "model.pth").stat().st_size / 2**20
    assert by["eager lookahead code"]["new_tokens"] == by["eager fp32 code"]["new_tokens"]  # lossless, same length
    assert "mean_accepted" in by["eager lookahead code"]
    assert by["eager fp32 cb4"]["new_tokens"] > 0
    table = r.stdout
    import bench  # a decoding-mode row runs the float target (its draft is what it adds)
    assert bench.ROWS["compile spec int4 k5"]["weights"] == "{ck}/model.pth"
    assert "| eager lookahead code |" in table and "eager fp32 code |" in table  # the ratio's reference row
    # --prompt_tokens: the default prompt becomes the long prompt's first N tokens (prefill at a given length)
    r = run_cli("bench.py", "--checkpoint_dir", d, "--rows", "eager fp32", "--runs", "1", "--max_new_tokens", "4",
                "--json", out, "--threads", "1", "--prompt_tokens", "12")
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["rows"][0]["prompt_tokens"] == 12
    r = run_cli("bench.py", "--checkpoint_dir", d, "--rows", "eager fp32", "--prompt_tokens", "0")
    assert r.returncode != 0 and r.stderr.strip().splitlines() == [
        "error: --prompt_tokens must be in [1, 480], got 0"]


def test_build_makes_missing_artifacts_in_dependency_order(tmp_path, monkeypatch):
    """bench.build: an artifact whose command names its own output (every export does) and an input artifact that is
    itself missing: the input is built first, each once, and a present artifact is not rebuilt."""
    import bench
    log = tmp_path / "log"
    monkeypatch.setattr(bench, "BUILD", {
        "{art}/in.bin": ["sh", "-c", f"echo in >> {log}; touch {{art}}/in.bin"],
        "{art}/out.bin": ["sh", "-c", f"test -f {{art}}/in.bin && echo out >> {log} && touch $0", "{art}/out.bin",
                          "{art}/in.bin"],
    })
    fill = lambda a: a.format(art=tmp_path)
    bench.build("{art}/out.bin", fill)
    bench.build("{art}/out.bin", fill)
    assert log.read_text().split() == ["in", "out"]


def test_markdown_page_from_results(tmp_path):
    """--markdown / --readme / --from_json: the benchmark page rendered from a results dict says how and where it ran
    (command, date, machine, threads, bandwidth) and gives each row its ratio to the llama.cpp row of its precision;
    the README's one table takes a column per run (the same ratios and both peaks), the rest of the README untouched."""
    import bench
    res = dict(command="python bench.py --rows peer --threads 2 --markdown docs/benchmarks.md", date="2026-11-24 18:45",
               machine=dict(cpu_model="Test CPU 9000", cpu_count=2, threads=2, bandwidth_gb_s=28.8, torch="2.x"),
               settings=dict(runs=1, rounds=5, max_new_tokens=128, model="Tiny-1B"),
               rows=[dict(name="llama.cpp F32", decode_tok_s=40.0, prefill_tok_s=300.0, peak_rss_mb=795.0, ttft_s=0.05),
                     dict(name="eager fp32", decode_tok_s=20.0, prefill_tok_s=100.0, peak_rss_mb=900.0, ttft_s=0.2),
                     dict(name="compile fp32", peer="llama.cpp F32", vs="eager fp32", decode_tok_s=50.0,
                          prefill_tok_s=240.0, pct_of_ceiling=94.0, peak_rss_mb=2896.0, ttft_s=0.0625),
                     dict(name="runner-et fp32", error="failed: no runner")])
    page = bench.markdown(res)
    lines = page.splitlines()
    assert lines[0] == "# Benchmarks" and "- date: 2026-11-24 18:45" in lines
    assert "python bench.py --rows peer --threads 2" in lines  # the run's command without its output flags
    assert any("Test CPU 9000, 2 cores, 2 threads" in x for x in lines) and "28.8 GB/s" in page
    header = next(i for i, x in enumerate(lines) if x.startswith("| row |"))
    assert lines[header] == ("| row | decode tok/s | prefill tok/s | TTFT ms | decode vs row | llama.cpp row | "
                             "decode vs llama.cpp | prefill vs llama.cpp | % of bandwidth ceiling | peak RSS MB |")
    assert lines[header + 2] == "| llama.cpp F32 | 40.00 | 300.0 | 50 | - | - | - | - | - | 795 |"
    assert lines[header + 4] == ("| compile fp32 | 50.00 | 240.0 | 62 | 2.50x eager fp32 | llama.cpp F32 | 1.25x | 0.80x "
                                 "| 94% | 2896 |")
    assert lines[header + 5].startswith("| runner-et fp32 | failed: no runner |")
    # the same page and the README's one table from results files, without running anything: a column per run
    (tmp_path / "bench.json").write_text(json.dumps(res))
    other = dict(res, command="python bench.py --model Big --random_weights --json b.json", settings=dict(model="Big-1B"),
                 rows=[dict(name="compile fp32", decode_tok_s=5.0, prefill_tok_s=30.0, peak_rss_mb=4000.0)])
    (tmp_path / "big.json").write_text(json.dumps(other))
    out, readme = tmp_path / "docs" / "benchmarks.md", tmp_path / "README.md"
    readme.write_text("# Title\n\n<!-- bench.py -->\nold table\n<!-- /bench.py -->\n\n## Next\n")
    r = run_cli("bench.py", "--markdown", out, "--from_json", tmp_path / "bench.json")
    assert r.returncode == 0, r.stderr
    assert out.read_text() == page
    r = run_cli("bench.py", "--readme", readme, "--from_json", f"{tmp_path / 'bench.json'},{tmp_path / 'big.json'}")
    assert r.returncode == 0, r.stderr
    text = readme.read_text()
    block = text.split("<!-- bench.py -->\n")[1].split("\n<!-- /bench.py -->")[0].splitlines()
    assert text.startswith("# Title\n\n") and text.endswith("-->\n\n## Next\n") and "old table" not in text
    assert block[0] == ("- Tiny-1B: `python bench.py --rows peer --threads 2` (2026-11-24 18:45; Test CPU 9000, 2 threads, "
                        "28.8 GB/s read bandwidth; every row: [docs/benchmarks.md](docs/benchmarks.md))")
    assert block[1].startswith("- Big-1B: `python bench.py --model Big --random_weights` (")  # (no output flags)
    assert block[5:] == ["| row | Tiny-1B | Big-1B |", "|---|---|---|", "| eager fp32 | 20.0 / 100; -; 900 | - |",
                         "| compile fp32 | 50.0 / 240; 1.25x / 0.80x F32; 2896 (795) | 5.0 / 30; -; 4000 |"]
    r = run_cli("bench.py", "--from_json", tmp_path / "bench.json")
    assert r.returncode != 0 and r.stderr.startswith("error: --from_json needs --markdown PATH"), r.stderr
    r = run_cli("bench.py", "--readme", readme)
    assert r.returncode != 0 and r.stderr.strip().splitlines() == [
        f"error: --readme {readme} needs an existing README and --from_json RUN.json[,RUN.json...]"], r.stderr
    readme.write_text("# no block\n")
    r = run_cli("bench.py", "--readme", readme, "--from_json", tmp_path / "bench.json")
    assert r.returncode != 0 and r.stderr.strip().splitlines() == [
        f"error: {readme} has no '<!-- bench.py -->' ... '<!-- /bench.py -->' block for the table; "
        "add one where it goes"], r.stderr
    assert readme.read_text() == "# no block\n"

def test_profile_step_times_prompts_and_decode(tmp_path):
    """scripts/profile_step.py: a tiny model's prompts and decode steps timed in one process, with RSS per phase;
    bad flags are one error line before anything loads."""
    d = make_bpe_tokenizer(tmp_path / "tiny")
    hf = tiny_hf("llama", seed=5, vocab_size=load_tokenizer(d).vocab_size, max_position_embeddings=512)
    save_checkpoint(checkpoint_state(hf_to_model(hf)), d / "model.pth")
    r = run_cli("scripts/profile_step.py", "--checkpoint_path", d / "model.pth", "--eager", "--threads", "1",
                "--prompt_tokens", "4,9", "--steps", "3", "--max_seq_length", "32")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("loaded: RSS ") and lines[1].startswith("prompt 4 tokens: ")
    assert lines[2].startswith("prompt 9 tokens: ") and lines[3].startswith("prompts: RSS ")
    assert lines[4].startswith("decode: ") and "median of 4 x 3 steps after position 9" in lines[4], lines
    for args, msg in [(["--prompt_tokens", "1"], "--prompt_tokens must be comma-separated lengths >= 2, got '1'"),
                      (["--max_seq_length", "16"], "--max_seq_length 16 is too short for a 128-token prompt and 81 "
                                                   "decode steps"),
                      (["--eager", "--kernels"], "--kernels profiles the compiled decode step; drop --eager")]:
        r = run_cli("scripts/profile_step.py", "--checkpoint_path", d / "model.pth", *args)
        assert r.returncode != 0 and r.stderr.strip().splitlines() == [f"error: {msg}"], r.stderr


def test_random_checkpoint_in_bfloat16_and_its_gguf(tmp_path):
    """scripts/random_checkpoint.py --dtype bfloat16 (an 8B's weights are 15 GB so, 30 in float32: it builds them in
    bfloat16 from the start) and `llamacpp_peer.py write` from it (the checkpoint mapped in its own dtype, each tensor
    float32 only as it is written): gguf's own reader finds the checkpoint's values, as float32 (F32) and rounded to
    float16 (F16), the Q and K rows in llama.cpp's rotary order."""
    import gguf  # (requirements.txt)
    import numpy as np
    import torch
    d = make_bpe_tokenizer(tmp_path / "ck")
    r = run_cli("scripts/random_checkpoint.py", "stories15M", d, "--dtype", "bfloat16", "--seed", "3")
    assert r.returncode == 0, r.stderr
    sd = torch.load(d / "model.pth", weights_only=True, mmap=True)
    assert {v.dtype for k, v in sd.items() if not k.startswith("_")} == {torch.bfloat16}
    wq = sd["layers.0.attention.wqkv.weight"][:288].float().numpy()
    meta = wq.reshape(6, 2, 24, 288).swapaxes(1, 2).reshape(288, 288)  # convert_hf_to_gguf's permute (6 heads of 48)
    for kind, dtype in (("f32", np.float32), ("f16", np.float16)):
        out = tmp_path / f"{kind}.gguf"
        r = run_cli("scripts/llamacpp_peer.py", "write", "--checkpoint_path", d / "model.pth", "--type", kind,
                    "--output", out)
        assert r.returncode == 0, r.stderr
        t = {x.name: x.data for x in gguf.GGUFReader(out).tensors}
        assert len(t) == 2 + 6 * 9  # embeddings, final norm (tied output), 9 tensors a block
        ffn = sd["layers.0.feed_forward.w2.weight"].float().numpy().astype(dtype)
        assert np.array_equal(t["blk.0.ffn_down.weight"], ffn) and t["blk.0.ffn_down.weight"].dtype == dtype
        assert np.array_equal(t["blk.0.attn_q.weight"], meta.astype(dtype))
        assert np.array_equal(t["token_embd.weight"], sd["tok_embeddings.weight"].float().numpy().astype(dtype))
