# server_job.py: one choice of one server.py request on its way through the engine. pick() chooses each token (logit
# bias, presence / frequency penalties, the grammar's mask, then the request's sampling; logprobs recorded), keep()
# keeps tokens with engine.py's Emitter (stop ids, max_tokens), decodes them with tokenizer.py's streaming decoder and
# cuts at stop strings; tool calls (server_tools.py) are held back from the stream and parsed at the end.
# Events go to the request's asyncio.Queue as (index, kind, ...):
#     (i, "text", piece, logprobs)   logprobs: the entries of the tokens behind the piece ([] unless asked for)
#     (i, "end", finish_reason, tool_calls, logprobs)
#     (i, "error", message)
import random
import time
from collections import Counter

import torch

import engine as E
import server_tools as T


class Job:
    """Choice `index` of a request with Options `opts`. pick(), keep() and end() run in the engine thread."""

    def __init__(self, srv, opts, index: int, events, loop):
        self.srv, self.opts, self.index, self.events, self.loop = srv, opts, index, events, loop
        self.emit = E.Emitter(1, opts.max_tokens, () if opts.ignore_eos else srv.tok.stop_ids, None, srv.device)
        self.decoder, self.text, self.sent, self.stopped, self.ended = srv.tok.stream(), "", 0, False, False
        self.failed, self.content, self.tool_calls = "", None, []
        seed = random.randrange(2**63) if opts.seed is None else opts.seed + index
        self.sampling = E.Sampling(opts.temperature, opts.top_k, opts.top_p, torch.Generator().manual_seed(seed))
        self.matcher = srv.grammars.matcher(opts.grammar) if opts.grammar else None
        self.counts: Counter = Counter()
        self.lps: list = []    # logprob entries of the tokens chosen
        self.lp_sent = 0
        plain = not (self.matcher or opts.logprobs is not None or opts.logit_bias or opts.presence_penalty or
                     opts.frequency_penalty)
        self.request = E.Request(opts.ids, self.keep, self.sampling, self.end, None if plain else self.pick)
        self.t_added, self.t_last = time.perf_counter(), None  # for /metrics
        self.opening = T.opening(opts.tool_format) if opts.tool_format else ""
        self.opening_id = srv.tok.special_tokens.get(self.opening) if self.opening else None

    @property
    def tokens(self) -> list:
        return self.emit.out[0]

    def post(self, *event):
        self.loop.call_soon_threadsafe(self.events.put_nowait, (self.index, *event))

    def pick(self, logits: torch.Tensor) -> int:
        """logits [V] -> the next token, after bias, penalties and the grammar mask."""
        raw, o = logits.float(), self.opts
        logits = raw
        if o.logit_bias:
            logits = logits.clone()
            for t, b in o.logit_bias.items():
                logits[t] += b
        if self.counts and (o.presence_penalty or o.frequency_penalty):
            ids = torch.tensor(list(self.counts), device=logits.device)
            n = torch.tensor(list(self.counts.values()), dtype=logits.dtype, device=logits.device)
            logits = logits.index_add(0, ids, -(o.frequency_penalty * n + o.presence_penalty))
        if self.matcher:
            try:
                logits = self.matcher.mask(logits)
            except ValueError as e:  # the grammar's dead end: this request ends with the error, the others go on
                self.failed = str(e)
        t = int(self.sampling.sample(logits.view(1, -1))[0])
        self.counts[t] += 1
        if o.logprobs is not None:
            lp = torch.log_softmax(raw, -1)
            top = torch.topk(lp, o.logprobs) if o.logprobs else None
            self.lps.append((t, float(lp[t]), [] if top is None else list(zip(top.indices.tolist(),
                                                                               top.values.tolist()))))
        if self.matcher:
            self.matcher.consume(t)
        return t

    def keep(self, tokens) -> bool:
        if self.failed:
            return False
        n = len(self.tokens)
        go = self.emit.put(0, tokens)
        self.srv.metrics.tokens(self, len(self.tokens) - n)
        self.text += "".join(self.piece(t) for t in self.tokens[n:])
        if not go:
            self.text += self.decoder.flush()
        return self.cut(final=not go) and go

    def piece(self, t: int) -> str:
        """Token t's text; a tool call's opening that the tokenizer decodes to nothing (a SentencePiece control token:
        Mistral's [TOOL_CALLS]) as its text, for the parser."""
        text = self.decoder.put(t)
        return text + self.opening if t == self.opening_id and self.opening not in text else text

    def cut(self, final: bool) -> bool:
        """Post the text that can no longer become part of a stop string or a tool call; False once a stop string
        appeared (the text ends just before it)."""
        hits = [i for i in (self.text.find(s) for s in self.opts.stops) if i >= 0]
        if hits:
            self.text, self.stopped = self.text[:min(hits)], True
        holds, end = [] if hits or final else list(self.opts.stops), len(self.text)
        if self.opening:  # a call is held back whole, until end() parses it
            at = 0 if self.opts.tool_format != "mistral" and self.text.lstrip().startswith(("{", "[")) else \
                self.text.find(self.opening)  # (a reply that is a JSON call: Llama 3's form, Hermes without tags)
            end = at if at >= 0 else end
            holds += [] if at >= 0 else [self.opening]
        end -= max((k for s in holds for k in range(1, len(s)) if self.text[:end].endswith(s[:k])), default=0)
        if end > self.sent:
            self.post("text", self.text[self.sent:end], self.lps[self.lp_sent:len(self.tokens)])
            self.sent, self.lp_sent = end, len(self.tokens)
        return not hits

    def parse_calls(self) -> list:
        """At the end of a tools request: the tool calls in the reply (self.content: the text around them); the
        content not posted yet is posted."""
        content, calls = T.parse(self.opts.tool_format, self.text, self.opts.tool_names)
        self.content, calls = content, calls if self.opts.parallel_calls else calls[:1]
        done = self.text[:self.sent]
        rest = self.text[self.sent:] if not calls else (content or "")[len(done):] if \
            (content or "").startswith(done) else ""
        if rest:
            self.post("text", rest, [])
        self.sent = len(self.text)
        return calls

    def end(self, reason: str):
        self.ended = True
        self.srv.live.discard(self)
        if self.failed:
            return self.post("error", self.failed)
        if reason == "length":  # the context is full: keep() never saw the end
            self.text += self.decoder.flush()
            self.cut(final=True)
        calls = self.parse_calls() if self.opts.tool_format and reason != "cancelled" else []
        full = len(self.tokens) >= self.emit.max_new or reason == "length"
        self.tool_calls = calls
        finish = None if reason == "cancelled" else "tool_calls" if calls else \
            "length" if full and not self.stopped else "stop"
        self.post("end", finish, calls, self.lps[self.lp_sent:len(self.tokens)])
