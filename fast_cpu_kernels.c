// fast_cpu_kernels.c: y = x @ w.T for quantized (and AVX2's bfloat16) weights in two instruction sets (each kernel
// names its own, the file none; llama_flat_kernels_isa says which run here). Built by fast_cpu_kernels.py and
// runner-aoti's CMakeLists.txt with kernel_ops.cpp, which registers them as torch ops. Plain C (and OpenMP).
//   AVX-512 + BF16 (bfloat16 x; vdpbf16ps: exact products, float32 sums): int4 on the tiles (llama_flat_int4_tiles_mm),
//     int8 on the words, one row (llama_flat_int8_words_mm).
//   AVX2 + FMA (llama_flat_*_avx2), any number of rows, each weight read once per 2 rows: int4 on the tiles and int8 on
//     the words with x as int16 per run of 32 (d = max |x| / 32767: 2e-5 of its largest |x|; vpmaddwd: exact int32
//     sums); bfloat16 weights as stored, float32 x and FMAs (where oneDNN has no bfloat16 products).
// The tiles: [N/16][K/gs][gs/32 runs of 256 bytes, then s and z, 16 bfloat16 each] (one stream per 16 channels,
// scales beside their weights); a run's 64-byte row i holds, in 16-bit lane L = 2c + h, nibble j at bits 4j:
// q[16t + c][32r + 8i + 2j + h] (t the tile, r the run). `(lane >> 4j) & 15` is then one k-pair of 16 channels, the
// operand order of vdpbf16ps and of vpmaddwd. AVX-512, many rows: each run of 32 k of 64 channels is converted once
// per call into bfloat16 pairs (q - 8: exact), kept in L1 while every row of x passes over them. One row: each nibble
// becomes the bfloat16 128 + q by one OR (0x4300 | q), 136 s sum_k x taken off per group (8192x2048 g32 streamed, 2
// threads: 0.21 ms, 50 GB/s; ATen's kernel 0.27). `python fast_cpu_kernels.py` times them.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { G = 32, BLOCK = 64, ROWS = 6, PREFETCH = 4096 };
static int split(int threads, long parts) { return threads < 1 ? 1 : threads > parts ? (int)parts : threads; }
static inline float top_abs(float top, float v) { return fabsf(v) > top || v != v ? fabsf(v) : top; }  // (NaN sticks)
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512bf16")))
#define AVX2 __attribute__((target("avx2,fma")))
// The bfloat16 of i - 8 at index i (and i + 16): the table _mm512_permutexvar_epi16 converts nibbles with.
AVX512 static inline __m512i q_minus_8(void) {
    return _mm512_set_epi16(0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0, 0xbf80, 0xc000, 0xc040, 0xc080,
                            0xc0a0, 0xc0c0, 0xc0e0, 0xc100, 0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0,
                            0xbf80, 0xc000, 0xc040, 0xc080, 0xc0a0, 0xc0c0, 0xc0e0, 0xc100);
}
AVX512 static inline __m512 bf16x16(const uint16_t *p) {  // 16 bfloat16 -> float32
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
AVX2 static inline __m256 bf16x8(const uint16_t *p) {  // 8 bfloat16 -> float32
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

// Which kernels run here: 2 the AVX-512 ones (AVX512-BF16; the AVX2 ones too), 1 the AVX2 + FMA ones, 0 none.
int llama_flat_kernels_isa(void) {
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512bf16"))
        return 2;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1 : 0;
}

typedef struct { const uint16_t *x; const uint8_t *w; float *y; const float *xs; long M, N, K, gs, b0, b1; } job_t;

// Tiles 4b..4b+3 (channels n0 + 16c + 0-15), run r of group g, converted: wv[p][c] holds, for k-pair p (k = 2p, 2p + 1)
// and the 16 channels of tile c, the bfloat16 pairs (q[n][2p] - 8, q[n][2p + 1] - 8) (wb: the first tile's run;
// `stride` bytes per tile).
AVX512 static void convert_tiles(const uint8_t *wb, long stride, __m512i wv[G / 2][4]) {
    const __m512i table = q_minus_8();
    const __m512i low = _mm512_set1_epi16(0x000f);
    for (int c = 0; c < 4; c++)
        for (int i = 0; i < 4; i++) {
            __m512i v = _mm512_loadu_si512((const void *)(wb + c * stride + 64 * i));
            for (int jj = 0; jj < 4; jj++)
                wv[4 * i + jj][c] =
                    _mm512_permutexvar_epi16(_mm512_and_si512(_mm512_srli_epi16(v, 4 * jj), low), table);
        }
}

// Runs g0..g0+ng-1 (converted: wv, s, z) of channels n0 + at[c0], at[c0 + 1] (2 x 16) for rows m0..m0+R-1: R x 2
// partial sums per run and R x 2 totals, all in registers (R = 6: 24 of 32), y read and written once per chunk.
enum { KC = 8 };  // runs of 32 per chunk: 8 x 16 pairs x 4 x 64 bytes = 32 KB
#define TILE(R)                                                                                                    \
AVX512 static void tile##R(const job_t *j, long m0, long g0, long ng, long n0, int c0, __m512i (*wv)[G / 2][4],    \
                           const __m512 (*s)[4], const __m512 (*z)[4]) {                                           \
    static const int at[4] = {0, 16, 32, 48};                                                                      \
    __m512 tot[R][2];                                                                                              \
    for (int r = 0; r < R; r++) for (int c = 0; c < 2; c++)                                                        \
        tot[r][c] = g0 ? _mm512_loadu_ps(j->y + (m0 + r) * j->N + n0 + at[c0 + c]) : _mm512_setzero_ps();          \
    for (long gi = 0; gi < ng; gi++) {                                                                             \
        __m512 acc[R][2];                                                                                          \
        for (int r = 0; r < R; r++) for (int c = 0; c < 2; c++) acc[r][c] = _mm512_setzero_ps();                   \
        const uint16_t *xg = j->x + (g0 + gi) * G;                                                                 \
        for (int p = 0; p < G / 2; p++) {                                                                          \
            __m512bh w0 = (__m512bh)wv[gi][p][c0], w1 = (__m512bh)wv[gi][p][c0 + 1];                               \
            for (int r = 0; r < R; r++) {                                                                          \
                int32_t pair;                                                                                      \
                memcpy(&pair, xg + (m0 + r) * j->K + 2 * p, 4);                                                    \
                __m512bh xp = (__m512bh)_mm512_set1_epi32(pair);                                                   \
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xp);                                                   \
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xp);                                                   \
            }                                                                                                      \
        }                                                                                                          \
        for (int r = 0; r < R; r++) {                                                                              \
            __m512 xs = _mm512_set1_ps(j->xs[(m0 + r) * (j->K / G) + g0 + gi]);                                    \
            for (int c = 0; c < 2; c++)                                                                            \
                tot[r][c] = _mm512_fmadd_ps(z[gi][c0 + c], xs, _mm512_fmadd_ps(acc[r][c], s[gi][c0 + c], tot[r][c])); \
        }                                                                                                          \
    }                                                                                                              \
    for (int r = 0; r < R; r++) for (int c = 0; c < 2; c++)                                                        \
        _mm512_storeu_ps(j->y + (m0 + r) * j->N + n0 + at[c0 + c], tot[r][c]);                                     \
}
TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6)

