# Decoding modes beyond one token per step: speculative decoding with a draft model, and lookahead decoding.
#
# speculative_generate(target, draft, prompt_ids, ...)  (Leviathan et al. 2023; gpt-fast's speculative_decode)
#     The draft proposes k tokens one at a time; the target scores all of them in ONE forward of k + 1 tokens. Greedy:
#     the longest prefix the target agrees with is kept, plus the target's own next token, so the text is plain greedy
#     decoding of the target. Sampling: draft token d with draft probability q(d) is kept with probability
#     min(1, p(d) / q(d)); the first rejected one is replaced by a sample of norm(max(p - q, 0)); when all k are kept
#     a bonus token comes from the target's last distribution. The output is distributed exactly as the target's.
#     Any backend pair with the same vocabulary works (a quantize.py checkpoint of the target itself: self-
#     speculation). The target must return logits for every position ([1, T, V]); the draft may be any backend.
#
# lookahead_generate(backend, prompt_ids, ...)  (Fu et al. 2024, "Break the Sequential Dependency of LLM Inference
#     Using Lookahead Decoding"). No draft: each step is ONE forward of the model over
#       * the current token,
#       * the lookahead branch: a window of W columns x (N - 1) levels of guesses at future positions; level j of
#         column i sits at position p + i + j and attends to the current token, level 0 of columns 1..i and levels
#         1..j of its own column (each column is one Jacobi trajectory). The last level's outputs become a new level
#         and every column yields an n-gram (its N - 1 levels + the new output) for the pool,
#       * the verification branch: up to G n-grams from the pool whose first token is the current token, each a
#         causal chain at positions p + 1 .. p + N - 1.
#     The target's greedy token after the current one is always kept; a candidate whose tokens match the greedy
#     tokens predicted along it extends the step by up to N - 1 more tokens (lossless: plain greedy output).
#     The pool is also seeded with the n-grams of the prompt and of the accepted text (prompt_ngrams=True).
#     The speculative tokens need positions that repeat and cache slots apart from positions, and a mask that is
#     not "slot <= position": for the duration of the call each layer's KVCache is swapped for a _SlotCache (the same
#     cache plus scratch slots, written at slots chosen here; layer.attention.kv_cache is model.py's swap point) and
#     each step's mask goes to Transformer.forward(mask=...). The network is model.py's; the swap is undone on return.
#     Needs model.py's Transformer (TorchBackend.model); runs it eagerly.
#
# Both: batch 1 (one prompt); tokens kept and timed by generate.py's Emitter (its stats plus the acceptance figures);
# format_stats() for a one-line summary. Their arguments are checked once, by check_speculate_k / check_lookahead
# (generate.py calls them on the command line's values before anything loads).
# Greedy output equals plain greedy decoding up to floating-point rounding: the target scores several tokens per
# forward, whose matmuls round differently from one-token decode steps, so an exact near-tie could in principle flip.
#
# On a CPU (memory-bound decode), what pays (SmolLM2-135M, measured on a busy 2-core machine):
#   * speculative: a quantize.py checkpoint of the target as the draft, compiled (--compile; eager int4 dequantizes
#     every weight on every call and is slower than float32), and the target's k+1-token verification compiled too
#     (--compile_prefill). int8 (98% of greedy tokens agree) drafts as fast as int4 g32 (94%) here; k = 5..6.
#   * lookahead: keep the step small, since a forward of T tokens costs more than one of 1 token (about 1.6x at
#     T = 6 and 2x at T = 16 in eager float32): e.g. 5,1,2 on text that repeats (code, edits, lists), where most
#     hits come from the pool's n-grams of the prompt and of the text so far; on free prose few guesses hit.
from typing import Callable, Optional

import torch
from torch import Tensor

from generate import Emitter, logits_to_probs, prefill
from model import KVCache


