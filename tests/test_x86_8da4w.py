# fast_cpu_8da4w.c (8da4w's AVX2 kernel), its torch op llama_flat::q8a4w_mm and ExecuTorch's kernel of it
# (runner-et/kernel_ops.cpp, et_export.py --x86_kernels): the eager 8da4w module's arithmetic (qops.py: x's per-token
# int8 values times (q - 8) s, plus x's group sums times z + 8 s) up to float rounding, in eager, in a .pte run by
# ExecuTorch's Python runtime and by runner-et. Skips on CPUs without AVX2 (where the flag is refused).
import sys

import pytest
import torch

import fast_cpu_kernels
import qexport
import qops
import quantize as Q
import torch_internals as TI

pytestmark = pytest.mark.skipif(not TI.cpu_has("avx2"), reason="this CPU has no AVX2: the x86 kernel does not run")


def _linear(N, K, G, symmetric, bias=False, seed=0):
    torch.manual_seed(seed)
    qw = Q.quantize_weight(torch.randn(N, K) * 0.05, Q._scheme(4, G, symmetric=symmetric, xnnpack=not symmetric))
    return qops.QuantizedLinear(qw, torch.randn(N) if bias else None, "int8")


def test_vnni_kernel_runs_where_the_cpu_has_it():
    """fast_cpu_8da4w.c keeps its AVX-512 VNNI kernel only when it gives the AVX2 kernel's bits on its own check: on a
    CPU with AVX-512 VNNI the check must pass (else this fails: a bug in the VNNI kernel, never a wrong product)."""
    assert fast_cpu_kernels.isa_8da4w() == (2 if TI.cpu_has("avx512") and TI.cpu_has("vnni") else 1)


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("N,K,G", [(64, 64, 32), (192, 576, 32), (128, 256, 64), (48, 512, 128)])
def test_kernel_matches_the_eager_8da4w_module(N, K, G, symmetric):
    """One row (decode), pairs and an odd row out, a 3-D x: the module's own float32 result up to float rounding
    (the integer sums are exact; an activation rounded differently would show as ~1/255 of a row's range)."""
    assert fast_cpu_kernels.available()
    lin = _linear(N, K, G, symmetric, bias=True)
    fast = qexport.X86Linear(lin)
    assert qexport.X86Linear.takes(lin)
    assert fast.records.shape == (N // 16, K // G, G // 32 * 256 + 32 + (0 if symmetric else 64))
    for shape in ((1, K), (2, K), (3, K), (17, K), (1, 5, K)):
        x = torch.randn(*shape) * 3
        x[..., 7] = 40.0  # an outlier channel, as real activations have
        want = lin(x)
        got = fast(x)
        assert got.shape == want.shape and got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_kernel_keeps_a_non_finite_activation():
    lin = _linear(64, 128, 32, False)
    fast = qexport.X86Linear(lin)
    x = torch.randn(3, 128)
    clean = fast(x)
    x[1, 9] = float("nan")
    y = fast(x)
    assert not torch.isfinite(y[1]).any()
    torch.testing.assert_close(y[[0, 2]], clean[[0, 2]])


def test_records_refuse_scales_off_the_bfloat16_grid():
    q = torch.randint(0, 16, (16, 32), dtype=torch.int32)
    with pytest.raises(ValueError, match="bfloat16 grid"):
        fast_cpu_kernels.make_8da4w_records(q, torch.full((16, 1), 0.1), None, 32)
    lin = _linear(64, 128, 32, False)
    lin.qweight.scales = lin.qweight.scales * (1 + 2 ** -12)
    assert not qexport.X86Linear.takes(lin)


def test_pte_with_x86_kernels_matches_eager_8da4w(tmp_path):
    """et_export.py --x86_kernels: every 8da4w linear is one llama_flat::q8a4w_mm call (no XNNPACK GEMM left for
    them), and the .pte (ExecuTorch's Python runtime, the kernel registered by pte_backend.py) gives the eager
    quantized model's logits and greedy tokens."""
    pytest.importorskip("executorch")
    from test_et_export import _8DA4W_ARGS, PROMPT, _greedy, _tiny
    from test_families_backends import pte_operators
    import engine
    import et_export
    import pte_backend
    from checkpoint import checkpoint_state, save_checkpoint
    model = _tiny(1)
    recipe = Q.quantize_model(model, "8da4w", groupsize=32, log=False)
    save_checkpoint(checkpoint_state(model, quantization=recipe), tmp_path / "model.pth")
    pte = tmp_path / "x86.pte"
    et_export.main(["--checkpoint_path", str(tmp_path / "model.pth"), "--output_path", str(pte), "--x86_kernels",
                    *_8DA4W_ARGS])
    ops = pte_operators(pte)
    assert "llama_flat::q8a4w_mm" in ops
    assert not any("dequantize" in o or "choose_qparams" in o for o in ops)  # (no 8da4w pattern outside XNNPACK)
    be = pte_backend.PTEBackend(pte)
    eager = engine.TorchBackend(Q.load_model(tmp_path / "model.pth"), 1, 128)
    toks = torch.tensor([PROMPT])
    torch.testing.assert_close(be.forward(toks, torch.arange(8)), eager.forward(toks, torch.arange(8)),
                               atol=1e-3, rtol=1e-3)
    assert _greedy(be) == _greedy(eager)


def test_x86_kernels_flag_is_checked_before_loading(tmp_path):
    import subprocess
    from conftest import REPO
    (tmp_path / "model.pth").write_bytes(b"not read")
    r = subprocess.run([sys.executable, REPO / "et_export.py", "--checkpoint_path", tmp_path / "model.pth",
                        "--output_path", tmp_path / "x.pte", "--x86_kernels", "--backend", "coreml"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and r.stderr.strip().splitlines() == [
        "error: --x86_kernels runs on a CPU: --backend xnnpack or portable, not coreml"], r.stderr
    assert not (tmp_path / "x.pte").exists()
    pytest.importorskip("executorch")
    from test_aoti import tiny_checkpoint  # a float checkpoint: nothing for the kernel, said before exporting
    r = subprocess.run([sys.executable, REPO / "et_export.py", "--checkpoint_path", tiny_checkpoint(tmp_path / "f.pth"),
                        "--output_path", tmp_path / "x.pte", "--x86_kernels"], capture_output=True, text=True)
    assert r.returncode != 0 and r.stderr.strip().splitlines()[-1].startswith(
        "error: --x86_kernels: the model has no 8da4w linears"), r.stderr
    assert not (tmp_path / "x.pte").exists()