AVX512 static void *run(void *arg) {
    const job_t *j = arg;
    __m512i wv[KC][G / 2][4];
    __m512 s[KC][4], z[KC][4];
    for (long b = j->b0; b < j->b1; b++) {
        long n0 = b * BLOCK;
        for (long g0 = 0; g0 < j->K / G; g0 += KC) {
            long ng = j->K / G - g0 < KC ? j->K / G - g0 : KC;
            for (long gi = 0; gi < ng; gi++) {
                long g = g0 + gi;
                // run g % R of group g / R, tile 4b; its scales and offsets after the group's runs
                long R = j->gs / G, stride = j->K / j->gs * (R * 256 + 64);
                const uint8_t *wg = j->w + 4 * b * stride + g / R * (R * 256 + 64);
                convert_tiles(wg + g % R * 256, stride, wv[gi]);
                for (int c = 0; c < 4; c++) {
                    const uint16_t *p = (const uint16_t *)(wg + c * stride + R * 256);
                    s[gi][c] = bf16x16(p);
                    z[gi][c] = bf16x16(p + 16);
                }
            }
            for (int c0 = 0; c0 < 4; c0 += 2) {
                long m = 0;
                for (; m + ROWS <= j->M; m += ROWS) tile6(j, m, g0, ng, n0, c0, wv, s, z);
                switch (j->M - m) {
                    case 5: tile5(j, m, g0, ng, n0, c0, wv, s, z); break;
                    case 4: tile4(j, m, g0, ng, n0, c0, wv, s, z); break;
                    case 3: tile3(j, m, g0, ng, n0, c0, wv, s, z); break;
                    case 2: tile2(j, m, g0, ng, n0, c0, wv, s, z); break;
                    case 1: tile1(j, m, g0, ng, n0, c0, wv, s, z); break;
                }
            }
        }
    }
    return 0;
}

