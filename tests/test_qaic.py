# compile_qaic.py without the Qualcomm SDK: tests/fake_qaic/qaic-compile models both compiler CLIs (qaic-compile,
# and qaic-exec of older SDKs): each takes exactly the options its real CLI documents for these flows and fails on any
# other, and checks the compiler inputs against the graph. Here: the command each CLI gets, the compiler search order,
# the inputs, the QPC cache, --dry_run, --sub_functions (the function graph equals the flat one on ONNX Runtime) and the
# error paths. QpcBackend and the one command (--prompt): test_qpc_backend.py.
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import compile_qaic  # noqa: E402
import export_onnx  # noqa: E402
import engine  # noqa: E402
from export_onnx import OnnxBackend  # noqa: E402
from test_onnx import make_checkpoint  # noqa: E402

pytest.importorskip("onnxruntime")
yaml = pytest.importorskip("yaml")

N_LAYER = 2
KV = [f"past_{k}.{i}" for i in range(N_LAYER) for k in ("key", "value")]
FAKE = Path(__file__).resolve().parent / "fake_qaic" / "qaic-compile"
SDK_VERSION = "1.20.4.0 (fake)"


def write_compiler(directory: Path, kind="qaic-compile") -> Path:
    """tests/fake_qaic/qaic-compile as `kind` in `directory`, run by this interpreter (onnx, yaml)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / kind
    path.write_text(f"#!{sys.executable}\n" + FAKE.read_text().split("\n", 1)[1])
    path.chmod(0o755)
    return path


def calls(compiler: Path) -> list:
    """The compile calls (not `-v`) the fake at `compiler` got, each its argv."""
    log = compiler.parent / "argv.jsonl"
    rows = [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []
    return [r["argv"] for r in rows if r["argv"] != ["-v"]]


@pytest.fixture(autouse=True)
def no_env_compilers(monkeypatch):
    monkeypatch.delenv("QAIC_COMPILE", raising=False)
    monkeypatch.delenv("QAIC_EXEC", raising=False)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tiny_q"))


@pytest.fixture(scope="module")
def graphs(ckpt, tmp_path_factory):
    """A plain, a continuous-batching and a sub-function graph (exported once, no self-check: test_onnx.py covers it;
    the sub-function graph is compared with the plain one below)."""
    dirs = [tmp_path_factory.mktemp(n) for n in ("g", "g_cb", "g_sf")]
    export_onnx.export(ckpt, dirs[0], ctx_len=32, check=False, log=lambda *a: None)
    export_onnx.export(ckpt, dirs[1], ctx_len=32, full_batch_size=2, check=False, log=lambda *a: None)
    export_onnx.export(ckpt, dirs[2], ctx_len=32, sub_functions=True, check=False, log=lambda *a: None)
    return [d / "model.onnx" for d in dirs]


@pytest.fixture
def compiler(tmp_path):
    return write_compiler(tmp_path / "bin")


@pytest.fixture
def qaic_exec(tmp_path):
    return write_compiler(tmp_path / "oldbin", "qaic-exec")


def run_main(argv):
    return Path(compile_qaic.main([str(a) for a in argv]))


def base_args(onnx_path, out, compiler, *extra):
    return ["--onnx_path", onnx_path, "--output_dir", out, "--num_cores", 14, "--batch_size", 1, "--prompt_len", 8,
            "--ctx_len", 32, "--compiler", compiler, *extra]


def common_tail(cache):
    return ["-retained-state", "-convert-to-fp16", "-aic-num-cores=14",
            f"-network-specialization-config={cache / 'specializations.json'}",
            f"-custom-IO-list-file={cache / 'custom_io.yaml'}", f"-aic-binary-dir={cache / 'qpc.tmp'}"]


# ------------------------------------------------------------------------------------------------- the two CLIs
def test_qaic_compile_command(graphs, tmp_path, compiler, capsys):
    out = tmp_path / "out"
    cache = run_main(base_args(graphs[0], out, compiler))
    assert cache == (out / "qpc_14cores_1bs_8pl_32cl_-1mos_1devices_fp16").resolve()
    [argv] = calls(compiler)
    assert argv == ["-aic-hw", "-aic-hw-version=ai100", f"-m={graphs[0].resolve()}", *common_tail(cache)]
    assert f"compiler: {compiler} (qaic-compile, version: qaic-compile version {SDK_VERSION})" in capsys.readouterr().out
    assert json.loads((cache / "qpc" / "programqpc.bin").read_text())["compiler"] == "qaic-compile"
    assert not (cache / "qpc.tmp").exists() and not (cache / "mdp.json").exists()
    assert json.loads((cache / "specializations.json").read_text()) == {"specializations": [
        {"batch_size": "1", "seq_len": "8", "ctx_len": "32"}, {"batch_size": "1", "seq_len": "1", "ctx_len": "32"}]}
    io = yaml.safe_load((cache / "custom_io.yaml").read_text())
    assert io == [{"IOName": n, "Precision": "float16"} for n in KV] + \
        [{"IOName": n + "_RetainedState", "Precision": "float16"} for n in KV]
    done = json.loads((cache / "qpc_done.json").read_text())
    assert done["command"] == argv and done["export_id"] == export_onnx.read_metadata(graphs[0])["export_id"]
    assert (done["compiler"], done["compiler_version"]) == ("qaic-compile", f"qaic-compile version {SDK_VERSION}")
    assert done["vocab_size"] == 320 and done["tokenizer_dir"] == str(graphs[0].parent)


def test_qaic_exec_command(graphs, tmp_path, qaic_exec):
    """An older SDK's qaic-exec: -aic-hw-version=2.0 and -compile-only (same inputs, same cache layout)."""
    out = tmp_path / "out"
    cache = run_main(base_args(graphs[0], out, qaic_exec, "--mxfp6", "--mos", 1))
    [argv] = calls(qaic_exec)
    assert argv == ["-aic-hw", "-aic-hw-version=2.0", f"-m={graphs[0].resolve()}", "-compile-only",
                    *common_tail(cache), "-mxfp6-matmul", "-mos=1"]
    assert json.loads((cache / "qpc_done.json").read_text())["compiler"] == "qaic-exec"
    # the legacy flag names the same CLI; ai100 is spelled 2.0 for it
    run_main(base_args(graphs[0], tmp_path / "o2", qaic_exec, "--aic_hw_version", "ai100")[:-4] +
             ["--ctx_len", 32, "--qaic_exec", qaic_exec, "--aic_hw_version", "ai100"])
    assert "-aic-hw-version=2.0" in calls(qaic_exec)[1]
    # what only qaic-compile has: one line before anything is written
    for extra in (["--sub_functions"], ["--aic_hw_version", "ai200"], ["--mdts_mos", 1, "--device_group", "0,1"]):
        with pytest.raises(ValueError, match="need.* qaic-compile"):
            run_main(base_args(graphs[2] if extra == ["--sub_functions"] else graphs[0], tmp_path / "o3", qaic_exec,
                               *extra))
    assert not (tmp_path / "o3").exists() and len(calls(qaic_exec)) == 2


