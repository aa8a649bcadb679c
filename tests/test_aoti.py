# aoti_export.py and runner-aoti/: a tiny random model exported once to a .pt2 with --fast_prefill (about a minute
# on 2 cores; prompts of more than one token go through its "prompt" model); its greedy tokens through AOTIBackend
# equal eager model.py's; the C++ runner prints exactly what
# `generate.py --aoti_package ... --temperature 0` prints, for a SentencePiece and a byte-level BPE tokenizer, in
# generate and chat mode (and for an int4 quantize.py checkpoint when quantize.py is there); broken inputs are clear
# errors.
# The runner is built once into runner-aoti/build (incremental afterwards); tests that need it skip only when
# cmake or a C++ compiler is missing.
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections import Counter
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_tokenizer_bin import export_bin, make_bpe_dir, make_sp_dir  # noqa: E402

RUNNER_DIR = REPO / "runner-aoti"
RUNNER = RUNNER_DIR / "build" / "run"
ENV = dict(os.environ, OMP_NUM_THREADS="1")  # identical GEMM reductions in both processes, and fast on 2 shared cores
MAX_SEQ = 96
VOCAB = 512  # > both tokenizers: the model may emit ids the tokenizer lacks (decoded as "" in both)
PROMPTS = ["Once upon a time", "Hello", " x  y\n\nz 123 café 🤖"]  # generate.py splits --prompt at '|'
SPECIAL_PROMPT = "<|im_start|>user\nhi<|im_end|>\n"


def tiny_checkpoint(path: Path, seed=0, vocab=VOCAB, n_layer=2):
    from checkpoint import checkpoint_state, save_checkpoint
    from model import ModelArgs, Transformer
    torch.manual_seed(seed)
    args = ModelArgs(n_layer=n_layer, n_head=4, n_local_heads=2, dim=64, intermediate_size=128, vocab_size=vocab,
                     block_size=256)
    m = Transformer(args)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2)
    save_checkpoint(checkpoint_state(m), path)
    return path


def run(cmd, **kw):
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=kw.pop("env", ENV), **kw)


def build_runner(src=RUNNER_DIR, binary=RUNNER, what="runner-aoti"):
    """cmake configure (first time) + incremental build of a runner; skip when the toolchain is missing."""
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not installed: cannot build " + what)
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler: cannot build " + what)
    build = src / "build"
    build.mkdir(exist_ok=True)
    with open(build / "test.lock", "w") as lock:  # test files run in parallel (pytest -n 2): one build at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (build / "CMakeCache.txt").exists():
            r = run(["cmake", "-S", src, "-B", build, f"-DPYTHON_EXECUTABLE={sys.executable}"])
            assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        r = run(["cmake", "--build", build, "-j2"])
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return binary


def package_index(pt2: Path):
    """A package's shared-weights index (aoti_export.package_shared): its reader and the index's lines, each split
    into model, internal name, record, dtype, storage offset, shape, stride."""
    import aoti_export
    reader = torch._C.PyTorchFileReader(str(pt2))
    index = reader.get_record(f"{aoti_export.SHARED_WEIGHTS}/index").decode()
    return reader, [line.split("\t") for line in index.splitlines()]


def export_pt2(ckpt: Path, out: Path, *extra):
    r = run([sys.executable, REPO / "aoti_export.py", "--checkpoint_path", ckpt, "--output_path", out,
             "--max_seq_length", MAX_SEQ, *extra])
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def generate_py(model_args, tok_dir, prompt, n, *extra, stdin=None):
    r = run([sys.executable, REPO / "generate.py", *model_args, "--tokenizer_path", tok_dir, "--prompt", prompt,
             "--max_new_tokens", n, "--temperature", 0, *extra], input=stdin)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("aoti")
    sp, bpe = make_sp_dir(root / "sp"), make_bpe_dir(root / "bpe")
    ckpt = tiny_checkpoint(bpe / "model.pth")  # beside the BPE tokenizer: its facts go into the package metadata
    pt2 = export_pt2(ckpt, root / "tiny.pt2", "--fast_prefill")
    one_layer = tiny_checkpoint(root / "one_layer.pth", n_layer=1)  # (for the other packages: see `quantized`)
    return dict(root=root, sp=sp, bpe=bpe, ckpt=ckpt, pt2=pt2, one_layer=one_layer,
                bins={"sp": export_bin(sp, root / "sp.bin"), "bpe": export_bin(bpe, root / "bpe.bin")})