// One row from the tiles (decode): tiles t0..t1-1, 16 channels each, y[16t..] written once.
AVX512 static void gemv(const uint16_t *x, const uint8_t *w, float *y, const float *xs, long K, long gs, long t0,
                        long t1) {
    const long R = gs / G, gbytes = R * 256 + 64, groups = K / gs;
    const __m512i low = _mm512_set1_epi16(0x000f), magic = _mm512_set1_epi16(0x4300);  // bfloat16 128 + q
    const int32_t *xp = (const int32_t *)x;  // k-pairs of x, as vdpbf16ps reads them
    for (long t = t0; t < t1; t++) {
        const uint8_t *wt = w + t * groups * gbytes;
        __m512 tot = _mm512_setzero_ps();
        for (long g = 0; g < groups; g++) {
            const uint8_t *wg = wt + g * gbytes;
            for (long l = 0; l < gbytes; l += 64)  // 4 KB ahead: 40 against 49 GB/s (python fast_cpu_kernels.py)
                _mm_prefetch((const char *)(wg + PREFETCH + l), _MM_HINT_T0);
            __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            float sx = 0;
            for (long r = 0; r < R; r++) {
                const int32_t *xr = xp + (g * gs + r * G) / 2;
                sx += xs[g * R + r];
                for (int i = 0; i < 4; i++) {  // four chains of dependent dot products, summed per group
                    __m512i v = _mm512_loadu_si512((const void *)(wg + r * 256 + 64 * i));
                    for (int jj = 0; jj < 4; jj++) {
                        __m512i q = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4 * jj), low, magic, 0xEA);
                        a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)q, (__m512bh)_mm512_set1_epi32(xr[4 * i + jj]));
                    }
                }
            }
            const __m512 s = bf16x16((const uint16_t *)(wg + R * 256));
            const __m512 z = bf16x16((const uint16_t *)(wg + R * 256) + 16);
            __m512 sum = _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3]));
            // s (sum x (128 + q)) + (z - 136 s) sum x = s sum x (q - 8) + z sum x
            tot = _mm512_fmadd_ps(sum, s, tot);
            tot = _mm512_fmadd_ps(_mm512_fnmadd_ps(s, _mm512_set1_ps(136.f), z), _mm512_set1_ps(sx), tot);
        }
        _mm512_storeu_ps(y + 16 * t, tot);
    }
}

// x [M][K] bfloat16 @ the tiles w [N/16][K/gs][gs / 32 * 256 + 64] (scales and offsets inside) -> y [M][N] float32;
// xs [M][K/32] scratch; N % 64 == 0, gs % 32 == 0, K % gs == 0 (1 for any other, or no AVX512-BF16). One row: gemv over
// tiles of 16 channels; more: blocks of 64 channels split over `threads` OpenMP threads (torch's pool: see the .py).
int llama_flat_int4_tiles_mm(const uint16_t *x, const uint8_t *w, float *y, float *xs, long M, long N, long K,
                             long gs, int threads) {
    if (M < 1 || N < BLOCK || K < G || gs < G || N % BLOCK || gs % G || K % gs || llama_flat_kernels_isa() != 2)
        return 1;
    threads = split(threads, N / 16);
#pragma omp parallel for num_threads(threads)
    for (long m = 0; m < M; m++)  // the sums of x over each run of 32, float32
        for (long g = 0; g < K / G; g++) {
            float t = 0;
            for (int i = 0; i < G; i++) {
                uint32_t u = (uint32_t)x[m * K + g * G + i] << 16;
                float f;
                memcpy(&f, &u, 4);
                t += f;
            }
            xs[m * (K / G) + g] = t;
        }
    if (M == 1) {
        long n16 = N / 16;
#pragma omp parallel for num_threads(threads) schedule(static, 1)
        for (int t = 0; t < threads; t++) gemv(x, w, y, xs, K, gs, n16 * t / threads, n16 * (t + 1) / threads);
        return 0;
    }
    long blocks = N / BLOCK;
    threads = split(threads, blocks);
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int t = 0; t < threads; t++) {
        job_t job = {x, w, y, xs, M, N, K, gs, blocks * t / threads, blocks * (t + 1) / threads};
        run(&job);
    }
    return 0;
}

