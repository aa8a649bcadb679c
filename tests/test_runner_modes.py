# The decoding modes of the C++ runners (-M kv|hybrid|lookahead, runner-common) over one .pte and one .pt2 exported
# with --prefill_chunk and --lookahead (through the source docs' flag spellings): every mode of both runners prints
# exactly what `generate.py --temperature 0` prints; lookahead takes the same forwards in C++ as speculative.py;
# generate.py --lookahead runs the same programs; eval.py's perplexity is the same in every mode in the three phases
# (float, quantized, exported); the aliases parse to the canonical flags; bad mode flags are one error line; a .pt2
# with bytes changed at random is one error line, never a crash (RUNNER_AOTI_FUZZ_SEED=N repeats a sweep).
# The programs that lack a method are refused in test_runner_et.py / test_aoti.py (their kv-only artifacts).
import contextlib
import io
import os
import random
import re
import signal
import subprocess
import zipfile
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import assert_clean_error  # noqa: E402
from test_aoti import ENV, build_runner, package_index, run, tiny_checkpoint  # noqa: E402
from test_tokenizer_bin import export_bin, make_bpe_dir  # noqa: E402

MAX_SEQ, CHUNK = 96, 8
MODES = ["kv", "hybrid", "lookahead"]
PROMPTS = ["Once upon a time there was a little robot who liked to paint the sea and the sky",  # several chunks
           "the sea, the sky, the sea, the sky, the sea, the sky,", "Hi"]


@pytest.fixture(scope="module")
def arts(tmp_path_factory):
    pytest.importorskip("executorch", reason="the executorch package is not installed")
    root = tmp_path_factory.mktemp("modes")
    bpe = make_bpe_dir(root / "bpe")
    ckpt = tiny_checkpoint(bpe / "model.pth")
    pte, pt2, fp16 = root / "tiny.pte", root / "tiny.pt2", root / "tiny_fp16.pte"
    common = ["--checkpoint_path", ckpt, "--max_seq_length", MAX_SEQ, "--prefill_chunk", CHUNK, "--lookahead"]
    # the exports at once (each mostly one core); the source docs' spellings of the flags
    procs = [subprocess.Popen([str(c) for c in [sys.executable, REPO / "et_export.py", "--checkpoint_path", ckpt,
                                                "--max_seq_length", MAX_SEQ, "-d", "fp16", "--out-path", fp16]],
                              stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=ENV),
             subprocess.Popen([str(c) for c in [sys.executable, REPO / "et_export.py", *common, "-d", "fp32",
                                                "-xnnpack", "--out-path", pte]],
                              stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=ENV),
             subprocess.Popen([str(c) for c in [sys.executable, REPO / "aoti_export.py", *common, "--device", "cpu",
                                                "--out-path", pt2]],
                              stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=ENV)]
    for p in procs:
        err = p.communicate()[1]
        assert p.returncode == 0, err[-3000:]
    return dict(root=root, bpe=bpe, ckpt=ckpt, pte=pte, pt2=pt2, fp16=fp16, bin=export_bin(bpe, root / "bpe.bin"))


@pytest.fixture(scope="module")
def runners():
    return {"pte": build_runner(REPO / "runner-et", REPO / "runner-et" / "build" / "run", "runner-et"),
            "pt2": build_runner()}


