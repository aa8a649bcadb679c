# onnx_backends.QpcBackend and compile_qaic.py's one command (--prompt) without the Qualcomm SDK: a fake device session
# runs the compiled graph on ONNX Runtime and enforces the compiled specializations the way the card does; the text is
# model.py's greedy text. The fake compilers and the graphs: test_qaic.py.
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import compile_qaic
import engine
import onnx_backends
from compile_qaic import QpcBackend
from quantize import load_model
from test_qaic import FAKE, REPO, SDK_VERSION, _cli, calls, ckpt, compiler, graphs, no_env_compilers, run_main  # noqa: F401

pytest.importorskip("onnxruntime")


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
                     "--compiler", compiler, *extra])


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


def test_one_command_checkpoint_to_text(ckpt, tmp_path, compiler, monkeypatch, capsys):
    """compile_qaic.py --checkpoint_path ... --prompt: export, compile, run (the device through the fake session,
    which runs the compiled graph on ONNX Runtime); the text is model.py's greedy text. A second run reuses both."""
    def session(qpc_path, device_ids):
        done = json.loads((Path(qpc_path).parent / "qpc_done.json").read_text())
        assert json.loads((Path(qpc_path) / "programqpc.bin").read_text())["onnx"] == done["onnx"]
        return FakeDeviceSession(done["onnx"], Path(qpc_path).parent)
    monkeypatch.setattr(onnx_backends, "QaicSession", session)
    monkeypatch.setattr(compile_qaic, "check_runtime", lambda: None)
    from tokenizer import load_tokenizer
    tok = load_tokenizer(ckpt.parent)
    prompts = ["hello world", "the capital of france is", "how are you"]
    ref = engine.TorchBackend(load_model(ckpt), 1, 32)
    want = [p + tok.decode(engine.generate(engine.TorchBackend(load_model(ckpt), 1, 32), [tok.encode(p)], 8,
                                           torch.device("cpu"), stop_ids=tok.stop_ids)[0][0]) for p in prompts]
    del ref
    out = tmp_path / "out"
    args = ["--checkpoint_path", ckpt, "--output_dir", out, "--num_cores", 14, "--batch_size", 2, "--prompt_len", 4,
            "--ctx_len", 32, "--compiler", compiler, "--prompt", "|".join(prompts), "--max_new_tokens", 8]
    run_main(args)
    text = capsys.readouterr().out
    assert "exporting" in text and "compiling model.onnx with qaic-compile" in text
    for w in want:
        assert w + "\n" + "-" * 40 in text, (w, text)
    run_main([*args, "--sub_functions"])  # the same text from the sub-function graph
    text = capsys.readouterr().out
    assert "as calls of TransformerBlock" in text and all(w in text for w in want)
    run_main([*args, "--sub_functions"])
    text = capsys.readouterr().out
    assert "using" in text and "reusing" in text and all(w in text for w in want)
    assert len(calls(compiler)) == 2


def test_one_command_through_the_sdk_runtime(ckpt, tmp_path, compiler):
    """The command line end to end with the fakes where the SDK's would be: qaic-compile on PATH, qaicrt and
    QAicApi_pb2 (tests/fake_qaic) on PYTHONPATH, so QaicSession's own code drives a runtime that runs the compiled graph
    on ONNX Runtime. The text equals generate.py's greedy text on the checkpoint; generate.py --qpc gives it too."""
    env = {"PYTHONPATH": str(FAKE.parent), "PATH": f"{compiler.parent}:/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    prompts, out = "hello world|the capital of", tmp_path / "out"
    r = _cli(["--checkpoint_path", ckpt, "--output_dir", out, "--num_cores", 14, "--batch_size", 2, "--prompt_len", 4,
              "--ctx_len", 32, "--prompt", prompts, "--max_new_tokens", 6], env_extra=env)
    assert r.returncode == 0, r.stderr
    assert f"compiler: {compiler} (qaic-compile, version: qaic-compile version {SDK_VERSION})" in r.stdout
    gen = ["--prompt", prompts, "--temperature", 0, "--max_new_tokens", 6, "--quiet"]
    want = subprocess.run([sys.executable, "generate.py", "--checkpoint_path", ckpt, *map(str, gen)], cwd=REPO,
                          capture_output=True, text=True, env={**os.environ, **env}, timeout=300)
    assert want.returncode == 0 and want.stdout.count("-" * 40) == 2, want.stderr
    assert want.stdout in r.stdout
    cache = out / "qpc_14cores_2bs_4pl_32cl_-1mos_1devices_fp16"
    got = subprocess.run([sys.executable, "generate.py", "--qpc", str(cache), *map(str, gen)], cwd=REPO,
                         capture_output=True, text=True, env={**os.environ, **env}, timeout=300)
    assert got.returncode == 0 and got.stdout == want.stdout, got.stderr