// int8 words (fast_cpu_quant's compiled decode layout): w [N/16][K/4][16] int32, byte j of word [t][i][c] holding
// q[16t + c][j K/4 + i], plus 128 in bytes 0-2 (unsigned), byte 3 as is (signed). y[m][n] = s[n] sum_k x[m][k] q[n][k]
// for x [M][K] float32 (M small: each tile's words, K * 16 bytes, stay in cache while every row passes), float32
// products and sums, 128 x's sum over the first three quarters taken off per row.
AVX512 static void words_tiles(const float *x, const int32_t *w, const float *s, float *y, const float *off, long M,
                               long N, long K, long t0, long t1) {
    const long K4 = K / 4;
    const __m512i byte = _mm512_set1_epi32(0xff);
    for (long t = t0; t < t1; t++) {
        const int32_t *wt = w + t * K4 * 16;
        for (long m = 0; m < M; m++) {
            const float *xm = x + m * K;
            __m512 a[8];
            for (int i = 0; i < 8; i++) a[i] = _mm512_setzero_ps();
            for (long i = 0; i < K4; i += 2) {
                for (int h = 0; h < 2 && i + h < K4; h++) {
                    const int32_t *wr = wt + (i + h) * 16;
                    _mm_prefetch((const char *)wr + PREFETCH, _MM_HINT_T0);
                    __m512i v = _mm512_loadu_si512((const void *)wr);
                    __m512 *acc = a + 4 * h;
                    acc[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, byte)),
                                             _mm512_set1_ps(xm[i + h]), acc[0]);
                    acc[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 8), byte)),
                                             _mm512_set1_ps(xm[K4 + i + h]), acc[1]);
                    acc[2] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 16), byte)),
                                             _mm512_set1_ps(xm[2 * K4 + i + h]), acc[2]);
                    acc[3] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(v, 24)),
                                             _mm512_set1_ps(xm[3 * K4 + i + h]), acc[3]);
                }
            }
            __m512 sum = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])),
                                       _mm512_add_ps(_mm512_add_ps(a[4], a[5]), _mm512_add_ps(a[6], a[7])));
            sum = _mm512_sub_ps(sum, _mm512_set1_ps(off[m]));
            _mm512_storeu_ps(y + m * N + 16 * t, _mm512_mul_ps(sum, _mm512_loadu_ps(s + 16 * t)));
        }
    }
}

int llama_flat_int8_words_mm(const float *x, const int32_t *w, const float *s, float *y, float *off, long M, long N,
                             long K, int threads) {
    if (M < 1 || N < 16 || N % 16 || K < 4 || K % 4 || llama_flat_kernels_isa() != 2) return 1;
    for (long m = 0; m < M; m++) {
        float t = 0;
        for (long k = 0; k < 3 * (K / 4); k++) t += x[m * K + k];
        off[m] = 128 * t;
    }
    long n16 = N / 16;
    threads = split(threads, n16);
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int t = 0; t < threads; t++) words_tiles(x, w, s, y, off, M, N, K, n16 * t / threads, n16 * (t + 1) / threads);
    return 0;
}

