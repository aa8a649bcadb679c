// kernel_ops.cpp: ExecuTorch's kernel for llama_flat::q8a4w_mm.out, 8da4w's product by ../fast_cpu_8da4w.c (AVX2),
// which et_export.py --x86_kernels puts in a .pte in place of XNNPACK's 8da4w linears. Linked into runner-et's `run`
// and built alone (pte_backend.py) into the library Python's ExecuTorch runtime loads for such a .pte. The kernel
// splits the weight's 16-channel tiles over ExecuTorch's thread pool (the one -j sizes for XNNPACK).
//   x [..., K] float32, w [N/16, K/gs, record] uint8, wsum [N] float32 -> out [..., N] float32
#include <executorch/extension/kernel_util/make_boxed_from_unboxed_functor.h>
#include <executorch/runtime/core/exec_aten/util/tensor_util.h>
#include <executorch/runtime/kernel/kernel_includes.h>
#include <executorch/runtime/kernel/thread_parallel_interface.h>

#include <atomic>
#include <cstdint>
#include <vector>

extern "C" long llama_flat_8da4w_row_bytes(long K, long gs);
extern "C" long llama_flat_8da4w_record_bytes(long gs, int zeros);
extern "C" int llama_flat_8da4w_prepare(const float *x, uint8_t *xp, long M, long K, long gs);
extern "C" int llama_flat_8da4w_mm(const uint8_t *xp, const uint8_t *w, const float *wsum, float *y, long M, long N,
                                   long K, long gs, int zeros, long t0, long t1);

namespace {
using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::KernelRuntimeContext;

Tensor &q8a4w_mm_out(KernelRuntimeContext &ctx, const Tensor &x, const Tensor &w, const Tensor &wsum,
                     int64_t groupsize, Tensor &out) {
  const int64_t K = x.dim() ? x.size(x.dim() - 1) : 0, N = w.dim() == 3 ? w.size(0) * 16 : 0;
  const bool shapes = x.dim() >= 1 && K >= 32 && w.dim() == 3 && groupsize >= 32 && groupsize % 32 == 0 && K % groupsize == 0 &&
                      w.size(1) == K / groupsize && wsum.numel() == N;
  const int zeros = shapes && w.size(2) == llama_flat_8da4w_record_bytes(groupsize, 1);
  ET_KERNEL_CHECK_MSG(ctx, shapes && x.scalar_type() == ScalarType::Float && w.scalar_type() == ScalarType::Byte &&
                               wsum.scalar_type() == ScalarType::Float && out.scalar_type() == ScalarType::Float &&
                               (zeros || w.size(2) == llama_flat_8da4w_record_bytes(groupsize, 0)),
                      InvalidArgument, out, "llama_flat::q8a4w_mm: unexpected operands");
  executorch::aten::SizesType sizes[16];
  ET_KERNEL_CHECK(ctx, x.dim() <= 16, InvalidArgument, out);
  for (int d = 0; d < x.dim(); d++) sizes[d] = x.size(d);
  sizes[x.dim() - 1] = static_cast<executorch::aten::SizesType>(N);
  ET_KERNEL_CHECK(ctx, executorch::runtime::resize_tensor(out, {sizes, size_t(x.dim())}) == Error::Ok,
                  InvalidArgument, out);
  const int64_t M = x.numel() / K;
  thread_local std::vector<uint8_t> xp;  // (the prepared rows: grows to the longest prompt's, then stays)
  xp.resize(M * llama_flat_8da4w_row_bytes(K, groupsize));
  ET_KERNEL_CHECK_MSG(ctx, !llama_flat_8da4w_prepare(x.const_data_ptr<float>(), xp.data(), M, K, groupsize),
                      NotSupported, out, "llama_flat::q8a4w_mm: the kernel needs AVX2 + FMA");
  std::atomic<bool> ok{true};
  const uint8_t *rows = xp.data();  // (the caller's buffer: a worker's thread_local is its own)
  executorch::extension::parallel_for(0, N / 16, 1, [&](int64_t t0, int64_t t1) {
    if (llama_flat_8da4w_mm(rows, w.const_data_ptr<uint8_t>(), wsum.const_data_ptr<float>(),
                            out.mutable_data_ptr<float>(), M, N, K, groupsize, zeros, t0, t1))
      ok.store(false);
  });
  ET_KERNEL_CHECK_MSG(ctx, ok.load(), NotSupported, out, "llama_flat::q8a4w_mm: unsupported shape");
  return out;
}
}  // namespace

EXECUTORCH_LIBRARY(llama_flat, "q8a4w_mm.out", q8a4w_mm_out);