# ----------------------------------------------------------------------------------------------------------- helpers
def _one_prompt(prompt_ids) -> list[int]:
    if isinstance(prompt_ids, Tensor):
        prompt_ids = prompt_ids.tolist()
    prompt_ids = list(prompt_ids)
    if prompt_ids and isinstance(prompt_ids[0], (list, tuple)):
        if len(prompt_ids) != 1:
            raise ValueError(f"{len(prompt_ids)} prompts given: speculative and lookahead decoding run one prompt at a "
                             "time (batch 1)")
        prompt_ids = list(prompt_ids[0])
    if not prompt_ids:
        raise ValueError("empty prompt: nothing to condition on")
    return [int(t) for t in prompt_ids]


def _check_int(name: str, value, minimum: int):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def check_speculate_k(k) -> None:
    _check_int("speculate_k", k, 1)


def check_lookahead(ngram, window, gcap, temperature: float = 0.0) -> None:
    """Lookahead decoding is greedy; NGRAM >= 2, WINDOW >= 1, GCAP >= 1."""
    if temperature and temperature > 0:
        raise ValueError("lookahead decoding is greedy only: use --temperature 0")
    for name, value, minimum in (("NGRAM", ngram, 2), ("WINDOW", window, 1), ("GCAP", gcap, 1)):
        _check_int(f"lookahead {name}", value, minimum)


def parse_lookahead_spec(spec: str, temperature: float = 0.0) -> tuple[int, int, int]:
    """'NGRAM,WINDOW,GCAP' (e.g. '4,5,5') -> (ngram, window, gcap), checked, with a clear error for anything else."""
    parts = [p.strip() for p in str(spec).split(",")]
    if len(parts) != 3:
        raise ValueError(f"--lookahead expects NGRAM,WINDOW,GCAP (three integers, e.g. 4,5,5), got {spec!r}")
    try:
        n, w, g = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"--lookahead expects NGRAM,WINDOW,GCAP as integers (e.g. 4,5,5), got {spec!r}") from None
    check_lookahead(n, w, g, temperature)
    return n, w, g


def format_stats(stats: dict) -> str:
    """One line with the acceptance figures of speculative_generate / lookahead_generate."""
    if stats.get("mode") == "speculative":
        hist = " ".join(f"{n}:{c}" for n, c in enumerate(stats["accepted_hist"]))
        return (f"speculative k={stats['k']}: acceptance rate {stats['acceptance_rate']:.1%} "
                f"({stats['accepted']}/{stats['proposed']} draft tokens) | mean accepted per step "
                f"{stats['mean_accepted']:.2f} | {stats['tokens_per_step']:.2f} tokens per target forward | "
                f"accepted-per-step histogram {hist}")
    hist = " ".join(f"{n}:{c}" for n, c in enumerate(stats["accepted_hist"]) if c)
    return (f"lookahead N={stats['ngram']} W={stats['window']} G={stats['gcap']}: mean accepted per step "
            f"{stats['mean_accepted']:.2f} tokens ({stats['new_tokens']} tokens in {stats['steps']} forwards) | "
            f"{stats['steps_with_hit']} steps used a pool n-gram | pool {stats['pool_ngrams']} n-grams | "
            f"tokens-per-step histogram {hist}")


# ----------------------------------------------------------------------------------------------------------- speculative
def _check_full_logits(backend, name):
    if getattr(backend, "prefill_chunk", None):
        raise ValueError(f"the {name} backend runs fixed-size chunks and returns only last-position logits; "
                         "speculative verification needs logits for every position (use the PyTorch backend)")


