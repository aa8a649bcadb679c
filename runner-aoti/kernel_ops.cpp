// kernel_ops.cpp: the torch ops of ../fast_cpu_kernels.c: llama_flat::int4_tiles_mm (fast_cpu_kernels.py's tiles),
// llama_flat::int8_words_mm (fast_cpu_quant's int8 words), llama_flat::bf16_mm (bfloat16 weights as stored, AVX2), and
// a C shim of the first, which AOT Inductor packages call directly (fast_cpu_kernels.aoti_shims; packages keep
// Inductor's own int8 reduction and bfloat16 products).
// fast_cpu_kernels.py builds it with the kernels into the library that Python runs load (compiled code calls the ops
// through the dispatcher, no Python); the runner links it (and exports the shim). The kernels run where the build
// has them (LLAMA_FLAT_KERNELS) and the CPU has AVX2; elsewhere the ops refuse (callers use them only where they run).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/Parallel.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#ifdef LLAMA_FLAT_KERNELS
extern "C" int llama_flat_int4_tiles_mm(const uint16_t *x, const uint8_t *w, float *y, float *xs, long M, long N,
                                        long K, long gs, int threads);
extern "C" int llama_flat_int4_tiles_mm_avx2(const float *x, const uint8_t *w, float *y, void *scratch, long M, long N,
                                             long K, long gs, int threads);
extern "C" int llama_flat_int4_tiles_unpack_avx2(const uint8_t *w, float *wt, long n0, long n1, long K, long gs,
                                                 int threads);
extern "C" int llama_flat_int8_words_mm_avx2(const float *x, const int32_t *w, const float *s, float *y, void *scratch,
                                             long M, long N, long K, int threads);
extern "C" int llama_flat_bf16_mm_avx2(const float *x, const uint16_t *w, float *y, float *xs, long M, long N, long K,
                                       int threads);
extern "C" int llama_flat_kernels_isa(void);
extern "C" int llama_flat_int8_words_mm(const float *x, const int32_t *w, const float *s, float *y, float *off, long M,
                                        long N, long K, int threads);
extern "C" long llama_flat_8da4w_row_bytes(long K, long gs);
extern "C" long llama_flat_8da4w_record_bytes(long gs, int zeros);
extern "C" int llama_flat_8da4w_prepare(const float *x, uint8_t *xp, long M, long K, long gs);
extern "C" int llama_flat_8da4w_mm(const uint8_t *xp, const uint8_t *w, const float *wsum, float *y, long M, long N,
                                   long K, long gs, int zeros, long t0, long t1);
static int isa() {  // (asked once: every product asks)
  static const int v = llama_flat_kernels_isa();
  return v;
}
#else
static int isa() { return 0; }
#endif

