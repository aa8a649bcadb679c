# An OpenAI-compatible server over engine.py's continuous-batching Engine, with a small chat page.
#
#     python server.py                                              # default model, http://127.0.0.1:8000/
#     python server.py --checkpoint_path checkpoints/NAME/model_int8.pth --compile --full_batch_size 8 --port 8000
#     python server.py --pte smollm2.pte --api_key SECRET           # any backend generate.py takes
#
# Endpoints: POST /v1/chat/completions (messages through the model's chat template; tools, response_format),
# POST /v1/completions (raw prompt), GET /v1/models[/{id}], GET /health, GET /metrics (Prometheus), GET / (server.html,
# the chat page). `stream: true` sends server-sent events in OpenAI's chunk format ending with `data: [DONE]`; bad
# requests get OpenAI-style JSON errors with a 4xx code naming the field (server_request.py: a field the server does not
# implement is refused, never ignored). With --api_key every /v1 and /metrics request needs `Authorization: Bearer KEY`.
#
# Threads: one engine thread owns the model and the Engine (cache slots + FIFO queue, prefix reuse). The HTTP side
# (starlette on uvicorn's asyncio loop) checks requests (server_request.py), tokenizes them and hands Jobs
# (server_job.py: one per choice) and cancellations to that thread through a queue.Queue; the Jobs hand their text back
# through the request's asyncio.Queue (loop.call_soon_threadsafe). A finished choice frees its slot in the same step;
# a client that goes away mid-request cancels it: its slot is free before the next step.
import asyncio
import inspect
import json
import queue
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

import torch

import engine as E
from backends import add_backend_args, load_backend
from common import REPO, ArgumentParser, at_least, check_device, cli, resolve_checkpoint, set_threads, within
from server_grammar import GrammarError, Grammars
from server_job import Job
from server_request import ApiError, error_body, parse_request

DEFAULT_CONTEXT = 2048


