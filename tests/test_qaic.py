# compile_qaic.py without the Qualcomm SDK: a fake qaic-exec (a Python script that records its argv and writes
# <aic-binary-dir>/programqpc.bin) checks every compiler flag and input file, the QPC cache, --dry_run and the error
# paths; QpcBackend is checked for its SDK error, its specializations parsing, and its prefill-chunk / padding /
# batch_index logic against eager PyTorch through a fake device session that runs the same graph on ONNX Runtime
# and enforces the compiled specializations the way the card does.
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import compile_qaic  # noqa: E402
import export_onnx  # noqa: E402
import engine  # noqa: E402
from compile_qaic import QpcBackend  # noqa: E402
from quantize import load_model  # noqa: E402
from test_onnx import make_checkpoint  # noqa: E402

pytest.importorskip("onnxruntime")
yaml = pytest.importorskip("yaml")

N_LAYER = 2
KV = [f"past_{k}.{i}" for i in range(N_LAYER) for k in ("key", "value")]

FAKE_COMPILER = """#!{python}
import json, os, sys
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "argv.jsonl"), "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
out = [a.split("=", 1)[1] for a in sys.argv if a.startswith("-aic-binary-dir=")][0]
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "programqpc.bin"), "wb") as f:
    f.write(b"QPC")
if {fail}:
    sys.stderr.write("qaic-exec: ERROR: Node ScatterND_42: unsupported configuration\\n")
    sys.exit(1)
print("compilation done (fake)")
"""


def write_compiler(directory: Path, fail=False) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "qaic-exec"
    path.write_text(FAKE_COMPILER.format(python=sys.executable, fail=fail))
    path.chmod(0o755)
    return path


def calls(compiler: Path) -> list:
    log = compiler.parent / "argv.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tiny_q"))


@pytest.fixture(scope="module")
def graphs(ckpt, tmp_path_factory):
    """One plain and one continuous-batching graph (exported once, no self-check: test_onnx.py covers it)."""
    plain, cb = tmp_path_factory.mktemp("g"), tmp_path_factory.mktemp("g_cb")
    export_onnx.export(ckpt, plain, ctx_len=32, check=False, log=lambda *a: None)
    export_onnx.export(ckpt, cb, ctx_len=32, full_batch_size=2, check=False, log=lambda *a: None)
    return plain / "model.onnx", cb / "model.onnx"


@pytest.fixture
def compiler(tmp_path):
    return write_compiler(tmp_path / "bin")


def run_main(argv, capsys=None):
    cache = compile_qaic.main([str(a) for a in argv])
    return Path(cache)


def base_args(onnx_path, out, compiler, *extra):
    return ["--onnx_path", onnx_path, "--output_dir", out, "--num_cores", 14, "--batch_size", 1, "--prompt_len", 8,
            "--ctx_len", 32, "--qaic_exec", compiler, *extra]


# ------------------------------------------------------------------------------------------------- flags and inputs
def test_single_device_command(graphs, tmp_path, compiler):
    out = tmp_path / "out"
    cache = run_main(base_args(graphs[0], out, compiler))
    assert cache == (out / "qpc_14cores_1bs_8pl_32cl_-1mos_1devices_fp16").resolve()
    [argv] = calls(compiler)
    assert argv == ["-aic-hw", "-aic-hw-version=2.0", f"-m={graphs[0].resolve()}", "-compile-only",
                    "-retained-state", "-convert-to-fp16", "-aic-num-cores=14",
                    f"-network-specialization-config={cache / 'specializations.json'}",
                    f"-custom-IO-list-file={cache / 'custom_io.yaml'}", f"-aic-binary-dir={cache / 'qpc.tmp'}"]
    assert (cache / "qpc" / "programqpc.bin").read_bytes() == b"QPC"
    assert not (cache / "qpc.tmp").exists() and not (cache / "mdp.json").exists()
    assert json.loads((cache / "specializations.json").read_text()) == {"specializations": [
        {"batch_size": "1", "seq_len": "8", "ctx_len": "32"}, {"batch_size": "1", "seq_len": "1", "ctx_len": "32"}]}
    io = yaml.safe_load((cache / "custom_io.yaml").read_text())
    assert io == [{"IOName": n, "Precision": "float16"} for n in KV] + \
        [{"IOName": n + "_RetainedState", "Precision": "float16"} for n in KV]
    done = json.loads((cache / "qpc_done.json").read_text())
    assert done["command"] == argv and done["export_id"] == export_onnx.read_metadata(graphs[0])["export_id"]
    assert done["vocab_size"] == 320 and done["tokenizer_dir"] == str(graphs[0].parent)


