# runner-et/: the ExecuTorch C++ runner (runner-common's tokenizer / sampler / loops over executorch's Module) prints
# exactly what `generate.py --pte x.pte --temperature 0` prints, for a tiny random model exported by et_export.py in
# float32 and 8da4w, with a SentencePiece and a byte-level BPE tokenizer; broken programs are clear errors, and a
# program with bytes changed at random never kills the runner by a signal (RUNNER_ET_FUZZ_SEED=N repeats a sweep).
# Skips (with the reason) when et_export.py or the executorch package is missing, or cmake / a compiler is.
import os
import random
import resource
import signal
import struct
import subprocess
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
    # one layer for the programs that tests only run on two runtimes (an export's time goes by the graph's nodes)
    one_layer = tiny_checkpoint(root / "one_layer.pth", n_layer=1)
    return dict(root=root, sp=sp, bpe=bpe, ckpt=ckpt, pte=export_pte(ckpt, root / "tiny.pte"), one_layer=one_layer,
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
    # the program records its tokenizer's vocabulary fingerprint: the SentencePiece run gets one exported with it
    pte = env["pte"] if kind == "bpe" else export_pte(env["one_layer"], env["root"] / "tiny_sp.pte", "--tokenizer_path",
                                                      env["sp"])
    for prompt in PROMPTS:
        compare(runner, pte, env[kind], env["bins"][kind], prompt, 24)
    compare(runner, pte, env[kind], env["bins"][kind], "Once upon a time", 500)  # clamped to the context


def test_a_program_loads_without_the_exporter(env):
    """PTEBackend loads and runs a program without importing ExecuTorch's exporter (executorch.exir: it was ~7 s of
    `generate.py --pte`'s 15)."""
    code = ("import sys, torch; sys.path.insert(0, sys.argv[1]); from pte_backend import PTEBackend; "
            "b = PTEBackend(sys.argv[2]); b.forward(torch.tensor([[1, 5, 9]]), torch.arange(3)); "
            "print(sorted(m for m in sys.modules if m.startswith('executorch.exir')))")
    r = run([sys.executable, "-c", code, REPO, env["pte"]])
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout[-2000:] + r.stderr[-2000:]


def test_ignore_stop_tokens(env, runner):
    """-x (runner) and --ignore_eos (generate.py) generate exactly -n tokens, the same ones, through stop tokens."""
    tok_bin = env["bins"]["bpe"]
    want = generate_py(["--pte", env["pte"]], env["bpe"], "Once upon a time", 40, "--ignore_eos")
    r = run([runner, env["pte"], "-z", tok_bin, "-i", "Once upon a time", "-n", 40, "-t", 0, "-x"])
    assert r.returncode == 0, r.stderr
    assert r.stdout == want and "| 40 new tokens" in r.stderr


def test_runner_8da4w(env, runner):
    pte = env["root"] / "tiny_8da4w.pte"
    r = run([sys.executable, REPO / "et_export.py", "--checkpoint_path", env["one_layer"], "--output_path", pte,
             "--max_seq_length", MAX_SEQ, "--quantize", "8da4w", "--groupsize", 32])
    if r.returncode != 0 and ("quantize" in r.stderr and "not" in r.stderr and "found" in r.stderr):
        pytest.skip("8da4w export unavailable: " + r.stderr.strip().splitlines()[-1])
    assert r.returncode == 0, r.stderr[-3000:]
    for prompt in PROMPTS:
        compare(runner, pte, env["bpe"], env["bins"]["bpe"], prompt, 24)


def test_runner_8da4w_x86_kernels(env, runner):
    """et_export.py --x86_kernels (8da4w linears as llama_flat::q8a4w_mm, fast_cpu_8da4w.c): the runner, which links
    the kernel, prints what generate.py --pte prints (ExecuTorch's Python runtime with the kernel pte_backend.py
    builds), for both tokenizers' prompts; without AVX2 the export refuses in one line."""
    import torch_internals as TI
    pte = env["root"] / "tiny_8da4w_x86.pte"
    r = run([sys.executable, REPO / "et_export.py", "--checkpoint_path", env["one_layer"], "--output_path", pte,
             "--max_seq_length", MAX_SEQ, "--quantize", "8da4w", "--groupsize", 32, "--x86_kernels"])
    if not TI.cpu_has("avx2"):
        assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith("error: ") and not pte.exists()
        return
    assert r.returncode == 0, r.stderr[-3000:]
    for prompt in PROMPTS:
        compare(runner, pte, env["bpe"], env["bins"]["bpe"], prompt, 24)


def test_fast_prefill_prompt_method(env, runner):
    """et_export.py --fast_prefill adds `prompt` (the last position's logits only): it equals eager model.py's last
    row, generate.py --pte and the runner take it for prompts, and both print what eager generate.py prints (a
    one-layer model: the method's export costs what its nodes do)."""
    import torch
    from et_export import PTEBackend
    from engine import TorchBackend
    from quantize import load_model
    pte = export_pte(env["one_layer"], env["root"] / "tiny_fp.pte", "--fast_prefill")
    tok, pos = torch.tensor([[5, 17, 33, 2, 90, 7]]), torch.arange(6)
    fast, eager = PTEBackend(pte), TorchBackend(load_model(env["one_layer"]), 1, MAX_SEQ)
    assert fast.logits_at and not PTEBackend(env["pte"]).logits_at
    last = fast.forward(tok, pos, logits_at=torch.tensor([5]))
    assert last.shape == (1, 1, fast.vocab_size)
    torch.testing.assert_close(last[0, 0], eager.forward(tok, pos)[0, -1], rtol=1e-5, atol=1e-5)
    for prompt in PROMPTS:
        want = generate_py(["--checkpoint_path", env["one_layer"]], env["bpe"], prompt, 24)
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


def _limit_memory():
    """A corrupt memory plan can ask for many GB: let the allocation fail at once instead of paging for minutes."""
    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))


