# speculative.py: speculative decoding. Greedy output == plain greedy (several k, drafts that agree fully, partly,
# hardly, a quantized draft); sampling keeps the target's distribution (exact enumeration on a tiny vocabulary);
# stop ids / length limits / streaming; clear errors for bad combinations; the generate.py flags once wired in.
import copy
import math

import pytest
import torch
from conftest import assert_clean_error, hf_to_model, run_cli, tiny_hf

import engine
import speculative as SP
from checkpoint import checkpoint_state, save_checkpoint
from quantize import load_model

def backend(model, seq=160):
    return engine.TorchBackend(model, 1, seq)


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread


@pytest.fixture(scope="module")
def models():
    """A target, a noisy copy of it (agrees often, not always), an unrelated smaller model, an exact twin."""
    hf = tiny_hf("llama", seed=3, vocab_size=96)
    target = hf_to_model(hf)
    noisy = copy.deepcopy(target)
    g = torch.Generator().manual_seed(0)
    for p in noisy.parameters():
        p.add_(torch.randn(p.shape, generator=g) * 0.02)
    other = hf_to_model(tiny_hf("llama", seed=4, vocab_size=96, num_hidden_layers=1, hidden_size=32,
                                intermediate_size=64))
    return dict(target=target, noisy=noisy, other=other, twin=hf_to_model(hf))


PROMPTS = [[1, 5, 9, 3, 7], [42], list(range(10, 40, 3))]


@pytest.mark.parametrize("draft", ["noisy", "other", "twin"])
def test_greedy_equals_plain_greedy(models, cpu, draft):
    tb, db = backend(models["target"]), backend(models[draft])
    rates = []
    for i, prompt in enumerate(PROMPTS):
        want, _ = engine.generate(tb, [prompt], 32, cpu)
        for k in ((1, 4), (2, 6), (3, 8))[i]:
            got, st = SP.speculative_generate(tb, db, prompt, 32, cpu, k)
            assert got == want[0], (prompt, k)
            assert sum(st["accepted_hist"]) == st["rounds"] and len(st["accepted_hist"]) == k + 1
            assert st["accepted"] == sum(n * c for n, c in enumerate(st["accepted_hist"]))
            assert st["new_tokens"] == 32 and "decode_tok_s" in st
            rates.append(st["acceptance_rate"])
    if draft == "twin":  # the same weights: every draft token is kept, k + 1 tokens per target forward
        assert all(r == 1.0 for r in rates)
    elif draft == "noisy":  # exercises both the accept and the reject path
        assert 0.1 < sum(rates) / len(rates) < 0.99


def test_draft_sharing_the_target_backend(models, cpu):
    tb = backend(models["target"])
    want, _ = engine.generate(tb, [PROMPTS[0]], 30, cpu)
    got, st = SP.speculative_generate(tb, tb, PROMPTS[0], 30, cpu, 4)
    assert got == want[0] and st["acceptance_rate"] == 1.0
    assert st["tokens_per_step"] > 4  # k + 1 per forward, but for the shorter last round


def test_quantized_draft_checkpoint(models, cpu, tmp_path):
    quantize = pytest.importorskip("quantize")
    q = copy.deepcopy(models["target"])
    recipe = quantize.quantize_model(q, "int4", 32, log=False)
    save_checkpoint(checkpoint_state(q, quantization=recipe), tmp_path / "model_int4.g32.pth")
    draft = load_model(tmp_path / "model_int4.g32.pth")
    tb, db = backend(models["target"]), backend(draft)
    for prompt in PROMPTS:
        want, _ = engine.generate(tb, [prompt], 30, cpu)
        got, st = SP.speculative_generate(tb, db, prompt, 30, cpu, 4)
        assert got == want[0]
        assert st["accepted"] > 0


def test_stop_ids_limits_and_streaming(models, cpu):
    tb, db = backend(models["target"], 48), backend(models["noisy"], 48)
    prompt = PROMPTS[2]
    want, _ = engine.generate(tb, [prompt], 40, cpu)
    stop = want[0][17]
    want_stop, _ = engine.generate(tb, [prompt], 40, cpu, stop_ids=[stop])
    streamed = []
    got, _ = SP.speculative_generate(tb, db, prompt, 40, cpu, 5, stop_ids=[stop],
                                     on_token=lambda b, t: streamed.append((b, t)))
    assert got == want_stop[0] and streamed == [(0, t) for t in got] and stop not in got
    for n in (0, 1, 2, 7):
        got, _ = SP.speculative_generate(tb, db, prompt, n, cpu, 4)
        assert got == want[0][:n]
    # the context (48) ends before max_new_tokens: same truncation as plain decoding
    long_want, _ = engine.generate(tb, [prompt], 100, cpu)
    got, _ = SP.speculative_generate(tb, db, prompt, 100, cpu, 6)
    assert got == long_want[0] and len(got) == 48 - len(prompt)
    assert SP.speculative_generate(tb, db, [[1, 2, 3]], 5, cpu, 2)[0] == engine.generate(tb, [[1, 2, 3]], 5, cpu)[0][0]


