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
#     The speculative tokens need positions that repeat and a mask that is not "slot <= position": the lookahead
#     contract is one call forward_masked(tokens [1, T], input_pos [T], mask [1, 1, T, S] additive float) -> logits
#     [1, T, V], where token k writes cache slot input_pos[0] + k (StepCache, at model.py's kv_cache swap point) and
#     attends as the mask says (Transformer.forward(mask=...)). A step's call is seq[committed:] (the tokens a
#     candidate got accepted with last step are fed again: their keys/values sat in scratch slots) then the
#     current token, the levels and the candidates; the same call with a causal mask is the prompt and plain decode.
#     TorchBackend runs it (eager or --compile); et_export.py / aoti_export.py --lookahead export it as the
#     `lookahead` program that runner-common/lookahead.h (the same algorithm in C++) and generate.py's --pte /
#     --aoti_package backends call. The network is model.py's; the swap is undone after each call.
#
# Both: batch 1 (one prompt); tokens kept and timed by engine.py's Emitter (its stats plus the acceptance figures);
# format_stats() for a one-line summary. Their arguments are checked once, by check_speculate_k / check_lookahead
# (generate.py calls them on the command line's values before anything loads).
# Greedy output equals plain greedy decoding up to floating-point rounding: the target scores several tokens per
# forward, whose matmuls round differently from one-token decode steps, so an exact near-tie could in principle flip.
#
# On a CPU (memory-bound decode), what pays (SmolLM2-135M, measured on a busy 2-core machine):
#   * speculative: a quantize.py checkpoint of the target as the draft, compiled (--compile, which compiles the
#     target's k+1-token verification too; eager int4 dequantizes every weight on every call and is slower than
#     float32). int8 (98% of greedy tokens agree) drafts as fast as int4 g32 (94%) here; k = 5..6.
#   * lookahead: keep the step small, since a forward of T tokens costs more than one of 1 token (about 1.6x at
#     T = 6 and 2x at T = 16 in eager float32): e.g. 5,1,2 on text that repeats (code, edits, lists), where most
#     hits come from the pool's n-grams of the prompt and of the text so far; on free prose few guesses hit.
from typing import Callable, Optional

import torch
from torch import Tensor

from engine import GREEDY, Emitter, Sampling, StepCache, prefill, step_caches  # noqa: F401


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
                         sampling: Sampling = GREEDY, stop_ids=(), on_token: Optional[Callable[[int, int], None]] = None):
    """Speculative decoding of one prompt (batch 1). Returns (new token ids, stats).

    target_backend / draft_backend follow engine.py's backend protocol; the target must return [1, T, V] logits.
    Greedy sampling: the output is the target's greedy output. Otherwise the standard accept / resample rule on
    sampling.probs() of both models keeps the target's distribution. on_token(0, token)
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
    greedy = sampling.greedy
    draft_one_by_one = bool(getattr(draft_backend, "prefill_chunk", None)) or \
        getattr(draft_backend, "decode_fn", None) is not getattr(draft_backend, "prefill_fn", None)

    def probs(logits):  # [n, V] -> [n, V] on the CPU (sampling is done there, with the seeded generator)
        return sampling.probs(logits.float().cpu())

    def draw(p):  # p [V] -> int
        return int(torch.multinomial(p, 1, generator=sampling.generator))

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
            u = torch.rand(kk, generator=sampling.generator).tolist()
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
def check_step_contract(config) -> None:
    """The lookahead contract puts a step's guesses in cache slots that are not their positions; a model whose
    attention depends on the key's position beyond its rotary embedding (ALiBi: MPT) cannot take them."""
    if config is not None and getattr(config, "alibi", False):
        raise ValueError("lookahead decoding needs keys whose position is in the rotary embedding: ALiBi models (MPT) "
                         "bias the scores by cache slot, so they cannot run the lookahead program")