// ------------------------------------------------------------------------------------------------ AVX2 + FMA: int4
// Few rows from the tiles, x as int16 per run of 32 k (xi = round(x / d), d = max |x| / 32767: 2e-5 of the run's
// largest |x|, finer than the bfloat16 x the callers pass): 16-bit lane 2c + h of a run's 64-byte row i holds nibble
// j of channel c at k = 8i + 2j + h, so (lane >> 4j) & 15 and x's k-pair make one vpmaddwd (int32 sums of pairs,
// exact). Per run: y += s d sum_k xi q + (z - 8 s) d sum_k xi, y's 16 channels kept in memory (L1).
#define ROWS16(MR)                                                                                                 \
AVX2 static void rows16_##MR(const int16_t *xi, const float *d, const int32_t *xsum, const uint8_t *w, float *y,  \
                             long N, long K, long gs, long t) {                                                    \
    const long R = gs / G, gbytes = R * 256 + 64, groups = K / gs;                                                 \
    const __m256i m0 = _mm256_set1_epi16(0xf), m1 = _mm256_set1_epi16(0xf0), m2 = _mm256_set1_epi16(0xf00);       \
    const uint8_t *wt = w + t * groups * gbytes;                                                                   \
    for (int m = 0; m < MR; m++)                                                                                   \
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(y + m * N + 16 * t + 8 * h, _mm256_setzero_ps());            \
    for (long g = 0; g < groups; g++) {                                                                            \
        const uint8_t *wg = wt + g * gbytes;                                                                       \
        for (long l = 0; l < gbytes; l += 64) _mm_prefetch((const char *)(wg + PREFETCH + l), _MM_HINT_T0);        \
        const uint16_t *sz = (const uint16_t *)(wg + R * 256);                                                     \
        for (long r = 0; r < R; r++) {                                                                             \
            const long run = g * R + r;                                                                            \
            __m256i a[MR][2][3];  /* nibbles 0 and 3 (q), 1 (16 q), 2 (256 q): masked in place, not shifted */     \
            for (int m = 0; m < MR; m++)                                                                           \
                for (int h = 0; h < 2; h++) a[m][h][0] = a[m][h][1] = a[m][h][2] = _mm256_setzero_si256();         \
            for (int i = 0; i < 4; i++)                                                                            \
                for (int h = 0; h < 2; h++) {                                                                      \
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(wg + r * 256 + 64 * i + 32 * h));       \
                    const __m256i q[4] = {_mm256_and_si256(v, m0), _mm256_and_si256(v, m1),                        \
                                          _mm256_and_si256(v, m2), _mm256_srli_epi16(v, 12)};                      \
                    for (int m = 0; m < MR; m++) {                                                                 \
                        const int32_t *xp = (const int32_t *)(xi + m * K + run * G + 8 * i);                       \
                        for (int j = 0; j < 4; j++)                                                                \
                            a[m][h][j % 3] = _mm256_add_epi32(a[m][h][j % 3],                                      \
                                                              _mm256_madd_epi16(q[j], _mm256_set1_epi32(xp[j])));  \
                    }                                                                                              \
                }                                                                                                  \
            for (int m = 0; m < MR; m++) {                                                                         \
                const float dm = d[m * (K / G) + run];                                                             \
                const __m256 dv = _mm256_set1_ps(dm), o = _mm256_set1_ps(dm * (float)xsum[m * (K / G) + run]);    \
                for (int h = 0; h < 2; h++) {  /* (16 q and 256 q: exact multiples, so the shifts are exact) */    \
                    const __m256i n = _mm256_add_epi32(_mm256_add_epi32(a[m][h][0], _mm256_srai_epi32(a[m][h][1], 4)), \
                                                       _mm256_srai_epi32(a[m][h][2], 8));                          \
                    const __m256 s = bf16x8(sz + 8 * h), z = bf16x8(sz + 16 + 8 * h);                              \
                    float *yp = y + m * N + 16 * t + 8 * h;                                                        \
                    __m256 v = _mm256_fmadd_ps(_mm256_mul_ps(s, dv), _mm256_cvtepi32_ps(n), _mm256_loadu_ps(yp));  \
                    _mm256_storeu_ps(yp, _mm256_fmadd_ps(_mm256_fnmadd_ps(s, _mm256_set1_ps(8.f), z), o, v));      \
                }                                                                                                  \
            }                                                                                                      \
        }                                                                                                          \
    }                                                                                                              \
}
ROWS16(1) ROWS16(2)

