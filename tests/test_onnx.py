# export_onnx.py: the retained-state ONNX graph (I/O contract, fp16 clipping, atomic writes, decoder layers as ONNX
# functions) and OnnxBackend on ONNX Runtime against eager PyTorch (model.py): logits, greedy tokens for one prompt, a
# padded batch and continuous batching, plus the command lines. Tiny random models only.
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

import export_onnx  # noqa: E402
import engine  # noqa: E402
from export_onnx import OnnxBackend  # noqa: E402
from checkpoint import checkpoint_state, save_checkpoint  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402
from quantize import load_model

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

TINY = dict(block_size=64, vocab_size=320, n_layer=2, n_head=4, n_local_heads=2, dim=32, intermediate_size=64,
            tie_embeddings=True)
CTX = 48


def make_tokenizer(directory: Path):
    """A small byte-level BPE tokenizer.json (vocab < 320) that tokenizer.py reads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"])
    tok.train_from_iterator(["hello world, the capital of france is paris. how are you today?"] * 8, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))


def make_checkpoint(directory: Path, seed=0, tokenizer=True, **overrides) -> Path:
    """A tiny random model.pth (weights ~ N(0, 0.2)) written with model.py's own checkpoint format."""
    torch.manual_seed(seed)
    model = Transformer(ModelArgs(**{**TINY, **overrides}))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    path = directory / "model.pth"
    save_checkpoint(checkpoint_state(model), path)
    if tokenizer:
        make_tokenizer(directory)
    return path


