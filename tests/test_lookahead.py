# speculative.py: lookahead decoding. One step's call of the lookahead contract (StepCache + custom mask) against
# transformers on the explicit sequences each token should see; output == plain greedy (several N, W, G; prompts incl. repetitive
# ones where the pool hits); the model is left as it was; stop ids / limits / context end; clear errors; CLI.
import pytest
import torch
from conftest import assert_clean_error, hf_to_model, run_cli, tiny_hf

import engine
import speculative as SP


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread


@pytest.fixture(scope="module")
def llama():
    hf = tiny_hf("llama", seed=3, vocab_size=96)
    return hf, hf_to_model(hf)


REPETITIVE = [7, 8, 9, 10, 11, 12] * 4
PROMPTS = [[1, 5, 9, 3, 7, 2], [42], REPETITIVE]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@torch.no_grad()
def test_one_step_sees_exactly_its_own_sequence(arch):
    """Every token of a step's call (tokens fed again, current, lookahead levels, candidates) gets the logits of a
    plain forward over the sequence it stands for; the tokens fed again and the current one then serve as ordinary
    cache entries for the next call."""
    hf = tiny_hf(arch, seed=5, vocab_size=64)
    model = hf_to_model(hf)
    b = engine.TorchBackend(model, 1, 48)
    S = b.max_seq_length
    ref = lambda seq: hf(torch.tensor([seq])).logits[0, -1]
    g = torch.Generator().manual_seed(0)
    rnd = lambda *shape: torch.randint(0, 64, shape, generator=g).tolist()
    prompt = rnd(9)
    W, n_levels = 4, 3
    levels = rnd(n_levels, W)
    cands = [tuple(rnd(3)), tuple(rnd(2)), tuple(rnd(3))]

    def call(tokens, positions, allowed):
        return b.forward_masked(torch.tensor([tokens]), torch.tensor(positions), SP.additive(allowed))[0]

    L = len(prompt)
    pre = call(prompt, list(range(L)), SP.causal_mask(range(L), S)[0, 0] == 0)
    torch.testing.assert_close(pre, hf(torch.tensor([prompt])).logits[0], atol=1e-4, rtol=1e-4)
    # the text so far: the prompt (in the cache), 2 tokens accepted last step (fed again), the current token
    seq = prompt + rnd(3)
    tokens, positions, allowed, r, idx, cidx = SP.step_inputs(seq, L, levels, cands, S)
    assert r == 2 and len(tokens) == r + 1 + (W - 1) + W * (n_levels - 1) + 8
    logits = call(tokens, positions, allowed)
    for k in range(r + 1):
        torch.testing.assert_close(logits[k], ref(seq[:L + k + 1]), atol=1e-4, rtol=1e-4)
    for (j, i), t in idx.items():
        want = seq + levels[0][1:i + 1] + [levels[jj][i] for jj in range(1, j + 1)]
        torch.testing.assert_close(logits[r + t], ref(want), atol=1e-4, rtol=1e-4, msg=f"level {j} column {i}")
    for c, ids in zip(cands, cidx):
        for m, t in enumerate(ids):
            torch.testing.assert_close(logits[r + t], ref(seq + list(c[:m + 1])), atol=1e-4, rtol=1e-4)
    # the next step: seq and two more tokens; the cache holds seq now (committed = len(seq))
    seq2 = seq + rnd(2)
    tokens, positions, allowed, r, idx, cidx = SP.step_inputs(seq2, len(seq), levels[:1], [tuple(rnd(2))], S)
    assert r == 1
    torch.testing.assert_close(call(tokens, positions, allowed)[r], ref(seq2), atol=1e-4, rtol=1e-4)
    # a call that would not fit the cache is refused (the caller takes a plain step)
    assert SP.step_inputs(seq2, len(seq), levels, cands, len(seq2) + 5) is None
    # the swap is undone: the original caches, plain decoding unchanged
    assert all(type(l.attention.kv_cache).__name__ == "KVCache" for l in model.layers)


@pytest.mark.parametrize("ngram,window,gcap", [(2, 1, 1), (3, 3, 2), (4, 4, 4), (5, 2, 3)])
def test_output_equals_plain_greedy(llama, cpu, ngram, window, gcap):
    _, model = llama
    b = engine.TorchBackend(model, 1, 96)
    for prompt in PROMPTS:
        want, _ = engine.generate(b, [prompt], 40, cpu)
        for prompt_ngrams in (True, False):
            got, st = SP.lookahead_generate(b, prompt, 40, cpu, ngram, window, gcap, prompt_ngrams=prompt_ngrams)
            assert got == want[0], (prompt, prompt_ngrams)
            assert st["new_tokens"] == 40 and st["steps"] == sum(st["accepted_hist"])
            assert st["steps"] + 1 == 40 - sum((n - 1) * c for n, c in enumerate(st["accepted_hist"]) if n)
            assert max(n for n, c in enumerate(st["accepted_hist"]) if c) <= ngram


def test_compiled_backend_equals_plain_greedy(llama, cpu):
    """--compile: the lookahead contract through torch.compile (dynamic T; autotuning off to keep the test short)."""
    import torch._inductor.config as cfg
    _, model = llama
    want, _ = engine.generate(engine.TorchBackend(model, 1, 96), [REPETITIVE], 24, cpu)
    b = engine.TorchBackend(model, 1, 96, compile=True)
    with cfg.patch(max_autotune=False, max_autotune_gemm=False):
        got, st = SP.lookahead_generate(b, REPETITIVE, 24, cpu, 5, 1, 2)
    assert got == want[0] and st["mean_accepted"] > 1