@pytest.fixture(scope="module")
def runner():
    return build_runner()


def test_a_package_loads_and_runs_without_the_compiler(env):
    """AOTIBackend loads a package (its "prompt" too) and runs it without importing Inductor or Dynamo: their import
    was half of `generate.py --aoti_package`'s start."""
    code = ("import sys, torch; sys.path.insert(0, sys.argv[1]); from aoti_export import AOTIBackend; "
            "b = AOTIBackend(sys.argv[2]); b.forward(torch.tensor([[1, 5, 9]]), torch.arange(3), "
            "logits_at=torch.tensor([2])); print(b.logits_at, sorted(m for m in sys.modules "
            "if m.startswith(('torch._dynamo', 'torch._inductor'))))")
    r = run([sys.executable, "-c", code, REPO, env["pt2"]])
    assert r.returncode == 0 and r.stdout.strip() == "True []", r.stdout[-2000:] + r.stderr[-2000:]


def test_metadata_and_atomic_write(env):
    from aoti_export import AOTIBackend
    b = AOTIBackend(env["pt2"])
    m = b.metadata
    assert b.max_seq_length == MAX_SEQ and int(m["vocab_size"]) == VOCAB and m["tokenizer_kind"] == "bpe"
    assert m["bos_id"] == "1" and set(m["eos_ids"].split(",")) == {"0", "2"} and m["dtype"] == "float32"
    assert [p.name for p in env["root"].iterdir() if p.name.startswith(".")] == []  # no temp leftovers


