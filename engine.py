# The generation loop every stage drives, gpt-fast style: sampling, the backends' common contract, prefill, the
# fixed-batch loop (generate) and the continuous-batching Engine. generate.py, server.py, eval.py, speculative.py and
# bench.py import it; exporters do not. Plumbing below it is common.py's.
#
# A backend is anything with
#     forward(tokens: LongTensor[B, T], input_pos: LongTensor[T] or [B, T]) -> FloatTensor[B, T, V] or [B, 1, V]
#     max_batch_size, max_seq_length        (ints)
#     prefill_chunk                         (None: any prompt length in one call; N: prompts go in chunks of exactly N)
# input_pos [T] means every row sits at the same positions; [B, T] gives each row its own, -1 marking padding.
# Optional: forward_masked(tokens [1, T], input_pos [T], mask [1, 1, T, S]) -> [1, T, V], speculative.py's lookahead
# contract (TorchBackend; the .pte / .pt2 backends of artifacts exported with --lookahead), which --lookahead needs.
# A [B, 1, V] result holds the logits of each row's last valid position (fixed-graph backends such as ONNX return that).
# Optional: logits_at = True when forward(..., logits_at=LongTensor[B]) computes only those rows' logits ([B, 1, V]);
# prefill then asks for each prompt's last token only (TorchBackend).
# The same prefill / decode / sampling code below then drives eager PyTorch, torch.compile, an AOT Inductor package,
# an ExecuTorch .pte, ONNX Runtime and a Cloud AI 100 QPC.
#
# engine.py imports no exporter: each entry point picks its backend (backends.py) and hands it here.
import contextlib
import time
from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

import torch

from torch import Tensor, nn

from model import Attention

try:
    import fast_cpu  # the CPU accelerator: delete it and everything runs the same tokens, slower
except ImportError:
    fast_cpu = None


# ----------------------------------------------------------------------------------------------------------- sampling
@dataclass(frozen=True)
class Sampling:
    """How each next token is chosen: one object through the loop, the Engine's requests, speculative.py and the
    server. temperature 0 is greedy (argmax); otherwise the logits / temperature keep the top_k likeliest tokens and
    the smallest set whose probability reaches top_p, and `generator` draws on the CPU, so that a seed gives the same
    text on every device and backend."""
    temperature: float = 0.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    generator: Optional[torch.Generator] = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [..., V] -> the distribution tokens are drawn from."""
        logits = logits / max(self.temperature, 1e-5)
        if self.top_k is not None and self.top_k < logits.shape[-1]:
            kth = torch.topk(logits, self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if self.top_p is not None and self.top_p < 1.0:
            sorted_probs, idx = torch.sort(probs, dim=-1, descending=True)
            drop = sorted_probs.cumsum(-1) - sorted_probs > self.top_p  # the smallest prefix whose mass reaches top_p
            probs = probs.scatter(-1, idx, sorted_probs.masked_fill(drop, 0.0))
            probs = probs / probs.sum(-1, keepdim=True)
        return probs

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] -> token ids [B]."""
        if self.greedy:
            return logits.argmax(-1)
        probs = self.probs(logits.float().cpu())
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1).to(logits.device)


GREEDY = Sampling()