namespace {
constexpr int64_t AVX2_GEMM_ROWS = 64;  // AVX2 int4 from this many rows: at::mm on float32 pieces of w.T
// of this many output channels (128 rows, 2 threads, Zen 1, medians: 8192x2048 71.5 ms against 88.9 for 4 MB pieces,
// 2048x8192 79.0 against 84.4: MKL copies each piece into its panels, and a small one is still in the cache)
constexpr int64_t AVX2_GEMM_PIECE = 96;

at::Tensor int4_tiles_mm_op(const at::Tensor &x, const at::Tensor &w, int64_t groupsize) {
  TORCH_CHECK(x.is_cpu() && x.dim() == 2 && x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kByte &&
                  w.dim() == 3 && groupsize >= 32 && groupsize % 32 == 0 && x.size(1) % groupsize == 0 &&
                  w.size(1) == x.size(1) / groupsize && w.size(2) == groupsize / 32 * 256 + 64,
              "llama_flat::int4_tiles_mm: unexpected operands");
#ifdef LLAMA_FLAT_KERNELS
  if (isa() == 1) {  // AVX2: one row by the kernel, prompts by at::mm on float32 pieces of w.T
    at::Tensor xf = x.to(at::kFloat).contiguous(), wc = w.contiguous();
    const int64_t M = xf.size(0), K = xf.size(1), N = wc.size(0) * 16;
    at::Tensor y = at::empty({M, N}, xf.options());
    if (M < AVX2_GEMM_ROWS) {
      at::Tensor scratch = at::empty({M * K * 2 + M * (K / 32) * 8}, xf.options().dtype(at::kByte));
      TORCH_CHECK(!llama_flat_int4_tiles_mm_avx2(xf.data_ptr<float>(), wc.data_ptr<uint8_t>(), y.data_ptr<float>(),
                                                 scratch.data_ptr(), M, N, K, groupsize, at::get_num_threads()),
                  "llama_flat::int4_tiles_mm: unsupported shape ", M, "x", K, " @ ", N, "x", K, ", group size ",
                  groupsize);
      return y;
    }
    const int64_t piece = std::min(N, AVX2_GEMM_PIECE);
    at::Tensor buf = at::empty({K * piece}, xf.options());
    for (int64_t n0 = 0; n0 < N; n0 += piece) {
      const int64_t n1 = std::min(N, n0 + piece);
      at::Tensor wt = buf.narrow(0, 0, K * (n1 - n0)).view({K, n1 - n0});
      TORCH_CHECK(!llama_flat_int4_tiles_unpack_avx2(wc.data_ptr<uint8_t>(), wt.data_ptr<float>(), n0, n1, K,
                                                     groupsize, at::get_num_threads()),
                  "llama_flat::int4_tiles_mm: unsupported shape ", M, "x", K, " @ ", N, "x", K, ", group size ",
                  groupsize);
      y.narrow(1, n0, n1 - n0).copy_(at::mm(xf, wt));
    }
    return y;
  }
  if (isa() == 2) {
    at::Tensor xc = x.contiguous(), wc = w.contiguous();
    const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0) * 16;
    at::Tensor y = at::empty({M, N}, xc.options().dtype(at::kFloat));
    at::Tensor xs = at::empty({M, K / 32}, xc.options().dtype(at::kFloat));
    TORCH_CHECK(!llama_flat_int4_tiles_mm(static_cast<const uint16_t *>(xc.data_ptr()), wc.data_ptr<uint8_t>(),
                                          y.data_ptr<float>(), xs.data_ptr<float>(), M, N, K, groupsize,
                                          at::get_num_threads()),
                "llama_flat::int4_tiles_mm: unsupported shape ", M, "x", K, " @ ", N, "x", K, ", group size ",
                groupsize);
    return y;
  }
#endif
  TORCH_CHECK(false, "llama_flat::int4_tiles_mm: the kernel does not run on this CPU or build");
}

at::Tensor int8_words_mm_op(const at::Tensor &x, const at::Tensor &w, const at::Tensor &s) {
  TORCH_CHECK(x.is_cpu() && x.dim() == 2 && x.scalar_type() == at::kFloat && w.scalar_type() == at::kInt &&
                  w.dim() == 4 && w.size(1) == 1 && w.size(3) == 16 && w.size(2) * 4 == x.size(1) &&
                  s.scalar_type() == at::kFloat && s.numel() == w.size(0) * 16,
              "llama_flat::int8_words_mm: unexpected operands");
#ifdef LLAMA_FLAT_KERNELS
  if (isa() == 1) {
    at::Tensor xc = x.contiguous(), wc = w.contiguous(), sc = s.contiguous();
    const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0) * 16, runs = (K / 4 + 31) / 32;
    at::Tensor y = at::empty({M, N}, xc.options());
    at::Tensor scratch = at::empty({M * K * 2 + M * runs * 8}, xc.options().dtype(at::kByte));
    TORCH_CHECK(!llama_flat_int8_words_mm_avx2(xc.data_ptr<float>(), wc.data_ptr<int32_t>(), sc.data_ptr<float>(),
                                               y.data_ptr<float>(), scratch.data_ptr(), M, N, K, at::get_num_threads()),
                "llama_flat::int8_words_mm: unsupported shape ", M, "x", K, " @ ", N, "x", K);
    return y;
  }
  if (isa() == 2) {
    at::Tensor xc = x.contiguous(), wc = w.contiguous(), sc = s.contiguous();
    const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0) * 16;
    at::Tensor y = at::empty({M, N}, xc.options());
    at::Tensor off = at::empty({M}, xc.options());
    TORCH_CHECK(!llama_flat_int8_words_mm(xc.data_ptr<float>(), wc.data_ptr<int32_t>(), sc.data_ptr<float>(),
                                          y.data_ptr<float>(), off.data_ptr<float>(), M, N, K, at::get_num_threads()),
                "llama_flat::int8_words_mm: unsupported shape ", M, "x", K, " @ ", N, "x", K);
    return y;
  }