def test_mxfp6_mos_depth_first_batch(graphs, tmp_path, compiler):
    out = tmp_path / "out"
    args = base_args(graphs[0], out, compiler, "--mxfp6", "--mos", 1, "--aic_enable_depth_first")
    args[args.index("--batch_size") + 1] = 4
    cache = run_main(args)
    assert cache.name == "qpc_14cores_4bs_8pl_32cl_1mos_1devices_mxfp6"
    [argv] = calls(compiler)
    assert argv[-3:] == ["-mxfp6-matmul", "-mos=1", "-aic-enable-depth-first"]
    specs = json.loads((cache / "specializations.json").read_text())["specializations"]
    assert [s["batch_size"] for s in specs] == ["4", "4"] and [s["seq_len"] for s in specs] == ["8", "1"]


def test_multi_device_partition(graphs, tmp_path, compiler):
    out = tmp_path / "out"
    cache = run_main(base_args(graphs[0], out, compiler, "--device_group", "0,1,2,3", "--mxfp6"))
    assert cache.name == "qpc_14cores_1bs_8pl_32cl_-1mos_4devices_mxfp6"
    [argv] = calls(compiler)
    assert argv[-1] == f"-mdp-load-partition-config={cache / 'mdp.json'}"
    assert "-allow-mxint8-mdp-io" not in argv
    assert json.loads((cache / "mdp.json").read_text()) == {
        "connections": [{"devices": [0, 1, 2, 3], "type": "p2p"}],
        "partitions": [{"name": "Partition0", "devices": [{"deviceId": d, "numCores": 14} for d in range(4)]}]}


def test_mxint8_kv_cache(graphs, tmp_path, compiler):
    out = tmp_path / "out"
    cache = run_main(base_args(graphs[0], out, compiler, "--mxint8"))
    assert cache.name == "qpc_14cores_1bs_8pl_32cl_-1mos_1devices_fp16_mxint8"
    io = yaml.safe_load((cache / "custom_io.yaml").read_text())
    assert len(io) == 2 * len(KV) and all(e["Precision"] == "mxint8" for e in io)
    assert {e["IOName"] for e in io} == set(KV) | {n + "_RetainedState" for n in KV}
    assert "-allow-mxint8-mdp-io" not in calls(compiler)[0]  # one device: no MDP IO
    cache2 = run_main(base_args(graphs[0], out, compiler, "--mxint8", "--mxfp6", "--device_group", "0,1"))
    assert cache2.name == "qpc_14cores_1bs_8pl_32cl_-1mos_2devices_mxfp6_mxint8"
    argv = calls(compiler)[1]
    assert argv[-3:] == ["-mxfp6-matmul", "-allow-mxint8-mdp-io", f"-mdp-load-partition-config={cache2 / 'mdp.json'}"]


def test_continuous_batching_specializations(graphs, tmp_path, compiler):
    out = tmp_path / "out"
    cache = run_main(base_args(graphs[1], out, compiler, "--full_batch_size", 2))
    assert cache.name == "qpc_14cores_1bs_8pl_32cl_-1mos_1devices_fp16_2fbs"
    assert json.loads((cache / "specializations.json").read_text()) == {"specializations": [
        {"batch_size": "1", "seq_len": "8", "ctx_len": "32", "full_batch_size": "2"},
        {"batch_size": "2", "seq_len": "1", "ctx_len": "32", "full_batch_size": "2"}]}
    assert compile_qaic.read_specializations(cache / "specializations.json") == dict(
        prompt_len=8, ctx_len=32, batch_size=1, decode_batch_size=2, full_batch_size=2)
    # the graph kind must match the request
    with pytest.raises(ValueError, match="full_batch_size"):
        run_main(base_args(graphs[1], out, compiler))
    with pytest.raises(ValueError, match="full_batch_size"):
        run_main(base_args(graphs[0], out, compiler, "--full_batch_size", 2))
    with pytest.raises(ValueError, match="batch_size"):
        args = base_args(graphs[1], out, compiler, "--full_batch_size", 2)
        args[args.index("--batch_size") + 1] = 2
        run_main(args)


