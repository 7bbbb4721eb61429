/* stoic's matrix products over GGML-quantised weights, for x86-64 CPUs with AVX2, FMA and F16C.
 *
 * y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]), where W is held as N rows of K/32 GGML blocks:
 *   Q4_0: {fp16 d; u8 qs[16]}          w = (q - 8) * d
 *   Q4_1: {fp16 d; fp16 m; u8 qs[16]}  w = q * d + m
 *   Q8_0: {fp16 d; i8 qs[32]}          w = q * d
 * (nibble j of a 4-bit block holds element j in its low half and element j + 16 in its high
 * half). Activations and accumulation are float32; each weight is de-quantised in registers to
 * exactly the float32 value gguf-py's de-quantisation (and so transformers' GGUF loader) gives
 * (hence -ffp-contract=off: q * d + m is rounded twice there), so a product differs from the
 * float32 one over the de-quantised matrix only in the order of its sums. (Factoring a block as
 * d * sum(q x) + m * sum(x) skips the de-quantisation but measured no faster at one row and up
 * to 25% slower at 8-64.)
 * Built and loaded by _qkernels.py; threads are OpenMP's (the libgomp torch itself loads).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define QK 32

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };

static inline float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* the 32 unsigned nibbles of a 4-bit block as four vectors of floats */
static inline void nibbles(const uint8_t *qs, __m256 q[4]) {
    __m128i raw = _mm_loadu_si128((const __m128i *)qs), mask = _mm_set1_epi8(0x0F);
    __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

/* A block as its quantised values q (four vectors of floats), scale d and offset m: w = q * d + m */
static inline void unpack_q4_0(const uint8_t *b, __m256 q[4], float *d, float *m) {
    *d = half_to_float(b);
    *m = -8.0f * *d; /* (q - 8) * d */
    nibbles(b + 2, q);
}

static inline void unpack_q4_1(const uint8_t *b, __m256 q[4], float *d, float *m) {
    *d = half_to_float(b);
    *m = half_to_float(b + 2);
    nibbles(b + 4, q);
}

static inline void unpack_q8_0(const uint8_t *b, __m256 q[4], float *d, float *m) {
    *d = half_to_float(b);
    *m = 0.0f;
    __m128i q0 = _mm_loadu_si128((const __m128i *)(b + 2));
    __m128i q1 = _mm_loadu_si128((const __m128i *)(b + 18));
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q0));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q0, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q1));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q1, 8)));
}

/* The weights exactly as gguf-py de-quantises them (q * d, then + m: two roundings). */
#define DEFINE_DEQUANT(NAME, UNPACK)                                                           \
    static inline void NAME(const uint8_t *b, __m256 w[4]) {                                  \
        float d, m;                                                                           \
        UNPACK(b, w, &d, &m);                                                                 \
        const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);                          \
        for (int i = 0; i < 4; i++) w[i] = _mm256_add_ps(_mm256_mul_ps(w[i], dv), mv);        \
    }
DEFINE_DEQUANT(dequant_q4_1, unpack_q4_1)
DEFINE_DEQUANT(dequant_q8_0, unpack_q8_0)

static inline void dequant_q4_0(const uint8_t *b, __m256 w[4]) {
    float d, m;
    unpack_q4_0(b, w, &d, &m);
    const __m256 dv = _mm256_set1_ps(d), eight = _mm256_set1_ps(8.0f);
    for (int i = 0; i < 4; i++) w[i] = _mm256_mul_ps(_mm256_sub_ps(w[i], eight), dv);
}

/* ROWS rows of x times one row of blocks `wr`: each block is de-quantised once for all the rows.
 * ROWS is a constant, so the accumulators stay in registers; per block and row the four partial
 * products are summed before they meet the accumulator, and one row alternates two
 * accumulators, so no chain of dependent additions bounds the loop. */