#endif
  TORCH_CHECK(false, "llama_flat::int8_words_mm: the kernel does not run on this CPU or build");
}

// x [M, K] (any float type) @ w.T for w [N, K] bfloat16 as stored -> float32 [M, N], on CPUs without oneDNN's bfloat16
// products, by the AVX2 kernel at every length (2 threads: 1 row at 19 GB/s, from 8 rows 50-54 GFLOP/s: MKL's float32
// GEMM's rate here, without a float32 copy of w; `python fast_cpu_kernels.py`).
at::Tensor bf16_mm_op(const at::Tensor &x, const at::Tensor &w) {
  TORCH_CHECK(x.is_cpu() && w.is_cpu() && x.dim() == 2 && at::isFloatingType(x.scalar_type()) &&
                  w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.size(1) == x.size(1) && w.size(0) % 4 == 0 &&
                  w.size(1) % 16 == 0,
              "llama_flat::bf16_mm: unexpected operands");
#ifdef LLAMA_FLAT_KERNELS
  if (isa() >= 1) {
    at::Tensor xf = x.to(at::kFloat).contiguous(), wc = w.contiguous();
    const int64_t M = xf.size(0), K = xf.size(1), N = wc.size(0);
    at::Tensor y = at::empty({M, N}, xf.options()), xs = at::empty({M, K}, xf.options());
    TORCH_CHECK(!M || !llama_flat_bf16_mm_avx2(xf.data_ptr<float>(), static_cast<const uint16_t *>(wc.data_ptr()),
                                               y.data_ptr<float>(), xs.data_ptr<float>(), M, N, K,
                                               at::get_num_threads()),
                "llama_flat::bf16_mm: unsupported shape ", M, "x", K, " @ ", N, "x", K);
    return y;
  }
#endif
  TORCH_CHECK(false, "llama_flat::bf16_mm: the kernel does not run on this CPU or build");
}
// 8da4w: x [..., K] float32, w ../fast_cpu_8da4w.c's records [N/16, K/gs, record], wsum [N] -> out [..., N] float32
// (the .pte's op, runner-et/kernel_ops.cpp; here for eager checks and export's tracing). AVX2, any number of rows.
at::Tensor &q8a4w_mm_out(const at::Tensor &x, const at::Tensor &w, const at::Tensor &wsum, int64_t groupsize,
                         at::Tensor &out) {
  const int64_t K = x.dim() ? x.size(-1) : 0, N = w.dim() == 3 ? w.size(0) * 16 : 0;
  TORCH_CHECK(x.is_cpu() && w.is_cpu() && wsum.is_cpu() && x.dim() >= 1 && x.scalar_type() == at::kFloat &&
                  w.scalar_type() == at::kByte && w.dim() == 3 && groupsize >= 32 && groupsize % 32 == 0 &&
                  K % groupsize == 0 && w.size(1) == K / groupsize && wsum.scalar_type() == at::kFloat &&
                  wsum.numel() == N && out.scalar_type() == at::kFloat,
              "llama_flat::q8a4w_mm: unexpected operands");
#ifdef LLAMA_FLAT_KERNELS
  const int zeros = w.size(2) == llama_flat_8da4w_record_bytes(groupsize, 1);
  TORCH_CHECK(isa() >= 1, "llama_flat::q8a4w_mm: the kernel does not run on this CPU or build");
  TORCH_CHECK(zeros || w.size(2) == llama_flat_8da4w_record_bytes(groupsize, 0), "llama_flat::q8a4w_mm: w's records");
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = N;
  out.resize_(shape);
  at::Tensor xc = x.contiguous(), wc = w.contiguous(), sc = wsum.contiguous();
  at::Tensor y = out.is_contiguous() ? out : out.contiguous();
  const int64_t M = xc.numel() / std::max<int64_t>(K, 1);
  at::Tensor xp = at::empty({M * llama_flat_8da4w_row_bytes(K, groupsize)}, xc.options().dtype(at::kByte));
  TORCH_CHECK(!llama_flat_8da4w_prepare(xc.data_ptr<float>(), xp.data_ptr<uint8_t>(), M, K, groupsize),
              "llama_flat::q8a4w_mm: unsupported shape");
  at::parallel_for(0, N / 16, 1, [&](int64_t t0, int64_t t1) {
    TORCH_CHECK(!llama_flat_8da4w_mm(xp.data_ptr<uint8_t>(), wc.data_ptr<uint8_t>(), sc.data_ptr<float>(),
                                     y.data_ptr<float>(), M, N, K, groupsize, zeros, t0, t1),
                "llama_flat::q8a4w_mm: unsupported shape ", M, "x", K, " @ ", N, "x", K);
  });
  if (!y.is_same(out)) out.copy_(y);
  return out;
#else
  TORCH_CHECK(false, "llama_flat::q8a4w_mm: the kernel does not run on this CPU or build");
#endif
}
at::Tensor q8a4w_mm_op(const at::Tensor &x, const at::Tensor &w, const at::Tensor &wsum, int64_t groupsize) {
  at::Tensor out = at::empty({0}, x.options().dtype(at::kFloat));
  return q8a4w_mm_out(x, w, wsum, groupsize, out);
}
}  // namespace

