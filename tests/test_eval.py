# eval.py: sliding-window perplexity against the same windows computed directly with transformers.
import math
import re

import pytest
import torch

import eval as ev
import engine
from conftest import assert_clean_error, hf_to_model, run_cli, tiny_hf

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def pair():
    hf = tiny_hf("llama", seed=7, vocab_size=256, max_position_embeddings=128)
    return hf, hf_to_model(hf)


@pytest.fixture(scope="module")
def ids():
    g = torch.Generator().manual_seed(0)
    # a text-like stream: mostly a short repeating motif (so the model's predictions vary in quality), some noise
    motif = torch.randint(0, 256, (17,), generator=g).tolist()
    noise = torch.randint(0, 256, (300,), generator=g).tolist()
    return [noise[i] if i % 5 == 0 else motif[i % 17] for i in range(300)]


@torch.no_grad()
def hf_window_nll(hf, ids, begin, end, n_scored):
    """Sum of -log p(token) over the window's last n_scored tokens, the Hugging Face way (labels -100 elsewhere)."""
    x = torch.tensor([ids[begin:end]])
    labels = x.clone()
    labels[:, :-n_scored] = -100
    out = hf(x, labels=labels)
    return out.loss.double().item() * n_scored  # loss is the mean over the scored (shifted) labels


def test_windows_score_every_token_once():
    for n, L, s in [(300, 64, 32), (300, 64, 64), (300, 64, 1), (64, 64, 32), (10, 64, 32), (65, 64, 64)]:
        wins = ev.sliding_windows(n, L, s)
        scored = [t for b, e, k in wins for t in range(e - k, e)]
        # each token at most once, in order; only window starts with no earlier context are skipped (stride = L)
        unscored = [0] + (list(range(L, n, L)) if s == L else [])
        assert scored == [t for t in range(n) if t not in unscored], (n, L, s)
        assert all(e - b <= L and k <= e - b - 1 for b, e, k in wins)
    with pytest.raises(ValueError, match="stride"):
        ev.sliding_windows(100, 64, 65)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        ev.sliding_windows(1, 64, 32)


@pytest.mark.parametrize("L,stride", [(64, 32), (64, 64), (48, 20), (512, None)])
def test_matches_transformers(pair, ids, L, stride):
    """Per-window NLL equal to transformers' on the same windows: strided, disjoint (stride = window), an uneven
    stride, and one window holding the whole text."""
    hf, model = pair
    backend = engine.TorchBackend(model, 1, min(L, 128))
    r = ev.perplexity(backend, ids, L, stride, CPU)
    assert len(r["windows"]) == len(ev.sliding_windows(len(ids), min(L, 128), stride or min(L, 128) // 2))
    total = 0.0
    for b, e, k, nll in r["windows"]:
        ref = hf_window_nll(hf, ids, b, e, k)
        assert nll == pytest.approx(ref, rel=1e-5, abs=1e-4), (b, e, k)
        total += ref
    n_scored = sum(k for _, _, k, _ in r["windows"])
    assert r["tokens"] == n_scored == (len(ids) - 1 if (stride or 0) < min(L, 128) else n_scored)
    assert r["ppl"] == pytest.approx(math.exp(total / n_scored), rel=1e-5)


class _Chunked:
    """A fixed-shape backend: prompts must come in chunks of exactly N tokens, padded with position -1."""

    def __init__(self, inner, n):
        self.inner, self.prefill_chunk = inner, n
        self.max_batch_size, self.max_seq_length = inner.max_batch_size, inner.max_seq_length

    def forward(self, tokens, pos):
        assert tokens.shape[1] == self.prefill_chunk
        return self.inner.forward(tokens, pos)


class _LastOnly(_Chunked):
    def forward(self, tokens, pos):
        return self.inner.forward(tokens, pos)[:, -1:]


def test_chunked_backend_and_last_position_backend(pair, ids):
    _, model = pair
    plain = ev.perplexity(engine.TorchBackend(model, 1, 64), ids, 64, 32, CPU)
    chunked = ev.perplexity(_Chunked(engine.TorchBackend(model, 1, 64), 24), ids, 64, 32, CPU)
    assert chunked["nll"] == pytest.approx(plain["nll"], rel=1e-5)
    with pytest.raises(ValueError, match="every position"):
        ev.perplexity(_LastOnly(engine.TorchBackend(model, 1, 64), None), ids, 64, 32, CPU)


def test_quantized_model_perplexity_close_to_float(pair, ids):
    import copy

    import quantize
    _, model = pair
    f = ev.perplexity(engine.TorchBackend(copy.deepcopy(model), 1, 64), ids, 64, 32, CPU)
    q = copy.deepcopy(model)
    quantize.quantize_model(q, "int8", log=False)
    r = ev.perplexity(engine.TorchBackend(q, 1, 64), ids, 64, 32, CPU)
    assert abs(r["nll"] - f["nll"]) < 0.02 * f["nll"]


def test_cli(tiny_checkpoint, tmp_path):
    d, hf = tiny_checkpoint
    from tokenizer import load_tokenizer
    text = "The quick brown fox jumps over the lazy dog. It painted 42 boats in the harbour! " * 6
    f = tmp_path / "t.txt"
    f.write_text(text)
    r = run_cli("eval.py", "--checkpoint_path", d / "model.pth", "--text_file", f, "--max_seq_length", "64",
                "--stride", "32", "--quiet")
    assert r.returncode == 0, r.stderr
    m = re.search(r"perplexity ([\d.]+) .* over (\d+) tokens", r.stdout)
    ids = load_tokenizer(d).encode(text)
    assert int(m.group(2)) == len(ids) - 1
    total = sum(hf_window_nll(hf, ids, b, e, k) for b, e, k in ev.sliding_windows(len(ids), 64, 32))
    assert float(m.group(1)) == pytest.approx(math.exp(total / (len(ids) - 1)), rel=1e-4)
    assert_clean_error(run_cli("eval.py", "--checkpoint_path", d / "model.pth", "--text_file", tmp_path / "no.txt"),
                       "text file not found")