def causal_mask(positions, S: int) -> Tensor:
    """The additive mask [1, 1, T, S] of ordinary causal calls (slot j visible to a query at position p iff j <= p)."""
    pos = torch.as_tensor(positions).view(-1, 1)
    allowed = torch.arange(S).view(1, S) <= pos
    return additive(allowed)


def additive(allowed: Tensor) -> Tensor:
    """bool [T, S] (True = may attend) -> the lookahead program's float32 mask [1, 1, T, S] (0 / -inf)."""
    return torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf")).view(1, 1, *allowed.shape)


def _step_layout(W: int, levels: int, cand_lens: tuple[int, ...]):
    """Relative layout of one lookahead step after the current token (index 0, position p): level 0 columns 1..W-1,
    levels 1..levels-1 columns 0..W-1 (level j column i is index j*W + i), then the candidates. Returns (position
    offsets [T'], ancestor matrix [T', T'-1] bool (token t attends to the step's token s + 1), {(level, column):
    index}, [per-candidate index lists])."""
    idx = {(0, 0): 0}
    offs, parents = [0], [[]]
    for i in range(1, W):
        idx[(0, i)] = len(offs)
        offs.append(i)
        parents.append(list(range(1, len(offs))))  # level 0 columns 1..i
    for j in range(1, levels):
        for i in range(W):
            t = len(offs)
            idx[(j, i)] = t
            offs.append(i + j)
            parents.append(list(range(1, i + 1)) + [idx[(jj, i)] for jj in range(1, j)] + [t])
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


def step_inputs(seq: list[int], committed: int, levels: list[list[int]], cands: list[tuple], S: int):
    """One lookahead step's call of the lookahead contract. seq: the text so far (its last token, the current one,
    is not in the cache); committed: tokens whose keys/values are in the cache (slots = positions 0..committed-1).
    The call holds seq[committed:] (tokens accepted last step from a candidate, whose keys/values sat in that
    step's scratch slots, are fed again: r of them, a causal chain), then the step layout; token k writes cache slot
    committed + k. Returns (tokens, positions, allowed [T, S] bool, r, {(level, column): index}, [candidate index
    lists]) with indices relative to the current token (add r for the row of the logits); None when the call would
    not fit the cache."""
    p = len(seq) - 1
    r = p - committed
    offs, anc, idx, cidx = _step_layout(len(levels[0]), len(levels), tuple(len(c) for c in cands))
    T = r + len(offs)
    if committed + T > S:
        return None
    tokens = seq[committed:] + [levels[0][i] for i in range(1, len(levels[0]))]
    for lv in levels[1:]:
        tokens += lv
    for c in cands:
        tokens += list(c)
    positions = list(range(committed, p)) + (offs + p).tolist()
    allowed = torch.zeros(T, S, dtype=torch.bool)
    allowed[:, :committed] = True
    for i in range(r + 1):  # the fed-again tokens and the current one: causal over their own slots
        allowed[i, committed:committed + i + 1] = True
    allowed[r + 1:, committed:p + 1] = True
    allowed[r:, p + 1:p + len(offs)] = anc
    return tokens, positions, allowed, r, idx, cidx