@torch.no_grad()
def speculative_generate(target_backend, draft_backend, prompt_ids, max_new_tokens: int, device, k: int,
                         temperature: float = 0.0, top_k: Optional[int] = None, top_p: Optional[float] = None,
                         stop_ids=(), generator: Optional[torch.Generator] = None,
                         on_token: Optional[Callable[[int, int], None]] = None):
    """Speculative decoding of one prompt (batch 1). Returns (new token ids, stats).

    target_backend / draft_backend follow generate.py's backend protocol; the target must return [1, T, V] logits.
    temperature 0: the output is the target's greedy output. Otherwise the standard accept / resample rule on
    logits_to_probs(temperature, top_k, top_p) of both models keeps the target's distribution. on_token(0, token)
    streams the kept tokens. stats: accepted_hist[n] = verification steps that kept n draft tokens, mean_accepted,
    acceptance_rate (kept / proposed draft tokens), tokens_per_step (new tokens per target forward), timings."""
    check_speculate_k(k)
    _check_int("max_new_tokens", max_new_tokens, 0)
    prompt = _one_prompt(prompt_ids)
    _check_full_logits(target_backend, "target")
    vt, vd = getattr(target_backend, "vocab_size", None), getattr(draft_backend, "vocab_size", None)
    if vt and vd and vt != vd:
        raise ValueError(f"the draft model's vocabulary ({vd} tokens) differs from the target's ({vt}): "
                         "speculative decoding needs a draft with the same tokenizer")
    for b in (target_backend, draft_backend):
        if getattr(b, "max_batch_size", 1) < 1:
            raise ValueError("backend holds no sequence")
    L = len(prompt)
    S = min(target_backend.max_seq_length, draft_backend.max_seq_length)
    if L >= S:
        raise ValueError(f"prompt of {L} tokens does not fit the context of {S} tokens")
    max_new_tokens = min(max_new_tokens, S - L)
    greedy = temperature <= 0
    draft_one_by_one = bool(getattr(draft_backend, "prefill_chunk", None)) or \
        getattr(draft_backend, "decode_fn", None) is not getattr(draft_backend, "prefill_fn", None)

    def probs(logits):  # [n, V] -> [n, V] on the CPU (sampling is done there, with the seeded generator)
        return logits_to_probs(logits.float().cpu(), temperature, top_k, top_p)

    def draw(p):  # p [V] -> int
        return int(torch.multinomial(p, 1, generator=generator))

    def draft_feed(tokens: list[int], start: int) -> Tensor:  # the draft's logits [V] after the last of tokens
        if len(tokens) == 1 or draft_one_by_one:
            for i, t in enumerate(tokens):
                logits = draft_backend.forward(torch.tensor([[t]], device=device),
                                               torch.tensor([start + i], device=device))
            return logits[0, -1]
        logits = draft_backend.forward(torch.tensor([tokens], device=device),
                                       torch.arange(start, start + len(tokens), device=device))
        return logits[0, -1]

    stats = dict(mode="speculative", k=k, accepted_hist=[0] * (k + 1), proposed=0, accepted=0, rounds=0,
                 draft_forwards=0)
    emit = Emitter(1, max_new_tokens, stop_ids, on_token, device)
    logits = prefill(target_backend, [prompt], device, chunk=target_backend.prefill_chunk)[0]
    vt = logits.shape[-1]
    first = int(logits.argmax()) if greedy else draw(probs(logits[None])[0])
    dlogits = prefill(draft_backend, [prompt], device, chunk=getattr(draft_backend, "prefill_chunk", None))
    if dlogits.shape[-1] != vt:
        raise ValueError(f"the draft model's vocabulary ({dlogits.shape[-1]} tokens) differs from the target's "
                         f"({vt}): speculative decoding needs a draft with the same tokenizer")
    seq = prompt + [first]          # everything so far; seq[-1] is in neither cache yet
    draft_valid = L                 # draft cache holds seq[:draft_valid]
    emit.put(0, [first])
    while not emit.done[0]:
        pos = len(seq) - 1          # position of the current token
        remaining = max_new_tokens - len(emit.out[0])
        kk = min(k, remaining - 1, S - 1 - pos)
        drafts, qs = [], []
        if kk > 0:
            dl = draft_feed(seq[draft_valid:], draft_valid)
            stats["draft_forwards"] += len(seq) - draft_valid if draft_one_by_one else 1
            for i in range(kk):
                if i:
                    dl = draft_feed([drafts[-1]], pos + i)
                    stats["draft_forwards"] += 1
                if greedy:
                    drafts.append(int(dl.argmax()))
                else:
                    q = probs(dl[None])[0]
                    qs.append(q)
                    drafts.append(draw(q))
        T = kk + 1
        tl = target_backend.forward(torch.tensor([[seq[-1]] + drafts], device=device),
                                    torch.arange(pos, pos + T, device=device))
        if tl.shape[1] != T:
            raise ValueError(f"the target backend returned logits for {tl.shape[1]} of {T} positions; speculative "
                             "verification needs logits for every position (use the PyTorch backend)")
        tl = tl[0]
        stats["rounds"] += 1
        n = 0
        if greedy:
            target_ids = tl.argmax(-1).tolist()
            while n < kk and target_ids[n] == drafts[n]:
                n += 1
            last = target_ids[n]
        else:
            ps = probs(tl)
            u = torch.rand(kk, generator=generator).tolist()
            last = None
            while n < kk:
                d, p, q = drafts[n], ps[n], qs[n]
                if u[n] * float(q[d]) < float(p[d]):  # u < p(d) / q(d), without dividing
                    n += 1
                    continue
                resid = (p - q).clamp_min(0)
                last = draw(resid / resid.sum()) if float(resid.sum()) > 0 else draw(p)
                break
            if last is None:
                last = draw(ps[kk])
        stats["proposed"] += kk
        stats["accepted"] += n
        stats["accepted_hist"][n] += 1
        new = drafts[:n] + [last]
        emit.put(0, new)
        seq += new
        if kk > 0:  # the draft saw seq[pos] and drafts[:kk-1]; those that were kept stay valid
            draft_valid = pos + 1 + min(n, kk - 1)
    stats.update(emit.stats(L, stats["rounds"]))
    r = max(stats["rounds"], 1)
    stats.update(mean_accepted=stats["accepted"] / r, acceptance_rate=stats["accepted"] / max(stats["proposed"], 1),
                 tokens_per_step=max(stats["new_tokens"] - 1, 0) / r)
    return emit.out[0], stats


