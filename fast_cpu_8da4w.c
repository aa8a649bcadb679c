// fast_cpu_8da4w.c: 8da4w's product on x86 (AVX2; AVX-512 VNNI where it checks out): y = fq(x) @ ((q - 8) s).T [+ group_sums(x) @ z8.T], where
// fq(x) = (xq - zp) scale is qops.quant_per_token_int8's per-row int8 quantization (the same float32 arithmetic, so
// the same xq) and z8 = z + 8 s the asymmetric weights' zero term (qops.py's 8da4w). The int8 activations multiply the
// 4-bit weights as bytes (vpmaddubsw: exact int16 pair sums, int32 per group; AVX-512 VNNI: vpdpbusd), then float32:
//   y[n] = scale (sum_g s[n][g] (A[n][g] - 8 Xq[g]) - zp W[n]) + sum_g z8[n][g] X[g],
// A = sum over the group of q xq, Xq and X the group sums of xq and of x, W[n] = sum_k (q - 8) s (`wsum`, per channel).
// The weight: fast_cpu_kernels.c's tiles with a record per (16 channels, group): gs / 32 runs of 256 bytes (lanes as
// there: in 16-bit lane 2c + h of a run's 64-byte row i, nibble j is q[c][8i + 2j + h]), then s as 16 bfloat16, then
// (asymmetric weights) z8 as 16 float32: `v & 0x0f0f` gives per lane the bytes (k = 8i + h, 8i + 4 + h), `v >> 4`
// masked (8i + 2 + h, 8i + 6 + h); x's bytes are stored in that order (0 4 1 5 2 6 3 7 per 8) so each is one
// broadcast 32-bit load. Built by fast_cpu_kernels.py (torch op llama_flat::q8a4w_mm, runner-aoti/kernel_ops.cpp) and
// by fast_cpu_kernels.load_et_kernels / runner-et's CMakeLists.txt (ExecuTorch's kernel, runner-et/kernel_ops.cpp).
// Plain C; callers split tiles over their own threads.
#include <immintrin.h>
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define AVX2 __attribute__((target("avx2,fma")))
int llama_flat_8da4w_isa(void);

// Bytes per row of the prepared activations: K int8, then K/gs int32 Xq, K/gs float32 X, and scale, zp (float32).
long llama_flat_8da4w_row_bytes(long K, long gs) { return K + 8 * (K / gs) + 8; }

// Bytes per (tile, group) record of the weight.
long llama_flat_8da4w_record_bytes(long gs, int zeros) { return gs / 32 * 256 + 32 + (zeros ? 64 : 0); }

