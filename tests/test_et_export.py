# ExecuTorch export (et_export.py): tiny random models lowered to .pte files and run through ExecuTorch's Python
# runtime (PTEBackend), compared with eager model.py through engine.generate.
import contextlib
import io
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

pytest.importorskip("executorch")

import et_export  # noqa: E402
import pte_backend  # noqa: E402
import engine  # noqa: E402
import qops  # noqa: E402
import quantize  # noqa: E402
from checkpoint import checkpoint_state, save_checkpoint  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402
from quantize import load_model

ARGS = dict(n_layer=2, n_head=4, n_local_heads=2, dim=64, intermediate_size=128, vocab_size=300, block_size=128)
EOS = 256
PROMPT = [5, 17, 72, 101, 108, 108, 111, 250]
CPU = torch.device("cpu")


def _tiny(seed=0, n_layer=ARGS["n_layer"]) -> Transformer:
    torch.manual_seed(seed)
    m = Transformer(ModelArgs(**dict(ARGS, n_layer=n_layer)))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2)
    return m.eval().requires_grad_(False)


def _write_tokenizer(d: Path):
    """A byte-level BPE tokenizer.json with no merges (bytes are tokens 0..255) and <|endoftext|> = 256, written by
    the tokenizers library itself."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from tokenizer import bytes_to_unicode
    b2u = bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={b2u[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    assert tok.add_special_tokens(["<|endoftext|>"]) == 1 and tok.token_to_id("<|endoftext|>") == EOS
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


def _greedy(backend, n=12, prompt=PROMPT):
    out, _ = engine.generate(backend, [list(prompt)], n, CPU)
    return out[0]


def _run(args, env=None):
    return subprocess.run([sys.executable, *map(str, args)], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=env)


@pytest.fixture(scope="module")
def float_ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_f32")
    save_checkpoint(checkpoint_state(_tiny()), d / "model.pth")
    _write_tokenizer(d)
    return d / "model.pth"


@pytest.fixture(scope="module")
def float_pte(float_ckpt):
    pte = float_ckpt.parent / "tiny.pte"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        et_export.main(["--checkpoint_path", str(float_ckpt), "--output_path", str(pte), "--max_seq_length", "128"])
    (pte.parent / "export.log").write_text(err.getvalue())
    return pte


def test_float_pte_matches_eager(float_ckpt, float_pte):
    assert float_pte.is_file() and not float_pte.with_name(float_pte.name + ".tmp").exists()
    pte = pte_backend.PTEBackend(float_pte)
    eager = engine.TorchBackend(load_model(float_ckpt), 1, 128)
    assert (pte.max_batch_size, pte.max_seq_length, pte.prefill_chunk) == (1, 128, None)
    # logits: a prompt in one call (dynamic length), then single-token decode steps over the persistent cache
    toks = torch.tensor([PROMPT])
    a, b = pte.forward(toks, torch.arange(len(PROMPT))), eager.forward(toks, torch.arange(len(PROMPT)))
    assert a.shape == b.shape == (1, len(PROMPT), ARGS["vocab_size"]) and a.dtype == torch.float32
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    for i in range(3):
        t, p = torch.tensor([[7 + i]]), torch.tensor([len(PROMPT) + i])
        torch.testing.assert_close(pte.forward(t, p), eager.forward(t, p), atol=1e-4, rtol=1e-4)
    # greedy tokens through engine.generate, twice on one loaded program (the cache is simply overwritten)
    ref = _greedy(eager)
    assert _greedy(pte) == ref and _greedy(pte) == ref and len(ref) == 12


def test_export_says_each_long_step(float_pte):
    """A line before each long step, in order; the XNNPACK one counts the subgraphs the op summary finds delegated."""
    log = (float_pte.parent / "export.log").read_text()
    lines = log.splitlines()
    steps = ["exporting forward", "lowering to xnnpack", "preprocessing", "to_executorch", "writing"]
    at = [next(i for i, line in enumerate(lines) if line.startswith(s)) for s in steps]
    assert at == sorted(at), log
    subgraphs = int(re.search(r"preprocessing (\d+) subgraphs", log).group(1))
    assert subgraphs == int(re.search(r"in (\d+) xnnpack delegate call", log).group(1)) > 0, log


def test_constant_methods(float_pte):
    c = pte_backend.PTEBackend(float_pte).constants
    assert c["get_max_seq_len"] == 128 and c["get_max_context_len"] == 128
    assert c["get_vocab_size"] == ARGS["vocab_size"] and c["get_n_layers"] == ARGS["n_layer"]
    assert c["get_eos_ids"] == [EOS]  # from the tokenizer beside the checkpoint
    assert isinstance(c["get_bos_id"], int)
    assert c["use_kv_cache"] is True and c["enable_dynamic_shape"] is True
    assert c["get_max_batch_size"] == 1 and c["use_sdpa_with_kv_cache"] is False


def test_portable_backend_with_prefill_and_decode_methods(float_ckpt, tmp_path):
    """--backend portable (no delegate) and the optional fixed-length prefill/decode methods sharing the cache."""
    pte = tmp_path / "portable.pte"
    model = load_model(float_ckpt)
    info = et_export.export_pte(model, pte, 64, "portable", bos_id=1, eos_ids=[EOS], prefill_chunk=4, verbose=False)
    assert all(s["delegate_calls"] == 0 and s["portable_ops"] > 0 for s in info["summary"].values())
    be = pte_backend.PTEBackend(pte)
    assert {"forward", "prefill", "decode"} <= be.method_names and be.constants["get_prefill_chunk"] == 4
    eager = engine.TorchBackend(load_model(float_ckpt), 1, 64)
    assert _greedy(be) == _greedy(eager)
    # prefill (2 chunks of 4) + decode write the same cache that forward reads
    prog, toks = be.program, torch.tensor([PROMPT])
    full = eager.forward(toks, torch.arange(8))
    for s in (0, 4):
        out = prog.load_method("prefill").execute([toks[:, s:s + 4], torch.arange(s, s + 4)])[0]
        torch.testing.assert_close(out, full[:, s:s + 4], atol=1e-4, rtol=1e-4)
    ref = eager.forward(torch.tensor([[3]]), torch.tensor([8]))
    torch.testing.assert_close(prog.load_method("decode").execute([torch.tensor([[3]]), torch.tensor([8])])[0], ref,
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(be.forward(torch.tensor([[9]]), torch.tensor([9])),
                               eager.forward(torch.tensor([[9]]), torch.tensor([9])), atol=1e-4, rtol=1e-4)


_8DA4W_ARGS = ["--max_seq_length", "128", "--bos_id", "1", "--eos_ids", str(EOS)]


@pytest.fixture(scope="module")
def pte_8da4w(tmp_path_factory):
    """An 8da4w checkpoint of a one-layer _tiny(1) and its .pte, written by `et_export.py` (a quantized checkpoint is
    exported as is; one layer: a lowering's time goes by the program's ops, and the float program has two)."""
    d = tmp_path_factory.mktemp("pte_8da4w")
    model = _tiny(1, n_layer=1)
    recipe = quantize.quantize_model(model, "8da4w", groupsize=32, log=False)
    # XNNPACK keeps 4-bit group scales as bfloat16: give the eager model bf16-representable scales (a no-op when
    # quantize.py already rounds them) so both run the very same weights
    for m in model.modules():
        if isinstance(m, qops.QuantizedWeight):
            m.scales = m.scales.to(torch.bfloat16).to(m.scales.dtype)
    save_checkpoint(checkpoint_state(model, quantization=recipe), d / "model.pth")
    et_export.main(["--checkpoint_path", str(d / "model.pth"), "--output_path", str(d / "q.pte"), *_8DA4W_ARGS])
    return d / "model.pth", d / "q.pte"


def test_8da4w_pte_matches_eager_8da4w(pte_8da4w, tmp_path):
    ckpt, pte = pte_8da4w
    be = pte_backend.PTEBackend(pte)
    eager = engine.TorchBackend(load_model(ckpt), 1, 128)
    toks = torch.tensor([PROMPT])
    torch.testing.assert_close(be.forward(toks, torch.arange(8)), eager.forward(toks, torch.arange(8)),
                               atol=1e-3, rtol=1e-3)
    assert _greedy(be) == _greedy(eager)
    assert pte.stat().st_size < 0.6 * (sum(p.numel() for p in _tiny(n_layer=1).parameters()) * 4)

    eval_py = REPO / "eval.py"
    if eval_py.is_file():  # perplexity of the exported program vs the eager quantized model
        _write_tokenizer(tmp_path)
        text = tmp_path / "text.txt"
        text.write_text("The quick brown fox jumps over the lazy dog. " * 4)
        common = ["--text_file", text, "--tokenizer_path", tmp_path, "--max_seq_length", "128", "--quiet"]
        r_pte = _run([eval_py, "--pte", pte, *common])
        r_eager = _run([eval_py, "--checkpoint_path", ckpt, *common])
        assert r_pte.returncode == 0 and r_eager.returncode == 0, r_pte.stderr[-2000:] + r_eager.stderr[-2000:]
        ppl = [_perplexity(r.stdout + r.stderr) for r in (r_pte, r_eager)]
        assert ppl[0] == pytest.approx(ppl[1], rel=1e-3), ppl


def test_partitioner_without_decomposition_filter_writes_the_same_pte(pte_8da4w, float_ckpt, float_pte, tmp_path,
                                                                      monkeypatch):
    """et_export's XNNPACK partitioner drops XnnpackPartitioner's per-node decomposition filter (two fewer retraces of
    the whole program) and, per subgraph, the XNNPACK passes with nothing to rewrite there (et_passes.PASS_OPS); the
    stock partitioner with its whole pass list gives the very same bytes (an 8da4w model: linears and quant ops; a
    float32 one), while on their subgraphs every one of those passes would be skipped at least once."""
    import et_passes
    import executorch.backends.xnnpack.xnnpack_preprocess as prep
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    stock = prep.XNNPACKPassManager
    default = stock(None).passes
    skipped = lambda names: {p.__name__ for p in default if not et_passes.pass_needed(p, names)}  # noqa: E731
    assert skipped({"aten.linear.default", "aten.mul.Tensor"}) == set(et_passes.PASS_OPS)
    assert skipped({"aten.convolution.default", "aten.relu.default", "aten.mm.default", "custom meta",
                    "dim_order_ops._to_dim_order_copy.default"}) == {
        "DecomposeConcatenate", "RemoveGetItemPass", "ConvertToSDPAPass", "RemoveRedundantCopyPass"}
    with et_passes.xnnpack_trimmed_passes():
        assert prep.XNNPACKPassManager is not stock
    assert prep.XNNPACKPassManager is stock
    skips = {}

    class Recording(stock):  # the whole list, a pass at a time, noting those the trimmed list would skip
        def transform(self):
            ep = self.exported_program
            for p in self.passes:
                if not et_passes.pass_needed(p, et_passes.subgraph_names(ep.graph_module)):
                    skips[p.__name__] = skips.get(p.__name__, 0) + 1
                ep = stock(ep, [p]).transform()
            return ep

    monkeypatch.setattr(et_export, "_backend_partitioners", lambda backend, log=None: [XnnpackPartitioner()])
    monkeypatch.setattr(et_passes, "xnnpack_trimmed_passes", contextlib.nullcontext)
    monkeypatch.setattr(prep, "XNNPACKPassManager", Recording)
    for (ckpt, ours), args in (((pte_8da4w[0], pte_8da4w[1]), _8DA4W_ARGS), ((float_ckpt, float_pte),
                                                                            ["--max_seq_length", "128"])):
        skips.clear()
        et_export.main(["--checkpoint_path", str(ckpt), "--output_path", str(tmp_path / "stock.pte"), *args])
        assert ours.read_bytes() == (tmp_path / "stock.pte").read_bytes(), ckpt
        assert set(skips) == set(et_passes.PASS_OPS), (ckpt, skips)  # every rule was taken on these graphs


def _perplexity(text: str) -> float:
    import re
    hits = re.findall(r"perplexity[^0-9]*([0-9]+(?:\.[0-9]+)?(?:e[+-]?[0-9]+)?)", text, re.IGNORECASE)
    assert hits, text[-2000:]
    return float(hits[-1])


def test_quantize_flag_quantizes_a_float_checkpoint(float_ckpt, tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(et_export, "export_pte", lambda model, *a, **k: seen.update(model=model, args=a, kw=k))
    et_export.main(["--checkpoint_path", str(float_ckpt), "--output_path", str(tmp_path / "x.pte"),
                    "--quantize", "8da4w", "--groupsize", "32"])
    assert any(isinstance(m, qops.QuantizedLinear) for m in seen["model"].modules())
    assert seen["model"].quantization["mode"] == "8da4w"


def test_truncated_or_corrupt_pte_is_a_one_line_error(float_pte, tmp_path):
    data = float_pte.read_bytes()
    bad = {"truncated": data[: len(data) // 2], "corrupt": b"\x00" * 64 + data[64:200]}
    for name, blob in bad.items():
        p = tmp_path / f"{name}.pte"
        p.write_bytes(blob)
        with pytest.raises(ValueError):
            pte_backend.PTEBackend(p)
    r = _run([REPO / "generate.py", "--pte", tmp_path / "truncated.pte", "--tokenizer_path", float_pte.parent,
              "--prompt", "hi", "--max_new_tokens", "2"])
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = [l for l in r.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and "truncated" in errors[0], r.stderr[-3000:]


def test_generate_cli_runs_a_pte(float_pte):
    r = _run([REPO / "generate.py", "--pte", float_pte, "--tokenizer_path", float_pte.parent, "--prompt", "Hello",
              "--max_new_tokens", "5", "--temperature", "0"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("Hello") and "decode" in r.stderr
    assert "cpuinfo_utils" not in r.stderr and "midr" not in r.stderr, r.stderr[-3000:]  # the runtime's x86 noise


def test_vendor_backend_without_sdk_is_a_clear_error(float_ckpt, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "QNN_SDK_ROOT"}
    r = _run([REPO / "et_export.py", "--checkpoint_path", float_ckpt, "--output_path", tmp_path / "q.pte",
              "--backend", "qnn"], env=env)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = [l for l in r.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and "QNN_SDK_ROOT" in errors[0] and "Qualcomm" in errors[0]
    assert not (tmp_path / "q.pte").exists()
    if sys.platform != "darwin":
        with pytest.raises(RuntimeError, match="macOS"):
            et_export._backend_partitioners("coreml")
