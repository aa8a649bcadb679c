// int4_op.cpp: llama_flat::int4_mm for the runner, the op that fast_cpu_int4.py registers in Python: an int4 package's
// "prompt" model (exported where the kernel runs) calls it through AOT Inductor's proxy executor. It runs
// ../fast_cpu_int4.c where the build targets AVX512-BF16 (CMakeLists.txt defines LLAMA_FLAT_INT4_KERNEL) and the CPU
// has it; elsewhere ATen's int4 kernel on the same operands, so a package runs on any CPU that packs int4 alike.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

#ifdef LLAMA_FLAT_INT4_KERNEL
extern "C" int llama_flat_int4_mm(const uint16_t *x, const uint8_t *w, const uint16_t *sz, float *y, float *xs, long M,
                                  long N, long K, long gs, int threads);
#endif

namespace {
at::Tensor int4_mm_op(const at::Tensor &x, const at::Tensor &w, int64_t groupsize, const at::Tensor &sz) {
  TORCH_CHECK(x.is_cpu() && x.dim() == 2 && x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kByte &&
                  sz.dim() == 3 && sz.scalar_type() == at::kBFloat16 && groupsize > 0 && x.size(1) % groupsize == 0 &&
                  sz.size(0) == x.size(1) / groupsize && sz.size(2) == 2 && w.numel() * 2 == sz.size(1) * x.size(1),
              "llama_flat::int4_mm: unexpected operands");
#ifdef LLAMA_FLAT_INT4_KERNEL
  if (__builtin_cpu_supports("avx512bf16")) {
    at::Tensor xc = x.contiguous(), wc = w.contiguous(), szc = sz.contiguous();
    const int64_t M = xc.size(0), K = xc.size(1), N = szc.size(1);
    at::Tensor y = at::empty({M, N}, xc.options().dtype(at::kFloat));
    at::Tensor xs = at::empty({M, K / 32}, xc.options().dtype(at::kFloat));
    if (!llama_flat_int4_mm(static_cast<const uint16_t *>(xc.data_ptr()), wc.data_ptr<uint8_t>(),
                            static_cast<const uint16_t *>(szc.data_ptr()), y.data_ptr<float>(), xs.data_ptr<float>(), M,
                            N, K, groupsize, at::get_num_threads()))
      return y;
  }
#endif
  return at::_weight_int4pack_mm_for_cpu(x, w, groupsize, sz).to(at::kFloat);
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(llama_flat, m) {
  m.def("int4_mm(Tensor x, Tensor w, int groupsize, Tensor sz) -> Tensor");
  m.impl("int4_mm", c10::DispatchKey::CPU, TORCH_FN(int4_mm_op));
}