def in_process(main, argv) -> tuple[str, str]:
    """A script's main(argv) in this process (no interpreter start-up per call): (stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        main([str(a) for a in argv])
    return out.getvalue(), err.getvalue()


def forwards(stderr: str, runner: bool) -> int:
    """Decode forwards: the runner's '(N steps)', speculative.format_stats' '(... in N forwards)'."""
    return int(re.search(r"\((\d+) steps\)" if runner else r"tokens in (\d+) forwards\)", stderr)[1])


def test_every_mode_of_both_runners_prints_generate_py_text(arts, runners, one_thread):
    import generate
    n = 40
    for kind, flag in (("pte", "--pte"), ("pt2", "--aoti_package")):
        for prompt in PROMPTS:
            base = [flag, arts[kind], "--tokenizer_path", arts["bpe"], "--prompt", prompt, "--max_new_tokens", n,
                    "--temperature", 0, "--ignore_eos"]
            want, _ = in_process(generate.main, base)
            # generate.py --lookahead on the same program (Python and C++ share the contract)
            got, err = in_process(generate.main, base + ["--lookahead", "5,1,2"])
            assert got == want, (kind, prompt, err[-2000:])
            py_forwards = forwards(err, runner=False)
            for mode in MODES:
                r = run([runners[kind], arts[kind], "-z", arts["bin"], "-i", prompt, "-n", n, "-t", 0, "-x",
                         "-M", mode, "-L", "5,1,2"])
                assert r.returncode == 0, r.stderr
                assert r.stdout == want, (kind, mode, prompt)
                per = float(re.search(r"([\d.]+) tokens/forward", r.stderr)[1])
                assert "achieved tok/s" in r.stderr and f"| {n} new tokens" in r.stderr
                if mode == "lookahead":
                    assert forwards(r.stderr, runner=True) == py_forwards, (kind, prompt)
                    if prompt == PROMPTS[1]:
                        assert per > 1.3, r.stderr  # the tiny model's greedy text loops: guesses verify
                else:
                    assert per == 1.0
    # stop tokens and chat go through the modes too
    for kind in ("pte", "pt2"):
        turns = "Hi there\nWhat is 2+2?\n\n"
        want = [run([runners[kind], arts[kind], "-z", arts["bin"], "-m", "chat", "-n", 12, "-t", 0, "-y", "Be brief.",
                     "-M", mode], input=turns) for mode in MODES]
        assert all(w.returncode == 0 for w in want) and len({w.stdout for w in want}) == 1, want[0].stderr


def test_pt2_holds_the_weights_once(arts):
    """The three models of the modes .pt2 hold no constants of their own: the package stores each distinct constant
    once and its index gives every model the same records (the prepacked weights of the dynamic-length, fixed-length
    and masked programs are the same bytes); their bytes are the checkpoint's weights, not three times them."""
    reader, index = package_index(arts["pt2"])
    records: dict = {}
    for model, _, record, *_ in index:
        records.setdefault(model, []).append(record)
    assert set(records) == {"model", "prefill", "lookahead"}
    assert sorted(records["model"]) == sorted(records["prefill"]) == sorted(records["lookahead"])
    stored = sum(reader.get_record_size(r) for r in set(records["model"]))
    ckpt = torch.load(arts["ckpt"], weights_only=True, mmap=True)
    weights = sum(t.numel() * t.element_size() for t in ckpt.values() if isinstance(t, torch.Tensor))
    assert weights <= stored < 1.1 * weights  # (+ the rope table)


def test_perplexity_is_the_same_in_every_mode(arts, one_thread):
    """The three-phase check: float checkpoint, quantized checkpoint, exported programs; in each, the hybrid and
    lookahead programs give the KV program's perplexity."""
    import eval as ev
    import quantize
    from aoti_export import AOTIBackend
    from et_export import PTEBackend
    from generate import TorchBackend
    from quantize import load_model
    from tokenizer import load_tokenizer
    ids = load_tokenizer(arts["bpe"]).encode(" ".join(PROMPTS) * 4)[:150]
    cpu = torch.device("cpu")

    def ppl(backend, mode):
        if mode == "hybrid" and not backend.prefill_chunk:
            backend.prefill_chunk = CHUNK
        r = ev.perplexity(backend, ids, 64, 32, cpu, mode=mode)
        if mode == "hybrid" and isinstance(backend, TorchBackend):
            backend.prefill_chunk = None
        return r["ppl"]

    float_model = load_model(arts["ckpt"])
    q = load_model(arts["ckpt"])
    q.quantization = quantize.quantize_model(q, "int8")
    q.requires_grad_(False)
    phases = {"float": lambda m: TorchBackend(float_model, 1, 64), "int8": lambda m: TorchBackend(q, 1, 64),
              "pte": lambda m: PTEBackend(arts["pte"], mode=m), "pt2": lambda m: AOTIBackend(arts["pt2"], mode=m)}
    results = {}
    for phase, make in phases.items():
        got = {mode: ppl(make(mode), mode) for mode in MODES}
        results[phase] = got
        for mode in MODES:
            assert got[mode] == pytest.approx(got["kv"], rel=1e-5), (phase, got)
    assert results["pte"]["kv"] == pytest.approx(results["float"]["kv"], rel=1e-4)
    assert results["pt2"]["kv"] == pytest.approx(results["float"]["kv"], rel=1e-4)
    assert results["int8"]["kv"] != results["float"]["kv"]
    # the eval.py command line takes the mode
    out, _ = in_process(ev.main, ["--pte", arts["pte"], "--tokenizer_path", arts["bpe"], "--text_file",
                                  REPO / "tests" / "data" / "eval_text.txt", "--max_tokens", 100, "--max_seq_length",
                                  64, "--mode", "hybrid", "--quiet"])
    assert "(hybrid): perplexity" in out