def torch_backend(ckpt, batch, ctx=CTX):
    return engine.TorchBackend(load_model(ckpt), batch, ctx)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def exported(ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("onnx")
    meta = export_onnx.export(ckpt, out, ctx_len=CTX, atol=1e-4, log=lambda *a: None)
    return out / "model.onnx", meta


@pytest.fixture(scope="module")
def exported_cb(ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("onnx_cb")
    meta = export_onnx.export(ckpt, out, ctx_len=CTX, full_batch_size=3, atol=1e-4, log=lambda *a: None)
    return out / "model.onnx", meta


def _io(path):
    m = onnx.load(str(path), load_external_data=False)
    def desc(v):
        t = v.type.tensor_type
        return t.elem_type, [d.dim_param or d.dim_value for d in t.shape.dim]
    return m, {v.name: desc(v) for v in m.graph.input}, {v.name: desc(v) for v in m.graph.output}


# ------------------------------------------------------------------------------------------------- the graph
def test_graph_io_contract(exported, exported_cb):
    INT64, FLOAT = onnx.TensorProto.INT64, onnx.TensorProto.FLOAT
    n_layer, n_kv, hd, V = TINY["n_layer"], TINY["n_local_heads"], TINY["dim"] // TINY["n_head"], TINY["vocab_size"]
    for (path, meta), rows in ((exported, "batch_size"), (exported_cb, "full_batch_size")):
        m, ins, outs = _io(path)
        kv = [f"past_{k}.{i}" for i in range(n_layer) for k in ("key", "value")]
        expect_in = ["input_ids", "position_ids"] + (["batch_index"] if rows == "full_batch_size" else []) + kv
        assert list(ins) == expect_in  # no attention-mask input: the mask comes from position_ids
        assert list(outs) == ["logits"] + [n + "_RetainedState" for n in kv]
        assert ins["input_ids"] == (INT64, ["batch_size", "seq_len"])
        assert ins["position_ids"] == (INT64, ["batch_size", "seq_len"])
        if rows == "full_batch_size":
            assert ins["batch_index"] == (INT64, ["batch_size", 1])
        for n in kv:
            assert ins[n] == (FLOAT, [rows, n_kv, "ctx_len", hd])
            assert outs[n + "_RetainedState"] == (FLOAT, [rows, n_kv, "ctx_len", hd])
        assert outs["logits"] == (FLOAT, ["batch_size", 1, V])
        ops = [n.op_type for n in m.graph.node]
        assert ops.count("ScatterND") == 2 * n_layer  # one scatter per K and V cache
        assert "ArgMax" in ops  # the logits position comes from argmax(position_ids)
        assert {o.domain: o.version for o in m.opset_import}[""] == 17
        # weights outside the graph file, beside it
        data = path.with_name("model.onnx.data")
        assert data.is_file() and data.stat().st_size > 4 * 32 * 320
        assert any(t.data_location == onnx.TensorProto.EXTERNAL for t in m.graph.initializer)
        # metadata in the graph and beside it
        props = {p.key: json.loads(p.value) for p in m.metadata_props}
        for key in ("vocab_size", "ctx_len", "bos_id", "eos_id", "n_layers", "kv_shape", "tokenizer_dir", "export_id"):
            assert key in props, key
        assert props["vocab_size"] == V and props["ctx_len"] == CTX and props["n_layers"] == n_layer
        assert props["kv_shape"] == [3 if rows == "full_batch_size" else "batch_size", n_kv, "ctx_len", hd]
        assert props["eos_id"] == 0 and props["tokenizer_dir"] == "."
        assert (path.parent / "tokenizer.json").is_file()  # the tokenizer travels with the graph
        side = json.loads(path.with_name("model.meta.json").read_text())
        assert side["export_id"] == props["export_id"] == meta["export_id"]
        assert not list(path.parent.glob(".export-tmp-*"))


def test_self_check_passes(exported, exported_cb):
    for _, meta in (exported, exported_cb):
        chk = meta["check"]
        assert chk["passed"] and chk["tokens_equal"] == chk["tokens_total"] >= 8, chk
        assert chk["max_abs_diff"] <= 1e-4 and chk["decode_steps"] >= 3
    assert "slots [1, 0]" in exported_cb[1]["check"]["summary"]


def test_logits_close_to_pytorch(exported, ckpt):
    """Padded batch prefill (per-row positions, -1 padding), then decode, at a ctx_len other than the exported
    default (the axis is dynamic): ONNX Runtime logits within 1e-4 of model.py in eager PyTorch."""
    ctx = 40
    ob = OnnxBackend(exported[0], max_batch_size=3, ctx_len=ctx)
    tb = torch_backend(ckpt, 3, ctx)
    assert ob.max_seq_length == ctx and ob.prefill_chunk is None
    g = torch.Generator().manual_seed(1)
    lens = [9, 4, 6]
    tokens = torch.randint(0, 320, (3, 9), generator=g)
    pos = torch.full((3, 9), -1)
    for b, n in enumerate(lens):
        pos[b, :n] = torch.arange(n)
    ref = tb.forward(tokens, pos)[torch.arange(3), torch.tensor(lens) - 1]
    got = ob.forward(tokens, pos)
    assert got.shape == (3, 1, 320) and got.dtype == torch.float32
    worst = (got[:, 0] - ref).abs().max().item()
    last = torch.tensor(lens) - 1
    for _ in range(4):
        nxt = ref.argmax(-1).view(3, 1)
        last = last + 1
        ref = tb.forward(nxt, last.view(3, 1))[:, -1]
        got = ob.forward(nxt, last.view(3, 1))[:, 0]
        worst = max(worst, (got - ref).abs().max().item())
    assert worst <= 1e-4, worst
    # shared positions [T] broadcast to every row
    ob1, tb1 = OnnxBackend(exported[0], max_batch_size=2), torch_backend(ckpt, 2)
    t2 = tokens[:2, :5]
    d = (ob1.forward(t2, torch.arange(5))[:, 0] - tb1.forward(t2, torch.arange(5))[:, -1]).abs().max().item()
    assert d <= 1e-4, d


def _greedy(backend, prompts, n=8, **kw):
    out, _ = engine.generate(backend, prompts, n, torch.device("cpu"), **kw)
    return out


def test_greedy_tokens_batch1(exported, ckpt):
    prompt = [[5, 17, 42, 99, 7, 250]]
    want = _greedy(torch_backend(ckpt, 1), prompt, 12)
    assert _greedy(OnnxBackend(exported[0], max_batch_size=1), prompt, 12) == want
    assert len(want[0]) == 12
    # the same graph fed in fixed chunks (what a fixed-shape runtime does) gives the same tokens
    assert _greedy(OnnxBackend(exported[0], max_batch_size=1), prompt, 12, prefill_chunk=4) == want


def test_greedy_tokens_padded_batch(exported, exported_cb, ckpt):
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [27, 18], [100, 200, 300, 12, 13]]
    want = _greedy(torch_backend(ckpt, 3), prompts, 10)
    assert _greedy(OnnxBackend(exported[0], max_batch_size=3), prompts, 10) == want
    # the continuous-batching graph serves an ordinary batch too (rows = slots 0..B-1)
    assert _greedy(OnnxBackend(exported_cb[0], max_batch_size=3), prompts, 10) == want
    # fewer rows than the backend holds
    assert _greedy(OnnxBackend(exported[0], max_batch_size=4), prompts[:2], 6) == \
        _greedy(torch_backend(ckpt, 2), prompts[:2], 6)


def test_continuous_batching_more_prompts_than_slots(exported, exported_cb, ckpt):
    prompts = [[3, 1, 4, 1, 5], [27, 18], [100, 200, 300, 12, 13, 14, 15], [9], [77, 66, 55]]
    n = 7
    want = [_greedy(torch_backend(ckpt, 1), [p], n)[0] for p in prompts]
    for path in (exported_cb[0], exported[0]):  # batch_index in the graph / emulated by OnnxBackend
        backend = OnnxBackend(path, max_batch_size=2)
        got, stats = engine.generate_continuous(backend, prompts, n, torch.device("cpu"), 2)
        assert got == want, path
        assert stats["new_tokens"] == sum(map(len, want))


def test_batch_index_slots_are_independent(exported_cb, ckpt):
    """Two sequences prefilled one at a time into slots 2 and 0 of a 3-slot cache, then decoded together through
    batch_index, match each sequence run alone in PyTorch."""
    ob = OnnxBackend(exported_cb[0], max_batch_size=3)
    assert ob.continuous_batching
    a, b = [11, 22, 33, 44, 55], [66, 77, 88]
    la = ob.forward(torch.tensor([a]), torch.arange(5).view(1, 5), batch_index=torch.tensor([[2]]))[:, 0]
    lb = ob.forward(torch.tensor([b]), torch.arange(3).view(1, 3), batch_index=torch.tensor([[0]]))[:, 0]
    ra = torch_backend(ckpt, 1)
    rb = torch_backend(ckpt, 1)
    pa = ra.forward(torch.tensor([a]), torch.arange(5))[:, -1]
    pb = rb.forward(torch.tensor([b]), torch.arange(3))[:, -1]
    assert (la - pa).abs().max() <= 1e-4 and (lb - pb).abs().max() <= 1e-4
    ta, tb_ = pa.argmax(-1), pb.argmax(-1)
    both = ob.forward(torch.stack([tb_, ta]).view(2, 1), torch.tensor([[3], [5]]), batch_index=torch.tensor([[0], [2]]))
    na = ra.forward(ta.view(1, 1), torch.tensor([5]))[:, -1]
    nb = rb.forward(tb_.view(1, 1), torch.tensor([3]))[:, -1]
    assert (both[0, 0] - nb[0]).abs().max() <= 1e-4 and (both[1, 0] - na[0]).abs().max() <= 1e-4


def test_backend_errors(exported, tmp_path):
    ob = OnnxBackend(exported[0], max_batch_size=1, ctx_len=16)
    with pytest.raises(ValueError, match="outside the context"):
        ob.forward(torch.tensor([[1]]), torch.tensor([16]))
    with pytest.raises(ValueError, match="at most 1"):
        ob.forward(torch.tensor([[1], [2]]), torch.tensor([0]))
    with pytest.raises(ValueError, match="rotary table"):
        OnnxBackend(exported[0], ctx_len=TINY["block_size"] + 1)
    with pytest.raises(FileNotFoundError):
        OnnxBackend(tmp_path / "missing.onnx")


# ------------------------------------------------------------------------------------------------- fp16 clipping
def test_clip_to_fp16_range_unit():
    from onnx import TensorProto, helper, numpy_helper
    init = numpy_helper.from_array(np.array([1e5, -1e9, -np.inf, 3.0, 65504.0], np.float32), "w")
    ints = numpy_helper.from_array(np.array([10 ** 12], np.int64), "big_int")
    const = helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.array(7e4, np.float32)))
    cos = helper.make_node("ConstantOfShape", ["shape"], ["z"],
                           value=numpy_helper.from_array(np.array([-1e6], np.float32)))
    add = helper.make_node("Add", ["x", "c"], ["y"])
    graph = helper.make_graph([const, cos, add], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1]),
                                                       helper.make_tensor_value_info("shape", TensorProto.INT64, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])], [init, ints])
    m = helper.make_model(graph)
    assert export_onnx.clip_to_fp16_range(m) == 4
    w = numpy_helper.to_array(m.graph.initializer[0])
    assert w.tolist() == [65504.0, -65504.0, -np.inf, 3.0, 65504.0]  # -inf (a mask value) is kept
    assert numpy_helper.to_array(m.graph.initializer[1]).tolist() == [10 ** 12]  # integers untouched
    assert float(numpy_helper.to_array(m.graph.node[0].attribute[0].t)) == 65504.0
    assert numpy_helper.to_array(m.graph.node[1].attribute[0].t).tolist() == [-65504.0]
    assert export_onnx.clip_to_fp16_range(m) == 0


