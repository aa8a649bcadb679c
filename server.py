# An OpenAI-compatible server over engine.py's continuous-batching Engine, with a small chat page.
#
#     python server.py                                              # default model, http://127.0.0.1:8000/
#     python server.py --checkpoint_path checkpoints/NAME/model_int8.pth --compile --full_batch_size 8 --port 8000
#     python server.py --pte smollm2.pte                            # any backend generate.py takes
#
# Endpoints: POST /v1/chat/completions (messages through the model's chat template), POST /v1/completions (raw
# prompt), GET /v1/models, GET /health, GET / (server.html, the chat page). `stream: true` sends server-sent events in
# OpenAI's chunk format ending with `data: [DONE]`; bad requests get OpenAI-style JSON errors with a 4xx code.
#
# Threads: one engine thread owns the model and the Engine (cache slots + FIFO queue). The HTTP side (starlette on
# uvicorn's asyncio loop) parses and validates requests, tokenizes them and hands Jobs and cancellations to that
# thread through a queue.Queue; each Job hands its text back through an asyncio.Queue (loop.call_soon_threadsafe).
# A Job keeps its tokens with engine.py's Emitter (stop ids, max_tokens), decodes them with tokenizer.py's streaming
# decoder (never splitting a UTF-8 character) and cuts at stop strings, so a finished request frees its slot in the
# same step. A client that goes away mid-request cancels it: its slot is free before the next step.
import asyncio
import inspect
import json
import queue
import random
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

import torch

import engine as E
from backends import add_backend_args, load_backend
from common import REPO, ArgumentParser, check_device, cli, resolve_checkpoint, set_threads, within