# ------------------------------------------------------------------------------------------------- the server
class Server:
    """One model behind the API: its tokenizer, backend and Engine (owned by the engine thread, run_engine), the
    grammars of its vocabulary, its metrics, and the HTTP handlers' side (complete, events)."""

    def __init__(self, args, slots_wanted):
        from tokenizer import load_tokenizer
        self.device, self.threads = torch.device(args.device), args.threads
        self.tok = load_tokenizer(args.tokenizer_path)
        if args.chat_template:  # vLLM's --chat-template: e.g. a template that takes tools, for a model whose own lacks it
            self.tok.chat_template = Path(args.chat_template).read_text()
        max_seq = args.max_seq_length or DEFAULT_CONTEXT
        self.backend = load_backend(args, self.device, getattr(torch, args.dtype), slots_wanted or 4, max_seq)
        E.check_vocab(self.tok, self.backend)
        # continuous batching needs rows mapped to cache slots (a QPC compiled without --full_batch_size has none)
        batches = "batch_index" in inspect.signature(self.backend.forward).parameters and \
            getattr(self.backend, "full_batch_size", 0) is not None
        slots = min(slots_wanted or 4, self.backend.max_batch_size) if batches else 1
        self.engine = E.Engine(self.backend, self.device, slots, args.prefill_chunk, reuse=not args.no_prefix_reuse,
                               prefill_budget=args.prefill_budget)
        self.how = (f"{slots} slots, continuous batching" if batches else
                    "one request at a time (this backend has no batch_index: no continuous batching)")
        self.context = self.backend.max_seq_length
        artifact = next((getattr(args, a) for a in ("aoti_package", "pte", "onnx", "qpc") if getattr(args, a)), None)
        if artifact:
            self.name = Path(artifact).stem if Path(artifact).stem != "model" else Path(artifact).resolve().parent.name
        else:
            ck = Path(args.checkpoint_path).resolve()
            self.name = ck.name if ck.is_dir() else ck.parent.name
        self.inbox: queue.Queue = queue.Queue()
        self.live: set = set()  # jobs handed to the engine and not ended yet
        self.ready = threading.Event()
        self.startup_error: Exception | None = None
        self.created = int(time.time())
        self.grammars = Grammars(self.tok, getattr(self.backend, "vocab_size", None) or self.tok.vocab_size)
        self.metrics = Metrics(self)

    # ---- the engine thread: the only one that touches the model
    def run_engine(self):
        if self.threads:
            torch.set_num_threads(self.threads)  # OpenMP thread counts are per thread
        # warm-up: compiles (--compile) the decode step for 3, 2 and 1 rows (one static, one dynamic and one size-1
        # graph cover every row count) before the first request, and the prompt graphs for several rows and for one,
        # fresh and continuing a prefix in their slots' caches (prefix reuse: fewer new tokens than cached ones; a
        # graph that saw only prompts from position 0 is specialized to that and would be compiled again when serving)
        n = min(3, len(self.engine.req))
        hello, more = self.tok.encode("Hello, how are you?") or [0], self.tok.encode(" Fine.", bos=False) or [1]
        phases = [[hello] * n, [hello + more * (i + 1) for i in range(n)], [hello + more * (n + 1)]]
        try:
            for prompts in phases:
                warm = E.Emitter(len(prompts), 4, (), None, self.device)
                for i, p in enumerate(prompts):
                    self.engine.add(E.Request(p, lambda t, i=i: warm.put(i, t) and len(warm.out[i]) < 2 + i))
                while self.engine.busy():
                    self.engine.step()
            self.engine.prompt_tokens = self.engine.reused_tokens = 0
        except Exception as e:  # noqa: BLE001 - reported by main() as one error line
            self.startup_error = e
        self.ready.set()
        if self.startup_error:
            return
        while True:
            try:
                kind, job = self.inbox.get(block=not self.engine.busy())
            except queue.Empty:
                try:
                    self.engine.step()
                except Exception as e:  # noqa: BLE001 - a backend failure ends the requests in flight, not the server
                    print(f"server.py: engine step failed: {type(e).__name__}: {e}", file=sys.stderr)
                    for failed in list(self.live):
                        failed.failed = f"the backend failed: {type(e).__name__}"
                        self.engine.cancel(failed.request)
                continue
            if kind == "add":
                try:
                    self.engine.add(job.request)  # the HTTP side checked the prompt length already
                except ValueError as e:
                    job.failed = str(e)
                    job.end("cancelled")
            else:
                self.engine.cancel(job.request)

    def health(self) -> dict:
        busy = sum(r is not None for r in self.engine.req)
        return {"status": "ok" if self.ready.is_set() else "loading", "model": self.name, "slots": len(self.engine.req),
                "slots_busy": busy, "queued": len(self.engine.queue) + self.inbox.qsize(), "requests": len(self.live),
                "decode_steps": self.engine.steps, "prompt_tokens": self.engine.prompt_tokens,
                "prompt_tokens_reused": self.engine.reused_tokens}

    # ---- the HTTP side
    def render(self, messages: list, **variables) -> str:
        """The chat template applied to the messages (tools and other template variables passed through)."""
        from tokenizer import render_chat_template
        if not variables:
            return self.tok.apply_chat_template(messages, add_generation_prompt=True)
        return render_chat_template(self.tok.chat_template, messages, True, **variables,
                                    bos_token=self.tok.token_text(self.tok.bos_id) or "",
                                    eos_token=self.tok.token_text(self.tok.eos_id) or "")

    async def complete(self, request, chat: bool):
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError):
            raise ApiError(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        self.metrics.requests.labels("chat" if chat else "completions").inc()
        opts = parse_request(body, chat, self)
        events, loop = asyncio.Queue(), asyncio.get_running_loop()
        try:  # (off the event loop: a grammar's first use builds llguidance's view of the vocabulary)
            jobs = await asyncio.to_thread(lambda: [Job(self, opts, i, events, loop) for i in range(opts.n)])
        except GrammarError as e:
            raise ApiError(400, f"{opts.grammar_param}: {e}", opts.grammar_param) from None
        for job in jobs:
            self.live.add(job)
            self.inbox.put(("add", job))
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
                "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.name}
        from starlette.responses import JSONResponse, StreamingResponse
        if opts.stream:
            return StreamingResponse(self.events(jobs, events, head, opts), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        disconnected = asyncio.ensure_future(self.wait_disconnect(request))
        finish, lps = {}, {i: [] for i in range(opts.n)}
        try:
            while len(finish) < opts.n:
                get = asyncio.ensure_future(events.get())
                await asyncio.wait({get, disconnected}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    return JSONResponse(error_body("client disconnected"), status_code=499)
                i, kind, *value = get.result()
                if kind == "error":
                    return JSONResponse(error_body(value[0], "server_error"), status_code=500)
                lps[i] += value[-1]
                if kind == "end":
                    finish[i] = value[0]
        finally:
            disconnected.cancel()
            for job in jobs:
                self.cancel(job)
        choices = []
        for job in jobs:
            c = {"index": job.index, "logprobs": self.logprobs(lps[job.index], opts), "finish_reason": finish[job.index]}
            if chat:
                text = job.content if job.tool_calls else job.text
                c["message"] = {"role": "assistant", "content": text}
                if job.tool_calls:
                    c["message"]["tool_calls"] = [t.openai() for t in job.tool_calls]
            else:
                c["text"] = opts.echo + job.text
            choices.append(c)
        return JSONResponse({**head, "choices": choices, "usage": self.usage(jobs)})

    def logprobs(self, entries: list, opts):
        """Logprob entries (token, logprob, [(token, logprob)]) in the chat or the completions form (None if none)."""
        if opts.logprobs is None:
            return None
        text = lambda t: self.tok.decode([t])
        if opts.chat:
            item = lambda t, lp: {"token": text(t), "logprob": lp, "bytes": list(text(t).encode())}
            return {"content": [{**item(t, lp), "top_logprobs": [item(a, b) for a, b in top]}
                                for t, lp, top in entries], "refusal": None}
        return {"tokens": [text(t) for t, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [{text(a): b for a, b in top} for _, _, top in entries] if opts.logprobs else None,
                "text_offset": [sum(len(text(t)) for t, _, _ in entries[:k]) for k in range(len(entries))]}

    @staticmethod
    def usage(jobs) -> dict:
        p, n = jobs[0].opts.ids, sum(len(j.tokens) for j in jobs)
        return {"prompt_tokens": len(p), "completion_tokens": n, "total_tokens": len(p) + n}

    async def events(self, jobs, events, head, opts):
        """The server-sent events of a streaming request; closing the stream early (the client went away) cancels it."""
        chat = opts.chat
        head = {**head, "object": head["object"] + ".chunk" if chat else head["object"]}

        def chunk(i, text=None, finish=None, delta=None, lps=()):
            c = {"index": i, "logprobs": self.logprobs(list(lps), opts) if lps else None, "finish_reason": finish}
            c.update({"delta": delta or ({} if text is None else {"content": text})} if chat else {"text": text or ""})
            return f"data: {json.dumps({**head, 'choices': [c]})}\n\n"

        try:
            for job in jobs:
                if chat:
                    yield chunk(job.index, delta={"role": "assistant", "content": ""})
                elif opts.echo:
                    yield chunk(job.index, opts.echo)
            ended = 0
            while ended < len(jobs):
                i, kind, *value = await events.get()
                if kind == "text":
                    yield chunk(i, value[0], lps=value[1])
                elif kind == "error":
                    yield f"data: {json.dumps(error_body(value[0], 'server_error'))}\n\n"
                    break
                else:
                    finish, calls, lps = value
                    if calls:
                        yield chunk(i, delta={"tool_calls": [t.openai(k) for k, t in enumerate(calls)]})
                    yield chunk(i, finish=finish, lps=lps)
                    ended += 1
            if ended == len(jobs) and opts.include_usage:
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': self.usage(jobs)})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for job in jobs:
                self.cancel(job)

    def cancel(self, job):
        if not job.ended:
            self.inbox.put(("cancel", job))

    @staticmethod
    async def wait_disconnect(request):
        while (await request.receive())["type"] != "http.disconnect":
            pass


class Metrics:
    """/metrics in Prometheus' text format (prometheus-client, a registry of this server's own): requests, tokens,
    time to first token and between tokens, queue length, busy slots, prompt tokens reused from the cache."""

    def __init__(self, srv):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        self.registry = r = CollectorRegistry()
        p = "llamaflat_"
        self.requests = Counter(p + "requests", "Completion requests received", ["endpoint"], registry=r)
        self.generated = Counter(p + "generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "From the request to its first token", registry=r,
                              buckets=(.05, .1, .25, .5, .75, 1, 1.5, 2, 3, 5, 10, 20, 60))
        self.itl = Histogram(p + "inter_token_seconds", "Between one token of a request and the next", registry=r,
                             buckets=(.005, .01, .02, .04, .06, .08, .1, .15, .2, .3, .5, 1, 2))
        eng = srv.engine
        Gauge(p + "queue_length", "Requests waiting for a slot", registry=r).set_function(
            lambda: len(eng.queue) + srv.inbox.qsize())
        Gauge(p + "slots_busy", "Cache slots holding a request", registry=r).set_function(
            lambda: sum(q is not None for q in eng.req))
        Gauge(p + "slots", "Cache slots", registry=r).set(len(eng.req))
        Gauge(p + "prompt_tokens_total", "Prompt tokens of the requests started", registry=r).set_function(
            lambda: eng.prompt_tokens)
        Gauge(p + "prompt_tokens_reused_total", "Prompt tokens found in a slot's cache (not prefilled)",
              registry=r).set_function(lambda: eng.reused_tokens)

    def tokens(self, job, n: int):
        """A Job kept n new tokens (engine thread)."""
        if n <= 0:
            return
        now = time.perf_counter()
        self.generated.inc(n)
        if job.t_last is None:
            self.ttft.observe(now - job.t_added)
        else:
            self.itl.observe(now - job.t_last)
        job.t_last = now

    def text(self) -> bytes:
        from prometheus_client import generate_latest
        return generate_latest(self.registry)


def make_app(srv: Server, api_key: str = ""):
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.responses import HTMLResponse, JSONResponse, Response
    from starlette.routing import Route

    page = (REPO / "server.html").read_text()

    async def chat(request):
        return await srv.complete(request, chat=True)

    async def completions(request):
        return await srv.complete(request, chat=False)

    def card():
        return {"id": srv.name, "object": "model", "created": srv.created, "owned_by": "llama-flat",
                "max_model_len": srv.context}

    async def models(request):
        return JSONResponse({"object": "list", "data": [card()]})

    async def model(request):
        if request.path_params["id"] != srv.name:
            raise ApiError(404, f"The model `{request.path_params['id']}` does not exist: this server serves "
                                f"`{srv.name}`", "model", "model_not_found")
        return JSONResponse(card())

    async def health(request):
        return JSONResponse(srv.health())

    async def metrics(request):
        return Response(srv.metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def index(request):
        return HTMLResponse(page)

    async def api_error(request, e: ApiError):
        return JSONResponse(error_body(e.message, param=e.param, code=e.code), status_code=e.status)

    async def http_error(request, e: HTTPException):
        return JSONResponse(error_body(f"{e.detail}: {request.method} {request.url.path}"), status_code=e.status_code)

    def key_guard(app):  # --api_key: the API and /metrics need it; the page and /health do not
        async def guarded(scope, receive, send):
            if scope["type"] == "http" and scope["path"].startswith(("/v1/", "/metrics")) and \
                    dict(scope["headers"]).get(b"authorization", b"") != f"Bearer {api_key}".encode():
                answer = JSONResponse(error_body("Incorrect or missing API key: send `Authorization: Bearer <key>`",
                                                 code="invalid_api_key"), status_code=401)
                return await answer(scope, receive, send)
            return await app(scope, receive, send)
        return guarded

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/models", models), Route("/v1/models/{id:path}", model),
                             Route("/health", health), Route("/metrics", metrics), Route("/", index)],
                     exception_handlers={ApiError: api_error, HTTPException: http_error},
                     middleware=[Middleware(key_guard)] if api_key else [])


# ------------------------------------------------------------------------------------------------- CLI
def parse_args(argv=None):
    p = ArgumentParser(description="OpenAI-compatible server (chat, completions, a chat page) on any backend.")
    add_backend_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 = pick a free port (printed)", rule=within(0, 65535))
    p.add_argument("--api_key", default="", help="require `Authorization: Bearer KEY` on /v1 and /metrics (401 without)")
    p.add_argument("--prefill_budget", type=int, default=None, rule=at_least(1),
                   help="prompt tokens prefilled per step between the running requests' decode steps (default: all "
                        "new prompts at once); with --prefill_chunk every prompt call has that many columns")
    p.add_argument("--no_prefix_reuse", action="store_true",
                   help="prefill every prompt whole (default: reuse the prefix a free slot's cache holds)")
    p.add_argument("--chat_template", type=Path, default=None,
                   help="a Jinja chat template file replacing the tokenizer's (e.g. one that takes tools)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    check_device(args.device)
    for flag in ("threads", "full_batch_size"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise ValueError(f"--{flag} must be >= 1")
    if args.max_seq_length is not None and args.max_seq_length < 2:
        raise ValueError("--max_seq_length must be >= 2")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} is not a port number")
    if args.chat_template and not args.chat_template.is_file():
        raise FileNotFoundError(f"chat template not found: {args.chat_template}")
    import uvicorn  # noqa: F401 - missing server packages are reported before the model is loaded
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
        sock.listen(2048)  # connections made before uvicorn runs wait in the backlog
    except (OSError, OverflowError) as e:
        raise ValueError(f"cannot listen on {args.host}:{args.port}: {e}") from None
    args.threads = set_threads(args.threads, log=lambda m: print(m, file=sys.stderr))  # the engine thread's count too
    resolve_checkpoint(args)
    print(f"loading {args.checkpoint_path or 'the artifact'} ...", file=sys.stderr, flush=True)
    srv = Server(args, args.full_batch_size)
    print("warming up" + (" (compiling)" if args.compile else "") + " ...", file=sys.stderr, flush=True)
    threading.Thread(target=srv.run_engine, name="engine", daemon=True).start()
    while not srv.ready.wait(0.5):
        pass
    if srv.startup_error:
        raise RuntimeError(f"the warm-up failed: {type(srv.startup_error).__name__}: {srv.startup_error}")
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}/"
    print(f"serving {srv.name} ({srv.how}; context {srv.context} tokens) at {url}  (OpenAI API: {url}v1)", flush=True)
    config = uvicorn.Config(make_app(srv, args.api_key), log_level="warning", timeout_graceful_shutdown=1)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    cli(main)