def test_qpc_cache_reuse(graphs, tmp_path, compiler, capsys):
    out = tmp_path / "out"
    first = run_main(base_args(graphs[0], out, compiler, "--mxfp6"))
    stamp = (first / "qpc" / "programqpc.bin").stat().st_mtime_ns
    second = run_main(base_args(graphs[0], out, compiler, "--mxfp6"))
    assert second == first and len(calls(compiler)) == 1  # the compiler ran once
    assert (first / "qpc" / "programqpc.bin").stat().st_mtime_ns == stamp
    assert "reusing" in capsys.readouterr().out
    # same directory name, different command (depth-first): compiled again, replacing the old QPC
    third = run_main(base_args(graphs[0], out, compiler, "--mxfp6", "--aic_enable_depth_first"))
    assert third == first and len(calls(compiler)) == 2
    # a half-finished earlier compile (QPC without its done marker) is not trusted
    (first / "qpc_done.json").unlink()
    run_main(base_args(graphs[0], out, compiler, "--mxfp6", "--aic_enable_depth_first"))
    assert len(calls(compiler)) == 3


def test_dry_run(graphs, tmp_path, compiler, capsys):
    out = tmp_path / "out"
    cache = run_main(base_args(graphs[0], out, compiler, "--dry_run", "--device_group", "0,1"))
    assert calls(compiler) == []
    text = capsys.readouterr().out
    assert f"{compiler} -aic-hw -aic-hw-version=2.0 -m={graphs[0].resolve()}" in text and "dry run" in text
    assert "-mdp-load-partition-config=" in text
    for f in ("specializations.json", "custom_io.yaml", "mdp.json"):
        assert (cache / f).is_file(), f
    assert not (cache / "qpc").exists() and not (cache / "qpc.tmp").exists()


def test_auto_export_and_reexport(ckpt, tmp_path, compiler, capsys):
    """Without --onnx_path the checkpoint is exported to <output_dir>/model.onnx; that graph is reused while it
    matches, and re-exported when the batching kind changes."""
    out = tmp_path / "out"
    run_main(["--checkpoint_path", ckpt, "--output_dir", out, "--prompt_len", 4, "--ctx_len", 16,
              "--qaic_exec", compiler])
    text = capsys.readouterr().out
    assert "exporting" in text and "PASS" in text and (out / "model.onnx").is_file()
    first_id = export_onnx.read_metadata(out / "model.onnx")["export_id"]
    run_main(["--checkpoint_path", ckpt, "--output_dir", out, "--prompt_len", 4, "--ctx_len", 16, "--mxfp6",
              "--qaic_exec", compiler])
    assert "using" in capsys.readouterr().out
    assert export_onnx.read_metadata(out / "model.onnx")["export_id"] == first_id
    run_main(["--checkpoint_path", ckpt, "--output_dir", out, "--prompt_len", 4, "--ctx_len", 16,
              "--full_batch_size", 2, "--qaic_exec", compiler])
    assert "exported without --full_batch_size" in capsys.readouterr().out
    assert export_onnx.read_metadata(out / "model.onnx")["full_batch_size"] == 2
    assert len(calls(compiler)) == 3
    assert calls(compiler)[0][2] == f"-m={(out / 'model.onnx').resolve()}"