# ----------------------------------------------------------------------------------------------------------- lookahead
class _SlotCache(KVCache):
    """model.KVCache with R scratch slots after the S regular ones. While `slots` is set, update() writes the call's
    keys/values at those slots instead of at input_pos (which the model still uses for the rotary embedding)."""

    def __init__(self, like: KVCache, scratch: int):
        B, H, S, D = like.k_cache.shape
        super().__init__(B, S + scratch, H, D, like.k_cache.dtype)
        self.to(like.k_cache.device)
        self.slots: Optional[Tensor] = None

    def update(self, input_pos, k, v, batch_index=None):
        return super().update(self.slots if self.slots is not None else input_pos, k, v, batch_index)

    def move(self, src: Tensor, dst: Tensor):
        """Copy the keys/values at slots src to slots dst (commit accepted speculative tokens)."""
        for c in (self.k_cache, self.v_cache):
            c.index_copy_(2, dst, c.index_select(2, src))


class _Lookahead:
    """Swaps model.py's caches for _SlotCache for the duration of a `with` block; runs the model with our masks.
    prefill() runs the prompt; step() runs one lookahead step (current token + lookahead + verification branches)."""

    def __init__(self, model, window: int, scratch: int):
        self.model, self.W, self.scratch = model, window, scratch
        self.S = model.max_seq_length
        self.device = model.norm.weight.device
        self.layouts = {}

    def __enter__(self):
        m = self.model
        self.orig = [layer.attention.kv_cache for layer in m.layers]
        self.caches = [_SlotCache(c, self.scratch) for c in self.orig]
        for layer, c in zip(m.layers, self.caches):
            layer.attention.kv_cache = c
        return self

    def __exit__(self, *exc):
        for layer, c in zip(self.model.layers, self.orig):
            layer.attention.kv_cache = c

    def run(self, tokens: list[int], rope_pos: Tensor, slots: Optional[Tensor], mask: Tensor) -> Tensor:
        for c in self.caches:
            c.slots = slots
        try:
            return self.model(torch.tensor([tokens], device=self.device), rope_pos,
                              mask=mask.view(1, 1, *mask.shape))[0]
        finally:
            for c in self.caches:
                c.slots = None

    def prefill(self, prompt: list[int], start_pos: int = 0) -> Tensor:
        """Causal forward of the prompt at positions start_pos.. (its own cache slots); logits [L, V]."""
        L, S = len(prompt), self.S
        pos = torch.arange(start_pos, start_pos + L, device=self.device)
        mask = torch.cat([torch.arange(S, device=self.device).view(1, S) <= pos.view(L, 1),
                          torch.zeros(L, self.scratch, dtype=torch.bool, device=self.device)], 1)
        return self.run(prompt, pos, None, mask)

    def step(self, cur: int, p: int, levels: list[list[int]], cands: list[tuple]):
        """One forward: cur at position p (cache slot p), the lookahead levels, the candidate n-grams (scratch slots).
        Returns (logits [T, V], tokens, {(level, column): index}, [[index of each candidate token]])."""
        W, S = self.W, self.S
        key = (len(levels), tuple(len(c) for c in cands))
        if key not in self.layouts:
            offs, anc, idx, cidx = _step_layout(W, len(levels), key[1])
            self.layouts[key] = (offs.to(self.device), anc.to(self.device), idx, cidx)
        offs, anc, idx, cidx = self.layouts[key]
        T = offs.numel()
        tokens = [cur] + [levels[0][i] for i in range(1, W)]
        for j in range(1, len(levels)):
            tokens += levels[j]
        for c in cands:
            tokens += list(c)
        rope = (offs + p).clamp_(max=S - 1)  # lookahead guesses past the context end: any position will do
        slots = torch.cat([torch.tensor([p], device=self.device), S + torch.arange(T - 1, device=self.device)])
        mask = torch.zeros(T, S + self.scratch, dtype=torch.bool, device=self.device)
        mask[:, :p + 1] = True
        mask[:, S:S + T - 1] = anc
        return self.run(tokens, rope, slots, mask), tokens, idx, cidx

    def commit(self, token_indices: list[int], p: int):
        """The step's tokens at these indices (scratch) become the cache entries of positions p+1, p+2, ..."""
        src = torch.tensor(token_indices, device=self.device) + (self.S - 1)
        dst = torch.arange(p + 1, p + 1 + len(token_indices), device=self.device)
        for c in self.caches:
            c.move(src, dst)