def _all_float_constants(m):
    from onnx import numpy_helper
    for t in export_onnx._all_tensors(m.graph):
        if t.data_type == onnx.TensorProto.FLOAT:
            yield numpy_helper.to_array(t)


def test_exported_constants_fit_fp16(exported, tmp_path):
    m = onnx.load(str(exported[0]))
    vals = list(_all_float_constants(m))
    assert all(np.abs(v[np.isfinite(v)]).max(initial=0) <= 65504 for v in vals)
    assert any(np.isneginf(v).any() for v in vals)  # the mask's -inf survives
    # a checkpoint with out-of-range weights comes out clipped
    ck = make_checkpoint(tmp_path / "big", tokenizer=False)
    sd = torch.load(ck, weights_only=True)
    sd["norm.weight"][0] = 1e6
    sd["layers.0.feed_forward.w2.weight"][0, 0] = -3e5
    save_checkpoint(sd, ck)  # (with new checksums: load_model refuses tensors changed behind their CRC32)
    meta = export_onnx.export(ck, tmp_path / "out", ctx_len=16, check=False, log=lambda *a: None)
    assert meta["fp16_clipped_values"] == 2
    vals = list(_all_float_constants(onnx.load(str(tmp_path / "out" / "model.onnx"))))
    assert max(np.abs(v[np.isfinite(v)]).max(initial=0) for v in vals) == 65504.0