// Tiles t0..t1-1 as float32 w.T: wt[k][16 (t - base) + c] = (q - 8) s + z (exact products, one float32 rounding).
AVX2 static void unpack2(const uint8_t *w, float *wt, long K, long gs, long base, long t0, long t1, long ld) {
    const long R = gs / G, gbytes = R * 256 + 64, groups = K / gs;
    const __m256i low = _mm256_set1_epi32(15);
    const __m256 eight = _mm256_set1_ps(8.f);
    for (long t = t0; t < t1; t++)
        for (long g = 0; g < groups; g++) {
            const uint8_t *wg = w + (t * groups + g) * gbytes;
            const uint16_t *sz = (const uint16_t *)(wg + R * 256);
            for (int h = 0; h < 2; h++) {
                const __m256 s = bf16x8(sz + 8 * h), z = bf16x8(sz + 16 + 8 * h);
                for (long r = 0; r < R; r++)
                    for (int i = 0; i < 4; i++) {
                        const __m256i v = _mm256_loadu_si256((const __m256i *)(wg + r * 256 + 64 * i + 32 * h));
                        float *o = wt + (g * gs + r * G + 8 * i) * ld + 16 * (t - base) + 8 * h;
                        for (int j = 0; j < 8; j++) {  // (k = 8i + j: nibble j / 2 of half j % 2)
                            __m256i q = _mm256_and_si256(_mm256_srli_epi32(v, 4 * (j / 2) + 16 * (j % 2)), low);
                            __m256 v8 = _mm256_sub_ps(_mm256_cvtepi32_ps(q), eight);
                            _mm256_storeu_ps(o + j * ld, _mm256_fmadd_ps(v8, s, z));
                        }
                    }
            }
        }
}

// x [M][K] float32 @ tiles w [N/16][K/gs][gs / 32 * 256 + 64] -> y [M][N], each tile read once per pair of rows
// (kernel_ops: from AVX2_GEMM_ROWS rows, unpack and at::mm); scratch: M K int16 then M K/32 float32 and M K/32 int32.
// N % 16 == 0, gs % 32 == 0, K % gs == 0; 1 for any other shape or where AVX2 + FMA is missing.
int llama_flat_int4_tiles_mm_avx2(const float *x, const uint8_t *w, float *y, void *scratch, long M, long N, long K,
                                  long gs, int threads) {
    if (!llama_flat_kernels_isa() || M < 1 || N < 16 || N % 16 || K < G || gs < G || gs % G || K % gs) return 1;
    int16_t *xi = scratch;
    float *d = (float *)(xi + M * K);
    int32_t *xsum = (int32_t *)(d + M * (K / G));
    for (long run = 0; run < M * (K / G); run++) {  // (K % 32 == 0: a run never spans two rows)
        const float *xr = x + run * G;
        float top = 0;
        for (int i = 0; i < G; i++) top = top_abs(top, xr[i]);  // (NaN or inf: d and y's row not finite)
        const float inv = top > 0 ? 32767.f / top : 0.f;
        int32_t sum = 0;
        for (int i = 0; i < G; i++) sum += xi[run * G + i] = (int16_t)lrintf(xr[i] * inv);
        d[run] = top / 32767.f;
        xsum[run] = sum;
    }
    long n16 = N / 16;
    threads = split(threads, n16);
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int p = 0; p < threads; p++)
        for (long t = n16 * p / threads; t < n16 * (p + 1) / threads; t++)
            for (long m = 0; m < M; m += 2)  // (rows in pairs: each tile read once per pair, in L1 for the rest)
                (M - m == 1 ? rows16_1 : rows16_2)(xi + m * K, d + m * (K / G), xsum + m * (K / G), w, y + m * N, N, K,
                                                   gs, t);
    return 0;
}

// Channels n0..n1-1 (multiples of 16) of the tiles as float32 w.T [K][n1 - n0], for a GEMM (prompts on AVX2).
int llama_flat_int4_tiles_unpack_avx2(const uint8_t *w, float *wt, long n0, long n1, long K, long gs, int threads) {
    if (!llama_flat_kernels_isa() || n0 % 16 || n1 % 16 || n1 <= n0 || gs < G || gs % G || K % gs) return 1;
    long t0 = n0 / 16, nt = (n1 - n0) / 16;
    threads = split(threads, nt);
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int t = 0; t < threads; t++)
        unpack2(w, wt, K, gs, t0, t0 + nt * t / threads, t0 + nt * (t + 1) / threads, n1 - n0);
    return 0;
}