def test_flag_aliases_parse_to_the_canonical_flags(arts, tmp_path):
    import aoti_export
    import et_export
    import generate
    ck = ["--checkpoint_path", str(arts["ckpt"])]
    out = str(tmp_path / "x.pte")
    for alias, canon in [
        (["-d", "fp32", "--quant", "8da4w", "-xnnpack", "--out-path", out],
         ["--dtype", "fp32", "--quantize", "8da4w", "--backend", "xnnpack", "--output_path", out]),
        (["-d", "fp16", "--quant", "int8", "-coreml", "--out-path", out],
         ["--dtype", "fp16", "--quantize", "int8", "--backend", "coreml", "--output_path", out]),
        (["-d", "bf16", "--mps", "--out-path", out], ["--dtype", "bf16", "--backend", "mps", "--output_path", out]),
    ]:
        assert et_export.parse_args(ck + alias) == et_export.parse_args(ck + canon)
    so = str(tmp_path / "x.so")
    assert (aoti_export.parse_args(ck + ["--out-path", so, "--device", "cpu"]) ==
            aoti_export.parse_args(ck + ["--output_path", so, "--device", "cpu"]))
    assert generate.parse_args(["--dso", str(arts["pt2"])]).aoti_package == arts["pt2"]
    # precisions a backend has no kernels for: refused before loading anything (cli() prints it as one line)
    with pytest.raises(ValueError, match="XNNPACK has no bfloat16 kernels"):
        et_export.main(ck + ["--out-path", out, "-d", "bf16"])
    with pytest.raises(ValueError, match="quantized programs are exported from float32"):
        et_export.main(ck + ["--out-path", out, "-d", "fp16", "--quant", "8da4w"])
    assert not Path(out).exists()


def test_fp16_program(arts, runners, one_thread):
    """et_export.py -d fp16: XNNPACK's half-precision kernels; the runner and generate.py --pte print what eager
    model.py in float16 prints."""
    import generate
    assert arts["fp16"].stat().st_size < 0.6 * arts["pte"].stat().st_size  # half the weight bytes
    prompt = PROMPTS[0]
    base = ["--tokenizer_path", arts["bpe"], "--prompt", prompt, "--max_new_tokens", 24, "--temperature", 0]
    want, _ = in_process(generate.main, ["--checkpoint_path", arts["ckpt"], "--dtype", "float16", *base])
    assert in_process(generate.main, ["--pte", arts["fp16"], *base])[0] == want
    r = run([runners["pte"], arts["fp16"], "-z", arts["bin"], "-i", prompt, "-n", 24, "-t", 0])
    assert r.returncode == 0 and r.stdout == want, r.stderr


def test_runner_mode_flags_are_checked(arts, runners):
    for args, msg in [(["-M", "fast"], "bad value for -M"), (["-L", "1,2,3", "-t", "0"], "bad value for -L"),
                      (["-L", "5,1", "-t", "0"], "bad value for -L"), (["-L", "5,x,2"], "bad value for -L"),
                      (["-M", "lookahead"], "greedy only")]:
        for kind in ("pte", "pt2"):
            r = run([runners[kind], arts[kind], "-z", arts["bin"], "-i", "hi", *args])
            assert_clean_error(r, msg)
            assert r.stdout == ""


def test_mutated_packages_never_crash(arts, runners, tmp_path):
    """30 copies of the modes .pt2 with one byte changed (fresh offsets every run, from a printed seed): half in the
    models' libraries and metadata (runner-aoti checks their CRC-32 before libtorch unpacks and dlopens them), the
    rest anywhere, the zip directory included. Each run ends with status 0 or 1 and one error line, never a signal."""
    seed = int(os.environ.get("RUNNER_AOTI_FUZZ_SEED", random.SystemRandom().randrange(1 << 30)))
    rng = random.Random(seed)
    good = arts["pt2"].read_bytes()
    code = [i for i in zipfile.ZipFile(arts["pt2"]).infolist() if "/data/aotinductor/" in i.filename]
    bad, f = [], tmp_path / "m.pt2"
    for _ in range(30):
        entry = rng.choice(code)
        off = (entry.header_offset + rng.randrange(30 + len(entry.filename) + 64 + entry.file_size)
               if rng.random() < 0.5 else rng.randrange(len(good)))
        data = bytearray(good)
        data[off] = (data[off] + rng.randrange(1, 256)) % 256
        f.write_bytes(data)
        r = run([runners["pt2"], f, "-z", arts["bin"], "-i", "hi", "-n", 4, "-t", 0, "-q", "-j", 1], timeout=300,
                errors="replace")
        errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
        if r.returncode < 0 or r.returncode > 1:
            name = signal.Signals(-r.returncode).name if r.returncode < 0 else r.returncode
            bad.append(f"offset {off}: died by {name}: {r.stderr[-300:]}")
        elif r.returncode == 1 and len(errors) != 1:
            bad.append(f"offset {off}: exit 1 without one error line: {r.stderr[-300:]}")
    assert not bad, f"seed {seed} (RUNNER_AOTI_FUZZ_SEED={seed} repeats it):\n" + "\n".join(bad)