def _chi2_critical(df: int, z: float = 3.29) -> float:
    """Upper critical value of chi-square (Wilson-Hilferty), z = 3.29 -> p about 5e-4."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


class TableBackend:
    """A backend-protocol "model" cheap enough for thousands of runs: the logits at position t are
    table[token at t-1, token at t]. Tokens are kept per position like a KV cache (written at input_pos, read only
    below the query), so stale speculative entries must be handled exactly as with the real cache."""

    prefill_chunk = None
    max_batch_size = 1

    def __init__(self, V, seed, scale=1.5, like=None, max_seq_length=32):
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(V, V, V, generator=g) * scale
        if like is not None:  # a draft that resembles the target
            self.table = like.table + self.table
        self.vocab_size, self.max_seq_length = V, max_seq_length
        self.hist = torch.zeros(max_seq_length, dtype=torch.long)

    def forward(self, tokens, input_pos):
        self.hist[input_pos] = tokens[0]
        prev = torch.where(input_pos > 0, self.hist[(input_pos - 1).clamp(min=0)], 0)
        return self.table[prev, tokens[0]][None]

    def exact_joint(self, prompt, temperature, top_k, top_p):
        """P(t1, t2, t3, t4) of sampling four tokens after the prompt, by enumeration."""
        probs = engine.Sampling(temperature, top_k, top_p).probs
        p1 = probs(self.table[prompt[-2], prompt[-1]])              # [a]
        p2 = probs(self.table[prompt[-1]])                          # [a, b]
        p3 = probs(self.table)                                      # [x, y, next]
        return (p1[:, None, None, None] * p2[:, :, None, None] * p3[:, :, :, None] * p3[None])


@pytest.mark.parametrize("temperature,top_k,top_p,runs", [(1.0, None, None, 4000), (0.8, 5, 0.9, 3000)])
def test_sampling_keeps_the_target_distribution(cpu, temperature, top_k, top_p, runs):
    V = 8
    target = TableBackend(V, seed=1)
    draft = TableBackend(V, seed=2, scale=1.0, like=target)
    prompt = [3, 1, 4, 1, 5]
    exact = target.exact_joint(prompt, temperature, top_k, top_p)
    exact_draft = draft.exact_joint(prompt, temperature, top_k, top_p)
    counts = torch.zeros(V, V, V, V)
    hist = [0, 0, 0]
    for i in range(runs):
        # k = 2: the first token from the target's prefill, then a round drafting 2 that yields t2 (draft kept or
        # resampled), t3 (likewise) and t4 (the bonus token when both were kept, else from the next round)
        sampling = engine.Sampling(temperature, top_k, top_p, torch.Generator().manual_seed(i))
        out, st = SP.speculative_generate(target, draft, prompt, 4, cpu, 2, sampling)
        counts[tuple(out)] += 1
        hist = [a + b for a, b in zip(hist, st["accepted_hist"])]
    assert min(hist) > runs / 20, hist  # rejected first, rejected second, both kept (bonus): all ran many times
    # the tokens the rule produced, marginalised over the others: pairs and single tokens
    for name, dims in [("t2,t3", (0, 3)), ("t3,t4", (0, 1)), ("t2", (0, 2, 3)), ("t3", (0, 1, 3)),
                       ("t4", (0, 1, 2)), ("t1,t2", (2, 3))]:
        emp, ref, ref_draft = (x.sum(dims).flatten() for x in (counts, exact, exact_draft))
        assert emp[ref == 0].sum() == 0, f"{name}: tokens the target can never produce"
        keep = ref * runs >= 5  # chi-square wants expected counts >= 5; the rest is pooled into one bin
        pool = lambda x: torch.cat([x[keep], x[~keep].sum().view(1)])
        e, o, ed = pool(ref * runs), pool(emp), pool(ref_draft * runs)
        o, ed, e = o[e > 0], ed[e > 0], e[e > 0]
        chi2 = float(((o - e) ** 2 / e).sum())
        crit = _chi2_critical(len(e) - 1)
        assert chi2 < crit, f"{name}: chi2 {chi2:.1f} >= {crit:.1f} ({len(e) - 1} dof)"
        # power: the same counts judged against the draft's distribution fail by far
        chi2_draft = float(((o - ed) ** 2 / ed.clamp_min(1e-3)).sum())
        assert chi2_draft > 3 * crit, f"{name}: the test cannot tell the draft from the target ({chi2_draft:.1f})"


def test_sampling_on_a_real_model_keeps_the_first_speculated_token_distribution(cpu):
    """A smaller check on model.py models: the token the accept/resample rule produces right after the first
    (t2) follows the target's exact distribution."""
    V = 8
    hf_t = tiny_hf("llama", seed=21, vocab_size=V)
    tb = backend(hf_to_model(hf_t), 16)
    db = backend(hf_to_model(tiny_hf("llama", seed=22, vocab_size=V)), 16)
    prompt, runs = [3, 1, 4, 1, 5], 600
    with torch.no_grad():
        p1 = engine.Sampling(1.0).probs(hf_t(torch.tensor([prompt])).logits[0, -1])
        p2 = engine.Sampling(1.0).probs(hf_t(torch.tensor([prompt + [a] for a in range(V)])).logits[:, -1])
    ref = (p1[:, None] * p2).sum(0)
    counts = torch.zeros(V)
    for i in range(runs):
        out, _ = SP.speculative_generate(tb, db, prompt, 2, cpu, 1,
                                         engine.Sampling(1.0, generator=torch.Generator().manual_seed(i)))
        counts[out[1]] += 1
    tv = 0.5 * float((counts / runs - ref).abs().sum())
    assert tv < 0.08, tv  # sampling noise alone: about 0.03 at 600 runs