#define DEFINE_TILE(NAME, BLOCK_BYTES, DEQUANT, ROWS)                                          \
    static inline void NAME(const float *x, int64_t K, const uint8_t *wr, int64_t nb,         \
                            float *out, int64_t stride, float add) {                          \
        __m256 acc[ROWS][2];                                                                  \
        for (int t = 0; t < ROWS; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();           \
        for (int64_t b = 0; b < nb; b++) {                                                    \
            __m256 w[4];                                                                      \
            DEQUANT(wr + b * (BLOCK_BYTES), w);                                               \
            for (int t = 0; t < ROWS; t++) {                                                  \
                const float *xr = x + t * K + b * QK;                                         \
                __m256 p = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr),                         \
                                           _mm256_mul_ps(w[1], _mm256_loadu_ps(xr + 8)));     \
                __m256 q = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16),                    \
                                           _mm256_mul_ps(w[3], _mm256_loadu_ps(xr + 24)));    \
                acc[t][ROWS == 1 ? (b & 1) : 0] =                                             \
                    _mm256_add_ps(acc[t][ROWS == 1 ? (b & 1) : 0], _mm256_add_ps(p, q));      \
            }                                                                                 \
        }                                                                                     \
        for (int t = 0; t < ROWS; t++)                                                        \
            out[t * stride] = hsum(_mm256_add_ps(acc[t][0], acc[t][1])) + add;                \
    }

/* y[M, N]: the output rows are shared out among the threads; each takes x in tiles of 8 rows,
 * then 4, then 1 (measured over the default model's matrices on 2 AVX2 cores: 8-row tiles
 * were 9-23% faster than 4-row ones from 8 rows on, 4-row ones 2-10% faster below). */
#define DEFINE_MM(NAME, BLOCK_BYTES, DEQUANT)                                                  \
    DEFINE_TILE(NAME##_1, BLOCK_BYTES, DEQUANT, 1)                                            \
    DEFINE_TILE(NAME##_4, BLOCK_BYTES, DEQUANT, 4)                                            \
    DEFINE_TILE(NAME##_8, BLOCK_BYTES, DEQUANT, 8)                                            \
    static void NAME(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,       \
                     const float *bias, float *y, int threads) {                              \
        const int64_t nb = K / QK, row_bytes = nb * (BLOCK_BYTES);                            \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                     \
        for (int64_t n = 0; n < N; n++) {                                                     \
            const uint8_t *wr = w + n * row_bytes;                                            \
            const float add = bias ? bias[n] : 0.0f;                                          \
            int64_t r = 0;                                                                    \
            for (; r + 8 <= M; r += 8) NAME##_8(x + r * K, K, wr, nb, y + r * N + n, N, add); \
            for (; r + 4 <= M; r += 4) NAME##_4(x + r * K, K, wr, nb, y + r * N + n, N, add); \
            for (; r < M; r++) NAME##_1(x + r * K, K, wr, nb, y + r * N + n, N, add);         \
        }                                                                                     \
    }

DEFINE_MM(mm_q4_0, 18, dequant_q4_0)
DEFINE_MM(mm_q4_1, 20, dequant_q4_1)
DEFINE_MM(mm_q8_0, 34, dequant_q8_0)

/* y = x @ W^T (+ bias). Returns 0, or -1 for a type it does not know or K not a multiple of 32. */
int stoic_qmm(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
              const float *bias, float *y, int threads) {
    if (K % QK != 0 || M < 0 || N < 0) return -1;
    switch (type) {
    case Q4_0: mm_q4_0(x, M, K, w, N, bias, y, threads); return 0;
    case Q4_1: mm_q4_1(x, M, K, w, N, bias, y, threads); return 0;
    case Q8_0: mm_q8_0(x, M, K, w, N, bias, y, threads); return 0;
    default: return -1;
    }
}

/* out[N, K] = W, de-quantised exactly as the products see it (for checks and tests). */
int stoic_dequantize(int type, const uint8_t *w, int64_t N, int64_t K, float *out) {
    if (K % QK != 0) return -1;
    const int64_t nb = K / QK;
    const int64_t bytes = type == Q4_0 ? 18 : type == Q4_1 ? 20 : type == Q8_0 ? 34 : 0;
    if (!bytes) return -1;
    for (int64_t n = 0; n < N; n++)
        for (int64_t b = 0; b < nb; b++) {
            __m256 v[4];
            const uint8_t *blk = w + (n * nb + b) * bytes;
            if (type == Q4_0) dequant_q4_0(blk, v);
            else if (type == Q4_1) dequant_q4_1(blk, v);
            else dequant_q8_0(blk, v);
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(out + n * K + b * QK + 8 * i, v[i]);
        }
    return 0;
}
