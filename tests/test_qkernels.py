# qops.py, fast_cpu_quant.py and qexport.py: every kernel and export form of a quantized product against references
# computed from the weights' own dequantized values; the int4 layouts; the 8da4w pattern XNNPACK lowers; fast_cpu_kernels'
# kernel against float64 and ATen's.
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import fast_cpu_kernels
import fast_cpu_quant as FQ
import qexport
import qops
import quantize as Q
import torch_internals as TI
from conftest import REPO, hf_to_model, tiny_hf

CPU = torch.device("cpu")
SCHEMES = {  # name: (scheme, activation quantization)
    "int8": (Q._scheme(8), None),
    "int4-g32": (Q._scheme(4, 32), None),
    "int4-g64": (Q._scheme(4, 64), None),
    "8da4w-g32": (Q._scheme(4, 32, xnnpack=True), "int8"),            # what --mode 8da4w makes
    "8da4w-sym-g32": (Q._scheme(4, 32, symmetric=True), "int8"),     # ExecuTorch's own 8da4w (older checkpoints)
    "8da8w": (Q._scheme(8), "int8"),                                  # what --mode 8da8w makes
}


def _linear(name, N=96, K=128, bias=False, seed=0):
    torch.manual_seed(seed)
    w = torch.randn(N, K) * 0.05
    scheme, act = SCHEMES[name]
    qw = Q.quantize_weight(w, scheme)
    return w, qops.QuantizedLinear(qw, torch.randn(N) if bias else None, act)