# ----------------------------------------------------------------------------------------------------------- backends
class TorchBackend:
    """model.py's Transformer, eager or torch.compile'd. On CPU, fast_cpu.speed_up swaps its faster modules in (with
    --compile: the decode step as one frozen graph of the whole model, prompts and lookahead's masked steps through
    compiled per-layer graphs); without fast_cpu.py the model runs as written and --compile compiles it whole."""

    prefill_chunk = None
    logits_at = True  # forward(..., logits_at=) computes only the named rows' logits (prefill's last tokens)

    def __init__(self, model, max_batch_size: int, max_seq_length: int, compile=False):
        device = next(model.parameters()).device
        with torch.device(device):
            model.setup_caches(max_batch_size, max_seq_length)
        self.model = model
        self.max_batch_size, self.max_seq_length = model.max_batch_size, model.max_seq_length
        self.vocab_size = model.config.vocab_size
        self.decode_fn = self.prefill_fn = model
        fast = fast_cpu is not None and device.type == "cpu"
        if fast:
            fast_cpu.speed_up(model, compile=compile)
        if compile:
            self.decode_fn = (fast_cpu.compile_decode(model) if fast else
                              torch.compile(model, mode="reduce-overhead" if device.type == "cuda" else None,
                                            fullgraph=True))
        self._step_caches = []

    def forward(self, tokens, input_pos, batch_index=None, logits_at=None):
        kw = {} if logits_at is None else {"logits_at": logits_at}
        with torch.inference_mode():
            fn = self.decode_fn if tokens.shape[1] == 1 else self.prefill_fn
            return fn(tokens, input_pos, **kw) if batch_index is None else fn(tokens, input_pos, batch_index, **kw)

    def forward_masked(self, tokens, input_pos, mask):
        """speculative.py's lookahead contract (batch 1): token k of tokens [1, T] sits at position input_pos[k] and
        writes cache slot input_pos[0] + k; mask [1, 1, T, S] (additive) says what it attends to."""
        with torch.inference_mode(), step_caches(self.model, self._step_caches):
            return self.prefill_fn(tokens, input_pos, mask=mask.to(self.model.norm.weight.dtype))


class StepCache(nn.Module):
    """The lookahead contract's cache (swapped in at model.py's kv_cache swap point, over the same buffers): one
    sequence; a call's T keys/values go to the consecutive cache slots input_pos[0] .. input_pos[0] + T - 1, whatever
    the tokens' own positions (the rotary embedding); the caller's mask says what each token attends to. With
    consecutive positions (a prompt, a decode step) slots and positions coincide: it is the ordinary KV cache.
    et_export.py / aoti_export.py export the `lookahead` program through this swap; TorchBackend runs it
    (forward_masked)."""

    def __init__(self, cache):
        super().__init__()
        if cache.k_cache.shape[0] != 1:
            raise ValueError("lookahead decoding runs one sequence: the cache must hold batch 1")
        self.register_buffer("k_cache", cache.k_cache, persistent=False)
        self.register_buffer("v_cache", cache.v_cache, persistent=False)

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor, batch_index: Optional[Tensor] = None):
        slots = input_pos[:1] + torch.arange(k.shape[2], device=input_pos.device)
        self.k_cache.index_copy_(2, slots, k.contiguous())
        self.v_cache.index_copy_(2, slots, v.contiguous())
        return self.k_cache, self.v_cache


@contextlib.contextmanager
def step_caches(model, made: Optional[list] = None):
    """Each layer's kv_cache -> a StepCache over the same buffers for the duration of the block (model.py's swap
    point); put back on exit. `made`: a list that keeps the StepCaches between calls (a compiled caller sees the same
    modules every time)."""
    attns = [m for m in model.modules() if isinstance(m, Attention)]
    orig = [a.kv_cache for a in attns]
    if made is None or len(made) != len(orig) or any(s.k_cache is not c.k_cache for s, c in zip(made, orig)):
        fresh = [StepCache(c) for c in orig]
        if made is None:
            made = fresh
        else:
            made[:] = fresh
    for a, c in zip(attns, made):
        a.kv_cache = c
    try:
        yield model
    finally:
        for a, c in zip(attns, orig):
            a.kv_cache = c