def test_backend_greedy_equals_eager(env):
    from aoti_export import AOTIBackend
    from generate import TorchBackend, generate
    from quantize import load_model
    cpu = torch.device("cpu")
    prompts = [[1, 5, 9, 300, 17], [7]]
    for p in prompts:
        eager = TorchBackend(load_model(env["ckpt"]), 1, MAX_SEQ)
        want, _ = generate(eager, [p], 40, cpu)
        got, _ = generate(AOTIBackend(env["pt2"]), [p], 40, cpu)
        assert got == want
    # logits too, prefill and decode
    b, m = AOTIBackend(env["pt2"]), load_model(env["ckpt"])
    m.setup_caches(1, MAX_SEQ)
    x, pos = torch.tensor([[3, 4, 5, 6]]), torch.arange(4)
    torch.testing.assert_close(b.forward(x, pos), m(x, pos), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(b.forward(x[:, :1], pos[:1] + 4), m(x[:, :1], pos[:1] + 4), atol=1e-4, rtol=1e-4)


def test_fast_prefill_prompt_model(env):
    """--fast_prefill adds "prompt": the last position's logits of a prompt, from weights of its own (the package's
    index lists only "model"'s), writing the cache that "model" then decodes from."""
    from aoti_export import AOTIBackend
    from quantize import load_model
    b = AOTIBackend(env["pt2"])
    assert b.metadata["models"] == "model,prompt" and b.logits_at and b.prompt_runner is not None
    _, index = package_index(env["pt2"])
    assert index and {row[0] for row in index} == {"model"}
    m = load_model(env["ckpt"])
    m.setup_caches(1, MAX_SEQ)
    x, pos = torch.tensor([[3, 4, 5, 6, 7, 8, 9]]), torch.arange(7)
    got = b.forward(x, pos, logits_at=torch.tensor([6]))
    assert got.shape == (1, 1, VOCAB)
    torch.testing.assert_close(got, m(x, pos)[:, -1:], atol=1e-4, rtol=1e-4)
    # "model" decodes from the cache "prompt" wrote
    torch.testing.assert_close(b.forward(x[:, :1], pos[:1] + 7), m(x[:, :1], pos[:1] + 7), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="last position"):
        b.forward(x, pos, logits_at=torch.tensor([2]))


@pytest.mark.parametrize("kind", ["bpe", "sp"])
def test_runner_matches_generate_py(env, runner, kind):
    # the package records its tokenizer's vocabulary fingerprint: the SentencePiece run gets one exported with it
    pt2 = env["pt2"] if kind == "bpe" else export_pt2(env["one_layer"], env["root"] / "tiny_sp.pt2", "--tokenizer_path",
                                                      env["sp"])
    for prompt, n in [(p, 24) for p in PROMPTS] + [("Once upon a time", 500)]:  # 500: clamped to the context
        want = generate_py(["--aoti_package", pt2], env[kind], prompt, n)
        r = run([runner, pt2, "-z", env["bins"][kind], "-i", prompt, "-n", n, "-t", 0])
        assert r.returncode == 0, r.stderr
        assert r.stdout == want, (kind, prompt)
        assert "achieved tok/s" in r.stderr and "TTFT" in r.stderr


def test_runner_usage_and_default_threads(env, runner):
    """The usage text's example is a .pt2; without -j and $OMP_NUM_THREADS the runner picks the free cores and the
    timing line says how many threads ran."""
    r = run([runner])
    assert r.returncode == 1 and " model.pt2 -z" in r.stderr and ".pte" not in r.stderr, r.stderr
    env_no_omp = {k: v for k, v in ENV.items() if k != "OMP_NUM_THREADS"}
    r = run([runner, env["pt2"], "-z", env["bins"]["bpe"], "-i", "hi", "-n", 4, "-t", 0], env=env_no_omp)
    timing = [l for l in r.stderr.splitlines() if l.startswith("TTFT")]
    n = int(re.search(r"\| (\d+) threads$", timing[0])[1])
    assert r.returncode == 0 and 1 <= n <= (os.cpu_count() or 1), r.stderr
    assert ("cores are busy with other work" in r.stderr) == (n < (os.cpu_count() or 1)), r.stderr


def test_runner_encode_mode(env, runner):
    import tokenizer as T
    tok = T.load_tokenizer(env["bpe"])
    for prompt in PROMPTS + [SPECIAL_PROMPT]:
        r = run([runner, env["pt2"], "-z", env["bins"]["bpe"], "-e", "-i", prompt])
        assert r.returncode == 0 and [int(x) for x in r.stdout.split()] == tok.encode(prompt)


def test_runner_chat_matches_generate_py(env, runner):
    turns = "Hi there\nWhat is 2+2?\n\n"
    # a short system prompt: the template's default one alone is ~90 tokens in this tiny vocabulary
    want = generate_py(["--aoti_package", env["pt2"]], env["bpe"], "unused", 12, "--chat", "--system", "Be brief.",
                       stdin=turns)
    r = run([runner, env["pt2"], "-z", env["bins"]["bpe"], "-m", "chat", "-n", 12, "-t", 0, "-y", "Be brief."],
            input=turns)
    assert r.returncode == 0, r.stderr
    assert r.stdout == want and r.stdout.count("> ") >= 3


def test_runner_sampling_is_seeded(env, runner):
    outs = [run([runner, env["pt2"], "-z", env["bins"]["bpe"], "-i", "Hello", "-n", 20, "-t", t, "-p", 0.9, "-s", s,
                 "-q"]).stdout for t, s in ((0.8, 42), (0.8, 42), (0.8, 43), (1.0, 42))]
    assert outs[0] == outs[1] and len({outs[0], outs[2], outs[3]}) > 1


def test_so_library(env, runner, tmp_path):
    """--so, spelled as the source docs do: aoti_export.py --out-path X.so --device cpu, generate.py --dso X.so."""
    so = env["root"] / "tiny.so"
    r = run([sys.executable, REPO / "aoti_export.py", "--checkpoint_path", env["ckpt"], "--out-path", so, "--device",
             "cpu", "--max_seq_length", MAX_SEQ])
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((env["root"] / "tiny.so.json").read_text())["max_seq_len"] == str(MAX_SEQ)
    want = generate_py(["--aoti_package", env["pt2"]], env["bpe"], "Once upon a time", 20)
    assert generate_py(["--dso", so], env["bpe"], "Once upon a time", 20) == want
    r = run([runner, so, "-z", env["bins"]["bpe"], "-i", "Once upon a time", "-n", 20, "-t", 0])
    assert r.returncode == 0 and r.stdout == want, r.stderr
    # the .so.json records the vocabulary fingerprint (test_vocabulary_fingerprint); without it, the size is checked
    from test_runner_et import other_vocabulary, vocab_fingerprint
    meta = json.loads((env["root"] / "tiny.so.json").read_text())
    assert meta.pop("vocab_fingerprint") == str(vocab_fingerprint(env["bins"]["bpe"].read_bytes()))
    (tmp_path / "other.bin").write_bytes(other_vocabulary(env["bins"]["bpe"].read_bytes()))
    r = run([runner, so, "-z", tmp_path / "other.bin", "-i", "Hi", "-n", 4, "-t", 0])
    assert r.returncode == 1 and "is not the vocabulary the model was exported with" in r.stderr, r.stderr
    (env["root"] / "tiny.so.json").write_text(json.dumps(meta))
    r = run([runner, so, "-z", tmp_path / "other.bin", "-i", "Hi", "-n", 4, "-t", 0])
    assert r.returncode == 0 and "achieved tok/s" in r.stderr, r.stderr


def test_vocabulary_fingerprint(env, runner, tmp_path):
    """The package records vocab_fingerprint (runner-common/README.md), that of the checkpoint's tokenizer.bin as
    test_runner_et.py's reference implementation computes it: the runner takes that tokenizer.bin and refuses another
    vocabulary of the same size (two tokens of the same length swapped) with one error line, exit 1."""
    import torch_internals as TI
    from test_runner_et import other_vocabulary, takes_only, vocab_fingerprint
    good = env["bins"]["bpe"].read_bytes()
    fp = vocab_fingerprint(good)
    assert TI.package_metadata(str(env["pt2"]), "model")["vocab_fingerprint"] == str(fp)
    (tmp_path / "other.bin").write_bytes(other_vocabulary(good))
    takes_only(runner, env["pt2"], env["bins"]["bpe"], tmp_path / "other.bin", fp)


@pytest.fixture(scope="module")
def quantized(env):
    """quantized(mode) -> (checkpoint, package), made once per mode for the tests below: `quantize.py --mode M
    --groupsize 32` on a one-layer model like env's (an export's time goes by the graph's nodes: 83 s against 116 for
    two layers, 8da4w), then `aoti_export.export(..., fast_prefill=True)` with fast_cpu_quant.BF16_GEMM forced on (a
    weight-only one adds "long_prompt", see test_long_prompt_model; any CPU makes the same package but for
    fast_cpu_kernels' kernel, which int4 and 8da4w "prompt" models call where it runs), and for "M-nokernel" with the
    kernel off (as on a CPU where it does not run)."""
    import aoti_export
    import fast_cpu_kernels
    import fast_cpu_quant
    made = {}

    def get(mode):
        if mode not in made:
            base = mode.removesuffix("-nokernel")
            q = env["root"] / f"model_{base}.pth"
            if not q.exists():
                r = run([sys.executable, REPO / "quantize.py", "--checkpoint_path", env["one_layer"], "--mode", base,
                         "--groupsize", "32", "--output", q])
                assert r.returncode == 0, r.stderr[-2000:]
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(fast_cpu_quant, "BF16_GEMM", True)
                if mode != base:
                    mp.setattr(fast_cpu_kernels, "_LIB", None)
                    mp.setattr(fast_cpu_kernels, "_TRIED", True)
                made[mode] = q, aoti_export.export(q, env["root"] / f"tiny_{mode}.pt2", MAX_SEQ, None, "cpu",
                                                   env["bpe"], False, log=lambda *a: None, fast_prefill=True)
        return made[mode]
    return get


def compiled_as_packaged(q):
    """`--compile` of checkpoint q: packages keep the int4 layout compiled code reads (fast_cpu_kernels' tiles where
    its kernels run, else ATen's blocked layout), so they compute what it computes (eager's one-row products differ:
    ATen's int4 kernel rounds within bfloat16 and AVX2's tiles take x as int16 per run, and a random model's near ties
    part them)."""
    from generate import TorchBackend
    from quantize import load_model
    return TorchBackend(load_model(q), 1, MAX_SEQ, compile=True)


def test_quantized_checkpoint(env, runner, quantized):
    # int4 weight-only in a package of its models (the models whose weights the package shares once once failed to
    # compile an int4 checkpoint: its several-row products lowered to an aten.mm that Inductor's C++ GEMM template
    # does not take; they are fast_cpu_quant.py's word kernels now)
    q, pt2 = quantized("int4")
    from aoti_export import AOTIBackend
    assert "quantization" in AOTIBackend(pt2).metadata
    # a quantized model's "prompt" shares the package's records with "model" (its products are not float GEMMs):
    # weight-only int4's linears hold ATen's blocked int4 layout alone, packed weights and bfloat16 scales / offsets,
    # which every model multiplies by (no word layouts: fast_cpu_quant._make_words), as eager runs them
    from generate import TorchBackend, generate
    from quantize import load_model
    from qops import QuantizedLinear
    reader, index = package_index(pt2)
    records, dtypes = {}, {row[2]: row[3] for row in index}
    for row in index:
        records.setdefault(row[0], set()).add(row[2])
    assert set(records) - {"long_prompt"} == {"model", "prompt"}  # (long_prompt: see test_long_prompt_model)
    added = records["prompt"] - records["model"]
    int4 = [m for m in load_model(q).modules() if isinstance(m, QuantizedLinear) and m.qweight.bits == 4]
    kinds = Counter(dtypes[r] for r in records["model"])
    import fast_cpu_kernels  # (the tiles hold their scales and offsets; ATen's layout has them beside it, bfloat16)
    scales = 0 if fast_cpu_kernels.available() else len(int4)
    assert len(int4) and kinds["uint8"] == len(int4) and kinds["bfloat16"] == scales and len(added) <= 1, (kinds, added)
    # the package computes what --compile computes on its layouts (ATen's int4 kernel rounds its input to bfloat16:
    # the norms' float32 differences between eager and generated code can part a random model's near ties)
    cpu = torch.device("cpu")
    want, _ = generate(compiled_as_packaged(q), [[1, 5, 9]], 30, cpu)
    got, _ = generate(AOTIBackend(pt2), [[1, 5, 9]], 30, cpu)
    assert got == want
    for prompt in PROMPTS[:2]:
        expect = generate_py(["--aoti_package", pt2], env["bpe"], prompt, 24)
        r = run([runner, pt2, "-z", env["bins"]["bpe"], "-i", prompt, "-n", 24, "-t", 0])
        assert r.returncode == 0 and r.stdout == expect, r.stderr


@pytest.mark.parametrize("mode", ["int8", "int4", "8da4w", "8da8w"])
def test_quantized_package_keeps_integer_weights(env, quantized, mode):
    """An int8 / int4 / 8da4w / 8da8w package holds its integer weights, not float32 copies: under export the products
    are fast_cpu_quant.py's word kernels (qexport.aoti_forms), where Inductor's freezing would fold dequantize(w) into new
    float32 constants. Its "prompt" model (--fast_prefill) runs the products of many rows on copies of their own: int4
    through ATen's packed kernel (its blocked layout), 8da8w's int8 x int8 products through torch._int_mm on qdata,
    int8 through oneDNN's bfloat16 GEMM on q as bfloat16 (exact; eager runs it from 32 rows, the packed kernel
    below); its one-row output projection through the words (8da4w's once failed to compile there: a folded slice).
    The package's tokens are eager's; 8da4w's and int4's are --compile's on the package's layouts (compiled_as_packaged;
    8da4w's prompts run the same packed int4 kernel on the activations' int8 values, eager 8da4w float32 products)."""
    import qops
    from aoti_export import AOTIBackend
    from generate import TorchBackend, generate
    from quantize import load_model
    q, pt2 = quantized(mode)
    reader, index = package_index(pt2)
    stored = {row[2]: (row[3], reader.get_record_size(row[2])) for row in index}
    float32 = sum(n for dtype, n in stored.values() if dtype == "float32")
    linears = sum(m.weight.numel() * 4 for m in load_model(env["one_layer"]).modules()
                  if isinstance(m, torch.nn.Linear))
    assert float32 < linears / 4, (float32, linears)  # scales, zero terms, norms and the rope table only
    # the int8 embedding table is read from its word layout, the one a tied output projection reads: no int8 copy of
    # it; 8da8w's linears are stored twice (words for "model", qdata for "prompt's" torch._int_mm), 8da4w's once,
    # int8's as words; int8's "prompt" keeps its own constants, q in bfloat16 packed by oneDNN, in its library
    int8 = sum(n for dtype, n in stored.values() if dtype == "int8")
    qlinears = [m.qweight for m in load_model(q).modules() if isinstance(m, qops.QuantizedLinear)]
    assert int8 == (sum(w.qdata.numel() for w in qlinears if w.bits == 8 and w.out_features != VOCAB)
                    if mode == "8da8w" else 0), int8
    assert ("prompt" in {row[0] for row in index}) == (mode != "int8")
    cpu = torch.device("cpu")
    ref = compiled_as_packaged(q) if mode in ("8da4w", "int4") else TorchBackend(load_model(q), 1, MAX_SEQ)
    for p in ([1, 5, 9, 300, 17], [7]):
        want, _ = generate(ref, [p], 30, cpu)
        got, _ = generate(AOTIBackend(pt2), [p], 30, cpu)
        assert got == want


LONG_PROMPT = "Once upon a time there was a little cat who lived in a big red house by the river, and"  # 58 tokens


def int4_kernel_calls(pt2) -> Counter:
    """How many calls of llama_flat::int4_tiles_mm (fast_cpu_kernels' kernel) each model of a package makes through its
    C shim (wrapper.cpp; the declaration not counted), checking that no llama_flat op goes through the proxy executor
    (which lists its ops in the model's wrapper.json)."""
    with zipfile.ZipFile(pt2) as z:
        assert not any('"target": "llama_flat::' in z.read(n).decode() for n in z.namelist()
                       if n.endswith(".wrapper.json"))
        return Counter({n.split("/")[-2]: len(re.findall(r"aoti_torch_cpu_int4_tiles_mm\((?!AtenTensorHandle)",
                                                         z.read(n).decode()))
                        for n in z.namelist() if n.endswith(".wrapper.cpp")})


@pytest.mark.parametrize("mode", ["int4", "8da4w"])
def test_int4_prompt_model_calls_the_kernel(env, runner, quantized, mode):
    """Where fast_cpu_kernels' kernels run, an int4 package keeps the kernel's tiles as its one int4 layout and both
    its models call llama_flat::int4_tiles_mm through the C shim (one call per int4 linear; no proxy executor); an
    8da4w package's "prompt" does for the blocks' linears, its decode "model" reads the words. No "long_prompt". runner-aoti
    serves the op from its own copy of the kernels: it prints the text generate.py prints with the package (itself
    --compile's: test_quantized_checkpoint), for a short prompt and one of more than BF16_ROWS tokens."""
    import fast_cpu_kernels
    import fast_cpu_quant
    import qops
    import tokenizer as T
    from aoti_export import AOTIBackend
    from quantize import load_model
    if not fast_cpu_kernels.available():
        pytest.skip("this CPU has no AVX2: fast_cpu_kernels' kernels do not run (test_long_prompt_model)")
    q, pt2 = quantized(mode)
    assert AOTIBackend(pt2).metadata["models"] == "model,prompt"
    model = load_model(q)
    blocks = sum(1 for m in model.layers.modules() if isinstance(m, qops.QuantizedLinear))
    int4 = sum(1 for m in model.modules() if isinstance(m, qops.QuantizedLinear) and m.qweight.bits == 4)
    want = Counter({"prompt": int4, "model": int4} if mode == "int4" else {"prompt": blocks, "model": 0})
    assert int4_kernel_calls(pt2) == want, int4_kernel_calls(pt2)
    assert len(T.load_tokenizer(env["bpe"]).encode(LONG_PROMPT)) > fast_cpu_quant.BF16_ROWS
    for prompt in ("Once upon a time", LONG_PROMPT):
        expect = generate_py(["--aoti_package", pt2], env["bpe"], prompt, 12)
        r = run([runner, pt2, "-z", env["bins"]["bpe"], "-i", prompt, "-n", 12, "-t", 0])
        assert r.returncode == 0 and r.stdout == expect and "long_prompt" not in r.stderr, r.stderr


@pytest.mark.parametrize("mode", ["int8", "int4-nokernel", "8da4w-nokernel"])
def test_long_prompt_model(env, runner, quantized, mode, monkeypatch):
    """An int4 or 8da4w package made where fast_cpu_kernels' kernel does not run (see `quantized`), on a CPU
    with bfloat16 dot products (forced in `quantized` and here, so any CPU runs the test: oneDNN converts where the
    instructions are missing) adds "long_prompt":
    prompts of BF16_ROWS tokens or more, their products through oneDNN's bfloat16 GEMM on weights converted per
    product: 8da4w's from its words (words_bf16_t: it adds only the shift amounts), weight-only int4's, which has no
    words (ATen's blocked layout alone), from qdata, its scales and zeros (_qdata_bf16_t); the long prompt's last
    logits (int4 / 8da4w: weights rounded once to bfloat16; eager int4's packed kernel rounds its scales and offsets
    instead, eager 8da4w runs float32 products) are no further from the float32 product of the dequantized weights
    than eager's are, up to a factor of 2 (int4, measured: 0.0043 against 0.0057 of 0.71); the cache it writes is
    the one "model" decodes from; the runner loads it and prints what generate.py prints. A weight-only int8 package
    has no "long_prompt": its "prompt" runs that GEMM at every length, on a bfloat16 copy of the integer weights
    (exact) packed by oneDNN, whose sums in another order than eager's unpacked GEMM round some outputs to the
    neighbouring bfloat16 (measured 0.0032 from the float32 product against eager's 0.0037 of 0.64; the step after
    it 0.0024 against 0.0023)."""
    import aoti_export
    import fast_cpu
    import fast_cpu_quant
    import qops
    from quantize import load_model
    monkeypatch.setattr(fast_cpu_quant, "BF16_GEMM", True)  # (the eager models below: int8's bfloat16 GEMM)
    q, pt2 = quantized(mode)
    b = aoti_export.AOTIBackend(pt2)
    with zipfile.ZipFile(pt2) as z:  # its products are GEMMs (oneDNN's), not ATen's packed weight-only kernels
        code = {n.split("/")[-2]: z.read(n).decode() for n in z.namelist() if n.endswith(".wrapper.cpp")}
    if mode == "int8":
        assert b.metadata["models"] == "model,prompt" and "pack_mm" not in code["prompt"]
    else:
        assert b.metadata["models"] == "model,prompt,long_prompt" and b.long_prompt_min == fast_cpu_quant.BF16_ROWS
        _, index = package_index(pt2)
        records = {}
        for row in index:
            records.setdefault(row[0], {})[row[2]] = row
        added = [row for rec, row in records["long_prompt"].items() if rec not in records["model"]]
        if mode == "8da4w-nokernel":  # the shift amounts only
            assert all(row[3] == "int32" and int(row[5].split(",")[0]) in (4, 8) for row in added), added
        else:  # each int4 linear's qdata, scales and zeros (and one shift-amount tensor)
            n = sum(1 for m in load_model(q).layers.modules() if isinstance(m, qops.QuantizedLinear))
            kinds = Counter(row[3] for row in added)
            assert set(kinds) == {"uint8", "float32"} and kinds["uint8"] >= n and kinds["float32"] == 2 * n, kinds
        assert "aoti_torch_cpu_mm" in code["long_prompt"]  # (int4's one-row output projection: ATen's int4 kernel)
        assert ("pack_mm" in code["long_prompt"]) == (mode == "int4-nokernel")
        assert int4_kernel_calls(pt2)["prompt"] == 0 and "pack_mm" in code["prompt"]  # ATen's below BF16_ROWS
    m = load_model(q)
    fast_cpu.swap_in(m)  # eager with the CPU kernels (generate.py's)
    m.setup_caches(1, MAX_SEQ)
    T = fast_cpu_quant.BF16_ROWS + 8
    x, pos = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(0)), torch.arange(T)
    f = load_model(q)  # float32 nn.Linear layers with the dequantized weights
    for name, lin in list(f.layers.named_modules()):
        if isinstance(lin, qops.QuantizedLinear):
            dense = torch.nn.Linear(lin.in_features, lin.out_features, bias=False)
            dense.weight.data = lin.qweight.dequantize().float()
            f.layers.get_submodule(name.rpartition(".")[0]).register_module(name.rpartition(".")[2], dense)
    f.setup_caches(1, MAX_SEQ)
    # the prompt (the output projection of one row, as the package), then a step that "model" decodes from the cache
    # "long_prompt" wrote
    for args, kw in (((x, pos), {"logits_at": torch.tensor([T - 1])}), ((x[:, :1], pos[:1] + T), {})):
        got, want, ref = b.forward(*args, **kw), m(*args, **kw), f(*args, **kw)
        err, eager_err = (got - ref).abs().max(), (want - ref).abs().max()
        assert err <= 2 * eager_err, (err, eager_err)
    expect = generate_py(["--aoti_package", pt2], env["bpe"], LONG_PROMPT, 12)
    r = run([runner, pt2, "-z", env["bins"]["bpe"], "-i", LONG_PROMPT, "-n", 12, "-t", 0])
    assert r.returncode == 0 and r.stdout == expect, r.stderr
    assert (f'from {fast_cpu_quant.BF16_ROWS} tokens "long_prompt"' in r.stderr) == (mode != "int8")


