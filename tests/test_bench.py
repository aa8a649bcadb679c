# bench.py end to end on a tiny random model: generate.py rows of each kind (plain, lookahead, continuous batching)
# run, report figures consistent with their own runs, and build a missing quantized checkpoint. Speeds are not
# asserted (benchmarks measure them; tests only keep the harness working).
import json

from conftest import hf_to_model, make_bpe_tokenizer, run_cli, tiny_hf
from model import checkpoint_state, save_checkpoint
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
        "error: --prompt_tokens must be between 1 and 480 (the long prompt's length), got 0"]


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