def test_other_architecture_equals_plain_greedy(cpu):
    model = hf_to_model(tiny_hf("qwen3", seed=8, vocab_size=80))
    b = engine.TorchBackend(model, 1, 80)
    for prompt in PROMPTS:
        want, _ = engine.generate(b, [prompt], 30, cpu)
        assert SP.lookahead_generate(b, prompt, 30, cpu, 4, 3, 3)[0] == want[0]


def test_repetitive_text_is_accepted_several_tokens_per_step(llama, cpu):
    """A prompt that repeats, and a model whose greedy text falls into a loop: verified n-grams from the pool
    (from the prompt/text, and from the lookahead branch alone) keep more than one token per forward."""
    _, model = llama
    b = engine.TorchBackend(model, 1, 128)
    want, _ = engine.generate(b, [REPETITIVE], 64, cpu)
    for prompt_ngrams in (True, False):
        got, st = SP.lookahead_generate(b, REPETITIVE, 64, cpu, 4, 4, 4, prompt_ngrams=prompt_ngrams)
        assert got == want[0]
        assert st["steps_with_hit"] > 0 and st["mean_accepted"] > 1.5, st
        assert "mean accepted per step" in SP.format_stats(st)


def test_model_is_restored_even_after_an_error(llama, cpu):
    _, model = llama
    b = engine.TorchBackend(model, 1, 64)
    caches = [l.attention.kv_cache for l in model.layers]
    want, _ = engine.generate(b, [PROMPTS[0]], 20, cpu)

    def boom(row, tok):
        raise RuntimeError("stop here")

    with pytest.raises(RuntimeError, match="stop here"):
        SP.lookahead_generate(b, PROMPTS[0], 20, cpu, 3, 2, 2, on_token=boom)
    assert [l.attention.kv_cache for l in model.layers] == caches
    assert all(not l.attention._forward_pre_hooks for l in model.layers)
    assert engine.generate(b, [PROMPTS[0]], 20, cpu)[0] == want


def test_stop_ids_limits_streaming_and_context_end(llama, cpu):
    _, model = llama
    b = engine.TorchBackend(model, 1, 40)
    prompt = REPETITIVE[:10]
    want, _ = engine.generate(b, [prompt], 30, cpu)
    stop = want[0][12]
    want_stop, _ = engine.generate(b, [prompt], 30, cpu, stop_ids=[stop])
    streamed = []
    got, _ = SP.lookahead_generate(b, prompt, 30, cpu, 4, 3, 3, stop_ids=[stop],
                                   on_token=lambda r, t: streamed.append((r, t)))
    assert got == want_stop[0] and streamed == [(0, t) for t in got]
    for n in (0, 1, 2, 5):
        assert SP.lookahead_generate(b, prompt, n, cpu, 4, 3, 3)[0] == want[0][:n]
    # the context (40) ends before max_new_tokens: guesses near the end must not step outside it
    long_want, _ = engine.generate(b, [prompt], 100, cpu)
    got, _ = SP.lookahead_generate(b, prompt, 100, cpu, 5, 6, 3)
    assert got == long_want[0] and len(got) == 40 - len(prompt)


class NoModel:
    max_batch_size, max_seq_length, prefill_chunk, vocab_size = 1, 64, None, 96

    def forward(self, tokens, input_pos):
        raise AssertionError("not called")


def test_bad_combinations(llama, cpu):
    _, model = llama
    b = engine.TorchBackend(model, 1, 64)
    with pytest.raises(ValueError, match="greedy only"):
        SP.lookahead_generate(b, PROMPTS[0], 10, cpu, 4, 3, 3, sampling=engine.Sampling(0.8))
    with pytest.raises(ValueError, match="attention mask.*--lookahead"):
        SP.lookahead_generate(NoModel(), PROMPTS[0], 10, cpu, 4, 3, 3)
    for n, w, g in [(1, 3, 3), (4, 0, 3), (4, 3, 0), (2.5, 3, 3)]:
        with pytest.raises(ValueError, match="lookahead"):
            SP.lookahead_generate(b, PROMPTS[0], 10, cpu, n, w, g)
    with pytest.raises(ValueError, match="batch 1"):
        SP.lookahead_generate(b, [[1, 2], [3]], 10, cpu, 4, 3, 3)
    with pytest.raises(ValueError, match="does not fit"):
        SP.lookahead_generate(b, list(range(64)), 10, cpu, 4, 3, 3)


def test_parse_lookahead_spec():
    assert SP.parse_lookahead_spec("4,5,5") == (4, 5, 5)
    assert SP.parse_lookahead_spec(" 3, 2 ,1") == (3, 2, 1)
    for bad in ["4,x", "4,5", "4,5,5,5", "", "a,b,c", "1,2,3", "4,0,2", "4,2,0", "4.5,2,2"]:
        with pytest.raises(ValueError, match="lookahead"):
            SP.parse_lookahead_spec(bad)


def test_cli_lookahead_greedy_and_errors(tiny_checkpoint):
    d, _ = tiny_checkpoint
    base = ["generate.py", "--checkpoint_path", d / "model.pth", "--prompt", "the sea, the sky, the sea, the sky,",
            "--max_new_tokens", 24, "--temperature", 0]
    plain = run_cli(*base)
    assert plain.returncode == 0, plain.stderr
    r = run_cli(*base, "--lookahead", "4,3,3")
    assert r.returncode == 0, r.stderr
    assert r.stdout == plain.stdout
    assert "mean accepted per step" in r.stderr
    assert_clean_error(run_cli(*base, "--lookahead", "4,x"), "lookahead.*NGRAM,WINDOW,GCAP")
    assert_clean_error(run_cli(*base[:-2], "--temperature", 0.8, "--lookahead", "4,3,3"), "greedy")