// ------------------------------------------------------------------------------------------------ AVX2 + FMA: int8
// The int8 words (llama_flat_int8_words_mm's layout) for any number of rows, x as int16 per run of 32 word rows i
// (its 128 values x[i], x[K/4 + i], x[K/2 + i], x[3K/4 + i] share d = max |x| / 32767): a word's 16-bit lanes masked
// to (byte 0, byte 2) and, shifted arithmetically, (byte 1, byte 3 signed) make one vpmaddwd each with x's pairs.
// Per run: y += s d (sum xi b - 128 sum of xi over bytes 0-2), in int32 before the conversion (exact).
#define WORDS16(MR)                                                                                                \
AVX2 static void words16_##MR(const int16_t *xi, const float *d, const int32_t *xoff, const int32_t *w,           \
                              const float *s, float *y, long N, long K, long t) {                                  \
    const long K4 = K / 4, runs = (K4 + G - 1) / G;                                                                \
    const __m256i lo = _mm256_set1_epi32(0x00ff00ff), hi = _mm256_set1_epi32((int)0xffff00ff);                    \
    const int32_t *wt = w + t * K4 * 16;                                                                           \
    for (int m = 0; m < MR; m++)                                                                                   \
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(y + m * N + 16 * t + 8 * h, _mm256_setzero_ps());            \
    for (long r = 0; r < runs; r++) {                                                                              \
        __m256i a[MR][2];                                                                                          \
        for (int m = 0; m < MR; m++) a[m][0] = a[m][1] = _mm256_setzero_si256();                                   \
        for (long i = r * G; i < K4 && i < (r + 1) * G; i++) {                                                     \
            _mm_prefetch((const char *)(wt + i * 16) + PREFETCH, _MM_HINT_T0);                                     \
            for (int h = 0; h < 2; h++) {                                                                          \
                const __m256i v = _mm256_loadu_si256((const __m256i *)(wt + i * 16 + 8 * h));                      \
                const __m256i b02 = _mm256_and_si256(v, lo), b13 = _mm256_and_si256(_mm256_srai_epi32(v, 8), hi);  \
                for (int m = 0; m < MR; m++) {                                                                     \
                    const int32_t *xp = (const int32_t *)(xi + m * K + 4 * i);                                     \
                    const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(b02, _mm256_set1_epi32(xp[0])),           \
                                                       _mm256_madd_epi16(b13, _mm256_set1_epi32(xp[1])));          \
                    a[m][h] = _mm256_add_epi32(a[m][h], p);                                                        \
                }                                                                                                  \
            }                                                                                                      \
        }                                                                                                          \
        for (int m = 0; m < MR; m++) {                                                                             \
            const __m256 dv = _mm256_set1_ps(d[m * runs + r]);                                                     \
            const __m256i off = _mm256_set1_epi32(xoff[m * runs + r]);                                             \
            for (int h = 0; h < 2; h++) {                                                                          \
                float *yp = y + m * N + 16 * t + 8 * h;                                                            \
                const __m256 n = _mm256_cvtepi32_ps(_mm256_sub_epi32(a[m][h], off));                               \
                _mm256_storeu_ps(yp, _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(s + 16 * t + 8 * h), dv), n,    \
                                                     _mm256_loadu_ps(yp)));                                        \
            }                                                                                                      \
        }                                                                                                          \
    }                                                                                                              \
}
WORDS16(1) WORDS16(2)

// x [M][K] float32 @ the int8 words w [N/16][K/4][16] (scales s [N]) -> y [M][N]; scratch: M K int16, then
// M ceil(K/128) float32 and as many int32. N % 16 == 0, K % 4 == 0; 1 for any other shape or without AVX2 + FMA.
int llama_flat_int8_words_mm_avx2(const float *x, const int32_t *w, const float *s, float *y, void *scratch, long M,
                                  long N, long K, int threads) {
    if (!llama_flat_kernels_isa() || M < 1 || N < 16 || N % 16 || K < 4 || K % 4) return 1;
    const long K4 = K / 4, runs = (K4 + G - 1) / G;
    int16_t *xi = scratch;  // per row: (x[i], x[K/2 + i], x[K/4 + i], x[3K/4 + i]) for each i: the words' pairs
    float *d = (float *)(xi + M * K);
    int32_t *xoff = (int32_t *)(d + M * runs);
    for (long m = 0; m < M; m++)
        for (long r = 0; r < runs; r++) {
            const float *xm = x + m * K;
            const long i0 = r * G, i1 = K4 < (r + 1) * G ? K4 : (r + 1) * G;
            float top = 0;
            for (long i = i0; i < i1; i++)
                for (int j = 0; j < 4; j++) top = top_abs(top, xm[j * K4 + i]);
            const float inv = top > 0 ? 32767.f / top : 0.f;
            static const int lane[4] = {0, 2, 1, 3};  // byte j's x in the word's pairs; bytes 0-2 hold q + 128
            int32_t off = 0;
            for (long i = i0; i < i1; i++)
                for (int j = 0; j < 4; j++)
                    off += (j < 3) * 128 * (xi[m * K + 4 * i + lane[j]] = (int16_t)lrintf(xm[j * K4 + i] * inv));
            d[m * runs + r] = top / 32767.f;
            xoff[m * runs + r] = off;
        }
    long n16 = N / 16;
    threads = split(threads, n16);
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int p = 0; p < threads; p++)
        for (long t = n16 * p / threads; t < n16 * (p + 1) / threads; t++)
            for (long m = 0; m < M; m += 2)
                (M - m == 1 ? words16_1 : words16_2)(xi + m * K, d + m * runs, xoff + m * runs, w, s, y + m * N, N,
                                                     K, t);
    return 0;
}