# ------------------------------------------------------------------------------------------------- files
def test_failed_check_leaves_previous_export(exported, ckpt):
    """A self-check failure (impossible tolerance) publishes nothing: the previous graph stays, no temp dirs."""
    path, meta = exported
    before = path.read_bytes()
    with pytest.raises(RuntimeError, match="self-check failed"):
        export_onnx.export(ckpt, path.parent, ctx_len=CTX, atol=-1.0, log=lambda *a: None)
    assert path.read_bytes() == before
    assert export_onnx.read_metadata(path)["export_id"] == meta["export_id"]
    assert not list(path.parent.glob(".export-tmp-*"))


def test_model_variants_export(tmp_path):
    """Qwen3-style (q/k RMSNorm, explicit head_dim, multi-head KV, llama3 rope scaling) and Qwen2-style (qkv bias,
    untied head) models pass the ONNX Runtime self-check too."""
    scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16)
    for name, over in (("qwen3", dict(qk_norm=True, head_dim=16, n_local_heads=4, rope_scaling=scaling)),
                       ("qwen2", dict(attn_bias=True, tie_embeddings=False, n_local_heads=1))):
        ck = make_checkpoint(tmp_path / name, seed=3, tokenizer=False, **over)
        meta = export_onnx.export(ck, tmp_path / f"{name}_out", ctx_len=24, atol=1e-4, log=lambda *a: None)
        assert meta["check"]["passed"], (name, meta["check"])