// The C shim: AOT Inductor packages call it directly (aoti_export.py names it in aot_inductor.custom_ops_to_c_shims;
// the name is aoti_torch_cpu_ + the op's name), not through the proxy executor (~18 us a call, 2 ms of a 1B step).
// The runner exports it (ENABLE_EXPORTS); Python loads this library with RTLD_GLOBAL (fast_cpu_kernels._load).
extern "C" AOTITorchError aoti_torch_cpu_int4_tiles_mm(AtenTensorHandle x, AtenTensorHandle w, int64_t groupsize,
                                                       AtenTensorHandle *ret0) {
  using namespace torch::aot_inductor;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = new_tensor_handle(
        int4_tiles_mm_op(*tensor_handle_to_tensor_pointer(x), *tensor_handle_to_tensor_pointer(w), groupsize));
  });
}

TORCH_LIBRARY_FRAGMENT(llama_flat, m) {
  m.def("int4_tiles_mm(Tensor x, Tensor w, int groupsize) -> Tensor");
  m.impl("int4_tiles_mm", c10::DispatchKey::CPU, TORCH_FN(int4_tiles_mm_op));
  m.def("int8_words_mm(Tensor x, Tensor w, Tensor s) -> Tensor");
  m.impl("int8_words_mm", c10::DispatchKey::CPU, TORCH_FN(int8_words_mm_op));
  m.def("bf16_mm(Tensor x, Tensor w) -> Tensor");
  m.impl("bf16_mm", c10::DispatchKey::CPU, TORCH_FN(bf16_mm_op));
  m.def("q8a4w_mm(Tensor x, Tensor w, Tensor wsum, int groupsize) -> Tensor");
  m.impl("q8a4w_mm", c10::DispatchKey::CPU, TORCH_FN(q8a4w_mm_op));
  m.def("q8a4w_mm.out(Tensor x, Tensor w, Tensor wsum, int groupsize, *, Tensor(a!) out) -> Tensor(a!)");
  m.impl("q8a4w_mm.out", c10::DispatchKey::CPU, TORCH_FN(q8a4w_mm_out));
}