def test_mutated_programs_never_crash(env, runner, tmp_path):
    """80 copies of a fresh .pte with one byte changed (fresh offsets every run, from a printed seed; most inside the
    flatbuffer, where ExecuTorch's structures are, the rest in the weights) plus the earlier sweep's crashes
    (offset 64: a root-table offset, SIGSEGV before; offsets 306 + 3775: SIGABRT inside ExecuTorch): each run ends
    with status 0 or 1 (one `error:` line), never by a signal."""
    seed = int(os.environ.get("RUNNER_ET_FUZZ_SEED", random.SystemRandom().randrange(1 << 30)))
    rng = random.Random(seed)
    good = env["pte"].read_bytes()
    program_size = struct.unpack_from("<Q", good, 16)[0] if good[8:12] == b"eh00" else len(good)
    cases = [[(64, 0x4D)], [(306, 0xC1), (3775, 0x57)]]
    for _ in range(80):
        off = rng.randrange(program_size) if rng.random() < 0.8 else rng.randrange(len(good))
        cases.append([(off, (good[off] + rng.randrange(1, 256)) % 256)])
    bad, f = [], tmp_path / "m.pte"
    for case in cases:
        data = bytearray(good)
        for off, value in case:
            data[off] = value
        f.write_bytes(data)
        try:
            r = run([runner, f, "-z", env["bins"]["bpe"], "-i", "hi", "-n", 4, "-t", 0, "-q", "-j", 1], timeout=120,
                    preexec_fn=_limit_memory, errors="replace")
        except subprocess.TimeoutExpired:
            bad.append(f"{case}: no answer in 120 s")
            continue
        errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
        if r.returncode < 0 or r.returncode > 1:
            name = signal.Signals(-r.returncode).name if r.returncode < 0 else r.returncode
            bad.append(f"{case}: died by {name}: {r.stderr[-300:]}")
        elif r.returncode == 1 and (len(errors) != 1 or not r.stderr.endswith(errors[0] + "\n")):
            bad.append(f"{case}: exit 1 without one final error line: {r.stderr[-300:]}")
    assert not bad, f"seed {seed} (RUNNER_ET_FUZZ_SEED={seed} repeats it):\n" + "\n".join(bad)