def test_sub_functions_export(tmp_path):
    """--sub_functions: each decoder layer is a call of an ONNX function, one function per kind of layer (SmolLM3's
    layers without rotary are a second kind); the outputs keep their contract names, the self-check against PyTorch
    passes, and nothing the exporter prints or hooks onto the model (it did both) shows."""
    ck = make_checkpoint(tmp_path, seed=3, tokenizer=False, nope_layers=[1], n_layer=3)
    r = _run(["export_onnx.py", "--checkpoint_path", ck, "--output_dir", tmp_path / "out", "--ctx_len", 24,
              "--atol", 1e-4, "--sub_functions"])
    assert r.returncode == 0, r.stderr
    assert "as calls of TransformerBlock" in r.stdout and "PASS" in r.stdout
    assert "Skipping" not in r.stdout + r.stderr and "\n\n" not in r.stdout
    m, ins, outs = _io(tmp_path / "out" / "model.onnx")
    assert sorted(f.name for f in m.functions) == ["TransformerBlock", "TransformerBlock.1"]
    assert [n.op_type for n in m.graph.node].count("TransformerBlock") + \
        [n.op_type for n in m.graph.node].count("TransformerBlock.1") == 3
    assert list(outs) == ["logits"] + [f"past_{k}.{i}_RetainedState" for i in range(3) for k in ("key", "value")]
    meta = json.loads((tmp_path / "out" / "model.meta.json").read_text())
    assert meta["check"]["passed"] and sorted(meta["sub_functions"]) == sorted(f.name for f in m.functions)
    bad = _run(["export_onnx.py", "--checkpoint_path", ck, "--output_dir", tmp_path / "o", "--dynamo", "--sub_functions"])
    assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1 and "not allowed with" in bad.stderr


def _run(args, **kw):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, *map(str, args)], cwd=REPO, capture_output=True, text=True, env=env,
                          timeout=300, **kw)


def test_cli_export_then_generate(ckpt, tmp_path):
    """export_onnx.py prints the self-check; generate.py --onnx gives the same greedy text as generate.py on the
    checkpoint, using the tokenizer copied next to the graph."""
    out = tmp_path / "out"
    r = _run(["export_onnx.py", "--checkpoint_path", ckpt, "--output_dir", out, "--ctx_len", 40])
    assert r.returncode == 0, r.stderr
    assert "greedy tokens equal" in r.stdout and "PASS" in r.stdout
    common = ["--prompt", "hello world|the capital of", "--temperature", "0", "--max_new_tokens", "6", "--quiet"]
    a = _run(["generate.py", "--onnx", out / "model.onnx", "--tokenizer_path", out, *common])
    b = _run(["generate.py", "--checkpoint_path", ckpt, *common])
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout and "hello world" in a.stdout
    bad = _run(["generate.py", "--onnx", tmp_path / "nope.onnx", "--tokenizer_path", out, "--prompt", "x"])
    assert bad.returncode == 1 and bad.stderr.strip().splitlines() == [f"error: ONNX graph not found: {tmp_path / 'nope.onnx'}"]


def test_dynamo_exporter_option(ckpt, tmp_path):
    """--dynamo: the same contract from torch.export (opset 18), also matching PyTorch; batch_index variant."""
    meta = export_onnx.export(ckpt, tmp_path, ctx_len=24, full_batch_size=2, dynamo=True, atol=1e-4,
                              log=lambda *a: None)
    assert meta["exporter"] == "dynamo" and meta["opset"] == 18 and meta["check"]["passed"], meta["check"]
    m, ins, outs = _io(tmp_path / "model.onnx")
    assert list(ins)[:3] == ["input_ids", "position_ids", "batch_index"]
    assert ins["past_key.0"][1] == ["full_batch_size", 2, "ctx_len", 8]
    assert outs["logits"][1] == ["batch_size", 1, 320]
    assert [n.op_type for n in m.graph.node].count("ScatterND") == 4