static inline int32_t ld32(const uint8_t *p) {  // (x's 4 bytes as the broadcast operand)
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

static int runs_here(void) { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

AVX2 static void prepare(const float *x, uint8_t *xp, long M, long K, long gs) {
    const long rb = llama_flat_8da4w_row_bytes(K, gs), groups = K / gs;
    for (long m = 0; m < M; m++) {
        const float *xr = x + m * K;
        int8_t *q = (int8_t *)(xp + m * rb);
        int32_t *xq = (int32_t *)(xp + m * rb + K);
        float *xs = (float *)(xq + groups), *sz = xs + groups;
        float lo = 0, hi = 0;
        int nan = 0;
        for (long k = 0; k < K; k++) {  // (torch.amin / amax: a NaN is the result; here it makes scale NaN)
            lo = xr[k] < lo ? xr[k] : lo;
            hi = xr[k] > hi ? xr[k] : hi;
            nan |= xr[k] != xr[k];
        }
        float scale = (hi - lo) / 255.0f;
        scale = nan ? NAN : scale < FLT_MIN ? FLT_MIN : scale;
        float zp = -128.0f - nearbyintf(lo / scale);
        zp = zp < -128.0f ? -128.0f : zp > 127.0f ? 127.0f : zp;
        const float inv = 1.0f / scale;
        for (long g = 0; g < groups; g++) {
            int32_t sum = 0;
            float fsum = 0;
            for (long k = g * gs; k < (g + 1) * gs; k++) {
                float v = nearbyintf(xr[k] * inv) + zp;
                v = v < -128.0f ? -128.0f : v > 127.0f ? 127.0f : v;  // (NaN: 0 here; scale carries it)
                const int8_t b = (int8_t)(v == v ? v : 0);
                q[(k & ~7L) + ((k & 3) << 1) + ((k >> 2) & 1)] = b;  // (0 4 1 5 2 6 3 7 within each 8)
                sum += b;
                fsum += xr[k];
            }
            xq[g] = sum;
            xs[g] = fsum;
        }
        sz[0] = scale;
        sz[1] = zp;
    }
}

// x [M][K] float32 -> the prepared rows (llama_flat_8da4w_row_bytes each). 1 for shapes the kernel does not take or
// where AVX2 + FMA is missing.
int llama_flat_8da4w_prepare(const float *x, uint8_t *xp, long M, long K, long gs) {
    if (!llama_flat_8da4w_isa() || M < 0 || K < 32 || gs < 32 || gs % 32 || K % gs) return 1;
    prepare(x, xp, M, K, gs);
    return 0;
}

AVX2 static inline __m256 bf16x8(const uint16_t *p) {  // 8 bfloat16 -> float32
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

// Rows m0, m0 + 1 (MR of them) of tile t: y[m][16 t .. 16 t + 15].
#define ROWS(MR)                                                                                                   \
AVX2 static void rows_##MR(const uint8_t *xp, long rb, const uint8_t *w, const float *wsum, float *y, long N,     \
                           long K, long gs, int zeros, long t) {                                                   \
    const long R = gs / 32, groups = K / gs, gb = llama_flat_8da4w_record_bytes(gs, zeros);                        \
    const __m256i mask = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);                                      \
    __m256 f[MR][2], zf[MR][2];                                                                                    \
    for (int m = 0; m < MR; m++) f[m][0] = f[m][1] = zf[m][0] = zf[m][1] = _mm256_setzero_ps();                    \
    for (long g = 0; g < groups; g++) {                                                                            \
        const uint8_t *wg = w + (t * groups + g) * gb;                                                             \
        for (long l = 0; l < gb; l += 64) _mm_prefetch((const char *)(wg + 4096 + l), _MM_HINT_T0);                \
        __m256i a[MR][2];                                                                                          \
        for (int m = 0; m < MR; m++) a[m][0] = a[m][1] = _mm256_setzero_si256();                                   \
        for (long r = 0; r < R; r++) {                                                                             \
            __m256i p[MR][2];                                                                                      \
            for (int m = 0; m < MR; m++) p[m][0] = p[m][1] = _mm256_setzero_si256();                               \
            for (int i = 0; i < 4; i++) {                                                                          \
                const __m256i v0 = _mm256_loadu_si256((const __m256i *)(wg + r * 256 + 64 * i));                  \
                const __m256i v1 = _mm256_loadu_si256((const __m256i *)(wg + r * 256 + 64 * i + 32));             \
                const __m256i l0 = _mm256_and_si256(v0, mask), h0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), mask); \
                const __m256i l1 = _mm256_and_si256(v1, mask), h1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), mask); \
                for (int m = 0; m < MR; m++) {  /* (8 pair sums of at most 15 * 128 * 2 per run: int16 holds them) */ \
                    const uint8_t *xb = xp + m * rb + g * gs + r * 32 + 8 * i;                                     \
                    const __m256i xl = _mm256_set1_epi32(ld32(xb)), xh = _mm256_set1_epi32(ld32(xb + 4));          \
                    p[m][0] = _mm256_add_epi16(p[m][0], _mm256_add_epi16(_mm256_maddubs_epi16(l0, xl),            \
                                                                         _mm256_maddubs_epi16(h0, xh)));           \
                    p[m][1] = _mm256_add_epi16(p[m][1], _mm256_add_epi16(_mm256_maddubs_epi16(l1, xl),            \
                                                                         _mm256_maddubs_epi16(h1, xh)));           \
                }                                                                                                  \
            }                                                                                                      \
            for (int m = 0; m < MR; m++)                                                                           \
                for (int h = 0; h < 2; h++) a[m][h] = _mm256_add_epi32(a[m][h], _mm256_madd_epi16(p[m][h], ones)); \
        }                                                                                                          \
        const uint16_t *s = (const uint16_t *)(wg + R * 256);                                                      \
        const float *z8 = (const float *)(wg + R * 256 + 32);                                                      \
        for (int m = 0; m < MR; m++) {                                                                             \
            const int32_t *xq = (const int32_t *)(xp + m * rb + K);                                                \
            const __m256i e = _mm256_set1_epi32(8 * xq[g]);                                                        \
            for (int h = 0; h < 2; h++)                                                                            \
                f[m][h] = _mm256_fmadd_ps(bf16x8(s + 8 * h), _mm256_cvtepi32_ps(_mm256_sub_epi32(a[m][h], e)),     \
                                          f[m][h]);                                                                \
            if (zeros) {                                                                                           \
                const __m256 xs = _mm256_set1_ps(((const float *)(xq + groups))[g]);                               \
                for (int h = 0; h < 2; h++) zf[m][h] = _mm256_fmadd_ps(_mm256_loadu_ps(z8 + 8 * h), xs, zf[m][h]); \
            }                                                                                                      \
        }                                                                                                          \
    }                                                                                                              \
    for (int m = 0; m < MR; m++) {                                                                                 \
        const float *sz = (const float *)(xp + m * rb + K + 8 * groups);                                           \
        const __m256 sc = _mm256_set1_ps(sz[0]), zp = _mm256_set1_ps(sz[1]);                                       \
        for (int h = 0; h < 2; h++) {                                                                              \
            const __m256 v = _mm256_fnmadd_ps(zp, _mm256_loadu_ps(wsum + 16 * t + 8 * h), f[m][h]);                \
            _mm256_storeu_ps(y + m * N + 16 * t + 8 * h, _mm256_fmadd_ps(sc, v, zf[m][h]));                        \
        }                                                                                                          \
    }                                                                                                              \
}
ROWS(1) ROWS(2)

