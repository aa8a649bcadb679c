# runner-et/: the ExecuTorch C++ runner (runner-common's tokenizer / sampler / loops over executorch's Module) prints
# exactly what `generate.py --pte x.pte --temperature 0` prints, for a tiny random model exported by et_export.py in
# float32 and 8da4w, with a SentencePiece and a byte-level BPE tokenizer; broken programs are clear errors.
# Skips (with the reason) when et_export.py or the executorch package is missing, or cmake / a compiler is.
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_aoti import build_runner, generate_py, run, tiny_checkpoint  # noqa: E402
from test_tokenizer_bin import export_bin, make_bpe_dir, make_sp_dir  # noqa: E402

RUNNER_DIR = REPO / "runner-et"
RUNNER = RUNNER_DIR / "build" / "run"
MAX_SEQ = 96
PROMPTS = ["Once upon a time", " x  y\n\nz 123 café 🤖"]


def _need_et():
    pytest.importorskip("executorch", reason="the executorch package is not installed")


def export_pte(ckpt: Path, out: Path, *extra):
    r = run([sys.executable, REPO / "et_export.py", "--checkpoint_path", ckpt, "--output_path", out,
             "--max_seq_length", MAX_SEQ, *extra])
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    _need_et()
    root = tmp_path_factory.mktemp("et")
    sp, bpe = make_sp_dir(root / "sp"), make_bpe_dir(root / "bpe")
    ckpt = tiny_checkpoint(bpe / "model.pth")
    return dict(root=root, sp=sp, bpe=bpe, ckpt=ckpt, pte=export_pte(ckpt, root / "tiny.pte"),
                bins={"sp": export_bin(sp, root / "sp.bin"), "bpe": export_bin(bpe, root / "bpe.bin")})


@pytest.fixture(scope="module")
def runner():
    _need_et()
    return build_runner(RUNNER_DIR, RUNNER, "runner-et")


def compare(runner, pte, tok_dir, tok_bin, prompt, n):
    want = generate_py(["--pte", pte], tok_dir, prompt, n)
    r = run([runner, pte, "-z", tok_bin, "-i", prompt, "-n", n, "-t", 0])
    assert r.returncode == 0, r.stderr
    assert r.stdout == want, prompt
    assert "achieved tok/s" in r.stderr
    return r


@pytest.mark.parametrize("kind", ["bpe", "sp"])
def test_runner_matches_generate_py(env, runner, kind):
    for prompt in PROMPTS:
        compare(runner, env["pte"], env[kind], env["bins"][kind], prompt, 24)
    compare(runner, env["pte"], env[kind], env["bins"][kind], "Once upon a time", 500)  # clamped to the context


def test_ignore_stop_tokens(env, runner):
    """-x (runner) and --ignore_eos (generate.py) generate exactly -n tokens, the same ones, through stop tokens."""
    tok_bin = env["bins"]["bpe"]
    want = generate_py(["--pte", env["pte"]], env["bpe"], "Once upon a time", 40, "--ignore_eos")
    r = run([runner, env["pte"], "-z", tok_bin, "-i", "Once upon a time", "-n", 40, "-t", 0, "-x"])
    assert r.returncode == 0, r.stderr
    assert r.stdout == want and "| 40 new tokens" in r.stderr


def test_runner_8da4w(env, runner):
    pte = env["root"] / "tiny_8da4w.pte"
    r = run([sys.executable, REPO / "et_export.py", "--checkpoint_path", env["ckpt"], "--output_path", pte,
             "--max_seq_length", MAX_SEQ, "--quantize", "8da4w", "--groupsize", 32])
    if r.returncode != 0 and ("quantize" in r.stderr and "not" in r.stderr and "found" in r.stderr):
        pytest.skip("8da4w export unavailable: " + r.stderr.strip().splitlines()[-1])
    assert r.returncode == 0, r.stderr[-3000:]
    for prompt in PROMPTS:
        compare(runner, pte, env["bpe"], env["bins"]["bpe"], prompt, 24)