def vocab_fingerprint(tokenizer_bin: bytes) -> int:
    """runner-common/README.md's vocabulary fingerprint: FNV-1a 64 over part A's token records without their scores
    (per id: uint32 length little-endian, then the bytes); part A ends at the extension (footer) or the file's end."""
    end = struct.unpack_from("<Q", tokenizer_bin, len(tokenizer_bin) - 16)[0] \
        if tokenizer_bin.endswith(b"LLTOKEND") else len(tokenizer_bin)
    h, pos = 0xCBF29CE484222325, 4
    while pos < end:
        n = struct.unpack_from("<I", tokenizer_bin, pos + 4)[0]
        for b in tokenizer_bin[pos + 4:pos + 8 + n]:
            h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
        pos += 8 + n
    return h


def other_vocabulary(good: bytes) -> bytes:
    """Another vocabulary of the same size: good's tokenizer.bin with the part A records of two tokens of equal
    length (ids 260 on) swapped."""
    records, pos = [], 4
    while len(records) < 300:
        n = struct.unpack_from("<I", good, pos + 4)[0]
        records.append((pos, 8 + n))
        pos += 8 + n
    (a, la), (b, lb) = next((x, y) for x in records[260:] for y in records[260:] if x[0] < y[0] and x[1] == y[1])
    other = bytearray(good)
    other[a + 4:a + la], other[b + 4:b + lb] = good[b + 4:b + lb], good[a + 4:a + la]
    assert vocab_fingerprint(bytes(other)) != vocab_fingerprint(good)
    return bytes(other)


def takes_only(runner, program, good_bin, other_bin, fp):
    """The runner runs program with good_bin and refuses other_bin (another vocabulary of the same size) with one
    error line naming the fingerprint fp, exit 1 (test_aoti.py's package too)."""
    r = run([runner, program, "-z", good_bin, "-i", "Once upon a time", "-n", 8, "-t", 0])
    assert r.returncode == 0 and "achieved tok/s" in r.stderr, r.stderr
    r = run([runner, program, "-z", other_bin, "-i", "Once upon a time", "-n", 8, "-t", 0])
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and r.stdout == "" and last.startswith("error: "), r.stderr
    assert f"{other_bin.name} is not the vocabulary the model was exported with" in last and str(fp) in last, last
    assert [l for l in r.stderr.splitlines() if l.startswith("error: ")] == [last], r.stderr


def test_vocabulary_fingerprint(env, runner, tmp_path):
    """et_export.py writes get_vocab_fingerprint, the fingerprint of the checkpoint's tokenizer.bin (equal to this
    file's reference implementation), so the .pte runs only with that tokenizer.bin: another vocabulary of the same
    size (two tokens of the same length swapped) is one error line. A checkpoint without a tokenizer gives a program
    without the method, which takes any tokenizer of a fitting size."""
    import et_export
    from tokenizer import load_tokenizer
    good = env["bins"]["bpe"].read_bytes()
    fp = vocab_fingerprint(good)
    assert et_export.vocab_fingerprint(load_tokenizer(env["bpe"])) % (1 << 64) == fp
    (tmp_path / "other.bin").write_bytes(other_vocabulary(good))
    takes_only(runner, env["pte"], env["bins"]["bpe"], tmp_path / "other.bin", fp)
    (tmp_path / "none").mkdir()  # no tokenizer: no fingerprint in the program, only the size is checked
    pte = tmp_path / "nofp.pte"
    et_export.main(["--checkpoint_path", str(env["ckpt"]), "--output_path", str(pte), "--max_seq_length", str(MAX_SEQ),
                    "--tokenizer_path", str(tmp_path / "none"), "--bos_id", "1", "--eos_ids", "0", "2"])
    r = run([runner, pte, "-z", tmp_path / "other.bin", "-i", "Once upon a time", "-n", 12, "-t", 0])
    assert r.returncode == 0 and "achieved tok/s" in r.stderr, r.stderr