// AVX-512 VNNI: a record's 64-byte row is one zmm (32-bit lane c: channel c's nibble bytes for k = 8i + 0, 4, 1, 5
// after & 15, 8i + 2, 6, 3, 7 after >> 4: x's broadcasts as above), and vpdpbusd adds the 4 products to its int32
// lane: no int16 stage. The float steps are AVX2's, element for element, so both give the same bits (vnni() checks).
#define AVX512VNNI __attribute__((target("avx512f,avx512bw,avx512vnni,fma")))
#define ROWS512(MR)                                                                                                \
AVX512VNNI static void vnni_##MR(const uint8_t *xp, long rb, const uint8_t *w, const float *wsum, float *y, long N, \
                                 long K, long gs, int zeros, long t) {                                             \
    const long R = gs / 32, groups = K / gs, gb = llama_flat_8da4w_record_bytes(gs, zeros);                        \
    const __m512i mask = _mm512_set1_epi8(0x0f);                                                                   \
    __m512 f[MR], zf[MR];                                                                                          \
    for (int m = 0; m < MR; m++) f[m] = zf[m] = _mm512_setzero_ps();                                               \
    for (long g = 0; g < groups; g++) {                                                                            \
        const uint8_t *wg = w + (t * groups + g) * gb;                                                             \
        for (long l = 0; l < gb; l += 64) _mm_prefetch((const char *)(wg + 4096 + l), _MM_HINT_T0);                \
        __m512i a[MR];                                                                                             \
        for (int m = 0; m < MR; m++) a[m] = _mm512_setzero_si512();                                                \
        for (long r = 0; r < R; r++)                                                                               \
            for (int i = 0; i < 4; i++) {                                                                          \
                const __m512i v = _mm512_loadu_si512((const void *)(wg + r * 256 + 64 * i));                       \
                const __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask); \
                for (int m = 0; m < MR; m++) {                                                                     \
                    const uint8_t *xb = xp + m * rb + g * gs + r * 32 + 8 * i;                                     \
                    a[m] = _mm512_dpbusd_epi32(a[m], lo, _mm512_set1_epi32(ld32(xb)));                             \
                    a[m] = _mm512_dpbusd_epi32(a[m], hi, _mm512_set1_epi32(ld32(xb + 4)));                         \
                }                                                                                                  \
            }                                                                                                      \
        const __m512 sv = _mm512_castsi512_ps(_mm512_slli_epi32(                                                   \
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(wg + R * 256))), 16));                      \
        for (int m = 0; m < MR; m++) {                                                                             \
            const int32_t *xq = (const int32_t *)(xp + m * rb + K);                                                \
            const __m512i e = _mm512_set1_epi32(8 * xq[g]);                                                        \
            f[m] = _mm512_fmadd_ps(sv, _mm512_cvtepi32_ps(_mm512_sub_epi32(a[m], e)), f[m]);                       \
            if (zeros)                                                                                             \
                zf[m] = _mm512_fmadd_ps(_mm512_loadu_ps((const float *)(wg + R * 256 + 32)),                       \
                                        _mm512_set1_ps(((const float *)(xq + groups))[g]), zf[m]);                 \
        }                                                                                                          \
    }                                                                                                              \
    for (int m = 0; m < MR; m++) {                                                                                 \
        const float *sz = (const float *)(xp + m * rb + K + 8 * groups);                                           \
        const __m512 v = _mm512_fnmadd_ps(_mm512_set1_ps(sz[1]), _mm512_loadu_ps(wsum + 16 * t), f[m]);            \
        _mm512_storeu_ps(y + m * N + 16 * t, _mm512_fmadd_ps(_mm512_set1_ps(sz[0]), v, zf[m]));                    \
    }                                                                                                              \
}
ROWS512(1) ROWS512(2) ROWS512(4)

