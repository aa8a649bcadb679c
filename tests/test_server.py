# server.py against the real `openai` client: chat and completions, streaming and not, 8 concurrent clients, stop
# strings, seeds, clients that go away mid-request, bad requests; greedy text checked against generate.py's CLI entry
# (main()) on the same prompt. A tiny random model for the bulk, one end-to-end run on the default model.
import io
import json
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from conftest import REPO, hf_to_model, make_bpe_tokenizer, tiny_hf

import engine
import generate as G

SLOTS = 4  # fewer than the 8 concurrent clients: the rest wait in the queue
PROMPTS = ["Once upon a time", "The quick brown fox", "It painted the sea", "Numbers like 3.14159",
           "a little robot", "42 boats in the harbour!", "The sky", "There was"]


# ------------------------------------------------------------------------------------------------- helpers
class ServerProcess:
    """server.py in a subprocess on 127.0.0.1 and a free port; .url, .client (openai), .health()."""

    def __init__(self, *args, timeout=300, api_key="none"):
        self.err = tempfile.TemporaryFile("w+")
        cmd = [sys.executable, "server.py", "--host", "127.0.0.1", "--port", "0", *map(str, args)]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=self.err, text=True)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(iter(self.proc.stdout.readline, "")), daemon=True)
        reader.start()
        deadline = time.time() + timeout
        while not any("http://" in l for l in lines):
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                self.err.seek(0)
                raise RuntimeError(f"server.py did not start: {self.err.read()}")
            time.sleep(0.05)
        self.startup_line = next(l for l in lines if "http://" in l)
        self.url = re.search(r"http://127\.0\.0\.1:\d+/", self.startup_line).group(0)
        self.client = openai.OpenAI(base_url=self.url + "v1", api_key=api_key, max_retries=0, timeout=120)
        self.model = self.client.models.list().data[0].id

    def health(self) -> dict:
        with urllib.request.urlopen(self.url + "health", timeout=30) as r:
            return json.loads(r.read())

    def post(self, path: str, data: bytes) -> tuple[int, dict]:
        """A raw POST (bodies the openai client would not send); returns (status, JSON body)."""
        req = urllib.request.Request(self.url + path.lstrip("/"), data=data,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def wait_idle(self, timeout=10.0) -> dict:
        deadline = time.time() + timeout
        while True:
            h = self.health()
            if (h["slots_busy"], h["queued"], h["requests"]) == (0, 0, 0) or time.time() > deadline:
                return h
            time.sleep(0.02)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def make_checkpoint(d, positions=1024):
    """A tiny random Llama (from transformers) with a small BPE tokenizer and a ChatML template, in checkpoint form."""
    from checkpoint import checkpoint_state, save_checkpoint
    from tokenizer import load_tokenizer
    make_bpe_tokenizer(d)
    hf = tiny_hf("llama", seed=5, vocab_size=load_tokenizer(d).vocab_size, max_position_embeddings=positions)
    save_checkpoint(checkpoint_state(hf_to_model(hf)), d / "model.pth")
    return d


def cli_text(capsys, *argv, stdin=None) -> str:
    """The text generate.py's CLI entry prints for these flags (stdout)."""
    capsys.readouterr()
    old = sys.stdin
    sys.stdin = io.StringIO(stdin) if stdin is not None else old
    try:
        G.main([str(a) for a in argv] + ["--quiet"])
    finally:
        sys.stdin = old
    return capsys.readouterr().out


def completion(srv, prompt, stream=False, **kw):
    """(text, finish_reason) of one /v1/completions request through the openai client."""
    r = srv.client.completions.create(model=srv.model, prompt=prompt, stream=stream, **kw)
    if not stream:
        return r.choices[0].text, r.choices[0].finish_reason
    chunks = list(r)
    return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason


def chat(srv, messages, stream=False, **kw):
    r = srv.client.chat.completions.create(model=srv.model, messages=messages, stream=stream, **kw)
    if not stream:
        return r.choices[0].message.content, r.choices[0].finish_reason
    chunks = [c for c in r if c.choices]
    return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason


# ------------------------------------------------------------------------------------------------- tiny model
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = make_checkpoint(tmp_path_factory.mktemp("srv") / "tiny-srv")
    srv = ServerProcess("--checkpoint_path", d / "model.pth", "--full_batch_size", SLOTS, "--max_seq_length", 1024,
                        "--threads", 1)
    yield srv, d
    srv.stop()


def test_models_health_and_startup_line(tiny):
    srv, _ = tiny
    assert "4 slots, continuous batching" in srv.startup_line and "context 1024 tokens" in srv.startup_line
    assert [m.id for m in srv.client.models.list().data] == ["tiny-srv"]
    h = srv.health()
    assert h["status"] == "ok" and h["slots"] == SLOTS and h["model"] == "tiny-srv"


def test_greedy_completions_alone_and_8_concurrent_match_generate_cli(tiny, capsys):
    srv, d = tiny
    want = {}
    for p in PROMPTS:
        out = cli_text(capsys, "--checkpoint_path", d / "model.pth", "--prompt", p, "--temperature", 0,
                       "--max_new_tokens", 24, "--threads", 1)
        assert out.startswith(p) and out.endswith("\n")
        want[p] = out[len(p):-1]
    assert len(set(want.values())) > 1
    alone = completion(srv, PROMPTS[0], max_tokens=24, temperature=0)
    assert alone[0] == want[PROMPTS[0]]
    # 8 clients at once on 4 slots, half of them streaming: every text is the same as alone
    with ThreadPoolExecutor(8) as ex:
        got = list(ex.map(lambda ip: completion(srv, ip[1], stream=ip[0] % 2 == 1, max_tokens=24, temperature=0),
                          enumerate(PROMPTS)))
    for p, (text, finish) in zip(PROMPTS, got):
        assert text == want[p] and finish in ("length", "stop"), p
    assert srv.wait_idle()["slots_busy"] == 0


def test_greedy_chat_matches_generate_chat_and_usage(tiny, capsys):
    srv, d = tiny
    out = cli_text(capsys, "--checkpoint_path", d / "model.pth", "--chat", "--temperature", 0,
                   "--max_new_tokens", 20, "--threads", 1, stdin="Tell me about the sea\n")
    head = "> Tell me about the sea\n"  # generate.py --chat echoes piped input and ends the last prompt's line
    assert out.startswith(head) and out.endswith("\n> \n")
    want = out[len(head):-4]
    messages = [{"role": "user", "content": "Tell me about the sea"}]
    r = srv.client.chat.completions.create(model=srv.model, messages=messages, max_tokens=20, temperature=0)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    from tokenizer import load_tokenizer
    tok = load_tokenizer(d)
    prompt_ids = tok.encode(tok.apply_chat_template(messages), bos=False)
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert (r.choices[0].finish_reason == "length") == (r.usage.completion_tokens == 20)
    # the same through server-sent events; the usage chunk comes last when asked for
    chunks = list(srv.client.chat.completions.create(model=srv.model, messages=messages, max_tokens=20,
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-2].choices[0].finish_reason == r.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # streamed in pieces


def test_max_tokens_length_and_sse_wire_format(tiny):
    srv, _ = tiny
    text, finish = completion(srv, "The sky", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert finish == "length"
    status, body = srv.post("/v1/completions", json.dumps({"prompt": "The sky", "max_completion_tokens": 5,
                                                           "temperature": 0, "ignore_eos": True}).encode())
    assert status == 200 and body["usage"]["completion_tokens"] == 5 and body["choices"][0]["text"] == text
    req = urllib.request.Request(srv.url + "v1/completions", data=json.dumps(
        {"prompt": "The sky", "max_tokens": 5, "temperature": 0, "stream": True, "ignore_eos": True}).encode())
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = resp.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_stop_strings(tiny):
    srv, _ = tiny
    full, _ = completion(srv, "Once upon a time", max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    assert len(full) > 12
    stop = full[6:9]
    want = full[:full.index(stop)]
    for stream in (False, True):
        assert completion(srv, "Once upon a time", stream=stream, max_tokens=40, temperature=0, stop=stop,
                          extra_body={"ignore_eos": True}) == (want, "stop")
        # several stop strings: the earliest in the text wins; one that never appears changes nothing
        assert completion(srv, "Once upon a time", stream=stream, max_tokens=40, temperature=0,
                          stop=["\x00never", full[10:14], stop], extra_body={"ignore_eos": True}) == (want, "stop")
        assert completion(srv, "Once upon a time", stream=stream, max_tokens=40, temperature=0, stop="\x00never",
                          extra_body={"ignore_eos": True}) == (full, "length")
    chat_full, _ = chat(srv, [{"role": "user", "content": "Hi"}], max_tokens=30, temperature=0)
    if len(chat_full) > 4:
        s = chat_full[2:4]
        assert chat(srv, [{"role": "user", "content": "Hi"}], stream=True, max_tokens=30, temperature=0,
                    stop=[s]) == (chat_full[:chat_full.index(s)], "stop")


def test_seeded_sampling_same_alone_and_among_others(tiny):
    srv, _ = tiny
    kw = dict(max_tokens=16, temperature=1.0, top_p=0.9, extra_body={"ignore_eos": True})
    alone = [completion(srv, "It painted", seed=s, **kw)[0] for s in (1, 2, 3)]
    assert len(set(alone)) > 1  # different seeds, different samples
    with ThreadPoolExecutor(6) as ex:
        mixed = list(ex.map(lambda s: completion(srv, "It painted" if s < 4 else "There was", seed=s, **kw)[0],
                            (1, 2, 3, 4, 5, 6)))
    assert mixed[:3] == alone


def _stream_then_leave(srv, n_chunks):
    stream = srv.client.completions.create(model=srv.model, prompt="The quick brown fox", max_tokens=900,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i + 1 >= n_chunks:
            break
    stream.close()


def test_client_disconnect_frees_the_slot(tiny):
    """A client that goes away mid-stream (or while waiting for a non-streaming answer) cancels its request: the
    slot is free and the engine stops stepping long before the 900 tokens it asked for."""
    srv, _ = tiny
    before = srv.health()["decode_steps"]
    _stream_then_leave(srv, 3)
    h = srv.wait_idle()
    assert (h["slots_busy"], h["queued"], h["requests"]) == (0, 0, 0)
    time.sleep(0.3)
    assert srv.health()["decode_steps"] == h["decode_steps"] < before + 300
    # non-streaming: the connection closes while the request runs
    before = h["decode_steps"]
    s = socket.create_connection(("127.0.0.1", int(srv.url.rsplit(":", 1)[1].strip("/"))))
    body = json.dumps({"prompt": "The sky", "max_tokens": 900, "temperature": 0, "ignore_eos": True}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    time.sleep(0.3)
    s.close()
    h = srv.wait_idle()
    assert (h["slots_busy"], h["requests"]) == (0, 0)
    assert h["decode_steps"] < before + 600


BAD = [  # (path, body, status, words in the message, param)
    ("/v1/chat/completions", b"{not json", 400, "JSON", None),
    ("/v1/chat/completions", b"[1, 2]", 400, "object", None),
    ("/v1/chat/completions", b'{"max_tokens": 3}', 400, "messages", "messages"),
    ("/v1/chat/completions", b'{"messages": []}', 400, "messages", "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "hi"}]}', 400, "role", "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}]}', 400, "content", "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "n": 5}', 400, "n", "n"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "functions": []}', 400, "functions",
     "functions"),
    ("/v1/completions", b'{"prompt": "x", "suffix": "y"}', 400, "suffix", "suffix"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', 400, "max_tokens",
     "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": -4}', 400, "max_tokens", "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "max_completion_tokens": 0}', 400, "max_completion_tokens",
     "max_completion_tokens"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": "many"}', 400, "max_tokens", "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "temperature": 9}', 400, "temperature", "temperature"),
    ("/v1/completions", b'{"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}', 400, "stop", "stop"),
    ("/v1/completions", b'{"max_tokens": 3}', 400, "prompt", "prompt"),
    ("/v1/completions", b'{"prompt": "x", "model": "gpt-4o"}', 404, "gpt-4o", "model"),
]


def test_bad_requests_get_openai_errors_and_leave_no_trace(tiny):
    srv, _ = tiny
    for path, body, status, words, param in BAD:
        got, err = srv.post(path, body)
        assert got == status, (body, err)
        assert set(err["error"]) == {"message", "type", "param", "code"} and words in err["error"]["message"], err
        assert err["error"]["param"] == param
    assert srv.post("/v1/completions", b'{"prompt": "x", "model": "gpt-4o"}')[1]["error"]["code"] == "model_not_found"
    # a prompt longer than the context: 400 that names the context length
    with pytest.raises(openai.BadRequestError) as e:
        srv.client.completions.create(model=srv.model, prompt="fox " * 1100, max_tokens=4)
    assert "1024" in e.value.body["message"] and e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        srv.client.chat.completions.create(model=srv.model, messages=[{"role": "user", "content": "hi"}], n=SLOTS + 1)
    with pytest.raises(openai.NotFoundError):
        srv.client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with urllib.request.urlopen(srv.url + "v1/models", timeout=10):
        pass
    try:
        urllib.request.urlopen(srv.url + "v2/nothing", timeout=10)
    except urllib.error.HTTPError as e:
        assert e.code == 404 and "error" in json.loads(e.read())
    # a burst: bad requests and clients leaving mid-stream, all at once; then the server answers as before
    want = completion(srv, "The sky", max_tokens=12, temperature=0)
    jobs = [lambda b=b: srv.post(b[0], b[1]) for b in BAD] * 2 + [lambda: _stream_then_leave(srv, 2)] * 6
    with ThreadPoolExecutor(8) as ex:
        list(ex.map(lambda f: f(), jobs))
    assert_serves_as_before(srv, want)


def assert_serves_as_before(srv, want):
    """After a burst: nothing busy, queued or in flight, and "The sky"'s greedy text is `want`, alone and 8 at once."""
    h = srv.wait_idle()
    assert (h["slots_busy"], h["queued"], h["requests"]) == (0, 0, 0)
    assert completion(srv, "The sky", max_tokens=12, temperature=0) == want
    with ThreadPoolExecutor(8) as ex:
        assert set(ex.map(lambda _: completion(srv, "The sky", max_tokens=12, temperature=0), range(8))) == {want}


def test_bad_flags_fail_before_loading():
    from conftest import assert_clean_error, run_cli
    assert_clean_error(run_cli("server.py", "--port", "70000"), "port")
    assert_clean_error(run_cli("server.py", "--full_batch_size", "0"), "full_batch_size")
    assert_clean_error(run_cli("server.py", "--checkpoint_path", "/nonexistent/model.pth", "--port", "0"),
                       "nonexistent|not found|no such")


# ------------------------------------------------------------------------------------------------- the Engine
class NoSlots:
    """A backend whose forward takes no batch_index (like the AOTI and ExecuTorch backends): batch 1 only."""

    def __init__(self, inner):
        self.inner, self.prefill_chunk = inner, None
        self.max_batch_size, self.max_seq_length = 1, inner.max_seq_length

    def forward(self, tokens, input_pos):
        return self.inner.forward(tokens, input_pos)


def test_engine_one_slot_without_batch_index_and_mixed_sampling(tiny, cpu):
    from quantize import load_model
    _, d = tiny
    model = load_model(d / "model.pth")
    prompts = [[5, 17, 33, 2, 90], [7, 8, 9], [100, 3]]
    want = [engine.generate(engine.TorchBackend(model, 1, 64), [p], 10, cpu)[0][0] for p in prompts]
    got, _ = engine.generate_continuous(NoSlots(engine.TorchBackend(model, 1, 64)), prompts, 10, cpu, 1)
    assert got == want
    # sampled rows beside greedy rows in one batch: the greedy rows stay exactly greedy
    eng = engine.Engine(engine.TorchBackend(model, 3, 64), cpu, 3)
    emit = engine.Emitter(6, 10, (), None, cpu)
    for i in range(6):
        hot = i % 2 == 1
        eng.add(engine.Request(prompts[i // 2], lambda t, i=i: emit.put(i, t),
                               engine.Sampling(1.5 if hot else 0.0, generator=torch.Generator().manual_seed(i))))
    while eng.busy():
        eng.step()
    assert emit.out[0::2] == want
    assert emit.out[1::2] != want
    # the queue is served in order; a request cancelled while it waits never runs, one cancelled in its slot stops
    eng, first, ends = engine.Engine(engine.TorchBackend(model, 1, 64), cpu, 1), [], {}
    reqs = [engine.Request(p, lambda t, i=i: first.append(i) or True, on_end=lambda why, i=i: ends.setdefault(i, why))
            for i, p in enumerate(prompts + prompts[:1])]
    for r in reqs:
        eng.add(r)
    eng.cancel(reqs[1])
    for _ in range(3):
        eng.step()
    eng.cancel(reqs[0])
    while eng.busy():
        eng.step()
    assert ends == {1: "cancelled", 0: "cancelled", 2: "length", 3: "length"}
    assert first == [0] * 4 + [2] * (64 - len(prompts[2])) + [3] * (64 - len(prompts[0]))


def test_engine_prefix_reuse_gives_the_same_tokens(tiny, cpu):
    """A prompt that starts with tokens a free slot holds prefills only the rest (the previous turn of a chat, a
    shared prefix; the whole prompt but its last token when it is sent again) and yields the same greedy tokens."""
    from quantize import load_model
    _, d = tiny
    model = load_model(d / "model.pth")
    a = [5, 17, 33, 2, 90, 11, 12]
    prompts = [a, a + [40, 41], a[:4] + [7, 7], a + [40, 41], [9, 9]]
    want = [engine.generate(engine.TorchBackend(model, 1, 128), [p], 8, cpu)[0][0] for p in prompts]
    eng = engine.Engine(engine.TorchBackend(model, 2, 128), cpu, 2)
    got, reqs = [], []
    for p in prompts:  # one after the other, as turns of a chat
        emit = engine.Emitter(1, 8, (), None, cpu)
        reqs.append(engine.Request(p, lambda t, emit=emit: emit.put(0, t)))
        eng.add(reqs[-1])
        while eng.busy():
            eng.step()
        got.append(emit.out[0])
    assert got == want
    assert [r.reused for r in reqs] == [0, 7, 4, 4, 0]  # the 3rd took the slot of the 2nd
    assert (eng.prompt_tokens, eng.reused_tokens) == (sum(map(len, prompts)), 15)
    # all at once on 2 slots, after the slots hold other tokens: the same again; and with prompts prefilled a few
    # tokens per step between the decode steps (in fixed chunks, as fixed-shape and compiled backends take them)
    for budget, chunk in ((None, None), (3, None), (4, 4)):
        if budget:
            eng = engine.Engine(engine.TorchBackend(model, 2, 128), cpu, 2, chunk, prefill_budget=budget)
        emit = engine.Emitter(len(prompts), 8, (), None, cpu)
        for i, p in enumerate(prompts):
            eng.add(engine.Request(p, lambda t, i=i: emit.put(i, t)))
        steps = 0
        while eng.busy():
            eng.step()
            steps += 1
        assert emit.out == want, (budget, chunk)
    assert steps > len(prompts) * 8 / 2  # some steps only prefilled


def test_server_reuses_the_previous_turn(tiny, capsys):
    srv, d = tiny
    first = "Once upon a time"
    reply, _ = completion(srv, first, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    before = srv.wait_idle()
    second = first + reply + " and then"
    got, _ = completion(srv, second, max_tokens=12, temperature=0)
    h = srv.wait_idle()
    from tokenizer import load_tokenizer
    n = len(load_tokenizer(d).encode(second))
    assert h["prompt_tokens"] - before["prompt_tokens"] == n
    assert h["prompt_tokens_reused"] - before["prompt_tokens_reused"] >= len(load_tokenizer(d).encode(first))
    out = cli_text(capsys, "--checkpoint_path", d / "model.pth", "--prompt", second, "--temperature", 0,
                   "--max_new_tokens", 12, "--threads", 1)
    assert got == out[len(second):-1]


# ------------------------------------------------------------------------------------------------- default model
def test_default_model_end_to_end_matches_generate_cli(capsys):
    """The default model: a completion and a chat reply, each among 8 concurrent requests on 8 slots, are the text
    generate.py prints for the same prompt / message."""
    from common import default_checkpoint
    default_checkpoint()
    prompt, message = "Once upon a time", "What is the capital of France?"
    srv = ServerProcess("--full_batch_size", 8, "--max_seq_length", 512, "--threads", 2)
    try:
        assert srv.model == "SmolLM2-135M-Instruct"
        others = [lambda p=p: completion(srv, p, max_tokens=24, temperature=0) for p in PROMPTS[1:4]] + \
            [lambda m=m: chat(srv, [{"role": "user", "content": m}], max_tokens=24, temperature=0)
             for m in ("Hi", "Tell me a joke", "What is 2 + 2?")]
        mine = [lambda: completion(srv, prompt, max_tokens=24, temperature=0),
                lambda: chat(srv, [{"role": "user", "content": message}], True, max_tokens=24, temperature=0)]
        with ThreadPoolExecutor(8) as ex:
            got = list(ex.map(lambda f: f(), mine + others))
    finally:
        srv.stop()
    out = cli_text(capsys, "--prompt", prompt, "--temperature", 0, "--max_new_tokens", 24)
    assert got[0][0] == out[len(prompt):-1]
    out = cli_text(capsys, "--chat", "--temperature", 0, "--max_new_tokens", 24, stdin=message + "\n")
    assert got[1][0] == out[len(f"> {message}\n"):-4] and "Paris" in got[1][0]  # (the echoed line, "\n> \n")


def test_bench_server_baseline_is_the_median_of_runs_after_a_discarded_one(tmp_path):
    """scripts/bench_server.py's generate.py batch-1 baseline: the server's flags less its own, `runs` runs after a
    discarded one (the first run after --compile's warm-up is not representative), their median."""
    sys.path.insert(0, str(REPO / "scripts"))
    import bench_server as BS
    assert BS.generate_args(["--compile", "--threads", "2", "--full_batch_size", "8", "--no_prefix_reuse",
                             "--max_seq_length", "512", "--prefill_budget", "64"]) == \
        ["--compile", "--threads", "2", "--max_seq_length", "512"]
    d = make_checkpoint(tmp_path / "tiny-bench")
    b = BS.generate_batch1(["--checkpoint_path", d / "model.pth", "--threads", 1], 8, "Once upon a time", runs=3)
    assert len(b["decode_runs"]) == 3 and b["decode_tok_s"] == sorted(b["decode_runs"])[1] > 0 and b["ttft_s"] > 0