// -------------------------------------------------------------------------------------------- AVX2 + FMA: bfloat16
// bfloat16 weights as nn.Linear stores them, w [N][K], where oneDNN has no bfloat16 products (AVX2 without AVX-512;
// ATen's bfloat16 product there: ~11 GFLOP/s at any length; this: 19 GB/s at 1 row, 50-54 GFLOP/s from 8, MKL's float32
// rate, 2 threads). A 32-bit lane of 16 loaded weights holds a k-pair: lane << 16 is the even k's float32, lane &
// 0xffff0000 the odd one's; x is split alike once per call (per 16 k: 8 even, 8 odd). Four channels per pass, rows in
// pairs (the channels' 8 K bytes stay in L2 while the rows pass): y is the float32 product of the bfloat16 operands.
#define BF16ROWS(MR)                                                                                               \
AVX2 static void bf16rows_##MR(const float *xs, const uint16_t *w, float *y, long N, long K, long n) {             \
    const __m256i odd = _mm256_set1_epi32((int)0xffff0000);                                                        \
    __m256 a[MR][4];                                                                                               \
    for (int m = 0; m < MR; m++) for (int c = 0; c < 4; c++) a[m][c] = _mm256_setzero_ps();                        \
    for (long k = 0; k < K; k += 16) {                                                                             \
        for (int c = 0; c < 4; c++) {                                                                              \
            const uint16_t *wc = w + (n + c) * K + k;                                                              \
            _mm_prefetch((const char *)(wc + 4 * K), _MM_HINT_T0);  /* the next pass's (+5% at one row) */         \
            const __m256i v = _mm256_loadu_si256((const __m256i *)wc);                                             \
            const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));                                       \
            const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v, odd));                                      \
            for (int m = 0; m < MR; m++)                                                                           \
                a[m][c] = _mm256_fmadd_ps(wo, _mm256_loadu_ps(xs + m * K + k + 8),                                 \
                                          _mm256_fmadd_ps(we, _mm256_loadu_ps(xs + m * K + k), a[m][c]));          \
        }                                                                                                          \
    }                                                                                                              \
    for (int m = 0; m < MR; m++) {  /* four horizontal sums at once (per 128-bit half), y[m][n..n+3] */            \
        const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a[m][0], a[m][1]), _mm256_hadd_ps(a[m][2], a[m][3]));       \
        _mm_storeu_ps(y + m * N + n, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));          \
    }                                                                                                              \
}
BF16ROWS(1) BF16ROWS(2)

// x [M][K] float32 @ w [N][K] bfloat16 -> y [M][N] float32; scratch: M K float32. N % 4 == 0, K % 16 == 0; 1 for any
// other shape or without AVX2 + FMA.
int llama_flat_bf16_mm_avx2(const float *x, const uint16_t *w, float *y, float *xs, long M, long N, long K,
                            int threads) {
    if (!llama_flat_kernels_isa() || M < 1 || N < 4 || N % 4 || K < 16 || K % 16) return 1;
    for (long i = 0; i < M * K; i++)  // (K % 16 == 0: a run of 16 never spans two rows)
        xs[i / 16 * 16 + i % 2 * 8 + i % 16 / 2] = x[i];
    threads = split(threads, N / 4);
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int p = 0; p < threads; p++)
        for (long q = N / 4 * p / threads; q < N / 4 * (p + 1) / threads; q++)
            for (long m = 0; m < M; m += 2)
                (M - m == 1 ? bf16rows_1 : bf16rows_2)(xs + m * K, w, y + m * N, N, K, 4 * q);
    return 0;
}
