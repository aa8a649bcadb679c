# server.py --compile: the warm-up before /health says ready compiles every graph the engine meets while serving
# (prompt graphs for one row and several, fresh and continuing a cached prefix, and the decode step for every row
# count), so no request waits for a compile (a first request of a new shape paid seconds of TTFT under load).
# Checked on a tiny model with Dynamo's own log: after the server is ready, nothing more is traced.
from concurrent.futures import ThreadPoolExecutor

from test_server import ServerProcess, completion, make_checkpoint

WORDS = "the quick brown fox jumps over the lazy dog and paints the sea".split()


def traced(srv) -> int:
    """Frames Dynamo has started tracing so far (a compile or a recompile each)."""
    srv.err.flush()
    srv.err.seek(0)
    return srv.err.read().count("start tracing")


def test_compiled_server_traces_nothing_after_ready(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_LOGS", "dynamo")  # INFO: one "torchdynamo start tracing" line per compiled frame
    d = make_checkpoint(tmp_path / "tiny-compile")
    srv = ServerProcess("--checkpoint_path", d / "model.pth", "--compile", "--full_batch_size", 8,
                        "--max_seq_length", 512, "--threads", 1, timeout=900)
    try:
        ready = traced(srv)
        assert ready > 0  # the warm-up compiled
        prompt = lambda i, n: " ".join(WORDS[(i + k) % len(WORDS)] for k in range(n))
        completion(srv, "Numbers like 3.14159", max_tokens=5, temperature=0)  # one fresh row from position 0
        with ThreadPoolExecutor(8) as ex:  # 8 rows of assorted lengths, some sharing prefixes, decoded 1..8 at once
            texts = list(ex.map(lambda i: completion(srv, prompt(i % 3, 3 + 7 * i), stream=i % 2 == 1,
                                                     max_tokens=2 + 3 * i, temperature=0)[0], range(8)))
        assert all(texts)
        first = prompt(0, 20)  # a continued prompt (prefix reuse, one row), a long one, two choices of one prompt
        completion(srv, first + texts[2] + " and then", max_tokens=4, temperature=0)
        completion(srv, prompt(1, 150), max_tokens=3, temperature=0)  # (~320 tokens)
        assert srv.client.completions.create(model=srv.model, prompt=first, n=2, max_tokens=3, seed=1).choices
        assert srv.wait_idle()["slots_busy"] == 0
        assert traced(srv) == ready, "server.py compiled while serving: a shape the warm-up does not cover"
    finally:
        srv.stop()