static int VNNI;  // 1: the VNNI kernel runs here and gave AVX2's bits on decide's check

static void tiles(int vnni, const uint8_t *xp, const uint8_t *w, const float *wsum, float *y, long M, long N, long K,
                  long gs, int zeros, long t0, long t1) {
    const long rb = llama_flat_8da4w_row_bytes(K, gs);
    for (long t = t0; t < t1; t++)
        for (long m = 0; m < M;) {  // (rows in pairs, VNNI's in fours: each record unpacked once for them)
            const long left = M - m, n = vnni ? (left >= 4 ? 4 : left >= 2 ? 2 : 1) : (left >= 2 ? 2 : 1);
            if (vnni)
                (n == 4 ? vnni_4 : n == 2 ? vnni_2 : vnni_1)(xp + m * rb, rb, w, wsum, y + m * N, N, K, gs, zeros, t);
            else
                (n == 2 ? rows_2 : rows_1)(xp + m * rb, rb, w, wsum, y + m * N, N, K, gs, zeros, t);
            m += n;
        }
}

// Runs both kernels on a small product of each record form (rows in 4 + 2 + 1) and keeps VNNI only if its y is
// AVX2's, bit for bit.
static void decide(void) {
    VNNI = 0;
    if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
          __builtin_cpu_supports("avx512vnni")))
        return;
    enum { M = 7, N = 32, K = 256 };
    static float x[M * K], ws[N], y[2][M * N];
    static uint8_t xp[M * (K + 8 * 8 + 8)], w[N / 16 * (K / 32) * 352];
    uint32_t r = 12345;
    int same = 1;
    for (int i = 0; i < M * K; i++) x[i] = (float)((r = r * 1664525u + 1013904223u) >> 8) / (1 << 20) - 8.f;
    for (int i = 0; i < (int)sizeof w; i++) w[i] = (uint8_t)((r = r * 1664525u + 1013904223u) >> 24);
    for (int i = 0; i < N; i++) ws[i] = (float)(i % 7) - 3.f;
    for (int zeros = 0; zeros < 2; zeros++)
        for (long gs = 32; gs <= 64; gs += 32) {
            const long gb = llama_flat_8da4w_record_bytes(gs, zeros);
            for (long rec = 0; rec < N / 16 * (K / gs); rec++)  // (scales and z8: small finite floats)
                for (int c = 0; c < 16; c++) {
                    const uint16_t sc = (uint16_t)(0x3c00 + ((rec * 16 + c) % 64));
                    const float z8 = 0.01f * (float)(c - 8);
                    memcpy(w + rec * gb + gs / 32 * 256 + 2 * c, &sc, 2);
                    if (zeros) memcpy(w + rec * gb + gs / 32 * 256 + 32 + 4 * c, &z8, 4);
                }
            prepare(x, xp, M, K, gs);
            tiles(0, xp, w, ws, y[0], M, N, K, gs, zeros, 0, N / 16);
            tiles(1, xp, w, ws, y[1], M, N, K, gs, zeros, 0, N / 16);
            same &= !memcmp(y[0], y[1], sizeof y[0]);
        }
    VNNI = same;
}

// Which kernel runs: 2 AVX-512 VNNI (where it passed decide's check, made once), 1 AVX2, 0 none.
int llama_flat_8da4w_isa(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    if (!runs_here()) return 0;
    pthread_once(&once, decide);
    return VNNI ? 2 : 1;
}

// Tiles t0..t1-1 (16 channels each) of y [M][N] from the prepared rows xp, the weight w [N/16][K/gs][record] and
// wsum [N], by the kernel llama_flat_8da4w_isa chose. 1 for shapes the kernel does not take or where AVX2 + FMA is
// missing.
int llama_flat_8da4w_mm(const uint8_t *xp, const uint8_t *w, const float *wsum, float *y, long M, long N, long K,
                        long gs, int zeros, long t0, long t1) {
    const int isa = llama_flat_8da4w_isa();
    if (!isa || N % 16 || K < 32 || gs < 32 || gs % 32 || K % gs || t0 < 0 || t1 > N / 16) return 1;
    tiles(isa == 2, xp, w, wsum, y, M, N, K, gs, zeros, t0, t1);
    return 0;
}
