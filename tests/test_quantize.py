# quantize.py: quantized models against their float originals and their own eager runs (greedy agreement,
# checkpoints, tied embeddings, torch.compile's prompts and decode), GPTQ, the CLI. The kernels: test_qkernels.py.
import copy
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import engine
import fast_cpu
import fast_cpu_quant as FQ
import generate
import gptq
import qops
import quantize as Q
from conftest import assert_clean_error, hf_to_model, run_cli, tiny_hf
from checkpoint import checkpoint_state, save_checkpoint
from quantize import load_model
from test_qkernels import CPU, SCHEMES, _linear
import torch_internals as TI

# oneDNN's bfloat16 products (what fast_cpu_quant.BF16_GEMM stands for; the tests below force it) need AVX512-BW/VL/DQ
# or AVX-NE-CONVERT: on an AVX2 CPU its packed bfloat16 weights are refused and its unpacked products round otherwise
needs_onednn_bf16 = pytest.mark.skipif(not TI.onednn_bf16(), reason="oneDNN has no bfloat16 products on this CPU")

# ----------------------------------------------------------------------------------------------------------- models
def _peaked_model(seed=3):
    """A tiny random Llama whose output projection maps each token's embedding to a fixed successor (a permutation),
    with the blocks' residual contributions scaled down: greedy decoding follows the permutation with logit gaps
    (> 3) well above the quantization error of any mode, while every layer still contributes."""
    hf = tiny_hf("llama", seed=seed, vocab_size=256, tie=False)
    perm = torch.randperm(256, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        hf.lm_head.weight.copy_(hf.model.embed_tokens.weight[torch.argsort(perm)])
        hf.model.norm.weight.fill_(1.0)
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.3)
            layer.mlp.down_proj.weight.mul_(0.3)
    return hf_to_model(hf)


@pytest.fixture(scope="module")
def peaked():
    return _peaked_model()


@pytest.fixture(scope="module")
def random_tied():
    m = hf_to_model(tiny_hf("llama", seed=5, vocab_size=256, tie=True))
    assert m.config.tie_embeddings
    return m


PROMPT = [5, 17, 99, 3, 42, 7]


def _greedy(model, n=32, compile=False):
    be = generate.TorchBackend(model, 1, 64, compile=compile)
    out, _ = generate.generate(be, [PROMPT], n, CPU)
    return out[0]


def _logits(model, ids):
    model.setup_caches(1, 64)
    with torch.no_grad():
        return model(torch.tensor([ids]), torch.arange(len(ids)))


@pytest.fixture(scope="module")
def peaked_greedy(peaked):
    return _greedy(copy.deepcopy(peaked))


@pytest.mark.parametrize("mode", ["int8", "int4", "8da4w", "8da8w"])
def test_greedy_agrees_with_float(peaked, peaked_greedy, random_tied, mode):
    """Criterion: on the peaked model (logit gaps > 3), all 32 greedy tokens equal the float model's and the logit
    error stays below half the smallest gap. On a plain random tied model (gaps ~0), the relative logit error is
    bounded: int8 / 8da8w < 3%, 4-bit g32 < 25% (no token-level claim there: its argmax flips are coin tosses)."""
    ref = peaked_greedy
    m = copy.deepcopy(peaked)
    Q.quantize_model(m, mode, 32, log=False)
    assert _greedy(m) == ref
    seq = PROMPT + ref
    lf, lq = _logits(copy.deepcopy(peaked), seq), _logits(m, seq)
    top2 = lf.topk(2, -1).values
    assert (lq - lf).abs().max() < (top2[..., 0] - top2[..., 1]).min() / 2
    r = copy.deepcopy(random_tied)
    Q.quantize_model(r, mode, 32, log=False)
    lf, lq = _logits(copy.deepcopy(random_tied), seq), _logits(r, seq)
    assert ((lq - lf).norm() / lf.norm()).item() < (0.03 if mode in Q.EIGHT_BIT else 0.25)