# ----------------------------------------------------------------------------------------------------------- the loop
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def prefill(backend, prompts: list[list[int]], device, chunk: Optional[int] = None, start_pos: int = 0,
            batch_index: Optional[torch.Tensor] = None):
    """Run the prompts through the backend; return each row's logits at its last prompt token, [B, V].
    Same-length prompts use shared positions [T]; different lengths use per-row positions with -1 padding.
    With a chunk size (fixed-shape backends), prompts go in chunks of exactly `chunk` tokens.
    batch_index [B, 1] names the cache slot of each row (continuous batching)."""
    B = len(prompts)
    lens = [len(p) for p in prompts]
    T = max(lens)
    width = T if not chunk else -(-T // chunk) * chunk
    tokens = torch.zeros(B, width, dtype=torch.long)
    pos = torch.full((B, width), -1, dtype=torch.long)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = torch.tensor(p, dtype=torch.long)
        pos[b, :len(p)] = torch.arange(start_pos, start_pos + len(p))
    shared = len(set(lens)) == 1 and not chunk and batch_index is None
    extra = {} if batch_index is None else {"batch_index": batch_index.to(device)}
    last = None
    for s in range(0, width, chunk or width):
        e = s + (chunk or width)
        ip = pos[0, s:e] if shared else pos[:, s:e]
        if getattr(backend, "logits_at", False) and e - s > 1:  # only the rows' last prompt tokens' logits
            extra["logits_at"] = torch.tensor([min(max(n - 1 - s, 0), e - s - 1) for n in lens], device=device)
        logits = backend.forward(tokens[:, s:e].to(device), ip.to(device), **extra)
        # rows whose last prompt token falls in this chunk take their logits from it
        for b, n in enumerate(lens):
            if s <= n - 1 < e:
                row = logits[b, -1] if logits.shape[1] == 1 else logits[b, n - 1 - s]
                if last is None:
                    last = torch.empty(B, row.shape[-1], dtype=row.dtype, device=row.device)
                last[b] = row
    return last


class Emitter:
    """The one token keeper and run clock of every decoding loop (generate, generate_continuous, speculative.py's
    speculative_generate and lookahead_generate). put(row, tokens) keeps a sequence's new tokens until a stop id or
    max_new_tokens, streams each kept one through on_token(row, token) and says whether the sequence goes on. The
    clock starts when the Emitter is made (just before the first prefill); the first put() marks the first token.
    stats(): prompt_tokens, new_tokens (kept, all sequences), decode_steps (the loop's forwards after the first token)
    and the one definition of the figures that every mode and bench.py report:
        ttft_s         time from the start to the first token produced
        prefill_tok_s  prompt tokens processed before that first token / ttft_s
        decode_s       time after ttft_s, to the end
        decode_tok_s   tokens produced after the first token of each sequence / decode_s"""

    def __init__(self, rows: int, max_new_tokens: int, stop_ids, on_token, device):
        self.out: list[list[int]] = [[] for _ in range(rows)]
        self.done = [max_new_tokens <= 0] * rows
        self.max_new, self.stop_ids, self.on_token, self.device = max_new_tokens, set(stop_ids), on_token, device
        _sync(device)
        self.t0, self.t_first = time.perf_counter(), None

    def put(self, row: int, tokens) -> bool:
        out = self.out[row]
        for t in tokens:
            if self.done[row] or t in self.stop_ids:
                self.done[row] = True
                break
            out.append(t)
            if self.on_token:
                self.on_token(row, t)
            self.done[row] = len(out) >= self.max_new
        if self.t_first is None:
            self.t_first = time.perf_counter()
        return not self.done[row]

    def stats(self, prompt_tokens: int, decode_steps: int, prefill_tokens: Optional[int] = None) -> dict:
        """prefill_tokens: the prompt tokens processed before the first token when not all of them were."""
        _sync(self.device)
        t_end = time.perf_counter()
        t_first = t_end if self.t_first is None else self.t_first
        n, firsts = sum(map(len, self.out)), sum(1 for o in self.out if o)
        ttft, decode_s, prefilled = t_first - self.t0, t_end - t_first, prefill_tokens or prompt_tokens
        return dict(prompt_tokens=prompt_tokens, ttft_s=ttft, decode_steps=decode_steps, decode_s=decode_s,
                    new_tokens=n, prefill_tok_s=prefilled / max(ttft, 1e-9),
                    decode_tok_s=(n - firsts) / decode_s if decode_s > 0 and n > firsts else 0.0)


def generate(backend, prompts: list[list[int]], max_new_tokens: int, device, *, sampling: Sampling = GREEDY,
             stop_ids=(), on_token: Optional[Callable[[int, int], None]] = None, start_pos: int = 0,
             prefill_chunk: Optional[int] = None):
    """Generate for a batch of prompts. Returns (new token ids per prompt, Emitter.stats()).
    on_token(row, token) is called for every kept token as it is produced (for streaming)."""
    B = len(prompts)
    lens = [start_pos + len(p) for p in prompts]
    if B > backend.max_batch_size:
        raise ValueError(f"{B} prompts but the backend holds at most {backend.max_batch_size} sequences")
    if max(lens) >= backend.max_seq_length:
        raise ValueError(f"prompt of {max(lens)} tokens does not fit the context of {backend.max_seq_length} tokens")
    max_new_tokens = min(max_new_tokens, backend.max_seq_length - max(lens))
    emit = Emitter(B, max_new_tokens, stop_ids, on_token, device)
    keep = lambda ids: [emit.put(b, [t]) for b, t in enumerate(ids.tolist())]
    logits = prefill(backend, prompts, device, chunk=prefill_chunk or backend.prefill_chunk, start_pos=start_pos)
    nxt = sampling.sample(logits)
    keep(nxt)
    shared = len(set(lens)) == 1
    steps = 0
    for i in range(max_new_tokens - 1):
        if all(emit.done):
            break
        ip = torch.tensor([lens[0] + i] if shared else [[n + i] for n in lens], device=device)
        logits = backend.forward(nxt.view(B, 1), ip)
        nxt = sampling.sample(logits[:, -1])
        keep(nxt)
        steps += 1
    return emit.out, emit.stats(sum(lens) - B * start_pos, steps)


@dataclass(eq=False)
class Request:
    """One sequence for the Engine: prompt ids; keep(tokens) -> bool keeps new tokens and says whether it goes on (an
    Emitter's put; server.py adds stop strings); its sampling; on_end("stop" | "length" | "cancelled") at its end.
    pick(logits [V]) -> token id, when given, chooses each next token instead of `sampling` (server.py: grammar masks,
    penalties, logit_bias, logprobs). reused: the prompt tokens found in its slot's cache (set by the Engine)."""
    ids: list
    keep: Callable[[list], bool]
    sampling: Sampling = GREEDY
    on_end: Optional[Callable[[str], None]] = None
    pick: Optional[Callable[[Tensor], int]] = None
    reused: int = 0


def common_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def prefill_rows(backend, rows: list, device, chunk: Optional[int], batch_index) -> Tensor:
    """prefill() for rows that each start at their own position: rows [(ids, start)] -> each row's logits at its
    last token, [B, V]. The rows go through the backend together (per-row positions, -1 padding), in chunks of
    exactly `chunk` tokens when given."""
    if len({start for _, start in rows}) == 1:
        return prefill(backend, [ids for ids, _ in rows], device, chunk=chunk, start_pos=rows[0][1],
                       batch_index=batch_index)
    lens = [len(ids) for ids, _ in rows]
    width = max(lens) if not chunk else -(-max(lens) // chunk) * chunk
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    pos = torch.full((len(rows), width), -1, dtype=torch.long)
    for b, (ids, start) in enumerate(rows):
        tokens[b, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        pos[b, :len(ids)] = torch.arange(start, start + len(ids))
    extra = {} if batch_index is None else {"batch_index": batch_index.to(device)}
    last = [None] * len(rows)
    for s in range(0, width, chunk or width):
        e = s + (chunk or width)
        if getattr(backend, "logits_at", False) and e - s > 1:
            extra["logits_at"] = torch.tensor([min(max(n - 1 - s, 0), e - s - 1) for n in lens], device=device)
        logits = backend.forward(tokens[:, s:e].to(device), pos[:, s:e].to(device), **extra)
        for b, n in enumerate(lens):
            if s <= n - 1 < e:
                last[b] = logits[b, -1] if logits.shape[1] == 1 else logits[b, n - 1 - s]
    return torch.stack(last)


class Engine:
    """Continuous batching: `slots` cache slots of a backend and a FIFO queue of Requests. step() refills the free
    slots with the next queued requests (prefilled together, each row into its slot; their first tokens kept at once),
    then advances every busy slot by one token in one forward (rows = busy slots), each row sampled with its own
    request's parameters (greedy rows are a plain argmax). A request that ends frees its slot at once.
    Prefix reuse (reuse=True): a slot remembers the tokens whose keys / values it holds (`fed`); a queued request goes
    to the free slot sharing the longest prefix with its prompt (the previous turn of a chat, a shared system prompt;
    among equals the one holding the fewest tokens) and only the rest of the prompt is prefilled, at its positions (the attention mask comes from the positions, so
    the stale entries past them are never read). Backends whose cache is not addressed by position take reuse=False.
    add() and cancel() go between steps: one thread owns the engine (server.py feeds it from its HTTP side).
    With more than one slot the backend's forward must accept batch_index [B, 1] (rows -> cache slots)."""

    def __init__(self, backend, device, slots: int, prefill_chunk: Optional[int] = None, reuse: bool = True,
                 prefill_budget: Optional[int] = None):
        if slots > backend.max_batch_size:
            raise ValueError(f"full_batch_size {slots} exceeds the backend's {backend.max_batch_size} slots")
        self.backend, self.device, self.chunk = backend, device, prefill_chunk or backend.prefill_chunk
        self.queue, self.steps = deque(), 0                  # waiting Requests; decode forwards so far
        self.req: list[Optional[Request]] = [None] * slots  # the request each slot holds
        self.pos, self.tok = [-1] * slots, [0] * slots       # position and token each slot feeds next
        self.fed: list[list] = [[] for _ in range(slots)]    # the tokens whose keys / values each slot holds
        self.reuse, self.prompt_tokens, self.reused_tokens = reuse, 0, 0  # counters for /metrics
        self.budget, self.todo, self.order = prefill_budget, [0] * slots, []  # prompt tokens each slot has left

    def add(self, r: Request):
        if len(r.ids) >= self.backend.max_seq_length:
            raise ValueError(f"prompt of {len(r.ids)} tokens does not fit the context of "
                             f"{self.backend.max_seq_length} tokens")
        self.queue.append(r)

    def busy(self) -> bool:
        return bool(self.queue) or any(r is not None for r in self.req)

    def cancel(self, r: Request):
        if r in self.queue:
            self.queue.remove(r)
            r.on_end and r.on_end("cancelled")
        elif r in self.req:
            self._end(self.req.index(r), "cancelled")

    def _end(self, slot, reason):
        r, self.req[slot], self.pos[slot], self.todo[slot] = self.req[slot], None, -1, 0
        r.on_end and r.on_end(reason)

    def _accept(self, slot, t):  # keep a sampled token; free the slot when its sequence ends or reaches the context end
        if not self.req[slot].keep([t]):
            self._end(slot, "stop")
        elif self.pos[slot] + 1 >= self.backend.max_seq_length:
            self._end(slot, "length")
        else:
            self.tok[slot] = t

    def _sample(self, logits, reqs) -> list[int]:
        greedy = logits.argmax(-1).tolist()
        return [r.pick(logits[b]) if r.pick else g if r.sampling.greedy else int(r.sampling.sample(logits[b:b + 1])[0])
                for b, (g, r) in enumerate(zip(greedy, reqs))]

    def _place(self, free: list) -> list:
        """Take queued requests into free slots (each to the free slot with the longest reusable prefix); returns
        the slots filled."""
        new = []
        while free and self.queue:
            r = self.queue.popleft()
            reuse = [min(common_prefix(self.fed[s], r.ids), len(r.ids) - 1) if self.reuse else 0 for s in free]
            s = free.pop(max(range(len(free)), key=lambda i: (reuse[i], -len(self.fed[free[i]]))))  # ties: lose least
            r.reused = max(reuse)
            self.req[s], self.pos[s], self.fed[s], self.todo[s] = r, len(r.ids), r.ids[:r.reused], len(r.ids) - r.reused
            self.order = [o for o in self.order if self.req[o] is not None and o != s] + [s]
            self.prompt_tokens += len(r.ids)
            self.reused_tokens += r.reused
            new.append(s)
        return new

    def _prefilled(self, s, done, logits):  # slot s holds its prompt up to `done`; its first token when complete
        r = self.req[s]
        self.todo[s], self.fed[s] = len(r.ids) - done, list(r.ids[:done])
        if not self.todo[s]:
            self._accept(s, self._sample(logits, [r])[0])

    def step(self):
        index = (lambda s: torch.tensor(s, device=self.device).view(-1, 1)) if len(self.req) > 1 else (lambda s: None)
        self._place([s for s, r in enumerate(self.req) if r is None])
        waiting = sorted((s for s, r in enumerate(self.req) if r is not None and self.todo[s]), key=self.order.index)
        pieces, left = [], self.budget or sum(self.todo)  # (slot, start, end): the prompt tokens this step prefills
        for s in waiting:  # the oldest prompts first; the new prompts go in together, each row into its own slot
            if left <= 0:
                break
            a = len(self.req[s].ids) - self.todo[s]
            pieces.append((s, a, min(len(self.req[s].ids), a + left)))
            left -= pieces[-1][2] - a
        if pieces:
            logits = prefill_rows(self.backend, [(self.req[s].ids[a:b], a) for s, a, b in pieces], self.device,
                                  self.chunk, index([s for s, _, _ in pieces]))
            for i, (s, _, b) in enumerate(pieces):
                self._prefilled(s, b, logits[i:i + 1])
        live = [s for s, r in enumerate(self.req) if r is not None and not self.todo[s]]
        if not live:
            return
        extra = {} if len(self.req) == 1 else {"batch_index": index(live)}
        logits = self.backend.forward(torch.tensor([[self.tok[s]] for s in live], device=self.device),
                                      torch.tensor([[self.pos[s]] for s in live], device=self.device), **extra)
        self.steps += 1
        for s in live:
            self.fed[s].append(self.tok[s])
        for s, t in zip(live, self._sample(logits[:, -1], [self.req[s] for s in live])):
            self.pos[s] += 1
            self._accept(s, t)


def generate_continuous(backend, prompts: list[list[int]], max_new_tokens: int, device, full_batch_size: int, *,
                        sampling: Sampling = GREEDY, stop_ids=(), on_token: Optional[Callable[[int, int], None]] = None,
                        prefill_chunk: Optional[int] = None):
    """Continuous batching of a fixed list of prompts on an Engine with full_batch_size slots. Returns (new token ids
    per prompt, Emitter.stats(): the first tokens come after the first full_batch_size prompts' prefill; later
    prefills fall in decode_s)."""
    engine = Engine(backend, device, full_batch_size, prefill_chunk)
    emit = Emitter(len(prompts), max_new_tokens, stop_ids, on_token, device)
    for i, p in enumerate(prompts):
        engine.add(Request(p, partial(emit.put, i), sampling))
    while engine.busy():
        engine.step()
    return emit.out, emit.stats(sum(map(len, prompts)), engine.steps,
                                prefill_tokens=sum(map(len, prompts[:full_batch_size])))


def weight_bytes(model) -> int:
    """Bytes of weights read per decode step (tied embedding/output counted once; the KV cache excluded)."""
    seen, total = set(), 0
    skip = ("cache", "rope")  # the KV cache and the rotary tables
    for t in list(model.parameters()) + [b for n, b in model.named_buffers() if not any(s in n for s in skip)]:
        key = id(t) if t.is_mkldnn else t.data_ptr()  # (an opaque oneDNN layout: fast_cpu.PackedLinear)
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def check_vocab(tok, backend):
    vocab = getattr(backend, "vocab_size", None)
    if vocab and tok.vocab_size > vocab:
        raise ValueError(f"the tokenizer has {tok.vocab_size} tokens but the model only {vocab}: "
                         "wrong tokenizer for this model?")