# ------------------------------------------------------------------------------------------------- error paths
def _cli(args, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k != "QAIC_EXEC"}
    env.update(PYTHONWARNINGS="ignore", PATH="/usr/bin:/bin", **(env_extra or {}))
    return subprocess.run([sys.executable, "compile_qaic.py", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, env=env, timeout=300)


@pytest.mark.skipif(Path(compile_qaic.DEFAULT_QAIC_EXEC).exists(), reason="a real qaic-exec is installed")
def test_no_compiler_is_one_clear_line(graphs, ckpt, tmp_path):
    """Without the SDK the run stops at once with one line: before exporting the checkpoint or writing any compiler
    input (issue 19). --dry_run, which the line points to, still writes the inputs and prints the command."""
    out = tmp_path / "out"
    for source in (["--checkpoint_path", ckpt], ["--onnx_path", graphs[0]]):
        r = _cli([*source, "--output_dir", out, "--num_cores", 4, "--prompt_len", 8, "--ctx_len", 32])
        assert r.returncode != 0
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and "Apps SDK" in lines[0] and "qaic-exec" in lines[0]
        assert "--dry_run" in lines[0] and r.stdout == ""
        assert not out.exists()  # no graph exported, no compiler inputs
    r = _cli(["--onnx_path", graphs[0], "--output_dir", out, "--num_cores", 4, "--prompt_len", 8, "--ctx_len", 32,
              "--dry_run"])
    assert r.returncode == 0, r.stderr
    assert f"{compile_qaic.DEFAULT_QAIC_EXEC} -aic-hw" in r.stdout and "-aic-binary-dir=" in r.stdout
    cache = out / "qpc_4cores_1bs_8pl_32cl_-1mos_1devices_fp16"
    assert (cache / "specializations.json").is_file() and (cache / "custom_io.yaml").is_file()
    assert not (cache / "qpc").exists()
    # a --qaic_exec that is not there is named as such
    r = _cli(["--onnx_path", graphs[0], "--output_dir", out, "--ctx_len", 32, "--qaic_exec", tmp_path / "nope"])
    assert r.returncode != 0 and r.stderr.strip().splitlines() == [f"error: --qaic_exec {tmp_path / 'nope'} is not an executable file"]


def test_compiler_failure_shows_stderr_and_leaves_no_qpc(graphs, tmp_path):
    bad = write_compiler(tmp_path / "badbin", fail=True)
    out = tmp_path / "out"
    r = _cli(["--onnx_path", graphs[0], "--output_dir", out, "--prompt_len", 8, "--ctx_len", 32],
             env_extra={"QAIC_EXEC": str(bad)})  # found through $QAIC_EXEC
    assert r.returncode != 0
    assert "ERROR: Node ScatterND_42: unsupported configuration" in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: qaic-exec exited with code 1")
    cache = out / "qpc_16cores_1bs_8pl_32cl_-1mos_1devices_fp16"
    assert len(calls(bad)) == 1
    assert not (cache / "qpc").exists() and not (cache / "qpc.tmp").exists() and not (cache / "qpc_done.json").exists()


def test_bad_arguments(graphs, tmp_path, compiler):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="longer than"):
        run_main(base_args(graphs[0], out, compiler, "--prompt_len", 64))
    with pytest.raises(ValueError, match="exceeds"):
        args = base_args(graphs[0], out, compiler)
        args[args.index("--ctx_len") + 1] = 4096
        run_main(args)
    with pytest.raises(ValueError, match="device ids"):
        run_main(base_args(graphs[0], out, compiler, "--device_group", "0,x"))
    assert compile_qaic.parse_device_group("[0, 1]") == [0, 1]
    assert calls(compiler) == []


# ------------------------------------------------------------------------------------------------- QpcBackend
def test_read_specializations_errors(tmp_path):
    p = tmp_path / "specializations.json"
    with pytest.raises(FileNotFoundError):
        compile_qaic.read_specializations(p)
    p.write_text("{}")
    with pytest.raises(ValueError, match="not a specializations file"):
        compile_qaic.read_specializations(p)
    p.write_text(json.dumps({"specializations": [{"batch_size": "1", "seq_len": "32", "ctx_len": "128"}]}))
    with pytest.raises(ValueError, match="no decode"):
        compile_qaic.read_specializations(p)
    p.write_text(json.dumps(compile_qaic.make_specializations(1, 1, 64)))  # prompt_len 1: one shape serves both
    assert compile_qaic.read_specializations(p)["prompt_len"] == 1


def _compiled(graph, out, compiler, *extra):
    return run_main(["--onnx_path", graph, "--output_dir", out, "--prompt_len", 4, "--ctx_len", 32,
                     "--qaic_exec", compiler, *extra])