@pytest.mark.parametrize("mode", ["int8", "int4", "8da4w", "8da8w", "int4-gptq"])
def test_save_load_roundtrip(tmp_path, random_tied, mode):
    m = copy.deepcopy(random_tied)
    calib = torch.randint(0, 256, (2, 32)) if mode == "int4-gptq" else None
    recipe = Q.quantize_model(m, mode, 32, calibration_ids=calib, log=False)
    ids = PROMPT * 3
    before = _logits(m, ids)
    path = tmp_path / f"{mode}.pth"
    save_checkpoint(checkpoint_state(m, quantization=recipe), path)
    sd = torch.load(path, weights_only=True)  # plain tensors only
    assert all(type(v) is torch.Tensor or isinstance(v, str) for v in sd.values())
    assert json.loads(sd["_quantization"])["mode"] == mode
    for k in [k for k in sd if k.startswith("output.")]:  # the tied output projection is the embedding's table,
        twin = sd["tok_embeddings." + k.removeprefix("output.")]   # stored once (shared storage)
        assert sd[k].untyped_storage().data_ptr() == twin.untyped_storage().data_ptr()
    loaded = load_model(path)
    assert loaded.output.qweight is loaded.tok_embeddings.qweight
    torch.testing.assert_close(_logits(loaded, ids), before, rtol=0, atol=0)
    assert Q._file_bytes(loaded) < Q._file_bytes(random_tied) * (0.3 if mode in Q.EIGHT_BIT else 0.22)


def test_embedding_choices_and_tied_output(random_tied, peaked):
    m = copy.deepcopy(random_tied)
    r = Q.quantize_model(m, "int4", 32, embedding="none", log=False)
    assert r["embedding"] is None and isinstance(m.tok_embeddings, nn.Embedding)
    assert isinstance(m.output, nn.Linear) and m.output.weight is m.tok_embeddings.weight  # stays tied, float
    m = copy.deepcopy(random_tied)
    r = Q.quantize_model(m, "int4", 32, embedding="int8", log=False)
    assert m.output.qweight is m.tok_embeddings.qweight and m.output.qweight.bits == 8
    m = copy.deepcopy(random_tied)
    r = Q.quantize_model(m, "8da4w", 32, log=False)
    assert m.output.act == "int8" and m.output.qweight.bits == 8  # int8 table, dynamic int8 activations (XNNPACK)
    assert "gptq" not in r
    m = copy.deepcopy(random_tied)
    r = Q.quantize_model(m, "8da4w", 32, embedding="int4", calibration_ids=torch.randint(0, 256, (2, 16)), log=False)
    assert r["gptq"]["calibration_tokens"] == 32 and m.output.qweight.symmetric and m.output.qweight.bits == 4
    m = copy.deepcopy(peaked)  # untied: output is an ordinary quantized linear, embedding separate
    Q.quantize_model(m, "int4", 32, log=False)
    assert m.output.qweight is not m.tok_embeddings.qweight
    with pytest.raises(ValueError, match="unknown mode"):
        Q.quantize_model(copy.deepcopy(peaked), "int3")
    with pytest.raises(ValueError, match="does not divide in_features 160"):
        Q.quantize_model(copy.deepcopy(peaked), "int4", 64)  # w2 has in_features 160
    with pytest.raises(ValueError, match="calibration"):
        Q.quantize_model(copy.deepcopy(peaked), "int4-gptq", 32)


def test_8da4w_skips_linears_the_group_size_does_not_divide(peaked, capsys):
    m = copy.deepcopy(peaked)
    r = Q.quantize_model(m, "8da4w", 64)
    assert r["skip"] == ["layers.0.feed_forward.w2", "layers.1.feed_forward.w2"]
    assert isinstance(m.layers[0].feed_forward.w2, nn.Linear)
    assert isinstance(m.layers[0].feed_forward.w1, qops.QuantizedLinear)
    assert "kept float" in capsys.readouterr().err