def _step_layout(W: int, levels: int, cand_lens: tuple[int, ...]):
    """Relative layout of one lookahead step. Token 0 is the current token (position p, its own cache slot p);
    then level 0 columns 1..W-1, levels 1..levels-1 columns 0..W-1, then the candidates. Returns
    (position offsets [T], scratch ancestor matrix [T, T-1] bool (token t may attend scratch slot s), index of
    (level, column) -> token index, list of per-candidate token index lists)."""
    idx = {(0, 0): 0}
    offs, parents = [0], [[]]  # parents: the scratch tokens (indices >= 1) each token attends to, itself included
    for i in range(1, W):
        idx[(0, i)] = len(offs)
        offs.append(i)
        parents.append(list(range(1, len(offs))))  # level 0 columns 1..i
    for j in range(1, levels):
        for i in range(W):
            t = len(offs)
            idx[(j, i)] = t
            offs.append(i + j)
            own = [idx[(jj, i)] for jj in range(1, j)] + [t]
            parents.append(list(range(1, i + 1)) + own)
    cands = []
    for n in cand_lens:
        ids = []
        for m in range(1, n + 1):
            t = len(offs)
            ids.append(t)
            offs.append(m)
            parents.append(list(ids))
        cands.append(ids)
    T = len(offs)
    anc = torch.zeros(T, max(T - 1, 0), dtype=torch.bool)
    for t, ps in enumerate(parents):
        for s in ps:
            anc[t, s - 1] = True
    return torch.tensor(offs), anc, idx, cands