# ----------------------------------------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("name", list(SCHEMES))
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_its_dequantized_weights(name, bias):
    w, lin = _linear(name, bias=bias)
    fast = FQ.FastQuantizedLinear(lin)
    x = torch.randn(2, 5, 128)
    qw = lin.qweight
    ref_x = qops.fake_quant_per_token_int8(x) if lin.act else x
    split = qw.xnnpack and qw.zeros is not None  # 8da4w: int8 x (q - 8) s, plus float x's group sums x (z + 8 s)
    zt = F.linear(x.unflatten(-1, (-1, qw.groupsize)).sum(-1), qw.zeros + 8 * qw.scales) if split else 0
    ref = F.linear(ref_x, qw.dequantize(offset=not split), lin.bias) + zt
    bf = lambda t: t.to(torch.bfloat16).float()  # float32 products and sums, output in bfloat16 (one flip allowed)
    want = None  # weight-only, more than one row: ATen's packed kernel, bfloat16 activations
    if qw.weight_only:  # int4: scales and offsets (z + 8 s) in bfloat16
        G, N = qw.groupsize, qw.out_features
        w16 = ((qw.int_values().view(N, -1, G) - 8) * bf(qw.scales)[..., None] + bf(qw.zeros + 8 * qw.scales)[..., None])
        want = bf(F.linear(bf(x), w16.view(N, -1))) + (lin.bias if bias else 0)
    elif qw.bits == 8 and not lin.act:  # int8: float32 scales after
        want = bf(F.linear(bf(x), qw.qdata.float())) * qw.scales + (lin.bias if bias else 0)
    if qw.bits == 8 and not lin.act:  # compiled prefill's bfloat16 w.T (words_bf16_t): the integer values, exact
        assert torch.equal(fast.words_bf16_t(), qw.qdata.t().to(torch.bfloat16))
    elif qw.weight_only:  # weight-only int4 holds ATen's blocked layout alone, no word layouts
        assert fast.words_bf16_t() is None and fast.int4_words is None and fast.int4_cpu is not None
    torch.testing.assert_close(lin(x), ref, rtol=1e-5, atol=1e-5)  # qops' module: the exact eager product
    if qw.bits == 8 and not lin.act and fast.int8_kernel == "all":  # AVX2: the words at every length (x as int16
        # per run of 32 word rows: 2e-5 of the run's largest |x|)
        torch.testing.assert_close(fast(x), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    elif want is None:
        torch.testing.assert_close(fast(x), ref, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(fast(x), want, rtol=2 ** -8, atol=1e-6)
        # one row: int8 float32; int4 its packed kernel (its one layout), whose one-row path rounds within bfloat16
        tol = 2 ** -7 * ref.abs().max().item() if qw.bits == 4 else 1e-5  # (measured 0.005 of 1.4: 1/280)
        torch.testing.assert_close(fast(x[:1, :1]), ref[:1, :1], rtol=tol, atol=tol)
    # the compile-path formulation (one reduction over the integer weights), run eagerly on one row
    fused = fast.fused_linear(ref_x[:1, :1], offset=not split) + (zt[:1, :1] if split else 0)
    torch.testing.assert_close(fused + (lin.bias if bias else 0), ref[:1, :1], rtol=1e-4, atol=1e-4)
    words = FQ.FastQuantizedLinear(fast, export_rows="words")  # an AOT Inductor package's dynamic length: the same
    many = words.fused_linear(ref_x, offset=not split) + zt     # kernels for any number of rows
    if split:  # 8da4w's form there (and in compiled decode): the float activations' group sums in the same kernel
        one = words.fused_linear(ref_x, sums=x.unflatten(-1, (-1, qw.groupsize)).sum(-1))
        torch.testing.assert_close(one + (lin.bias if bias else 0), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(many + (lin.bias if bias else 0), ref, rtol=1e-4, atol=1e-4)
    # round to nearest: every stored value is the grid point nearest to the float weight, given the stored scales
    qw = lin.qweight
    if qw.bits == 8:
        expect = torch.clamp(torch.round(w / qw.scales[:, None]), -127, 127) * qw.scales[:, None]
    else:
        G = qw.groupsize
        wg = w.view(w.shape[0], -1, G)
        expect = qops._int4_values(Q._int4_round(wg, qw.scales, qw.zeros), qw.scales, qw.zeros).view_as(w)
    torch.testing.assert_close(qw.dequantize(), expect, rtol=0, atol=1e-7)


@pytest.mark.parametrize("name", ["int8", "int4-g32", "int4-g64"])
def test_bfloat16_native_kernels_match_dequantized_weights(name):
    """bfloat16 on CPU runs ATen's packed weight-only kernels (_weight_int8pack_mm, _weight_int4pack_mm_for_cpu)."""
    w, lin = _linear(name, N=96, K=256)
    lin = lin.to(torch.bfloat16)
    fast = FQ.FastQuantizedLinear(lin)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    y = fast.native_linear(x)
    if y is None:
        pytest.skip("this torch build has no packed CPU kernel for this scheme")
    ref = F.linear(x.float(), lin.qweight.dequantize(torch.float32))
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(fast(x).float(), ref, rtol=2e-2, atol=2e-2)
    fast = FQ.FastQuantizedLinear(lin.to(torch.float32))  # float32 weight-only: bfloat16 activations for more than
    torch.testing.assert_close(fast.native_linear(x.float()), ref, rtol=2e-2, atol=2e-2)  # one row; for one, int8
    assert (fast.native_linear(x[:1].float()) is None) == (name == "int8")  # the portable path, int4 its one layout
    assert fast.native_linear(x.float(), float_rows=False) is None  # 8da4w's fake-quantized activations stay float32


def test_bfloat16_native_kernel_of_asymmetric_8da4w():
    """8da4w's packed copy holds the zero-point-free part (q - 8) s; the zero term is QuantizedLinear's."""
    w, lin = _linear("8da4w-g32", N=96, K=256)
    fast = FQ.FastQuantizedLinear(lin.to(torch.bfloat16))
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    y = fast.native_linear(x, offset=False)
    if y is None:
        pytest.skip("this torch build has no packed CPU int4 kernel")
    ref = F.linear(x.float(), fast.qweight.dequantize(torch.float32, offset=False))
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)
    assert fast.native_linear(x) is None  # with offsets: the portable path


def test_8da8w_rows_are_one_integer_product():
    """8da8w, more than one row: torch._int_mm on the int8 activations and weights, whose int32 sums are exact (checked
    against int64 sums of the same integers); one row takes the fake-quantized float product (decode)."""
    w, lin = _linear("8da8w", K=256, bias=True)
    qw, fast = lin.qweight, FQ.FastQuantizedLinear(lin)
    x = torch.randn(2, 7, 256) * torch.linspace(0.1, 4, 256)
    q, zp, scale = qops.quant_per_token_int8(x)
    acc = (q - zp).long() @ qw.qdata.long().T                      # [2, 7, 96] exact
    want = (acc.double() * scale.double() * qw.scales.double() + lin.bias.double()).float()
    y = fast(x)
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(y, fast.int8_act_linear(x) + lin.bias)
    ref = F.linear(qops.fake_quant_per_token_int8(x), qw.dequantize(), lin.bias)
    torch.testing.assert_close(fast(x[:1, :1]), ref[:1, :1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin(x), ref, rtol=1e-5, atol=1e-5)  # qops' module: the fake-quantized product


@pytest.mark.parametrize("name", ["8da4w-g32", "8da4w-sym-g32", "8da8w"])
def test_dynamic_act_export_arithmetic_matches_eager(name):
    """The op pattern the exporters emit (torchao quantize/dequantize_affine, qb4w weights with zero point 8, plus the
    group-sum GEMM for asymmetric weights; 8da8w: per-channel int8 weights, qc8w) computes what the eager module
    computes; 4-bit scales are bfloat16 values."""
    w, lin = _linear(name, bias=True)
    x = torch.randn(2, 5, 128)
    torch.testing.assert_close(qexport.XnnpackLinear(lin)(x), lin(x), rtol=1e-5, atol=1e-5)
    s = lin.qweight.scales
    assert torch.equal(s, s.to(torch.bfloat16).to(s.dtype)) == (name != "8da8w")
    assert (lin.qweight.zeros is None) == (name != "8da4w-g32")


def test_int4_pack_roundtrip_and_layout():
    q = torch.randint(0, 16, (7, 64))
    p = qops.pack_int4(q, 32)
    assert p.dtype == torch.uint8 and p.shape == (7, 32)
    assert torch.equal(qops.unpack_int4(p, 32).long(), q)
    assert int(p[0, 0]) == int(q[0, 0]) * 16 + int(q[0, 16])  # byte j of a group: element j (high), j + G/2 (low)


def test_int4_reproduces_a_weight_already_on_an_int4_grid():
    """SmolLM2's default checkpoint comes from a Q4_1 GGUF: g32 asymmetric int4 must give it back exactly."""
    torch.manual_seed(0)
    d, m = torch.rand(16, 4, 1) * 0.01 + 1e-3, torch.randn(16, 4, 1) * 0.05
    q = torch.randint(0, 16, (16, 4, 32)).float()
    q[..., 0], q[..., 1] = 0, 15  # Q4_1 groups use their full range
    w = (q * d + m).view(16, 128)
    qw = Q.quantize_weight(w, Q._scheme(4, 32))
    torch.testing.assert_close(qw.dequantize(), w, rtol=0, atol=1e-6)


def test_8da4w_activation_quantization_matches_torchao():
    qp = qexport.torchao_primitives()
    x = torch.randn(3, 7, 64) * 3 + 0.5
    bs = (1, 1, 64)
    s, zp = qp.choose_qparams_affine(x, qp.MappingType.ASYMMETRIC, bs, torch.int8, -128, 127,
                                     zero_point_dtype=torch.int8)
    ref = qp.dequantize_affine(qp.quantize_affine(x, bs, s, zp, torch.int8, -128, 127), bs, s, zp, torch.int8,
                               -128, 127, output_dtype=x.dtype)
    torch.testing.assert_close(qops.fake_quant_per_token_int8(x), ref, rtol=0, atol=1e-6)


def test_embedding_rows_match_dequantized_table():
    torch.manual_seed(0)
    w = torch.randn(50, 64)
    idx = torch.randint(0, 50, (2, 9))
    for scheme in (Q._scheme(8), Q._scheme(4, 32), Q._scheme(4, 64, symmetric=True)):
        qw = Q.quantize_weight(w, scheme)
        torch.testing.assert_close(qops.QuantizedEmbedding(qw)(idx), F.embedding(idx, qw.dequantize()), rtol=0, atol=0)


def test_compiled_decode_int8_layout_keeps_precision_in_bfloat16():
    """The compiled int8 decode reduction reads bytes 0-2 offset by 128 and subtracts 128 * sum(x) once per row: with
    bfloat16 activations that sum is far larger than the result, so it must be accumulated in float32. Compared with
    the same bfloat16 input through the dequantized weights in float32 (bfloat16 rounding of the result only)."""
    w, lin = _linear("int8", N=64, K=256)
    fast = FQ.FastQuantizedLinear(lin)
    assert fast.int8_words is not None  # the word layout this checks
    fast.int8_kernel = None  # the generated reduction (the kernel's: test_int8_words_kernel_matches_the_generated_...)
    x = (torch.randn(1, 1, 256) + 2.0).to(torch.bfloat16)  # a mean far from 0: a large offset term
    ref = F.linear(x.float(), lin.qweight.dequantize(torch.float32))
    got = fast.fused_linear(x).float()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


# ----------------------------------------------------------------------------------------------------------- export
def _lowered(model):
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    model.setup_caches(1, 16)
    ep = torch.export.export(model, (torch.tensor([[5, 17, 99, 3]]), torch.arange(4)))
    return to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()])


def test_8da4w_lowers_fully_to_xnnpack():
    pytest.importorskip("executorch")
    m = hf_to_model(tiny_hf("llama", seed=5, vocab_size=256, tie=True, num_hidden_layers=1))
    Q.quantize_model(m, "8da4w", 32, log=False)
    for parent in list(m.modules()):  # qexport's export form of each 8da4w linear
        for name, child in list(parent.named_children()):
            if qexport.xnnpack_kind(child) and child.act == "int8":
                setattr(parent, name, qexport.XnnpackLinear(child))
    low = _lowered(m)
    g = low.exported_program().graph_module.graph
    targets = [str(n.target) for n in g.nodes if n.op == "call_function"]
    left = [t for t in targets if any(k in t for k in ("aten.linear", "aten.mm", "aten.addmm", "dequantize_affine",
                                                        "quantize_affine", "choose_qparams"))]
    assert not left, left
    assert sum("executorch_call_delegate" in t for t in targets) >= 1
    # with et_export.py's swaps (its own norm / rope / cache forms), no matmul or quantize op is left out
    import et_export
    m = hf_to_model(tiny_hf("llama", seed=5, vocab_size=256, tie=True, num_hidden_layers=1))
    Q.quantize_model(m, "8da4w", 32, log=False)
    with et_export.export_swaps(m):
        low = _lowered(m)
    names = [getattr(n.target, "__name__", str(n.target)) for n in low.exported_program().graph_module.graph.nodes
             if n.op == "call_function"]
    assert any("embedding" in t for t in names), names  # the names are what this check expects
    left = [t for t in names if t.removeprefix("aten.").split(".")[0] in ("linear", "mm", "addmm", "bmm")
            or "affine" in t or "choose_qparams" in t]
    assert not left, left
    # (running the program, with its KV-cache buffers, is et_export.py's business: tests/test_et_export.py)


# ----------------------------------------------------------------------------------------------------- fast_cpu_kernels
BF16_DOTS = TI.cpu_has("avx512_bf16")
KERNELS = TI.cpu_has("avx2")  # (every CPU with AVX2 torch knows has FMA)
needs_int4_kernel = pytest.mark.skipif(not KERNELS, reason="this CPU has no AVX2: ATen's int4 kernel runs")
needs_bf16_dots = pytest.mark.skipif(not BF16_DOTS, reason="this CPU has no AVX512-BF16: AVX2's kernels read any 16")


def test_kernels_run_where_the_cpu_has_avx2():
    """Built, loaded and self-checked on every CPU with AVX2 (a failed build there is a failure here): the AVX-512
    kernels where it has AVX512-BF16, else the AVX2 ones."""
    on = os.environ.get("LLAMA_FLAT_KERNELS", "1") != "0"
    assert fast_cpu_kernels.available() == (KERNELS and on)
    assert fast_cpu_kernels.ISA == (0 if not (KERNELS and on) else 2 if BF16_DOTS else 1)


@needs_int4_kernel
@pytest.mark.parametrize("M", [1, 4, 5, 6, 8, 13, 70])
@pytest.mark.parametrize("N,K,G", [(64, 64, 32), (192, 512, 32), (64, 576, 32), (128, 256, 64), (64, 256, 128),
                                   (64, 512, 256)])
def test_int4_kernel_matches_float64_and_atens_kernel(M, N, K, G):
    """llama_flat::int4_tiles_mm on a weight's tiles (fast_cpu_kernels.make_tiles; one row: its own decode loop; on
    AVX2 70 rows are at::mm on float32 pieces of 96 channels: N 128 and 192 end in a partial piece and a whole one):
    float64's product of the dequantized weight up to float32 rounding (AVX2's tiles: x as int16 per run of 32, 2e-5
    of the run's largest |x|), and ATen's own kernel on its packed layout (bfloat16 output) up to its rounding."""
    g = torch.Generator().manual_seed(M * N + K + G)
    q = torch.randint(0, 16, (N, K), generator=g, dtype=torch.int32)
    sz = (torch.randn(K // G, N, 2, generator=g) * 0.1).to(torch.bfloat16)
    x = (torch.randn(M, K, generator=g) * 3).to(torch.bfloat16)
    s, z = (sz[..., i].t().double().repeat_interleave(G, 1) for i in (0, 1))
    ref = x.double() @ ((q - 8) * s + z).t()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    tiles = fast_cpu_kernels.make_tiles(q, sz[..., 0].t(), sz[..., 1].t(), G)
    assert tiles.shape == (N // 16, K // G, G // 32 * 256 + 64) and tiles.dtype == torch.uint8
    aten = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, G, sz).float()
    y, tol = torch.ops.llama_flat.int4_tiles_mm(x, tiles, G), 1e-5 if BF16_DOTS else 1e-4
    assert y.dtype == torch.float32 and y.shape == (M, N)
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    torch.testing.assert_close(y, aten, rtol=2 ** -7, atol=2 ** -7 * ref.abs().max().item())


@needs_bf16_dots
def test_int4_kernel_refuses_a_shape_it_does_not_read():
    q = torch.randint(0, 16, (96, 64), dtype=torch.int32)  # 96 channels: not whole blocks of 64
    sz = torch.ones(2, 96, 2, dtype=torch.bfloat16)
    x = torch.ones(8, 64, dtype=torch.bfloat16)
    tiles = fast_cpu_kernels.make_tiles(q, sz[..., 0].t(), sz[..., 1].t(), 32)
    with pytest.raises(RuntimeError, match="llama_flat::int4_tiles_mm: unsupported shape 8x64 @ 96x64, group size 32"):
        torch.ops.llama_flat.int4_tiles_mm(x, tiles, 32)
    with pytest.raises(RuntimeError, match="llama_flat::int4_tiles_mm: unexpected operands"):
        torch.ops.llama_flat.int4_tiles_mm(x, tiles, 64)


@needs_int4_kernel
def test_int4_linear_keeps_the_tiles_alone_at_every_length(monkeypatch):
    """FastQuantizedLinear (weight-only int4, 128 channels) keeps the kernel's tiles as its one int4 layout and
    multiplies every length by them, one row included; where the kernel does not take the weight, the linear keeps
    ATen's layout and kernel: the same products up to rounding."""
    _, lin = _linear("int4-g32", N=128, K=128)
    fast = FQ.FastQuantizedLinear(lin)
    monkeypatch.setattr(fast_cpu_kernels, "takes", lambda out_features, groupsize: False)
    aten = FQ.FastQuantizedLinear(lin)
    assert fast.int4_cpu[1] is None and fast.int4_cpu[0].shape == (8, 4, 320) and aten.int4_cpu[1] is not None
    rows, real = [], torch.ops.llama_flat.int4_tiles_mm
    monkeypatch.setattr(torch.ops.llama_flat, "int4_tiles_mm", lambda x, w, g: rows.append(len(x)) or real(x, w, g))
    for M in (1, 2, 21):
        x = torch.randn(1, M, 128)
        torch.testing.assert_close(fast(x), aten(x), rtol=2 ** -7, atol=1e-3)
    assert rows == [1, 2, 21]


@needs_int4_kernel
@pytest.mark.parametrize("M", [1, 3])
def test_int8_words_kernel_matches_the_generated_reduction(M):
    """llama_flat::int8_words_mm reads the int8 word layout in place (compiled decode's products; AVX2's: every
    length): float64's product up to float32 rounding (AVX2's: x as int16 per run of 32 word rows, 2e-5 of the
    run's largest |x|), and the generated reduction it stands in for (fused_linear without it, as in packages)."""
    _, lin = _linear("int8", N=256, K=512)
    fast = FQ.FastQuantizedLinear(lin)
    assert fast.int8_kernel
    x = torch.randn(M, 512)
    ref = x.double() @ (lin.qweight.qdata.double() * lin.qweight.scales.double()[:, None]).t()
    y = fast.fused_linear(x)
    fast.int8_kernel = False
    rtol = 1e-5 if BF16_DOTS else 1e-4
    tol = rtol * ref.abs().max().item()
    torch.testing.assert_close(y.double(), ref, rtol=rtol, atol=tol)
    torch.testing.assert_close(y, fast.fused_linear(x), rtol=rtol, atol=tol)
    with pytest.raises(RuntimeError, match="llama_flat::int8_words_mm: unexpected operands"):
        torch.ops.llama_flat.int8_words_mm(x[:, :256], fast.int8_words, lin.qweight.scales.float())


@needs_int4_kernel
@pytest.mark.parametrize("M", [1, 2, 3, 17])
@pytest.mark.parametrize("N,K", [(4, 16), (12, 48), (64, 576), (96, 2048)])
def test_bf16_kernel_matches_float64(M, N, K):
    """llama_flat::bf16_mm (AVX2's kernel, which fast_cpu.Bf16Linear runs where oneDNN has no bfloat16 products; it
    runs on any CPU with AVX2) on a bfloat16 weight as stored: float64's product of the operands (x float32 or
    bfloat16) up to float32 rounding; operands it does not read are refused by name."""
    g = torch.Generator().manual_seed(M * N + K)
    w = torch.randn(N, K, generator=g).to(torch.bfloat16)
    for x in (torch.randn(M, K, generator=g), torch.randn(M, K, generator=g).to(torch.bfloat16)):
        ref = x.double() @ w.double().t()
        y = torch.ops.llama_flat.bf16_mm(x, w)
        assert y.dtype == torch.float32 and y.shape == (M, N)
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    for bad in (w[:N - 1], w.float(), w[:, :K - 8]):  # 4k channels, bfloat16, K % 16 == 0 (and x's K)
        with pytest.raises(RuntimeError, match="llama_flat::bf16_mm: unexpected operands"):
            torch.ops.llama_flat.bf16_mm(x, bad)


@needs_int4_kernel
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_kernels_keep_a_non_finite_activation(bad):
    """A NaN or inf in x leaves its row of y not finite and the other rows as they were, in every kernel (AVX2's take
    x as int16 with a scale per run: a NaN there must not become zeros)."""
    g = torch.Generator().manual_seed(5)
    q = torch.randint(0, 16, (64, 128), generator=g, dtype=torch.int32)
    sz = (torch.randn(2, 64, 2, generator=g) * 0.1).to(torch.bfloat16)
    tiles = fast_cpu_kernels.make_tiles(q, sz[..., 0].t(), sz[..., 1].t(), 64)
    _, lin = _linear("int8", N=64, K=128)
    words = FQ.FastQuantizedLinear(lin).int8_words
    w16 = torch.randn(64, 128, generator=g).to(torch.bfloat16)
    ops = (lambda x: torch.ops.llama_flat.int4_tiles_mm(x.bfloat16(), tiles, 64),
           lambda x: torch.ops.llama_flat.int8_words_mm(x, words, lin.qweight.scales.float()),
           lambda x: torch.ops.llama_flat.bf16_mm(x, w16))
    for M, row in ((1, 0), (3, 1)):
        x = torch.randn(M, 128, generator=g)
        for op in ops:
            clean = op(x)
            x[row, 37] = bad
            y = op(x)
            x[row, 37] = 0.5
            assert not torch.isfinite(y[row]).any()
            others = [r for r in range(M) if r != row]
            torch.testing.assert_close(y[others], clean[others])


def test_int4_kernel_build_is_atomic(monkeypatch, tmp_path, capsys):
    """A failed build says so in one line and leaves nothing in the cache; a good one leaves its library alone."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    assert fast_cpu_kernels._build() is None
    assert "quantized products use slower kernels: building fast_cpu_kernels.c failed" in capsys.readouterr().err
    assert list((tmp_path / "llama-flat").iterdir()) == []
    if KERNELS:
        monkeypatch.delenv("CC")
        assert fast_cpu_kernels._build() is not None
        assert [p.suffix for p in (tmp_path / "llama-flat").iterdir()] == [".so"]


def test_int4_kernel_off_falls_back_to_atens(monkeypatch, capsys):
    """A kernel whose self-test fails (a layout it does not read) is not used: one note, and int4 linears keep ATen's
    layout and kernel. Where the library is not loaded (LLAMA_FLAT_KERNELS=0, as on a CPU without AVX2), int4
    linears compute on ATen's layout what qops' reference computes, and the kernels' ops are refused by name."""
    monkeypatch.setattr(fast_cpu_kernels, "_TRIED", False)
    monkeypatch.setattr(fast_cpu_kernels, "_LIB", fast_cpu_kernels._LIB)  # (restored after the test, as _TRIED)
    monkeypatch.setattr(fast_cpu_kernels, "_load", lambda: True)
    monkeypatch.setattr(fast_cpu_kernels, "_self_test", lambda: False)
    monkeypatch.setattr(fast_cpu_kernels.TI, "cpu_has", lambda feature: True)
    monkeypatch.setenv("LLAMA_FLAT_KERNELS", "1")
    assert not fast_cpu_kernels.available()
    assert "quantized products use slower kernels" in capsys.readouterr().err
    _, lin = _linear("int4-g32", N=128, K=128)
    assert FQ.FastQuantizedLinear(lin).int4_cpu[1] is not None  # (ATen's scales and offsets beside its layout)
    code = """if True:
        import torch, fast_cpu_kernels, fast_cpu_quant, qops, quantize
        torch.manual_seed(0)
        lin = qops.QuantizedLinear(quantize.quantize_weight(torch.randn(128, 128) * 0.05, quantize._scheme(4, 32)))
        fast, x = fast_cpu_quant.FastQuantizedLinear(lin), torch.randn(3, 128)
        assert not fast_cpu_kernels.available() and fast.int4_cpu[1] is not None
        y, ref = fast(x), lin(x)  # (ATen's kernel: x, scales and offsets in bfloat16)
        torch.testing.assert_close(y, ref, rtol=2 ** -7, atol=2 ** -7 * ref.abs().max().item())
        try:
            torch.ops.llama_flat.int4_tiles_mm(x.bfloat16(), fast.int4_cpu[0], 32)
        except NotImplementedError as e:
            print(str(e).splitlines()[0])
    """
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       env={**os.environ, "LLAMA_FLAT_KERNELS": "0"}, timeout=300)
    assert r.returncode == 0 and "llama_flat::int4_tiles_mm" in r.stdout, r.stderr[-2000:]