@torch.no_grad()
def lookahead_generate(backend, prompt_ids, max_new_tokens: int, device, ngram: int, window: int, gcap: int,
                       stop_ids=(), on_token: Optional[Callable[[int, int], None]] = None,
                       sampling: Sampling = GREEDY, prompt_ngrams: bool = True):
    """Lookahead decoding of one prompt (batch 1), greedy, lossless. Returns (new token ids, stats).

    ngram N >= 2 (n-gram size: a step keeps up to N tokens), window W >= 1 (lookahead columns), gcap G >= 1 (n-grams
    kept per first token, and verified per step). backend: anything with forward_masked(tokens [1, T], input_pos [T],
    mask [1, 1, T, S]) -> logits [1, T, V] (the lookahead contract: TorchBackend, eager or compiled; a .pte / .pt2
    exported with --lookahead). prompt_ngrams also seeds the pool with the prompt's and the accepted text's n-grams.
    The first guesses are the prompt's last W tokens (runner-common/lookahead.h does the same, so both take the same
    steps). stats: mean_accepted (tokens per forward), accepted_hist[n] = steps that kept n tokens, steps_with_hit."""
    check_lookahead(ngram, window, gcap, sampling.temperature)
    _check_int("max_new_tokens", max_new_tokens, 0)
    prompt = _one_prompt(prompt_ids)
    masked = getattr(backend, "forward_masked", None)
    if masked is None or not getattr(backend, "has_masked", True):
        raise ValueError("lookahead decoding needs a program that takes an attention mask: model.py (eager or "
                         "--compile), or a .pte / .pt2 exported with --lookahead")
    check_step_contract(getattr(getattr(backend, "model", None), "config", None))
    N, W, G = ngram, window, gcap
    S = backend.max_seq_length
    L = len(prompt)
    if L >= S:
        raise ValueError(f"prompt of {L} tokens does not fit the context of {S} tokens")
    max_new_tokens = min(max_new_tokens, S - L)
    pool: dict[int, list[tuple]] = {}

    def add_ngram(gram):
        lst = pool.setdefault(gram[0], [])
        tail = tuple(gram[1:])
        if tail in lst:
            lst.remove(tail)  # move to the back: most recently seen survive the cap
        lst.append(tail)
        if len(lst) > G:
            del lst[0]

    def forward(tokens, positions, allowed):
        out = masked(torch.tensor([tokens], device=device), torch.tensor(positions, device=device),
                     additive(allowed).to(device))
        return out[0]

    if prompt_ngrams:
        for i in range(L - N + 1):
            add_ngram(prompt[i:i + N])
    # level 0 starts as the prompt's last W tokens; levels 1..N-2 are filled by the first N-2 steps (warm-up)
    levels = [[prompt[(L - W + i) % L] for i in range(W)]]
    stats = dict(mode="lookahead", ngram=N, window=W, gcap=G, accepted_hist=[0] * (N + 1), steps=0,
                 steps_with_hit=0)
    emit = Emitter(1, max_new_tokens, stop_ids, on_token, device)
    cur = int(forward(prompt, list(range(L)), causal_mask(range(L), S)[0, 0] == 0)[-1].argmax())
    seq, committed = prompt + [cur], L
    emit.put(0, [cur])
    while not emit.done[0]:
        p = len(seq) - 1
        depth = min(N - 1, max_new_tokens - len(emit.out[0]) - 1)  # candidate tokens that can still be used
        cands = [c[:depth] for c in pool.get(cur, [])[-G:]] if depth > 0 else []
        call = step_inputs(seq, committed, levels, cands, S)
        stats["steps"] += 1
        if call is None:  # near the context end there is no room for the guesses: a plain step
            pos = list(range(committed, p + 1))
            accepted = [int(forward(seq[committed:], pos, causal_mask(pos, S)[0, 0] == 0)[-1].argmax())]
        else:
            tokens, positions, allowed, r, idx, cidx = call
            nxt = forward(tokens, positions, allowed)[r:].argmax(-1).tolist()
            # verification: the greedy token after cur, then along any candidate that keeps matching
            accepted = [nxt[0]]
            active = list(range(len(cands)))
            for m in range(depth):
                active = [c for c in active if cands[c][m] == accepted[-1]]
                if not active:
                    break
                accepted.append(nxt[cidx[active[0]][m]])
            # lookahead branch: the last level's outputs are the next guesses; every column yields an n-gram
            outs = [nxt[idx[(len(levels) - 1, i)]] for i in range(W)]
            if len(levels) < N - 1:
                levels.append(outs)
            else:
                for i in range(W):
                    add_ngram([levels[j][i] for j in range(N - 1)] + [outs[i]])
                levels = levels[1:] + [outs]
        v = len(accepted)
        stats["steps_with_hit"] += v > 1
        stats["accepted_hist"][v] += 1
        committed = p + 1  # the fed-again tokens and cur are in the cache now; accepted candidates come next step
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