def test_fast_prefill_prompt_method(env, runner):
    """et_export.py --fast_prefill adds `prompt` (the last position's logits only): it equals `forward`'s last row,
    generate.py --pte and the runner take it for prompts, and both print what the plain program prints."""
    import torch
    from et_export import PTEBackend
    pte = export_pte(env["ckpt"], env["root"] / "tiny_fp.pte", "--fast_prefill")
    tok, pos = torch.tensor([[5, 17, 33, 2, 90, 7]]), torch.arange(6)
    fast, plain = PTEBackend(pte), PTEBackend(env["pte"])
    assert fast.logits_at and not plain.logits_at
    last = fast.forward(tok, pos, logits_at=torch.tensor([5]))
    assert last.shape == (1, 1, plain.vocab_size)
    torch.testing.assert_close(last[0, 0], plain.forward(tok, pos)[0, -1], rtol=1e-5, atol=1e-5)
    for prompt in PROMPTS:
        want = generate_py(["--pte", env["pte"]], env["bpe"], prompt, 24)
        assert generate_py(["--pte", pte], env["bpe"], prompt, 24) == want
        r = run([runner, pte, "-z", env["bins"]["bpe"], "-i", prompt, "-n", 24, "-t", 0])
        assert r.returncode == 0, r.stderr
        assert r.stdout == want and 'prompts through "prompt"' in r.stderr, prompt


def test_runner_chat(env, runner):
    turns = "Hi there\nWhat is 2+2?\n\n"
    want = generate_py(["--pte", env["pte"]], env["bpe"], "unused", 12, "--chat", "--system", "Be brief.", stdin=turns)
    r = run([runner, env["pte"], "-z", env["bins"]["bpe"], "-m", "chat", "-n", 12, "-t", 0, "-y", "Be brief."],
            input=turns)
    assert r.returncode == 0 and r.stdout == want, r.stderr


def test_broken_programs(env, runner, tmp_path):
    good = env["pte"].read_bytes()
    cases = {"trunc.pte": (good[:len(good) // 2], "truncated"), "head.pte": (good[:2000], "truncated"),
             "junk.pte": (b"definitely not a flatbuffer" * 64, "not an ExecuTorch program"),
             "empty.pte": (b"", "not an ExecuTorch program")}
    for name, (data, msg) in cases.items():
        (tmp_path / name).write_bytes(data)
        r = run([runner, tmp_path / name, "-z", env["bins"]["bpe"], "-i", "hi"])
        last = r.stderr.strip().splitlines()[-1]
        assert r.returncode == 1 and last.startswith("error: ") and msg in last, (name, r.stderr)
    r = run([runner, tmp_path / "missing.pte", "-z", env["bins"]["bpe"], "-i", "hi"])
    assert r.returncode == 1 and "cannot open" in r.stderr
    r = run([runner])  # the usage text's example is a .pte
    assert r.returncode == 1 and " model.pte -z" in r.stderr and ".pt2" not in r.stderr, r.stderr


def test_modes_need_their_methods(env, runner):
    """A program exported without a mode's method: one error line naming the export flag (runner and generate.py)."""
    for mode, flag in (("hybrid", "--prefill_chunk"), ("lookahead", "--lookahead")):
        r = run([runner, env["pte"], "-z", env["bins"]["bpe"], "-i", "hi", "-t", 0, "-M", mode])
        assert r.returncode == 1 and r.stdout == "", r.stderr
        assert r.stderr.strip().splitlines()[-1].startswith("error: ") and flag in r.stderr, r.stderr
    r = run([sys.executable, REPO / "generate.py", "--pte", env["pte"], "--tokenizer_path", env["bpe"],
             "--temperature", 0, "--lookahead", "5,1,2"])
    last = r.stderr.strip().splitlines()[-1]  # (importing executorch / torchao may log lines before it)
    assert r.returncode == 1 and last.startswith("error: ") and "et_export.py --lookahead" in last, r.stderr
    assert "Traceback" not in r.stderr