DEFAULT_CONTEXT = 2048
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class ApiError(Exception):
    """A bad request: answered as {"error": {"message", "type", "param", "code"}} with a 4xx status."""

    def __init__(self, status: int, message: str, param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(message, type="invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ------------------------------------------------------------------------------------------------- request parsing
def field(body: dict, name: str, kind, default=None, check=None, why=""):
    """body[name] (absent or null: default) if it has the JSON type `kind` and passes check, else a 400."""
    v = body.get(name)
    if v is None:
        return default
    ok = isinstance(v, kind) and not (isinstance(v, bool) and kind is not bool)
    if not ok or (check and not check(v)):
        raise ApiError(400, f"'{name}' must be {why or kind.__name__}, got {json.dumps(v)[:80]}", name)
    return v


def message_text(m, i: int) -> dict:
    """One chat message -> {"role", "content"} for the chat template (text content, or a list of text parts)."""
    if not isinstance(m, dict):
        raise ApiError(400, f"messages[{i}] must be an object with 'role' and 'content'", "messages")
    role, content = m.get("role"), m.get("content")
    if role not in ROLES:
        raise ApiError(400, f"messages[{i}]: unknown role {json.dumps(role)} (expected one of {', '.join(ROLES)})",
                       "messages")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise ApiError(400, f"messages[{i}]: only text content parts are supported", "messages")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError(400, f"messages[{i}]: 'content' must be a string", "messages")
    return {"role": ROLES[role], "content": content}


# ------------------------------------------------------------------------------------------------- one request
class Job:
    """One request on its way through the engine. keep() and end() run in the engine thread; the HTTP side reads the
    events ("text", piece), ("end", finish_reason) or ("error", message) from self.events."""

    def __init__(self, srv, ids, max_tokens, stops, temperature, top_p, seed, ignore_eos, loop):
        self.loop, self.events, self.srv = loop, asyncio.Queue(), srv
        self.emit = E.Emitter(1, max_tokens, () if ignore_eos else srv.tok.stop_ids, None, srv.device)
        self.decoder, self.stops, self.text, self.sent = srv.tok.stream(), stops, "", 0
        self.stopped = self.ended = False
        self.failed: str = ""
        gen = torch.Generator().manual_seed(random.randrange(2**63) if seed is None else seed)
        self.request = E.Request(ids, self.keep, E.Sampling(temperature, None, top_p, gen), self.end)
        self.prompt_tokens = len(ids)

    @property
    def tokens(self) -> list:
        return self.emit.out[0]

    def post(self, *event):
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def keep(self, tokens) -> bool:
        n = len(self.tokens)
        go = self.emit.put(0, tokens)
        self.text += "".join(self.decoder.put(t) for t in self.tokens[n:])
        if not go:
            self.text += self.decoder.flush()
        return self.cut(final=not go) and go

    def cut(self, final: bool) -> bool:
        """Post the text that can no longer become part of a stop string; False once a stop string appeared (the text
        ends just before it)."""
        hits = [i for i in (self.text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.text, self.stopped = self.text[:min(hits)], True
        hold = 0 if hits or final else max(
            (k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        if len(self.text) - hold > self.sent:
            self.post("text", self.text[self.sent:len(self.text) - hold])
            self.sent = len(self.text) - hold
        return not hits

    def end(self, reason: str):
        self.ended = True
        self.srv.live.discard(self)
        if self.failed:
            return self.post("error", self.failed)
        if reason == "length":  # the context is full: keep() never saw the end
            self.text += self.decoder.flush()
            self.cut(final=True)
        full = len(self.tokens) >= self.emit.max_new or reason == "length"
        self.post("end", None if reason == "cancelled" else "length" if full and not self.stopped else "stop")

    def usage(self) -> dict:
        n = len(self.tokens)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n, "total_tokens": self.prompt_tokens + n}


# ------------------------------------------------------------------------------------------------- the server
class Server:
    def __init__(self, args, slots_wanted):
        from tokenizer import load_tokenizer
        self.device, self.threads = torch.device(args.device), args.threads
        self.tok = load_tokenizer(args.tokenizer_path)
        max_seq = args.max_seq_length or DEFAULT_CONTEXT
        self.backend = load_backend(args, self.device, getattr(torch, args.dtype), slots_wanted or 4, max_seq)
        E.check_vocab(self.tok, self.backend)
        # continuous batching needs rows mapped to cache slots (a QPC compiled without --full_batch_size has none)
        batches = "batch_index" in inspect.signature(self.backend.forward).parameters and \
            getattr(self.backend, "full_batch_size", 0) is not None
        slots = min(slots_wanted or 4, self.backend.max_batch_size) if batches else 1
        self.engine = E.Engine(self.backend, self.device, slots, args.prefill_chunk)
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

    # ---- the engine thread: the only one that touches the model
    def run_engine(self):
        if self.threads:
            torch.set_num_threads(self.threads)  # OpenMP thread counts are per thread
        # warm-up: compiles (--compile) the decode step for 3, 2 and 1 rows (one static, one dynamic and one size-1
        # graph cover every row count) before the first request, and warms up prefill
        n = min(3, len(self.engine.req))
        warm = E.Emitter(n, 4, (), None, self.device)
        try:
            for i in range(n):
                self.engine.add(E.Request(self.tok.encode("Hello") or [0], lambda t, i=i: warm.put(i, t) and
                                          len(warm.out[i]) < 2 + i))
            while self.engine.busy():
                self.engine.step()
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
                "decode_steps": self.engine.steps}

    # ---- the HTTP side
    def parse(self, body: dict, chat: bool) -> tuple:
        """Check a request body; returns (prompt ids, Job arguments, stream, include_usage). Raises ApiError."""
        model = body.get("model")
        if model not in (None, "", self.name):
            raise ApiError(404, f"The model `{model}` does not exist: this server serves `{self.name}`", "model",
                           "model_not_found")
        if field(body, "n", int, 1) != 1:
            raise ApiError(400, "'n' must be 1: this server returns one choice per request", "n")
        if chat:
            messages = field(body, "messages", list, None, len, "a non-empty list of messages")
            if messages is None:
                raise ApiError(400, "'messages' is required", "messages")
            messages = [message_text(m, i) for i, m in enumerate(messages)]
            try:
                ids = self.tok.encode(self.tok.apply_chat_template(messages, add_generation_prompt=True), bos=False)
            except ValueError as e:
                raise ApiError(400, str(e), "messages") from None
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1:
                prompt = prompt[0]
            if not isinstance(prompt, str):
                raise ApiError(400, "'prompt' is required and must be a string (one prompt per request)", "prompt")
            ids = self.tok.encode(prompt)
        if not ids:
            raise ApiError(400, "the prompt is empty (and the tokenizer adds no BOS): nothing to condition on")
        if len(ids) >= self.context:
            raise ApiError(400, f"This model's maximum context length is {self.context} tokens, but the prompt has "
                                f"{len(ids)} tokens (the reply needs at least one more).",
                           "messages" if chat else "prompt", "context_length_exceeded")
        positive = dict(check=lambda v: v >= 1, why="an integer >= 1")
        max_tokens = field(body, "max_completion_tokens", int, None, **positive)
        if max_tokens is None:
            max_tokens = field(body, "max_tokens", int, self.context - len(ids) if chat else 16, **positive)
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
        if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) for s in stops):
            raise ApiError(400, "'stop' must be a string or a list of at most 4 strings", "stop")
        temperature = field(body, "temperature", (int, float), 1.0, lambda v: 0 <= v <= 2, "a number in [0, 2]")
        top_p = field(body, "top_p", (int, float), 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]")
        seed = field(body, "seed", int)
        ignore_eos = field(body, "ignore_eos", bool, False)  # vLLM / llama-server extension (benchmarks)
        stream = field(body, "stream", bool, False)
        include_usage = bool(field(body, "stream_options", dict, {}).get("include_usage"))
        return ids, (max_tokens, [s for s in stops if s], float(temperature), float(top_p), seed, ignore_eos), \
            stream, include_usage

    async def complete(self, request, chat: bool):
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError):
            raise ApiError(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        ids, job_args, stream, include_usage = self.parse(body, chat)
        job = Job(self, ids, *job_args, asyncio.get_running_loop())
        self.live.add(job)
        self.inbox.put(("add", job))
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
                "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.name}
        from starlette.responses import JSONResponse, StreamingResponse
        if stream:
            return StreamingResponse(self.events(job, head, chat, include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        disconnected = asyncio.ensure_future(self.wait_disconnect(request))
        try:
            while True:
                get = asyncio.ensure_future(job.events.get())
                await asyncio.wait({get, disconnected}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    return JSONResponse(error_body("client disconnected"), status_code=499)
                kind, value = get.result()
                if kind == "error":
                    return JSONResponse(error_body(value, "server_error"), status_code=500)
                if kind == "end":
                    break
        finally:
            disconnected.cancel()
            self.cancel(job)
        choice = {"index": 0, "logprobs": None, "finish_reason": value}
        choice.update({"message": {"role": "assistant", "content": job.text}} if chat else {"text": job.text})
        return JSONResponse({**head, "choices": [choice], "usage": job.usage()})

    async def events(self, job, head, chat, include_usage):
        """The server-sent events of a streaming request; closing the stream early (the client went away) cancels it."""
        head = {**head, "object": head["object"] + ".chunk" if chat else head["object"]}

        def chunk(text=None, finish=None, delta=None):
            c = {"index": 0, "logprobs": None, "finish_reason": finish}
            c.update({"delta": delta or ({} if text is None else {"content": text})} if chat else {"text": text or ""})
            return f"data: {json.dumps({**head, 'choices': [c]})}\n\n"

        try:
            if chat:
                yield chunk(delta={"role": "assistant", "content": ""})
            while True:
                kind, value = await job.events.get()
                if kind == "text":
                    yield chunk(value)
                elif kind == "error":
                    yield f"data: {json.dumps(error_body(value, 'server_error'))}\n\n"
                    break
                else:
                    yield chunk(finish=value)
                    if include_usage:
                        yield f"data: {json.dumps({**head, 'choices': [], 'usage': job.usage()})}\n\n"
                    break
            yield "data: [DONE]\n\n"
        finally:
            self.cancel(job)

    def cancel(self, job):
        if not job.ended:
            self.inbox.put(("cancel", job))

    @staticmethod
    async def wait_disconnect(request):
        while (await request.receive())["type"] != "http.disconnect":
            pass


def make_app(srv: Server):
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import HTMLResponse, JSONResponse
    from starlette.routing import Route

    page = (REPO / "server.html").read_text()

    async def chat(request):
        return await srv.complete(request, chat=True)

    async def completions(request):
        return await srv.complete(request, chat=False)

    async def models(request):
        return JSONResponse({"object": "list", "data": [
            {"id": srv.name, "object": "model", "created": srv.created, "owned_by": "llama-flat",
             "max_model_len": srv.context}]})

    async def health(request):
        return JSONResponse(srv.health())

    async def index(request):
        return HTMLResponse(page)

    async def api_error(request, e: ApiError):
        return JSONResponse(error_body(e.message, param=e.param, code=e.code), status_code=e.status)

    async def http_error(request, e: HTTPException):
        return JSONResponse(error_body(f"{e.detail}: {request.method} {request.url.path}"), status_code=e.status_code)

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/models", models), Route("/health", health), Route("/", index)],
                     exception_handlers={ApiError: api_error, HTTPException: http_error})


# ------------------------------------------------------------------------------------------------- CLI
def parse_args(argv=None):
    p = ArgumentParser(description="OpenAI-compatible server (chat, completions, a chat page) on any backend.")
    add_backend_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 = pick a free port (printed)", rule=within(0, 65535))
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
    config = uvicorn.Config(make_app(srv), log_level="warning", timeout_graceful_shutdown=1)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    cli(main)