def test_broken_inputs(env, runner, tmp_path):
    good = env["pt2"].read_bytes()
    (tmp_path / "trunc.pt2").write_bytes(good[:len(good) // 2])
    (tmp_path / "junk.pt2").write_bytes(b"not a zip at all" * 100)
    tok = env["bins"]["bpe"].read_bytes()
    (tmp_path / "trunc.bin").write_bytes(tok[:len(tok) // 3])
    cases = [
        ([tmp_path / "trunc.pt2", "-z", env["bins"]["bpe"]], "truncated"),
        ([tmp_path / "junk.pt2", "-z", env["bins"]["bpe"]], "not an AOT Inductor package"),
        ([tmp_path / "missing.pt2", "-z", env["bins"]["bpe"]], "cannot open"),
        ([env["pt2"], "-z", tmp_path / "trunc.bin"], "truncated"),
        ([env["pt2"], "-z", tmp_path / "missing.bin"], "cannot open tokenizer"),
        ([env["pt2"], "-z", env["bins"]["bpe"], "-t", "abc"], "bad value"),
        ([env["pt2"], "-z", env["bins"]["bpe"], "-m", "poem"], "unknown mode"),
        ([env["pt2"], "-z", env["bins"]["bpe"], "-i", "x " * 200], "does not fit the context"),
    ]
    for args, msg in cases:
        r = run([runner, *args, "-i", "hi"] if "-i" not in args else [runner, *args])
        last = r.stderr.strip().splitlines()[-1]
        assert r.returncode == 1 and last.startswith("error: ") and msg in last, (args, r.stderr)
        assert r.stdout == ""
    # generate.py: one line, exit 1, no traceback
    for f, msg in ((tmp_path / "trunc.pt2", "not an AOT Inductor package"), (tmp_path / "missing.pt2", "not found")):
        r = run([sys.executable, REPO / "generate.py", "--aoti_package", f, "--tokenizer_path", env["bpe"]])
        assert r.returncode == 1 and r.stderr.startswith("error: ") and msg in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
    r = run([sys.executable, REPO / "aoti_export.py", "--checkpoint_path", tmp_path / "nope.pth", "--output_path",
             tmp_path / "x.pt2"])
    assert r.returncode == 1 and r.stderr.startswith("error: ") and not (tmp_path / "x.pt2").exists()


def test_modes_need_their_models(env, runner):
    """A package exported without a mode's model: one error line naming the export flag (runner and generate.py)."""
    for mode, flag in (("hybrid", "--prefill_chunk"), ("lookahead", "--lookahead")):
        r = run([runner, env["pt2"], "-z", env["bins"]["bpe"], "-i", "hi", "-t", 0, "-M", mode])
        assert r.returncode == 1 and r.stdout == "", r.stderr
        assert r.stderr.strip().splitlines()[-1].startswith("error: ") and flag in r.stderr, r.stderr
    r = run([sys.executable, REPO / "generate.py", "--aoti_package", env["pt2"], "--tokenizer_path", env["bpe"],
             "--temperature", 0, "--lookahead", "5,1,2"])
    last = r.stderr.strip().splitlines()[-1]  # (importing executorch / torchao may log lines before it)
    assert r.returncode == 1 and last.startswith("error: ") and "aoti_export.py --lookahead" in last, r.stderr
    assert "Traceback" not in r.stderr