@torch.no_grad()
def lookahead_generate(backend, prompt_ids, max_new_tokens: int, device, ngram: int, window: int, gcap: int,
                       stop_ids=(), on_token: Optional[Callable[[int, int], None]] = None, temperature: float = 0.0,
                       prompt_ngrams: bool = True, seed: int = 0):
    """Lookahead decoding of one prompt (batch 1), greedy, lossless. Returns (new token ids, stats).

    ngram N >= 2 (n-gram size: a step keeps up to N tokens), window W >= 1 (lookahead columns), gcap G >= 1 (n-grams
    kept per first token, and verified per step). backend: a TorchBackend (needs .model, model.py's Transformer).
    prompt_ngrams also seeds the pool with the prompt's and the accepted text's n-grams. seed: the initial guesses.
    stats: mean_accepted (tokens per forward), accepted_hist[n] = steps that kept n tokens, steps_with_hit, timings."""
    check_lookahead(ngram, window, gcap, temperature)
    _check_int("max_new_tokens", max_new_tokens, 0)
    prompt = _one_prompt(prompt_ids)
    model = getattr(backend, "model", None)
    if model is None or not hasattr(model, "layers") or getattr(model.layers[0].attention, "kv_cache", None) is None:
        raise ValueError("lookahead decoding needs the PyTorch backend (model.py's Transformer with its caches set "
                         "up): exported graphs cannot take its attention masks")
    N, W, G = ngram, window, gcap
    S = model.max_seq_length
    L = len(prompt)
    if L >= S:
        raise ValueError(f"prompt of {L} tokens does not fit the context of {S} tokens")
    max_new_tokens = min(max_new_tokens, S - L)
    scratch = (W - 1) + W * (N - 2) + G * (N - 1)
    pool: dict[int, list[tuple]] = {}

    def add_ngram(gram):
        lst = pool.setdefault(gram[0], [])
        tail = tuple(gram[1:])
        if tail in lst:
            lst.remove(tail)  # move to the back: most recently seen survive the cap
        lst.append(tail)
        if len(lst) > G:
            del lst[0]

    if prompt_ngrams:
        for i in range(L - N + 1):
            add_ngram(prompt[i:i + N])
    gen = torch.Generator().manual_seed(seed)
    # level 0 starts as tokens drawn from the prompt; levels 1..N-2 are filled by the first N-2 steps (warm-up)
    levels = [[prompt[int(i)] for i in torch.randint(0, L, (W,), generator=gen)]]
    stats = dict(mode="lookahead", ngram=N, window=W, gcap=G, accepted_hist=[0] * (N + 1), steps=0,
                 steps_with_hit=0)
    with _Lookahead(model, W, scratch) as la, torch.inference_mode():
        emit = Emitter(1, max_new_tokens, stop_ids, on_token, device)
        cur = int(la.prefill(prompt)[-1].argmax())
        seq = prompt + [cur]
        emit.put(0, [cur])
        while not emit.done[0]:
            p = len(seq) - 1
            remaining = max_new_tokens - len(emit.out[0])
            depth = min(N - 1, remaining - 1, S - 1 - p)  # candidate tokens that can still be used
            cands = [c[:depth] for c in pool.get(cur, [])[-G:]] if depth > 0 else []
            logits, _, idx, cidx = la.step(cur, p, levels, cands)
            nxt = logits.argmax(-1).tolist()
            stats["steps"] += 1
            # verification: the greedy token after cur, then along any candidate that keeps matching
            accepted = [nxt[0]]
            chosen, active = None, list(range(len(cands)))
            for m in range(depth):
                active = [c for c in active if cands[c][m] == accepted[-1]]
                if not active:
                    break
                chosen = active[0]
                accepted.append(nxt[cidx[chosen][m]])
            v = len(accepted)
            if v > 1:
                stats["steps_with_hit"] += 1
                la.commit(cidx[chosen][:v - 1], p)
            stats["accepted_hist"][v] += 1
            # lookahead branch: the last level's outputs are the next guesses; every column yields an n-gram
            last = len(levels) - 1
            outs = [nxt[idx[(last, i)]] for i in range(W)]
            if len(levels) < N - 1:
                levels.append(outs)
            else:
                for i in range(W):
                    add_ngram([levels[j][i] for j in range(N - 1)] + [outs[i]])
                levels = levels[1:] + [outs]
            emit.put(0, accepted)
            seq += accepted
            if prompt_ngrams:
                for e in range(max(len(seq) - v + 1, N), len(seq) + 1):
                    add_ngram(seq[e - N:e])
            cur = seq[-1]
        stats.update(emit.stats(L, stats["steps"]))
    stats.update(mean_accepted=max(stats["new_tokens"] - 1, 0) / max(stats["steps"], 1),
                 pool_ngrams=sum(len(v) for v in pool.values()))
    return emit.out[0], stats