def test_qpc_backend_without_sdk(graphs, tmp_path, compiler):
    cache = _compiled(graphs[0], tmp_path / "out", compiler)
    try:
        import qaicrt  # noqa: F401
        pytest.skip("the Cloud AI 100 runtime is installed here")
    except ImportError:
        pass
    with pytest.raises(ImportError, match="Platform SDK"):
        QpcBackend(cache, device_group="0")
    with pytest.raises(FileNotFoundError, match="no compiled QPC"):
        QpcBackend(tmp_path / "nothing")
    # through generate.py: one line naming the SDK
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")  # no note on busy cores before the error
    r = subprocess.run([sys.executable, "generate.py", "--qpc", str(cache), "--tokenizer_path", str(graphs[0].parent),
                        "--prompt", "hello"], cwd=REPO, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: running a QPC needs") and "Platform SDK" in lines[0]


class FakeDeviceSession:
    """Stands in for QaicSession: runs the compiled graph on ONNX Runtime, keeps the KV cache inside (retained
    state), and like the card accepts only the compiled (batch, seq_len) specializations, a logits buffer of the
    matching batch, and requires the KV buffers to be skipped."""

    def __init__(self, onnx_path, cache_dir):
        import onnxruntime as ort
        self.sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
        self.input_names = [i.name for i in self.sess.get_inputs()]
        self.output_names = [o.name for o in self.sess.get_outputs()]
        specs = json.loads((Path(cache_dir) / "specializations.json").read_text())["specializations"]
        self.allowed = {(int(s["batch_size"]), int(s["seq_len"])) for s in specs}
        ctx = int(specs[0]["ctx_len"])
        rows = int(specs[0].get("full_batch_size", specs[0]["batch_size"]))
        shape = self.sess.get_inputs()[self.input_names.index("past_key.0")].shape
        self.kv = {n: np.zeros((rows, shape[1], ctx, shape[3]), np.float32) for n in self.input_names
                   if n.startswith("past_")}
        self.skipped, self.logits_shape, self.runs = set(), None, []

    def binding_dims(self, name):
        return [1, 1, 320]

    def skip_buffers(self, names):
        self.skipped |= set(names)

    def set_buffers(self, buffers):
        self.logits_shape = buffers["logits"].shape

    def run(self, inputs):
        assert self.skipped == set(self.kv) | {n + "_RetainedState" for n in self.kv}
        B, S = inputs["input_ids"].shape
        assert (B, S) in self.allowed, f"no specialization for batch {B} seq_len {S}: {self.allowed}"
        assert self.logits_shape == (B, 1, 320)
        assert inputs["position_ids"].shape == (B, S) and inputs["position_ids"].dtype == np.int64
        self.runs.append((B, S))
        out = self.sess.run(None, {**inputs, **self.kv})
        for n, v in zip(self.output_names[1:], out[1:]):
            self.kv[n.replace("_RetainedState", "")] = v
        return {"logits": out[0]}


def test_qpc_backend_logic_matches_pytorch(graphs, ckpt, tmp_path, compiler):
    """Batch-2 QPC with prompt_len 4: prompts of 6 and 3 tokens go in two padded chunks, then decode; and a
    continuous-batching QPC (2 slots) serving 4 prompts through generate_continuous."""
    out = tmp_path / "out"
    cache = _compiled(graphs[0], out, compiler, "--batch_size", 2)
    backend = QpcBackend(cache, device_group="0", session=FakeDeviceSession(graphs[0], cache))
    assert (backend.prefill_chunk, backend.max_seq_length, backend.max_batch_size) == (4, 32, 2)
    prompts = [[5, 17, 42, 99, 7, 250], [27, 18, 300]]
    ref = engine.TorchBackend(load_model(ckpt), 2, 32)
    want, _ = engine.generate(ref, prompts, 8, torch.device("cpu"))
    got, _ = engine.generate(backend, prompts, 8, torch.device("cpu"))
    assert got == want
    assert backend.session.runs[:2] == [(2, 4), (2, 4)] and set(backend.session.runs[2:]) == {(2, 1)}
    # one prompt on the batch-2 QPC: the missing row rides along as padding
    one, _ = engine.generate(backend, prompts[:1], 5, torch.device("cpu"))
    ref1 = engine.TorchBackend(load_model(ckpt), 1, 32)
    assert one == engine.generate(ref1, prompts[:1], 5, torch.device("cpu"))[0]
    with pytest.raises(ValueError, match="without --full_batch_size"):
        backend.forward(torch.tensor([[1]]), torch.tensor([[3]]), batch_index=torch.tensor([[1]]))

    cache = _compiled(graphs[1], out, compiler, "--full_batch_size", 2)
    backend = QpcBackend(cache, device_group="0", session=FakeDeviceSession(graphs[1], cache))
    assert backend.max_batch_size == 2 and backend.prefill_chunk == 4
    prompts = [[3, 1, 4, 1, 5], [27, 18], [100, 200, 300, 12, 13, 14, 15, 16, 17], [9]]
    want = [engine.generate(engine.TorchBackend(load_model(ckpt), 1, 32), [p], 6, torch.device("cpu"))[0][0] for p in prompts]
    got, _ = engine.generate_continuous(backend, prompts, 6, torch.device("cpu"), 2)
    assert got == want
    assert set(backend.session.runs) == {(1, 4), (2, 1)}  # prefill batch 1, decode full_batch_size