def test_sampling_is_reproducible_with_a_seed(models, cpu):
    tb, db = backend(models["target"]), backend(models["noisy"])
    run = lambda s: SP.speculative_generate(tb, db, PROMPTS[0], 30, cpu, 3,
                                            engine.Sampling(0.9, 20, generator=torch.Generator().manual_seed(s)))[0]
    assert run(5) == run(5)
    assert run(5) != run(6)


class LastOnly:
    """A backend that returns only each row's last logits (as fixed-graph exports do)."""

    def __init__(self, inner):
        self.inner, self.max_batch_size, self.max_seq_length = inner, inner.max_batch_size, inner.max_seq_length
        self.prefill_chunk, self.vocab_size = None, inner.vocab_size

    def forward(self, tokens, input_pos):
        return self.inner.forward(tokens, input_pos)[:, -1:]


def test_bad_combinations(models, cpu):
    tb, db = backend(models["target"]), backend(models["noisy"])
    other_vocab = backend(hf_to_model(tiny_hf("llama", seed=5, vocab_size=64)))
    with pytest.raises(ValueError, match="vocabulary"):
        SP.speculative_generate(tb, other_vocab, PROMPTS[0], 10, cpu, 3)
    nameless = LastOnly(other_vocab)
    nameless.vocab_size = None  # the sizes are also checked on the logits themselves
    with pytest.raises(ValueError, match="vocabulary"):
        SP.speculative_generate(tb, nameless, PROMPTS[0], 10, cpu, 3)
    for k in (0, -2, 1.5, None):
        with pytest.raises(ValueError, match="speculate_k"):
            SP.speculative_generate(tb, db, PROMPTS[0], 10, cpu, k)
    with pytest.raises(ValueError, match="every position"):
        SP.speculative_generate(LastOnly(tb), db, PROMPTS[0], 10, cpu, 3)
    chunked = LastOnly(tb)
    chunked.prefill_chunk = 16
    with pytest.raises(ValueError, match="every position"):
        SP.speculative_generate(chunked, db, PROMPTS[0], 10, cpu, 3)
    # a draft that returns only last-position logits is fine: drafting needs nothing else
    want, _ = engine.generate(tb, [PROMPTS[0]], 20, cpu)
    assert SP.speculative_generate(tb, LastOnly(db), PROMPTS[0], 20, cpu, 3)[0] == want[0]
    with pytest.raises(ValueError, match="batch 1"):
        SP.speculative_generate(tb, db, [[1, 2], [3, 4]], 10, cpu, 3)
    with pytest.raises(ValueError, match="empty prompt"):
        SP.speculative_generate(tb, db, [], 10, cpu, 3)
    with pytest.raises(ValueError, match="does not fit"):
        SP.speculative_generate(tb, db, list(range(200)), 10, cpu, 3)


def test_format_stats(models, cpu):
    tb, db = backend(models["target"]), backend(models["noisy"])
    _, st = SP.speculative_generate(tb, db, PROMPTS[0], 20, cpu, 3)
    line = SP.format_stats(st)
    assert "acceptance rate" in line and "mean accepted" in line and "histogram" in line


def test_cli_speculative_greedy_and_errors(tiny_checkpoint, tmp_path):
    d, _ = tiny_checkpoint
    base = ["generate.py", "--checkpoint_path", d / "model.pth", "--prompt", "Once upon a time", "--max_new_tokens",
            24, "--temperature", 0]
    plain = run_cli(*base)
    assert plain.returncode == 0, plain.stderr
    r = run_cli(*base, "--draft_checkpoint_path", d / "model.pth", "--speculate_k", 3)
    assert r.returncode == 0, r.stderr
    assert r.stdout == plain.stdout
    assert "acceptance rate 100.0%" in r.stderr
    save_checkpoint(checkpoint_state(hf_to_model(tiny_hf("llama", seed=1, vocab_size=64))), tmp_path / "m.pth")
    assert_clean_error(run_cli(*base, "--draft_checkpoint_path", tmp_path / "m.pth", "--speculate_k", 3),
                       "vocabulary")
    assert_clean_error(run_cli(*base, "--draft_checkpoint_path", d / "model.pth", "--speculate_k", 0), "speculate_k")
    assert_clean_error(run_cli(*base, "--draft_checkpoint_path", tmp_path / "missing.pth"), "not found")