def test_compiler_search_order(tmp_path, monkeypatch):
    """qaic-compile first ($QAIC_COMPILE, the SDK's folder, PATH), then qaic-exec; --compiler picks a CLI."""
    sdk, path_dir = tmp_path / "sdk", tmp_path / "path"
    monkeypatch.setattr(compile_qaic, "SDK_EXEC", str(sdk))
    monkeypatch.setenv("PATH", str(path_dir))
    with pytest.raises(FileNotFoundError, match="neither qaic-compile nor qaic-exec"):
        compile_qaic.find_compiler()
    assert compile_qaic.find_compiler(required=False) == compile_qaic.Compiler("qaic-compile", None)
    old = write_compiler(path_dir, "qaic-exec")
    assert compile_qaic.find_compiler().kind == "qaic-exec"  # only an older SDK: its qaic-exec
    write_compiler(sdk, "qaic-exec")
    assert compile_qaic.find_compiler().path == str(sdk / "qaic-exec")  # the SDK's folder before PATH
    new = write_compiler(path_dir, "qaic-compile")
    found = compile_qaic.find_compiler()
    assert (found.kind, found.path, found.version) == ("qaic-compile", str(new), f"qaic-compile version {SDK_VERSION}")
    assert compile_qaic.find_compiler("qaic-exec").path == str(sdk / "qaic-exec")  # --compiler qaic-exec
    env = write_compiler(tmp_path / "env", "qaic-compile")
    monkeypatch.setenv("QAIC_COMPILE", str(env))
    assert compile_qaic.find_compiler().path == str(env)
    monkeypatch.setenv("QAIC_COMPILE", str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="QAIC_COMPILE=.* is not an executable"):
        compile_qaic.find_compiler()
    assert compile_qaic.find_compiler(str(old)).kind == "qaic-exec"  # a path: its kind from its name
    with pytest.raises(FileNotFoundError, match="neither qaic-compile, qaic-exec nor an executable"):
        compile_qaic.find_compiler(str(tmp_path / "nope"))