def test_compile_matches_eager(peaked):
    """One compile covering every kernel: int4 (asymmetric) layer 0, int8 and 8da4w layer 1, int8 tied-style table."""
    m = copy.deepcopy(peaked)
    Q.quantize_model(m, "int4", 32, embedding="int8", log=False)
    for name, mode in [("attention.wqkv", "int8"), ("attention.wo", "int8"), ("feed_forward.w1", "8da4w"),
                       ("feed_forward.w3", "int8"), ("feed_forward.w2", "8da4w")]:
        w = peaked.layers[1].get_submodule(name).weight
        scheme, act = SCHEMES["int8" if mode == "int8" else "8da4w-g32"]
        Q._set_module(m.layers[1], name, qops.QuantizedLinear(Q.quantize_weight(w, scheme), None, act))
    eager = _greedy(copy.deepcopy(m), n=12)
    assert _greedy(m, n=12, compile=True) == eager


@pytest.mark.parametrize("output", ["int8", "int4-g32"])
def test_compiled_prefill_matches_eager(peaked, monkeypatch, output):
    """--compile's prompts: each block and the output projection through fast_cpu.CompiledPrompt, compiled with dynamic
    lengths as one graph for every layer (weights as inputs, not frozen constants: no graph per layer); the output
    projection runs for the last token only, through the same kernel as decode (int8: the word kernel; weight-only
    int4: ATen's packed kernel, which eager runs too). The prompt's last logits and the greedy tokens match eager."""
    from torch._dynamo.utils import counters
    m = copy.deepcopy(peaked)
    Q.quantize_model(m, "int4", 32, embedding="int8", log=False)
    Q._set_module(m, "output", qops.QuantizedLinear(Q.quantize_weight(peaked.output.weight,
                                                                              SCHEMES[output][0])))
    ref = engine.prefill(generate.TorchBackend(copy.deepcopy(m), 1, 64), [PROMPT], CPU)[0]  # eager, same kernels
    eager = _greedy(copy.deepcopy(m), n=8)
    traced = []
    fused = FQ.FastQuantizedLinear.fused_linear
    monkeypatch.setattr(FQ.FastQuantizedLinear, "fused_linear", lambda self, *a: traced.append(1) or fused(self, *a))
    torch._dynamo.reset()  # (graphs of earlier tests would serve this model: its weights are inputs)
    be = generate.TorchBackend(m, 1, 64, compile=True)
    graphs = counters["stats"]["unique_graphs"]
    last = engine.prefill(be, [PROMPT], CPU)
    assert len(m.layers) > 1 and counters["stats"]["unique_graphs"] - graphs == 2  # a block, the output projection
    assert bool(traced) == (output == "int8")  # the last token's output projection: int8's decode word kernel
    torch.testing.assert_close(last[0], ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    out, _ = generate.generate(be, [PROMPT], 8, CPU)
    assert out[0] == eager


@needs_onednn_bf16
def test_eager_int8_long_product_bfloat16_gemm(monkeypatch):
    """Eager int8 products of BF16_ROWS rows or more on a CPU with bfloat16 dot products: one cast of the integer
    weights to bfloat16 and oneDNN's bfloat16 GEMM (forced on here), the same arithmetic as the packed kernel (x in
    bfloat16, exact weights, float32 sums, output in bfloat16, float32 scales after); shorter ones keep the kernel."""
    monkeypatch.setattr(FQ, "BF16_GEMM", True)
    _, lin = _linear("int8")
    qw, lin = lin.qweight, FQ.FastQuantizedLinear(lin)
    bf = lambda t: t.to(torch.bfloat16).float()
    calls = []
    packed = torch.ops.aten._weight_int8pack_mm
    monkeypatch.setattr(torch.ops.aten, "_weight_int8pack_mm", lambda *a: calls.append(1) or packed(*a))
    for rows, kernel in ((FQ.BF16_ROWS - 1, True), (FQ.BF16_ROWS + 8, False)):
        x = torch.randn(rows, 128)
        want = bf(F.linear(bf(x), qw.qdata.float())) * qw.scales
        calls.clear()
        torch.testing.assert_close(lin(x), want, rtol=2 ** -8, atol=1e-6)
        assert bool(calls) == kernel


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_compiled_long_prefill_bfloat16_gemm(peaked, monkeypatch, mode):
    """--compile's prompts of BF16_ROWS tokens or more (int8: INT8_WORD_ROWS), on a CPU with bfloat16 dot products,
    where the weights have no prompt copies (fast_cpu.pack_prompt_weights): the weights go to bfloat16 in a generated
    kernel (words_bf16_t) for oneDNN's bfloat16 GEMM, piece by piece (16 output channels each here: WORD_PIECE_BYTES).
    Forced on here, so that any CPU runs it (oneDNN converts where the instructions are missing). Eager int8 casts
    qdata for the same GEMM: the prompt's last logits agree within float rounding and the greedy tokens match.
    Weight-only int4 holds ATen's blocked layout alone (no word layouts) and runs its packed kernel at every length,
    compiled as eager: the same logits."""
    monkeypatch.setattr(FQ, "BF16_GEMM", True)
    monkeypatch.setattr(FQ, "WORD_PIECE_BYTES", 1)  # the smallest pieces: 16 channels
    monkeypatch.setattr(fast_cpu, "available_memory", lambda: 0)  # no prompt copies (no memory for them)
    traced = []
    words = FQ.FastQuantizedLinear.words_bf16_t
    monkeypatch.setattr(FQ.FastQuantizedLinear, "words_bf16_t",  # (None: no words)
                        lambda self, *a: (w := words(self, *a)) is not None and traced.append(a) or w)
    m = copy.deepcopy(peaked)
    Q.quantize_model(m, mode, 32, embedding="int8", log=False)
    prompt = (PROMPT * 16)[:max(FQ.BF16_ROWS, FQ.INT8_WORD_ROWS) + 4]  # (int8 below INT8_WORD_ROWS: word kernels)
    ref = engine.prefill(generate.TorchBackend(copy.deepcopy(m), 1, 96), [prompt], CPU)[0]
    eager, _ = generate.generate(generate.TorchBackend(copy.deepcopy(m), 1, 96), [prompt], 8, CPU)
    assert not traced  # eager: no word layouts
    be = generate.TorchBackend(m, 1, 96, compile=True)
    last = engine.prefill(be, [prompt], CPU)[0]
    assert bool(traced) == (mode == "int8")  # compiled int8 prefill took the bfloat16 GEMM
    assert mode != "int8" or all(hi - lo == 16 for lo, hi in traced) and {lo for lo, _ in traced} > {0, 16}  # pieces
    torch.testing.assert_close(last, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())  # (int8: 2e-6 of 12.3)
    out, _ = generate.generate(be, [prompt], 8, CPU)
    assert out == eager


@pytest.mark.parametrize("rows", ["short", "long"])
def test_compiled_8da4w_prefill(peaked, monkeypatch, rows):
    """8da4w under --compile: a prompt's products take the activations' integer values q - zp (exact in bfloat16)
    through fast_cpu_kernels' kernel where it takes the shape (any length; not this 96-channel linear), else ATen's
    packed int4 kernel (fewer than BF16_ROWS tokens) or oneDNN's bfloat16 GEMM on words_bf16_t's (q - 8) s (from
    BF16_ROWS tokens; forced on here, so any CPU runs it), times the activations' scales after.
    Eager keeps the float32 product of the fake-quantized activations. One product agrees with that float32 product
    (computed in float64) to bfloat16 rounding; the prompt's last logits agree with eager's likewise (before the
    argmax), and the greedy tokens match."""
    monkeypatch.setattr(FQ, "BF16_GEMM", True)
    M = FQ.BF16_ROWS + 4 if rows == "long" else FQ.BF16_ROWS - 8
    _, lin = _linear("8da4w-g32", N=96, K=256)
    qw, fast = lin.qweight, FQ.FastQuantizedLinear(lin)
    x = torch.randn(M, 256)
    want = F.linear(qops.fake_quant_per_token_int8(x).double(), qw.dequantize(torch.float64, offset=False))
    w = fast.words_bf16_t() if rows == "long" else None  # what the compiled graph multiplies by (eager: packed kernel)
    q, zp, scale = qops.quant_per_token_int8(x)
    got = (torch.mm((q - zp).to(torch.bfloat16), w).float() * scale) if w is not None else fast.int4_act_linear(x)
    torch.testing.assert_close(got.double(), want, rtol=2 ** -8, atol=2 ** -8 * want.abs().max().item())
    m = copy.deepcopy(peaked)
    Q.quantize_model(m, "8da4w", 32, log=False)
    prompt = (PROMPT * 8)[:M]
    ref = engine.prefill(generate.TorchBackend(copy.deepcopy(m), 1, 64), [prompt], CPU)[0]
    eager, _ = generate.generate(generate.TorchBackend(copy.deepcopy(m), 1, 64), [prompt], 8, CPU)
    calls = []
    act = FQ.FastQuantizedLinear.int4_act_linear
    monkeypatch.setattr(FQ.FastQuantizedLinear, "int4_act_linear", lambda self, x: calls.append(1) or act(self, x))
    be = generate.TorchBackend(m, 1, 64, compile=True)
    last = engine.prefill(be, [prompt], CPU)[0]
    assert calls  # traced into the compiled prompt graph
    torch.testing.assert_close(last, ref, rtol=2 ** -7, atol=2 ** -7 * ref.abs().max().item())
    out, _ = generate.generate(be, [prompt], 8, CPU)
    assert out == eager


@needs_onednn_bf16
def test_compiled_int8_prompts_use_bfloat16_copies(peaked, monkeypatch, capsys):
    """--compile of a weight-only int8 model on a CPU with bfloat16 dot products (forced on here) gives each block's
    weight a bfloat16 copy of q (exact) in oneDNN's packed layout that every product of a compiled prompt runs on, short
    or long (one graph), the scales after; not the output projection's, nor int4's or 8da4w's weights (not exact in
    bfloat16) or 8da8w's (integer GEMMs). The prompt's last logits equal eager's to float rounding and the greedy tokens
    match. A weight whose copy is dropped after compiling takes the kernels as before (a recompile); copies that would
    take more than half of the free memory are not made, with one line."""
    from torch._dynamo.utils import counters
    monkeypatch.setattr(FQ, "BF16_GEMM", True)
    m = copy.deepcopy(peaked)
    Q.quantize_model(m, "int8", embedding="int8", log=False)
    prompts = [PROMPT, (PROMPT * 8)[:FQ.BF16_ROWS + 4]]
    eager = generate.TorchBackend(copy.deepcopy(m), 1, 64)
    refs = [engine.prefill(eager, [p], CPU)[0] for p in prompts]
    want = [generate.generate(eager, [p], 8, CPU)[0] for p in prompts]
    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]
    be = generate.TorchBackend(m, 1, 64, compile=True)
    blocks = [mod for mod in m.layers.modules() if isinstance(mod, qops.QuantizedLinear)]
    assert blocks and all(b.prompt_packed and FQ.packed_copy(b.qweight.qdata) is not None for b in blocks)
    out = m.output.inner  # (the compiled prompt caller wraps the output projection)
    assert not out.prompt_packed and FQ.packed_copy(out.qweight.qdata) is None
    looked_up = []
    lookup = FQ.packed_copy
    monkeypatch.setattr(FQ, "packed_copy", lambda w: looked_up.append(1) or lookup(w))
    for p, ref, tokens in zip(prompts, refs, want):
        looked_up.clear()
        last = engine.prefill(be, [p], CPU)[0]
        assert len(looked_up) == len(blocks)  # every block product, once
        torch.testing.assert_close(last, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
        assert generate.generate(be, [p], 8, CPU)[0] == tokens
    assert counters["stats"]["unique_graphs"] - graphs == 3  # decode, one block graph for both lengths, the output
    m.layers[0].inner.feed_forward.w2.prompt_packed = False
    looked_up.clear()
    last = engine.prefill(be, [PROMPT], CPU)[0]  # (w2: the word kernels, INT8_WORD_ROWS, at decode's precision)
    torch.testing.assert_close(last, refs[0], rtol=1e-3, atol=1e-3 * refs[0].abs().max().item())
    assert last.argmax() == refs[0].argmax()
    assert len(looked_up) == len(blocks) - 1
    for mode in ("int4", "8da4w", "8da8w"):
        m2 = copy.deepcopy(peaked)
        Q.quantize_model(m2, mode, 32, log=False)
        fast_cpu.swap_in(m2)
        assert fast_cpu.pack_prompt_weights(m2) == (0, True)
    m2 = copy.deepcopy(peaked)
    Q.quantize_model(m2, "int8", log=False)
    monkeypatch.setattr(fast_cpu, "available_memory", lambda: 0)
    capsys.readouterr()
    generate.TorchBackend(m2, 1, 64, compile=True)
    assert "would take more than 0 MB (PROMPT_COPIES_MAX, or half of the free memory)" in capsys.readouterr().err
    assert not any(mod.prompt_packed for mod in m2.layers.modules() if isinstance(mod, qops.QuantizedLinear))


def test_compiled_8da4w_keeps_only_the_layouts_it_reads(peaked):
    """8da4w: an eager model keeps the unpacked int8 copy its float32 products read (qdata_int8) and reads qdata; a
    compiled one reads only its word layouts (decode) and int4_cpu (prompts: fast_cpu_kernels' tiles or ATen's
    layout): no int8 copy, and qdata's pages may be given back (reads_words_only; 1B shape: 4.0 -> 2.3 GB peak RSS)."""
    m = copy.deepcopy(peaked)
    Q.quantize_model(m, "8da4w", 32, log=False)
    eager = generate.TorchBackend(copy.deepcopy(m), 1, 64)
    fast = [f for f in eager.model.modules() if isinstance(f, FQ.FastQuantizedLinear) and f.qweight.bits == 4]
    assert fast and all(f.qdata_int8 is not None and not f.reads_words_only() for f in fast)
    generate.TorchBackend(m, 1, 64, compile=True)
    fast = [f for f in m.modules() if isinstance(f, FQ.FastQuantizedLinear) and f.qweight.bits == 4]
    assert fast and all(f.qdata_int8 is None and f.int4_words is not None for f in fast)
    assert any(f.int4_cpu is not None for f in fast)
    assert all(f.reads_words_only() == (f.int4_cpu is not None) for f in fast)


def test_word_layouts_only_when_compiled_and_prompts_without_copies(peaked, tmp_path, monkeypatch):
    """An eager model holds no word layouts (only compiled code reads them); a compiled int8 model whose prompt copies
    are not made (over PROMPT_COPIES_MAX) multiplies its prompts by the words: row by row below INT8_WORD_ROWS rows,
    as bfloat16 from there; the same greedy tokens as eager, short and long prompts. FQ.release_pages gives back the
    pages of a file-mapped tensor whose bytes still equal the file's (read again, the same values), and keeps a
    written one."""
    monkeypatch.setattr(FQ, "BF16_GEMM", True)
    m = copy.deepcopy(peaked)
    Q.quantize_model(m, "int8", embedding="int8", log=False)
    prompts = [PROMPT, (PROMPT * 8)[:FQ.BF16_ROWS + 4], (PROMPT * 16)[:FQ.INT8_WORD_ROWS + 4]]
    eager = generate.TorchBackend(copy.deepcopy(m), 1, 96)
    fast = [mod for mod in eager.model.modules() if isinstance(mod, FQ.FastQuantizedLinear)]
    assert fast and all(f.int8_words is None for f in fast)
    want = [generate.generate(eager, [p], 8, CPU)[0] for p in prompts]
    monkeypatch.setattr(fast_cpu, "PROMPT_COPIES_MAX", 0)
    be = generate.TorchBackend(m, 1, 96, compile=True)
    fast = [mod for mod in m.modules() if isinstance(mod, FQ.FastQuantizedLinear)]
    assert all(f.int8_words is not None and not f.prompt_packed and f.reads_words_only() for f in fast)
    kernels = []
    for name in ("fused_linear", "words_bf16_t"):
        monkeypatch.setattr(FQ.FastQuantizedLinear, name, lambda self, *a, _f=getattr(FQ.FastQuantizedLinear, name),
                            _n=name, **k: kernels.append(_n) or _f(self, *a, **k))
    got = []
    for p in prompts:  # (traced anew for each length range: the compiled prompt graph guards on it)
        kernels.clear()
        got.append(generate.generate(be, [p], 8, CPU)[0])
        assert ("words_bf16_t" in kernels) == (len(p) >= FQ.INT8_WORD_ROWS), (len(p), set(kernels))
    assert got == want
    torch.save({"a": torch.arange(1 << 20, dtype=torch.int32), "b": torch.arange(1 << 18)}, tmp_path / "t.pth")
    sd = torch.load(tmp_path / "t.pth", mmap=True, weights_only=True)
    before = sd["a"].clone()
    assert FQ.release_pages(sd["a"]) >= (4 << 20) - 8192
    assert torch.equal(sd["a"], before)
    sd["b"][:4096] += 1
    assert FQ.release_pages(sd["b"]) == 0 and sd["b"][0] == 1
    assert FQ.release_pages(before) == 0  # anonymous memory: never


def test_compiled_8da8w_prefill_matches_eager(peaked):
    """8da8w under --compile: the prompt's integer GEMMs (torch._int_mm) compiled, decode through the
    int8 word kernels on fake-quantized activations; the prompt's last logits and the greedy tokens match eager."""
    m = copy.deepcopy(peaked)
    Q.quantize_model(m, "8da8w", log=False)
    prompt = PROMPT * 3
    ref = engine.prefill(generate.TorchBackend(copy.deepcopy(m), 1, 64), [prompt], CPU)[0]
    eager, _ = generate.generate(generate.TorchBackend(copy.deepcopy(m), 1, 64), [prompt], 8, CPU)
    be = generate.TorchBackend(m, 1, 64, compile=True)
    last = engine.prefill(be, [prompt], CPU)
    torch.testing.assert_close(last[0], ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    out, _ = generate.generate(be, [prompt], 8, CPU)
    assert out == eager


# ----------------------------------------------------------------------------------------------------------- GPTQ
def test_gptq_beats_round_to_nearest_on_layer_output():
    torch.manual_seed(0)
    K, N = 256, 64
    mix = torch.randn(K, K) / K ** 0.5 * torch.linspace(0.1, 3, K)  # correlated, unevenly scaled input features
    X = torch.randn(2048, K) @ mix
    W = torch.randn(N, K) * 0.05
    H = 2 * X.T @ X / X.shape[0]
    scheme = Q._scheme(4, 64)
    ref = X @ W.T
    rtn = Q.quantize_weight(W, scheme).dequantize()
    err_rtn = (X @ rtn.T - ref).pow(2).mean()
    for act_order in (False, True):
        qt = gptq.gptq_quantize(W, H, scheme, act_order=act_order)
        g = qops.QuantizedWeight.from_quantized(qt, scheme, torch.float32).dequantize()
        err = (X @ g.T - ref).pow(2).mean()
        # measured: 0.73x (act_order 0.35x) of round-to-nearest's error
        assert err < (0.5 if act_order else 0.8) * err_rtn, (act_order, err.item(), err_rtn.item())
    # with uncorrelated inputs (H = I) there is nothing to compensate: GPTQ is round-to-nearest
    qt = gptq.gptq_quantize(W, torch.eye(K), scheme)
    torch.testing.assert_close(qops.QuantizedWeight.from_quantized(qt, scheme, torch.float32).dequantize(), rtn,
                               rtol=0, atol=0)


def test_gptq_model_reduces_error_on_calibration_tokens(peaked):
    """Through the model: each linear's output error on the calibration tokens is lower than with plain int4."""
    torch.manual_seed(0)
    calib = torch.randint(0, 256, (4, 48))
    rtn, gptq = copy.deepcopy(peaked), copy.deepcopy(peaked)
    Q.quantize_model(rtn, "int4", 32, embedding="none", log=False)
    Q.quantize_model(gptq, "int4-gptq", 32, calibration_ids=calib, embedding="none", log=False)
    inputs = {}
    hooks = [mod.register_forward_hook(lambda mod, a, o, n=n: inputs.setdefault(n, []).append(a[0]))
             for n, mod in peaked.named_modules() if isinstance(mod, nn.Linear)]
    peaked.setup_caches(4, 48)
    with torch.no_grad():
        peaked(calib, torch.arange(48))
    for h in hooks:
        h.remove()
    wins = 0
    for n, xs in inputs.items():
        x, w = xs[0], peaked.get_submodule(n).weight
        ref = F.linear(x, w)
        e_rtn = (F.linear(x, rtn.get_submodule(n).qweight.dequantize()) - ref).pow(2).mean()
        e_gptq = (F.linear(x, gptq.get_submodule(n).qweight.dequantize()) - ref).pow(2).mean()
        wins += int(e_gptq < e_rtn)
    assert wins == len(inputs), f"GPTQ better on {wins}/{len(inputs)} linears"


# ----------------------------------------------------------------------------------------------------------- CLI
def test_cli_writes_checkpoint_and_generate_reads_it(tiny_checkpoint, capsys):
    """quantize.py's and generate.py's main() in-process (the subprocess error path is covered below)."""
    d, _ = tiny_checkpoint
    Q.main(["--checkpoint_path", str(d / "model.pth"), "--mode", "int4", "--groupsize", "32"])
    out = d / "model_int4.g32.pth"
    assert capsys.readouterr().out.strip().endswith("model_int4.g32.pth") and out.is_file()
    generate.main(["--checkpoint_path", str(out), "--prompt", "The quick", "--max_new_tokens", "5",
                   "--temperature", "0", "--quiet"])
    assert capsys.readouterr().out.startswith("The quick")


def test_cli_writes_float32_from_a_bfloat16_source(tiny_checkpoint, tmp_path, capsys):
    """A bfloat16 source (as converted from Hugging Face) quantizes to a float32 file: scales, zeros and norms hold
    the values the bfloat16 model's quantization gives, and a float32 load maps them from the file (no cast copies,
    which would outlive the kernels' own layouts)."""
    d, _ = tiny_checkpoint
    src = load_model(d / "model.pth", dtype=torch.bfloat16)
    save_checkpoint(checkpoint_state(src), tmp_path / "model.pth")
    Q.main(["--checkpoint_path", str(tmp_path / "model.pth"), "--mode", "int4", "--groupsize", "32"])
    out = tmp_path / "model_int4.g32.pth"
    assert capsys.readouterr().out.strip().endswith("model_int4.g32.pth")
    sd = torch.load(out, weights_only=True)
    assert {v.dtype for v in sd.values() if torch.is_tensor(v) and v.is_floating_point()} == {torch.float32}
    Q.quantize_model(src, "int4", 32, log=False)  # in memory: the bfloat16 model's own scales and zeros
    for k, v in src.state_dict().items():
        if v.is_floating_point() and k in sd:
            assert v.dtype == torch.bfloat16 and torch.equal(sd[k], v.float()), k
    m = load_model(out, dtype=torch.float32)
    maps = [(*(int(a, 16) for a in x[0].split("-")), x[5]) for x in
            (line.split() for line in open("/proc/self/maps").read().splitlines()) if len(x) > 5]
    scales = [mod.qweight.scales.data_ptr() for mod in m.modules() if isinstance(mod, qops.QuantizedLinear)]
    assert scales and all(any(lo <= p < hi and f == str(out) for lo, hi, f in maps) for p in scales)


def test_cli_errors(tiny_checkpoint, tmp_path):
    """Two real subprocess runs for the error format (one `error:` line, no traceback); the other checks in-process."""
    d, _ = tiny_checkpoint
    ck = d / "model.pth"
    assert_clean_error(run_cli("quantize.py", "--checkpoint_path", ck, "--mode", "int3"), "unknown mode")
    assert_clean_error(run_cli("quantize.py", "--checkpoint_path", ck, "--mode", "int4", "--groupsize", "64"),
                       "does not divide in_features 160")
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        Q.main(["--checkpoint_path", str(tmp_path / "nope.pth"), "--mode", "int8"])
    with pytest.raises(FileNotFoundError, match="calibration file not found"):
        Q.main(["--checkpoint_path", str(ck), "--mode", "int4-gptq", "--calibration_file", str(tmp_path / "x.txt")])
    with pytest.raises(ValueError, match="needs --calibration_file"):
        Q.main(["--checkpoint_path", str(ck), "--mode", "int4-gptq"])
    with pytest.raises(ValueError, match="--groupsize must be one of"):
        Q.main(["--checkpoint_path", str(ck), "--mode", "int4", "--groupsize", "48"])
    with pytest.raises(ValueError, match="--embedding must be one of"):
        Q.main(["--checkpoint_path", str(ck), "--mode", "int4", "--embedding", "int2"])
