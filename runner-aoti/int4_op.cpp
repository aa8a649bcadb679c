// int4_op.cpp: llama_flat::int4_mm for the runner, the op that fast_cpu_int4.py registers in Python, over the same C
// kernel (../fast_cpu_int4.c): a package exported where the kernel runs calls it from its "prompt" model (AOT
// Inductor reaches ops outside its C shim through the dispatcher). Built only where the compiler targets
// AVX512-BF16 (CMakeLists.txt); the op checks the CPU before it runs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

extern "C" int int4_mm(const uint16_t *x, const uint8_t *w, const uint16_t *sz, float *y, float *xs, long M, long N,
                       long K, long gs, int threads);

namespace {
at::Tensor int4_mm_op(const at::Tensor &x, const at::Tensor &w, int64_t groupsize, const at::Tensor &sz) {
  TORCH_CHECK(__builtin_cpu_supports("avx512bf16"),
              "this package calls llama_flat::int4_mm (exported on a CPU with AVX512-BF16); this CPU has none");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kByte &&
                  sz.scalar_type() == at::kBFloat16 && sz.dim() == 3 && x.is_cpu(),
              "int4_mm: unexpected operands");
  at::Tensor xc = x.contiguous(), wc = w.contiguous(), szc = sz.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = szc.size(1);
  at::Tensor y = at::empty({M, N}, xc.options().dtype(at::kFloat));
  at::Tensor xs = at::empty({M, K / 32}, xc.options().dtype(at::kFloat));
  int failed = int4_mm(static_cast<const uint16_t *>(xc.data_ptr()), wc.data_ptr<uint8_t>(),
                       static_cast<const uint16_t *>(szc.data_ptr()), y.data_ptr<float>(), xs.data_ptr<float>(), M, N,
                       K, groupsize, at::get_num_threads());
  TORCH_CHECK(!failed, "int4_mm: unsupported shape ", M, "x", K, " @ ", N, "x", K, ", group size ", groupsize);
  return y;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(llama_flat, m) {
  m.def("int4_mm(Tensor x, Tensor w, int groupsize, Tensor sz) -> Tensor");
  m.impl("int4_mm", c10::DispatchKey::CPU, TORCH_FN(int4_mm_op));
}