def test_compiler_version_falls_back_to_the_sdk_file(tmp_path, monkeypatch):
    mute = tmp_path / "qaic-compile"
    mute.write_text("#!/bin/sh\nexit 1\n")
    mute.chmod(0o755)
    monkeypatch.setattr(compile_qaic, "APPS_VERSION_FILE", str(tmp_path / "apps.xml"))
    assert compile_qaic.compiler_version(str(mute)) == "unknown"
    (tmp_path / "apps.xml").write_text("<apps><base_version>1.21.2.0</base_version></apps>")
    assert compile_qaic.compiler_version(str(mute)).startswith("Apps SDK 1.21.2.0")


def test_fake_compilers_reject_what_the_real_ones_do(graphs, tmp_path):
    """The fakes are strict: a misspelled option, one of the other generation, a non-string specialization value or
    a custom IO name the graph lacks fails, so a test cannot pass on a command the real compiler would refuse."""
    new, old = write_compiler(tmp_path / "b"), write_compiler(tmp_path / "b", "qaic-exec")
    spec, io = tmp_path / "specializations.json", tmp_path / "custom_io.yaml"
    spec.write_text(json.dumps(compile_qaic.make_specializations(1, 8, 32)))
    io.write_text(compile_qaic.make_custom_io(KV, "float16"))
    base = [f"-m={graphs[0]}", "-aic-hw", "-retained-state", "-convert-to-fp16", "-aic-num-cores=14",
            f"-network-specialization-config={spec}", f"-custom-IO-list-file={io}", f"-aic-binary-dir={tmp_path / 'q'}"]

    def run(exe, *args):
        return subprocess.run([str(exe), *base, *args], capture_output=True, text=True, timeout=120)
    assert run(new, "-aic-hw-version=ai100").returncode == 0
    assert run(old, "-aic-hw-version=2.0", "-compile-only").returncode == 0
    for exe, args, why in ((new, ["-aic-hw-version=ai100", "-compile-only"], "-compile-only"),
                           (new, ["-aic-hw-version=2.0"], "not one of"),
                           (new, ["-aic-hw-version=ai100", "-mxfp6_matmul"], "-mxfp6_matmul"),
                           (new, ["-aic-hw-version=ai100", "-mos"], "malformed option '-mos'"),
                           (new, ["-aic-hw-version=ai100", "-aic-num-cores=17"], "in \\[1, 16\\]"),
                           (new, ["-aic-hw-version=ai100", "-sub-functions"], "no ONNX functions"),
                           (new, ["-aic-hw-version=ai100", "-mdts-mos=1"], "need -mdp-load-partition-config"),
                           (old, ["-aic-hw-version=ai100", "-compile-only"], "not one of"),
                           (old, ["-aic-hw-version=2.0"], "missing \\['-compile-only'\\]"),
                           (old, ["-aic-hw-version=2.0", "-compile-only", "-sub-functions"], "-sub-functions"),
                           (old, ["-aic-hw-version=2.0", "-compile-only", "-mdts-mos=1"], "-mdts-mos")):
        r = run(exe, *args)
        assert r.returncode == 2 and re.search(why, r.stderr), (exe.name, args, r.stderr)
    spec.write_text(json.dumps({"specializations": [{"batch_size": 1, "seq_len": "8", "ctx_len": "32"}]}))
    assert "must be strings" in run(new, "-aic-hw-version=ai100").stderr
    spec.write_text(json.dumps({"specializations": [{"batch": "1", "seq_len": "8", "ctx_len": "32"}]}))
    assert "no dynamic axes" in run(new, "-aic-hw-version=ai100").stderr
    spec.write_text(json.dumps(compile_qaic.make_specializations(1, 8, 32)))
    io.write_text(compile_qaic.make_custom_io(["past_key.0", "past_key.7"], "float16"))
    assert "past_key.7 is no input" in run(new, "-aic-hw-version=ai100").stderr
    assert not (tmp_path / "q" / "programqpc.bin").read_text() == ""  # the two good runs wrote a QPC


# ------------------------------------------------------------------------------------------------- flags and inputs
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


def test_multi_device_partition_and_mdts_mos(graphs, tmp_path, compiler):
    out = tmp_path / "out"
    cache = run_main(base_args(graphs[0], out, compiler, "--device_group", "0,1,2,3", "--mxfp6", "--mdts_mos", 1))
    assert cache.name == "qpc_14cores_1bs_8pl_32cl_-1mos_4devices_mxfp6_1mdtsmos"
    [argv] = calls(compiler)
    assert argv[-2:] == [f"-mdp-load-partition-config={cache / 'mdp.json'}", "-mdts-mos=1"]
    assert "-allow-mxint8-mdp-io" not in argv
    assert json.loads((cache / "mdp.json").read_text()) == {
        "connections": [{"devices": [0, 1, 2, 3], "type": "p2p"}],
        "partitions": [{"name": "Partition0", "devices": [{"deviceId": d, "numCores": 14} for d in range(4)]}]}
    with pytest.raises(ValueError, match="needs several devices"):
        run_main(base_args(graphs[0], out, compiler, "--mdts_mos", 1))


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


def test_qpc_cache_reuse(graphs, tmp_path, compiler, qaic_exec, capsys):
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
    # another compiler, or another version of it: compiled again
    run_main(base_args(graphs[0], out, qaic_exec, "--mxfp6", "--aic_enable_depth_first"))
    assert len(calls(qaic_exec)) == 1
    run_main(base_args(graphs[0], out, compiler, "--mxfp6", "--aic_enable_depth_first"))
    assert len(calls(compiler)) == 4
    compiler.write_text(compiler.read_text().replace("1.20.4.0", "1.21.0.0"))
    run_main(base_args(graphs[0], out, compiler, "--mxfp6", "--aic_enable_depth_first"))
    assert len(calls(compiler)) == 5
    assert json.loads((first / "qpc_done.json").read_text())["compiler_version"].endswith("1.21.0.0 (fake)")


def test_dry_run(graphs, tmp_path, compiler, capsys):
    out = tmp_path / "out"
    cache = run_main(base_args(graphs[0], out, compiler, "--dry_run", "--device_group", "0,1"))
    assert calls(compiler) == []
    text = capsys.readouterr().out
    assert f"{compiler} -aic-hw -aic-hw-version=ai100 -m={graphs[0].resolve()}" in text and "dry run" in text
    assert "-mdp-load-partition-config=" in text
    for f in ("specializations.json", "custom_io.yaml", "mdp.json"):
        assert (cache / f).is_file(), f
    assert not (cache / "qpc").exists() and not (cache / "qpc.tmp").exists()


def test_auto_export_and_reexport(ckpt, tmp_path, compiler, capsys):
    """Without --onnx_path the checkpoint is exported to <output_dir>/model.onnx; that graph is reused while it
    matches, and re-exported when the batching kind or the sub-functions change."""
    out = tmp_path / "out"
    common = ["--checkpoint_path", ckpt, "--output_dir", out, "--prompt_len", 4, "--ctx_len", 16, "--compiler", compiler]
    run_main(common)
    text = capsys.readouterr().out
    assert "exporting" in text and "PASS" in text and (out / "model.onnx").is_file()
    first_id = export_onnx.read_metadata(out / "model.onnx")["export_id"]
    run_main([*common, "--mxfp6"])
    assert "using" in capsys.readouterr().out
    assert export_onnx.read_metadata(out / "model.onnx")["export_id"] == first_id
    run_main([*common, "--full_batch_size", 2])
    assert "exported without --full_batch_size" in capsys.readouterr().out
    assert export_onnx.read_metadata(out / "model.onnx")["full_batch_size"] == 2
    run_main([*common, "--sub_functions"])
    text = capsys.readouterr().out
    assert "exported with --full_batch_size" in text and "as calls of TransformerBlock" in text and "PASS" in text
    assert export_onnx.read_metadata(out / "model.onnx")["sub_functions"] == ["TransformerBlock"]
    assert len(calls(compiler)) == 4 and calls(compiler)[3][-1] == "-sub-functions"
    assert calls(compiler)[0][2] == f"-m={(out / 'model.onnx').resolve()}"


# ------------------------------------------------------------------------------------------------- sub-functions
def test_sub_function_graph_equals_flat_graph(graphs, ckpt, tmp_path, compiler):
    """Each decoder layer is a call of one ONNX function; on ONNX Runtime the graph gives the flat graph's logits
    (padded batch prefill + decode) and greedy tokens; it compiles with -sub-functions only."""
    import onnx
    m = onnx.load(str(graphs[2]), load_external_data=False)
    assert [f.name for f in m.functions] == ["TransformerBlock"]
    calls_ = [n for n in m.graph.node if n.op_type == "TransformerBlock"]
    assert len(calls_) == N_LAYER and not any(n.op_type == "ScatterND" for n in m.graph.node)
    assert [o.name for o in m.graph.output] == ["logits"] + [n + "_RetainedState" for n in KV]
    inner = [o for o in m.functions[0].output if "RetainedState" in o]  # the names of one layer's call
    assert len(inner) == 2 and all(re.fullmatch(r"past_(key|value)\.\d_InternalRetainedState", o) for o in inner)
    flat, sub = OnnxBackend(graphs[0], max_batch_size=2, ctx_len=32), OnnxBackend(graphs[2], max_batch_size=2,
                                                                                 ctx_len=32)
    tokens = torch.tensor([[5, 17, 42, 99, 7, 250], [27, 18, 300, 0, 0, 0]])
    pos = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 1, 2, -1, -1, -1]])
    worst = (flat.forward(tokens, pos) - sub.forward(tokens, pos)).abs().max().item()
    for step in range(4):
        nxt, p = torch.tensor([[3 + step], [9 + step]]), torch.tensor([[6 + step], [3 + step]])
        worst = max(worst, (flat.forward(nxt, p) - sub.forward(nxt, p)).abs().max().item())
    assert worst <= 1e-5, worst
    prompts = [[5, 17, 42, 99, 7, 250], [27, 18, 300]]
    want, _ = engine.generate(OnnxBackend(graphs[0], max_batch_size=2), prompts, 10, torch.device("cpu"))
    got, _ = engine.generate(OnnxBackend(graphs[2], max_batch_size=2), prompts, 10, torch.device("cpu"))
    assert got == want and len(got[0]) == 10
    cache = run_main(base_args(graphs[2], tmp_path / "out", compiler, "--sub_functions"))
    assert cache.name.endswith("_subfn") and calls(compiler)[0][-1] == "-sub-functions"
    assert json.loads((cache / "qpc_done.json").read_text())["sub_functions"] == ["TransformerBlock"]
    with pytest.raises(ValueError, match="exported with --sub_functions"):
        run_main(base_args(graphs[2], tmp_path / "out", compiler))
    with pytest.raises(ValueError, match="exported without --sub_functions"):
        run_main(base_args(graphs[0], tmp_path / "out", compiler, "--sub_functions"))


# ------------------------------------------------------------------------------------------------- error paths
def _cli(args, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k not in ("QAIC_EXEC", "QAIC_COMPILE")}
    env.update({"PYTHONWARNINGS": "ignore", "PATH": "/usr/bin:/bin", **(env_extra or {})})
    return subprocess.run([sys.executable, "compile_qaic.py", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, env=env, timeout=300)


@pytest.mark.skipif(any(Path(f"{compile_qaic.SDK_EXEC}/{k}").exists() for k in compile_qaic.ENV),
                    reason="a real Cloud AI 100 compiler is installed")
def test_no_sdk_is_one_clear_line(graphs, ckpt, tmp_path, compiler):
    """Without the SDK the run stops at once with one line: before exporting the checkpoint or writing any compiler
    input. --dry_run, which the line points to, still writes the inputs and prints the command. With --prompt, a
    compiler but no runtime stops there too."""
    out = tmp_path / "out"
    for source in (["--checkpoint_path", ckpt], ["--onnx_path", graphs[0]], ["--checkpoint_path", ckpt, "--prompt",
                                                                           "hi"]):
        r = _cli([*source, "--output_dir", out, "--num_cores", 4, "--prompt_len", 8, "--ctx_len", 32])
        assert r.returncode != 0
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and "Apps SDK" in lines[0], lines
        assert "qaic-compile" in lines[0] and "qaic-exec" in lines[0] and "--dry_run" in lines[0]
        assert r.stdout == "" and not out.exists()  # no graph exported, no compiler inputs
    r = _cli(["--onnx_path", graphs[0], "--output_dir", out, "--num_cores", 4, "--prompt_len", 8, "--ctx_len", 32,
              "--dry_run"])
    assert r.returncode == 0, r.stderr
    assert f"{compile_qaic.SDK_EXEC}/qaic-compile -aic-hw -aic-hw-version=ai100" in r.stdout
    cache = out / "qpc_4cores_1bs_8pl_32cl_-1mos_1devices_fp16"
    assert (cache / "specializations.json").is_file() and (cache / "custom_io.yaml").is_file()
    assert not (cache / "qpc").exists()
    r = _cli(["--onnx_path", graphs[0], "--output_dir", out, "--ctx_len", 32, "--compiler", tmp_path / "nope"])
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and "nope is neither" in r.stderr
    try:
        import qaicrt  # noqa: F401
        return
    except ImportError:
        pass
    r = _cli(["--checkpoint_path", ckpt, "--output_dir", tmp_path / "o2", "--ctx_len", 32, "--prompt", "hi"],
             env_extra={"QAIC_COMPILE": str(compiler)})
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: running a QPC needs"), lines
    assert not (tmp_path / "o2").exists() and calls(compiler) == []


def test_compiler_failure_shows_stderr_and_leaves_no_qpc(graphs, tmp_path):
    bad = write_compiler(tmp_path / "badbin")
    out = tmp_path / "out"
    r = _cli(["--onnx_path", graphs[0], "--output_dir", out, "--prompt_len", 8, "--ctx_len", 32],
             env_extra={"QAIC_COMPILE": str(bad), "FAKE_QAIC_FAIL": "Node ScatterND_42: unsupported configuration"})
    assert r.returncode != 0
    assert "ERROR: Node ScatterND_42: unsupported configuration" in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: qaic-compile exited with code 2")
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
    with pytest.raises(ValueError, match="--mdts_mos must be >= -1"):
        run_main(base_args(graphs[0], out, compiler, "--mdts_mos", -3))
    with pytest.raises(ValueError, match="choose one"):
        run_main(base_args(graphs[0], out, compiler, "--qaic_exec", compiler))
    assert compile_qaic.parse_device_group("[0, 1]") == [0, 1]
    assert calls(compiler) == []
