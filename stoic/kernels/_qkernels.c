/* stoic's matrix products over GGML-quantised weights, for x86-64 CPUs with AVX2, FMA and F16C
 * (and 16-lane variants where the build has AVX-512F: HAVE_AVX512 below).
 *
 * y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]), where W is held as N rows of K/32 GGML blocks:
 *   Q4_0: {fp16 d; u8 qs[16]}          w = (q - 8) * d
 *   Q4_1: {fp16 d; fp16 m; u8 qs[16]}  w = q * d + m
 *   Q8_0: {fp16 d; i8 qs[32]}          w = q * d
 * (nibble j of a 4-bit block holds element j in its low half and element j + 16 in its high
 * half). Activations and accumulation are float32. With two or more rows of x each weight is
 * de-quantised in registers to exactly the float32 value gguf-py's de-quantisation (and so
 * transformers' GGUF loader) gives (hence -ffp-contract=off: q * d + m is rounded twice there),
 * so a product differs from the float32 one over the de-quantised matrix only in the order of
 * its sums. One row (a one-sequence decode step) factors each block instead (d * sum(q x) +
 * m * sum(x): 14-15% faster), multiplying by the exact q * d + m, which the float copy holds
 * rounded to float32; factoring measured up to 25% slower at 8-64 rows.
 * Outside the fixed order, a layout or'ed with INT8_ROWS (the default mode with a fast dtype)
 * takes one or two rows of x quantised to int8 instead where the build has AVX-512 VNNI
 * (_int8rows.c: not the float product; its numerics are stated there).
 * The K-quants (Q4_K, Q5_K, Q6_K: 256-weight super-blocks) are in _kquants.c, built after this
 * file into the same library, on the same loops (DEFINE_MM, DEFINE_MM16); a matrix stacked
 * from parts of different types (a fused projection of a mixed file) is the MIXED layout.
 * Built and loaded by _qkernels.py; threads are OpenMP's (the libgomp torch itself loads).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 32

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

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

/* The layouts the products read: GGML blocks repacked once at load (stoic_repack) so that a
 * block costs fewer instructions to expand, with scales (and offsets) as float32:
 *   S8: {float d; i8 q[32]}             w = q * d         (from Q8_0)
 *   U4: {float d; float m; u8 q[16]}    w = q * d + m     (from Q4_1)
 *   Z4: {float d; u8 q[16]}             w = (q - 8) * d   (from Q4_0)
 * In U4 and Z4, byte k < 8 holds weight k (low nibble) and k + 8 (high), byte 8 + k weights
 * 16 + k and 24 + k: one vpmovzxbd of 8 bytes, a mask and a shift give 16 weights in order.
 * Why: on 2 AVX2 cores the products over the GGML blocks themselves were bound by instructions
 * (one thread read 2.9 GB/s of Q4_1 where it streams 12 GB/s); one byte a weight (40-byte
 * blocks) halved the instructions at 8-64 rows but read 1.7x the bytes and gained nothing at
 * one row; this layout needs about as few instructions in 24 bytes.
 */
#define S8 100
#define U4 101
#define Z4 102
#define S8_BYTES 36
#define U4_BYTES 24
#define Z4_BYTES 20

/* 32 4-bit weights from the 16 bytes at q, in order, as floats */
static inline void widen_u4(const uint8_t *q, __m256 w[4]) {
    const __m256i mask = _mm256_set1_epi32(0x0F);
    for (int h = 0; h < 2; h++) {
        __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * h)));
        w[2 * h] = _mm256_cvtepi32_ps(_mm256_and_si256(v, mask));
        w[2 * h + 1] = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
    }
}

static inline void widen_s8(const uint8_t *q, __m256 w[4]) {
    for (int i = 0; i < 4; i++)
        w[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * i))));
}

/* DEQUANT(wr, i, w) and UNPACK(wr, i, q, d, m) read the i-th 32 weights of a row `wr` */
static inline void dequant_s8(const uint8_t *wr, int64_t i, __m256 w[4]) {
    const uint8_t *b = wr + i * S8_BYTES;
    float d;
    memcpy(&d, b, 4);
    const __m256 dv = _mm256_set1_ps(d);
    widen_s8(b + 4, w);
    for (int i = 0; i < 4; i++) w[i] = _mm256_mul_ps(w[i], dv);
}

static inline void dequant_u4(const uint8_t *wr, int64_t i, __m256 w[4]) {
    const uint8_t *b = wr + i * U4_BYTES;
    float d, m;
    memcpy(&d, b, 4);
    memcpy(&m, b + 4, 4);
    const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
    widen_u4(b + 8, w);
    for (int i = 0; i < 4; i++) w[i] = _mm256_add_ps(_mm256_mul_ps(w[i], dv), mv);
}

static inline void dequant_z4(const uint8_t *wr, int64_t i, __m256 w[4]) {
    const uint8_t *b = wr + i * Z4_BYTES;
    float d;
    memcpy(&d, b, 4);
    const __m256 dv = _mm256_set1_ps(d), eight = _mm256_set1_ps(8.0f);
    widen_u4(b + 4, w);
    for (int i = 0; i < 4; i++) w[i] = _mm256_mul_ps(_mm256_sub_ps(w[i], eight), dv);
}

/* ROWS rows of x times one row of blocks `wr`: each block is de-quantised once for all the rows.
 * ROWS is a constant, so the accumulators stay in registers; per block and row the four partial
 * products are summed before they meet the accumulator, and with ALT (the one-row tile) one row
 * alternates two accumulators, so no chain of dependent additions bounds the loop. Without ALT
 * every row is summed in the same order whatever ROWS is (the fixed order: below). */

/* The fixed order (--deterministic): a layout or'ed with FIXED_ORDER computes every row of y
 * in one order whatever M is, so a row's result is bitwise the same alone or in any batch: the
 * tiles only (no one-row factored routine, no alternating accumulators), and where AVX-512 is
 * built its 16-lane tiles for every M (not the 8-lane ones above MAX_ROWS_16). The flag reaches
 * the products (and _kquants.c's) through `fixed_order`, set by qmm_into for the calling thread
 * and read by each product before its parallel region. */
#define FIXED_ORDER 0x10000
static _Thread_local int fixed_order;
/* int8 activations for products of one or two rows (the default mode's fast dtype;
 * _int8rows.c): a layout or'ed with INT8_ROWS sets `int8_rows` for the calling thread as
 * FIXED_ORDER sets fixed_order; the fixed order wins where both are set */
#define INT8_ROWS 0x20000
#define INT8_MAX_ROWS 2 /* steps of up to this many rows (_int8rows.c: one, or a tile of two) */
static _Thread_local int int8_rows;
#define DEFINE_TILE(NAME, DEQUANT, ROWS, ALT)                                                  \
    static inline void NAME(const float *x, int64_t K, const uint8_t *wr, int64_t nb,         \
                            float *out, int64_t stride, float add) {                          \
        __m256 acc[ROWS][2];                                                                  \
        for (int t = 0; t < ROWS; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();           \
        for (int64_t b = 0; b < nb; b++) {                                                    \
            __m256 w[4];                                                                      \
            DEQUANT(wr, b, w);                                                                \
            for (int t = 0; t < ROWS; t++) {                                                  \
                const float *xr = x + t * K + b * QK;                                         \
                __m256 p = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr),                         \
                                           _mm256_mul_ps(w[1], _mm256_loadu_ps(xr + 8)));     \
                __m256 q = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16),                    \
                                           _mm256_mul_ps(w[3], _mm256_loadu_ps(xr + 24)));    \
                acc[t][ALT ? (b & 1) : 0] =                                                   \
                    _mm256_add_ps(acc[t][ALT ? (b & 1) : 0], _mm256_add_ps(p, q));            \
            }                                                                                 \
        }                                                                                     \
        for (int t = 0; t < ROWS; t++)                                                        \
            out[t * stride] = hsum(_mm256_add_ps(acc[t][0], acc[t][1])) + add;                \
    }

/* One row of x (a one-sequence decode step): each block factored as
 *   sum_j (q_j d + m) x_j = d * sum_j q_j x_j + m * sum_j x_j
 * with the block sums of x computed once per product, so no weight is de-quantised: about a
 * fifth fewer instructions, measured 14-15% faster over the default model's matrices. It
 * multiplies by the blocks' exact values q d + m; the float copy (and the tiles above) by those
 * values rounded to float32: the difference is within float32 rounding of the product. */
static inline void unpack_u4(const uint8_t *wr, int64_t i, __m256 q[4], float *d, float *m) {
    const uint8_t *b = wr + i * U4_BYTES;
    memcpy(d, b, 4);
    memcpy(m, b + 4, 4);
    widen_u4(b + 8, q);
}

static inline void unpack_z4(const uint8_t *wr, int64_t i, __m256 q[4], float *d, float *m) {
    const uint8_t *b = wr + i * Z4_BYTES;
    memcpy(d, b, 4);
    *m = -8.0f * *d; /* (q - 8) d = q d - 8 d: 8 d is exact */
    widen_u4(b + 4, q);
}

static inline void unpack_s8(const uint8_t *wr, int64_t i, __m256 q[4], float *d, float *m) {
    const uint8_t *b = wr + i * S8_BYTES;
    memcpy(d, b, 4);
    *m = 0.0f;
    widen_s8(b + 4, q);
}

#define MAX_ROW_BLOCKS 4096 /* K up to 131072; wider rows take the tile path */

#define DEFINE_ROW(NAME, UNPACK)                                                              \
    static inline float NAME(const float *x, const float *sx, const uint8_t *wr, int64_t nb) { \
        __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};                           \
        float offset[2] = {0.0f, 0.0f};                                                       \
        for (int64_t b = 0; b < nb; b++) {                                                    \
            __m256 q[4];                                                                      \
            float d, m;                                                                       \
            UNPACK(wr, b, q, &d, &m);                                                         \
            const float *xr = x + b * QK;                                                     \
            __m256 p = _mm256_fmadd_ps(q[0], _mm256_loadu_ps(xr),                             \
                                       _mm256_mul_ps(q[1], _mm256_loadu_ps(xr + 8)));         \
            __m256 r = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xr + 16),                        \
                                       _mm256_mul_ps(q[3], _mm256_loadu_ps(xr + 24)));        \
            acc[b & 1] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_add_ps(p, r), acc[b & 1]); \
            offset[b & 1] += m * sx[b];                                                       \
        }                                                                                     \
        return hsum(_mm256_add_ps(acc[0], acc[1])) + (offset[0] + offset[1]);                 \
    }

DEFINE_ROW(row_u4, unpack_u4)
DEFINE_ROW(row_z4, unpack_z4)
DEFINE_ROW(row_s8, unpack_s8)

static void block_sums(const float *x, int64_t nb, float *sx) {
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * QK;
        sx[b] = hsum(_mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8)),
                                   _mm256_add_ps(_mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24))));
    }
}

/* y[M, N]: the output rows are shared out among the threads; one row of x takes the factored
 * path above, more rows are taken in tiles of 8 rows, then 4, then 1 (measured over the default model's matrices on 2 AVX2 cores: 8-row tiles
 * were 9-23% faster than 4-row ones from 8 rows on, 4-row ones 2-10% faster below). */
#define DEFINE_MM(NAME, BYTES_256, DEQUANT, ROW)                                               \
    DEFINE_TILE(NAME##_1, DEQUANT, 1, 1)                                                      \
    DEFINE_TILE(NAME##_1f, DEQUANT, 1, 0)                                                     \
    DEFINE_TILE(NAME##_4, DEQUANT, 4, 0)                                                      \
    DEFINE_TILE(NAME##_8, DEQUANT, 8, 0)                                                      \
    static void NAME(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,       \
                     const float *bias, float *y, int64_t ldy, int threads) {                 \
        const int64_t nb = K / QK, row_bytes = nb * (BYTES_256) / 8;                          \
        const int fixed = fixed_order;                                                        \
        if (M == 1 && nb <= MAX_ROW_BLOCKS && !fixed) {                                       \
            float sx[MAX_ROW_BLOCKS];                                                         \
            block_sums(x, nb, sx);                                                            \
            _Pragma("omp parallel for schedule(static) num_threads(threads)")                 \
            for (int64_t n = 0; n < N; n++)                                                   \
                y[n] = ROW(x, sx, w + n * row_bytes, nb) + (bias ? bias[n] : 0.0f);           \
            return;                                                                           \
        }                                                                                     \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                     \
        for (int64_t n = 0; n < N; n++) {                                                     \
            const uint8_t *wr = w + n * row_bytes;                                            \
            const float add = bias ? bias[n] : 0.0f;                                          \
            int64_t r = 0;                                                                    \
            for (; r + 8 <= M; r += 8) NAME##_8(x + r * K, K, wr, nb, y + r * ldy + n, ldy, add); \
            for (; r + 4 <= M; r += 4) NAME##_4(x + r * K, K, wr, nb, y + r * ldy + n, ldy, add); \
            for (; r < M; r++) {                                                              \
                if (fixed) NAME##_1f(x + r * K, K, wr, nb, y + r * ldy + n, ldy, add);        \
                else NAME##_1(x + r * K, K, wr, nb, y + r * ldy + n, ldy, add);               \
            }                                                                                 \
        }                                                                                     \
    }

DEFINE_MM(mm_s8, 8 * S8_BYTES, dequant_s8, row_s8)
DEFINE_MM(mm_u4, 8 * U4_BYTES, dequant_u4, row_u4)
DEFINE_MM(mm_z4, 8 * Z4_BYTES, dequant_z4, row_z4)

#ifdef __AVX512F__
/* ---- The same products with 16-lane AVX-512 registers (built where the CPU has AVX-512F).
 * A 4-bit block widens in one vpmovzxbd of its 16 bytes: the low nibbles are weights 0-7 and
 * 16-23, the high ones 8-15 and 24-31, so x is copied once per product into that order
 * (permute_x); S8 blocks widen in order. Per block half the instructions of the 8-lane code:
 * measured on a Xeon with AVX-512 (2 cores, the default model's matrices), 35% less time at
 * one row (docs/benchmarks.md). The arithmetic is the 8-lane code's: the
 * same de-quantised weights (tiles) or factored blocks (one row); only the order of the sums
 * differs. */
#define HAVE_AVX512 1
/* more rows take the 8-lane tiles: over the default model's matrices the 16-lane ones took
 * 0.65x the time at 1 row, 0.68x at 4, 0.78x at 8, 0.94x at 16 and 1.11x at 32 */
#define MAX_ROWS_16 16

static inline void permute_x(const float *x, int64_t M, int64_t K, float *xp) {
    for (int64_t i = 0; i < M * K; i += QK) {
        memcpy(xp + i, x + i, 8 * sizeof(float));
        memcpy(xp + i + 8, x + i + 16, 8 * sizeof(float));
        memcpy(xp + i + 16, x + i + 8, 8 * sizeof(float));
        memcpy(xp + i + 24, x + i + 24, 8 * sizeof(float));
    }
}

static inline void widen16_u4(const uint8_t *q, __m512 w[2]) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
    w[0] = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0x0F)));
    w[1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
}

static inline void widen16_s8(const uint8_t *q, __m512 w[2]) {
    w[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
    w[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
}

static inline void unpack16_u4(const uint8_t *wr, int64_t i, __m512 q[2], float *d, float *m) {
    const uint8_t *b = wr + i * U4_BYTES;
    memcpy(d, b, 4);
    memcpy(m, b + 4, 4);
    widen16_u4(b + 8, q);
}

static inline void unpack16_z4(const uint8_t *wr, int64_t i, __m512 q[2], float *d, float *m) {
    const uint8_t *b = wr + i * Z4_BYTES;
    memcpy(d, b, 4);
    *m = -8.0f * *d;
    widen16_u4(b + 4, q);
}

static inline void unpack16_s8(const uint8_t *wr, int64_t i, __m512 q[2], float *d, float *m) {
    const uint8_t *b = wr + i * S8_BYTES;
    memcpy(d, b, 4);
    *m = 0.0f;
    widen16_s8(b + 4, q);
}

/* de-quantised as the 8-lane code does it: q * d (+ m), two roundings (no contraction) */
static inline void dequant16_u4(const uint8_t *wr, int64_t i, __m512 w[2]) {
    float d, m;
    unpack16_u4(wr, i, w, &d, &m);
    const __m512 dv = _mm512_set1_ps(d), mv = _mm512_set1_ps(m);
    for (int i = 0; i < 2; i++) w[i] = _mm512_add_ps(_mm512_mul_ps(w[i], dv), mv);
}

static inline void dequant16_z4(const uint8_t *wr, int64_t i, __m512 w[2]) {
    const uint8_t *b = wr + i * Z4_BYTES;
    float d;
    memcpy(&d, b, 4);
    widen16_u4(b + 4, w);
    const __m512 dv = _mm512_set1_ps(d), eight = _mm512_set1_ps(8.0f);
    for (int i = 0; i < 2; i++) w[i] = _mm512_mul_ps(_mm512_sub_ps(w[i], eight), dv);
}

static inline void dequant16_s8(const uint8_t *wr, int64_t i, __m512 w[2]) {
    const uint8_t *b = wr + i * S8_BYTES;
    float d;
    memcpy(&d, b, 4);
    widen16_s8(b + 4, w);
    const __m512 dv = _mm512_set1_ps(d);
    for (int i = 0; i < 2; i++) w[i] = _mm512_mul_ps(w[i], dv);
}

#define DEFINE_ROW16(NAME, UNPACK)                                                            \
    static inline float NAME(const float *x, const float *sx, const uint8_t *wr, int64_t nb) { \
        __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};                           \
        float offset[2] = {0.0f, 0.0f};                                                       \
        for (int64_t b = 0; b < nb; b++) {                                                    \
            __m512 q[2];                                                                      \
            float d, m;                                                                       \
            UNPACK(wr, b, q, &d, &m);                                                         \
            const float *xr = x + b * QK;                                                     \
            __m512 p = _mm512_fmadd_ps(q[1], _mm512_loadu_ps(xr + 16),                        \
                                       _mm512_mul_ps(q[0], _mm512_loadu_ps(xr)));             \
            acc[b & 1] = _mm512_fmadd_ps(_mm512_set1_ps(d), p, acc[b & 1]);                   \
            offset[b & 1] += m * sx[b];                                                       \
        }                                                                                     \
        return _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1])) + (offset[0] + offset[1]); \
    }

#define DEFINE_TILE16(NAME, DEQUANT, ROWS)                                                     \
    static inline void NAME(const float *x, int64_t K, const uint8_t *wr, int64_t nb,         \
                            float *out, int64_t stride, float add) {                          \
        __m512 acc[ROWS];                                                                     \
        for (int t = 0; t < ROWS; t++) acc[t] = _mm512_setzero_ps();                          \
        for (int64_t b = 0; b < nb; b++) {                                                    \
            __m512 w[2];                                                                      \
            DEQUANT(wr, b, w);                                                                \
            for (int t = 0; t < ROWS; t++) {                                                  \
                const float *xr = x + t * K + b * QK;                                         \
                acc[t] = _mm512_add_ps(acc[t],                                                \
                                       _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xr + 16),        \
                                                       _mm512_mul_ps(w[0],                    \
                                                                     _mm512_loadu_ps(xr))));  \
            }                                                                                 \
        }                                                                                     \
        for (int t = 0; t < ROWS; t++) out[t * stride] = _mm512_reduce_add_ps(acc[t]) + add;  \
    }

/* as DEFINE_MM; PERMUTE: whether x is copied into the 4-bit blocks' order first */
#define DEFINE_MM16(NAME, BYTES_256, DEQUANT, UNPACK, PERMUTE)                                 \
    DEFINE_ROW16(NAME##_row, UNPACK)                                                          \
    DEFINE_TILE16(NAME##_1, DEQUANT, 1)                                                       \
    DEFINE_TILE16(NAME##_4, DEQUANT, 4)                                                       \
    DEFINE_TILE16(NAME##_8, DEQUANT, 8)                                                       \
    static int NAME(const float *x0, int64_t M, int64_t K, const uint8_t *w, int64_t N,       \
                    const float *bias, float *y, int64_t ldy, int threads) {                  \
        const int64_t nb = K / QK, row_bytes = nb * (BYTES_256) / 8;                          \
        float *xp = NULL;                                                                     \
        const float *x = x0;                                                                  \
        if (PERMUTE) {                                                                        \
            xp = malloc(sizeof(float) * (size_t)(M * K > 0 ? M * K : 1));                     \
            if (!xp) return -2;                                                               \
            permute_x(x0, M, K, xp);                                                          \
            x = xp;                                                                           \
        }                                                                                     \
        if (M == 1 && nb <= MAX_ROW_BLOCKS && !fixed_order) {                                 \
            float sx[MAX_ROW_BLOCKS];                                                         \
            block_sums(x0, nb, sx);                                                           \
            _Pragma("omp parallel for schedule(static) num_threads(threads)")                 \
            for (int64_t n = 0; n < N; n++)                                                   \
                y[n] = NAME##_row(x, sx, w + n * row_bytes, nb) + (bias ? bias[n] : 0.0f);    \
        } else {                                                                              \
            _Pragma("omp parallel for schedule(static) num_threads(threads)")                 \
            for (int64_t n = 0; n < N; n++) {                                                 \
                const uint8_t *wr = w + n * row_bytes;                                        \
                const float add = bias ? bias[n] : 0.0f;                                      \
                int64_t r = 0;                                                                \
                for (; r + 8 <= M; r += 8)                                                    \
                    NAME##_8(x + r * K, K, wr, nb, y + r * ldy + n, ldy, add);                \
                for (; r + 4 <= M; r += 4)                                                    \
                    NAME##_4(x + r * K, K, wr, nb, y + r * ldy + n, ldy, add);                \
                for (; r < M; r++) NAME##_1(x + r * K, K, wr, nb, y + r * ldy + n, ldy, add); \
            }                                                                                 \
        }                                                                                     \
        free(xp);                                                                             \
        return 0;                                                                             \
    }

DEFINE_MM16(mm16_s8, 8 * S8_BYTES, dequant16_s8, unpack16_s8, 0)
DEFINE_MM16(mm16_u4, 8 * U4_BYTES, dequant16_u4, unpack16_u4, 1)
DEFINE_MM16(mm16_z4, 8 * Z4_BYTES, dequant16_z4, unpack16_z4, 1)
#endif

/* The K-quants' and Q5_0/Q5_1's layouts and products (_kquants.c, built after this file into
 * the same library) */
#define K4 103
#define K5 104
#define K6 105
#define Z5 106
#define U5 107
#define IS_KLAYOUT(t) ((t) >= K4 && (t) <= U5)
#define IS_KTYPE(t) ((t) == Q4_K || (t) == Q5_K || (t) == Q6_K || (t) == Q5_0 || (t) == Q5_1)
static int64_t kquant_repacked_bytes(int type);
static int kquant_repack(int type, const uint8_t *src, int64_t N, int64_t K, uint8_t *dst);
static int kquant_mm(int layout, const float *x, int64_t M, int64_t K, const uint8_t *w,
                     int64_t N, const float *bias, float *y, int64_t ldy, int threads);
static int kquant_dequantize(int type, const uint8_t *w, int64_t N, int64_t K, float *out);

/* The repacked size of one block of GGML type `type` (32 weights; 256 for a K-quant), 0 for a
 * type the kernels do not know. */
int64_t stoic_repacked_bytes(int type) {
    if (IS_KTYPE(type)) return kquant_repacked_bytes(type);
    return type == Q4_1 ? U4_BYTES : type == Q4_0 ? Z4_BYTES : type == Q8_0 ? S8_BYTES : 0;
}

/* GGML's nibble order (byte j: weights j and j + 16) into U4/Z4's (byte k < 8: k and k + 8) */
static inline void reorder_nibbles(const uint8_t *in, uint8_t *out) {
    uint8_t v[32];
    for (int j = 0; j < 16; j++) {
        v[j] = in[j] & 0x0F;
        v[j + 16] = in[j] >> 4;
    }
    for (int k = 0; k < 8; k++) {
        out[k] = (uint8_t)(v[k] | (v[k + 8] << 4));
        out[8 + k] = (uint8_t)(v[16 + k] | (v[24 + k] << 4));
    }
}

/* dst = the N rows of K / 32 GGML blocks at src, repacked (U4 for Q4_1, Z4 for Q4_0, S8 for
 * Q8_0; the K-quants as _kquants.c says). The values are the same: every w the products compute
 * equals gguf-py's de-quantisation (stoic_dequantize shows it). */
int stoic_repack(int type, const uint8_t *src, int64_t N, int64_t K, uint8_t *dst) {
    if (IS_KTYPE(type)) return kquant_repack(type, src, N, K, dst);
    if (K % QK != 0 || !stoic_repacked_bytes(type)) return -1;
    const int64_t blocks = N * (K / QK);
    for (int64_t i = 0; i < blocks; i++) {
        if (type == Q4_1) {
            const uint8_t *b = src + i * 20;
            uint8_t *o = dst + i * U4_BYTES;
            const float d = half_to_float(b), m = half_to_float(b + 2);
            memcpy(o, &d, 4);
            memcpy(o + 4, &m, 4);
            reorder_nibbles(b + 4, o + 8);
        } else if (type == Q4_0) {
            const uint8_t *b = src + i * 18;
            uint8_t *o = dst + i * Z4_BYTES;
            const float d = half_to_float(b);
            memcpy(o, &d, 4);
            reorder_nibbles(b + 2, o + 4);
        } else {
            const uint8_t *b = src + i * 34;
            uint8_t *o = dst + i * S8_BYTES;
            const float d = half_to_float(b);
            memcpy(o, &d, 4);
            memcpy(o + 4, b + 2, 32);
        }
    }
    return 0;
}

/* A matrix stacked from parts of different layouts (a fused projection whose matrices a mixed
 * file holds in different types, e.g. Q4_K q and k over a Q6_K v): `w` points to a descriptor,
 *   int64 parts; then per part int64 layout, int64 rows, int64 address of its repacked rows
 * and each part's product fills its columns of y. */
#define MIXED 110

static int qmm_into(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                    const float *bias, float *y, int64_t ldy, int threads);

static int qmm_mixed(const float *x, int64_t M, int64_t K, const int64_t *desc, int64_t N,
                     const float *bias, float *y, int64_t ldy, int threads) {
    int64_t row = 0;
    for (int64_t p = 0; p < desc[0]; p++) {
        const int64_t layout = desc[1 + 3 * p], rows = desc[2 + 3 * p];
        const uint8_t *w = (const uint8_t *)(intptr_t)desc[3 + 3 * p];
        if (layout == MIXED || rows < 0 || row + rows > N) return -1;
        const int rc = qmm_into((int)layout, x, M, K, w, rows, bias ? bias + row : NULL, y + row,
                                ldy, threads);
        if (rc) return rc;
        row += rows;
    }
    return row == N ? 0 : -1;
}

static int qmm_dispatch(int type, const float *x, int64_t M, int64_t K, const uint8_t *w,
                        int64_t N, const float *bias, float *y, int64_t ldy, int threads);

/* the product, in the fixed order for this thread while a FIXED_ORDER layout runs (with int8
 * activations for one or two rows while an INT8_ROWS one does) */
static int qmm_into(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                    const float *bias, float *y, int64_t ldy, int threads) {
    const int before = fixed_order, before8 = int8_rows;
    fixed_order = before || (type & FIXED_ORDER);
    int8_rows = before8 || (type & INT8_ROWS);
    const int rc = qmm_dispatch(type & ~(FIXED_ORDER | INT8_ROWS), x, M, K, w, N, bias, y, ldy,
                                threads);
    fixed_order = before;
    int8_rows = before8;
    return rc;
}

/* a product of one or two rows with int8 activations (_int8rows.c, built after this file into
 * the same library): 0, or 1 where the build or the layout has none (the float path then runs) */
static int int8_mm(int layout, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                   const float *bias, float *y, int64_t ldy, int threads);

/* --deterministic's bfloat16 products (_bf16fixed.c, built after this file into the same
 * library): `w` points to a descriptor {int64 layout, int64 blocks, int64 bfloat16 copy or 0} */
#define BF16FIXED 120
static int bf16_mm(const int64_t *desc, const float *x, int64_t M, int64_t K, int64_t N,
                   const float *bias, float *y, int64_t ldy, int threads);

/* int8 activations over the G8 layouts (_gemm8.c, built after this file into the same library;
 * G8 .. G8 + 3, its variants): any number of rows, each in one order (so --deterministic's
 * too); 1 where the build has no VNNI */
#define G8 130
static int g8_mm(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                 int layout, const float *bias, const float *residual, void *y, int y_bf16,
                 int64_t ldy, int threads);

static int qmm_dispatch(int type, const float *x, int64_t M, int64_t K, const uint8_t *w,
                        int64_t N, const float *bias, float *y, int64_t ldy, int threads) {
    if (K % QK != 0 || M < 0 || N < 0) return -1;
    if (type >= G8 && type <= G8 + 3) {
        const int rc = g8_mm(x, 0, M, K, w, N, type, bias, NULL, y, 0, ldy, threads);
        return rc == 1 ? -1 : rc;
    }
    if (type == BF16FIXED) return bf16_mm((const int64_t *)w, x, M, K, N, bias, y, ldy, threads);
    if (type == MIXED) return qmm_mixed(x, M, K, (const int64_t *)w, N, bias, y, ldy, threads);
    if (M >= 1 && M <= INT8_MAX_ROWS && int8_rows && !fixed_order) {
        const int rc = int8_mm(type, x, M, K, w, N, bias, y, ldy, threads);
        if (rc != 1) return rc;
    }
    if (IS_KLAYOUT(type)) return kquant_mm(type, x, M, K, w, N, bias, y, ldy, threads);
#ifdef HAVE_AVX512
    if (M <= MAX_ROWS_16 || fixed_order) switch (type) {
    case S8: return mm16_s8(x, M, K, w, N, bias, y, ldy, threads);
    case U4: return mm16_u4(x, M, K, w, N, bias, y, ldy, threads);
    case Z4: return mm16_z4(x, M, K, w, N, bias, y, ldy, threads);
    default: return -1;
    }
#endif
    switch (type) {
    case S8: mm_s8(x, M, K, w, N, bias, y, ldy, threads); return 0;
    case U4: mm_u4(x, M, K, w, N, bias, y, ldy, threads); return 0;
    case Z4: mm_z4(x, M, K, w, N, bias, y, ldy, threads); return 0;
    default: return -1;
    }
}

/* y = x @ W^T (+ bias) for W repacked as `type` (S8, U4, Z4, a K layout, MIXED or BF16FIXED;
 * or'ed with FIXED_ORDER: in the fixed order). Returns 0,
 * -1 for another type or K not a multiple of the blocks' width, -2 if a scratch buffer could not
 * be allocated. */
int stoic_qmm(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
              const float *bias, float *y, int threads) {
    return qmm_into(type, x, M, K, w, N, bias, y, N, threads);
}

/* out[N, K] = the weights of N rows of GGML blocks, as the products see them (repacked, then
 * de-quantised by the products' own code): for checks and tests. */
int stoic_dequantize(int type, const uint8_t *w, int64_t N, int64_t K, float *out) {
    if (IS_KTYPE(type)) return kquant_dequantize(type, w, N, K, out);
    const int64_t bytes = type == Q4_0 ? 18 : type == Q4_1 ? 20 : type == Q8_0 ? 34 : 0;
    if (K % QK != 0 || !bytes) return -1;
    uint8_t packed[S8_BYTES];
    for (int64_t i = 0; i < N * (K / QK); i++) {
        __m256 v[4];
        stoic_repack(type, w + i * bytes, 1, QK, packed);
        if (type == Q4_1) dequant_u4(packed, 0, v);
        else if (type == Q4_0) dequant_z4(packed, 0, v);
        else dequant_s8(packed, 0, v);
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(out + i * QK + 8 * j, v[j]);
    }
    return 0;
}

/* ---- One decoder layer of a decode step (Llama: RMSNorm, rotary, grouped-query attention over
 * the paged cache, gated SiLU MLP), for steps where every projection runs on repacked blocks.
 * Three calls a layer replace ~40 torch operators, whose dispatch, not arithmetic, was half of
 * a one-sequence step. float32 throughout; the same formulas as transformers' Llama, so the
 * results differ from the torch path's by float32 rounding only. */
#include <math.h>
#include <stdlib.h>

#define MAX_HEAD_DIM 256

static inline float dot(const float *a, const float *b, int64_t n) { /* n % 8 == 0 */
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    return hsum(acc);
}

/* out = x * rsqrt(mean(x^2) + eps) * w, per row (transformers' LlamaRMSNorm) */
static void rms_norm(const float *x, const float *w, int64_t M, int64_t D, float eps, float *out) {
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * D;
        float *o = out + m * D;
        float ss = 0.0f;
        for (int64_t i = 0; i < D; i++) ss += xr[i] * xr[i];
        const float r = 1.0f / sqrtf(ss / (float)D + eps);
        for (int64_t i = 0; i < D; i++) o[i] = w[i] * (xr[i] * r);
    }
}

/* x [rows, heads, dh] rotated in place: x * cos + rotate_half(x) * sin, cos/sin [rows, dh] */
static void rope(float *x, int64_t rows, int64_t heads, int64_t dh, const float *cos,
                 const float *sin, int64_t stride) {
    const int64_t half = dh / 2;
    for (int64_t m = 0; m < rows; m++)
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + m * stride + h * dh;
            const float *c = cos + m * dh, *s = sin + m * dh;
            for (int64_t i = 0; i < half; i++) {
                const float a = v[i], b = v[i + half];
                v[i] = a * c[i] + (-b) * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
}

/* q [M, heads, dh], k and v [M, kv_heads, dh] of M tokens from hidden [M, D]: RMSNorm, the
 * fused [q; k; v] product, rotary on q and k. */
int stoic_layer_pre(const float *hidden, int64_t M, int64_t D, const float *norm, float eps,
                    int layout, const uint8_t *qkv, const float *bias, int64_t heads,
                    int64_t kv_heads, int64_t dh, const float *cos, const float *sin, float *q,
                    float *k, float *v, int threads) {
    const int64_t nq = heads * dh, nk = kv_heads * dh, n = nq + 2 * nk;
    float *x = calloc((size_t)(M * D), sizeof(float)), *y = malloc(sizeof(float) * (size_t)(M * n));
    if (!x || !y) { free(x); free(y); return -2; }
    rms_norm(hidden, norm, M, D, eps, x);
    int rc = stoic_qmm(layout, x, M, D, qkv, n, bias, y, threads); /* bias: NULL or [n] */
    if (rc == 0) {
        rope(y, M, heads + kv_heads, dh, cos, sin, n); /* q and k are adjacent in each row */
        for (int64_t m = 0; m < M; m++) {
            memcpy(q + m * nq, y + m * n, sizeof(float) * (size_t)nq);
            memcpy(k + m * nk, y + m * n + nq, sizeof(float) * (size_t)nk);
            memcpy(v + m * nk, y + m * n + nq + nk, sizeof(float) * (size_t)nk);
        }
    }
    free(x);
    free(y);
    return rc;
}

/* 8 vectors to one: lane j holds the sum of a[j]'s lanes */
static inline __m256 hsum8(const __m256 *a) {
    const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                         _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

/* the largest of 8 lanes (-inf for none; NaN lanes are skipped, as the scalar loop that
 * follows each use skips them) */
static inline float hmax(__m256 v) {
    float lane[8], top = -INFINITY;
    _mm256_storeu_ps(lane, v);
    for (int j = 0; j < 8; j++) top = lane[j] > top ? lane[j] : top;
    return top;
}

/* e^x, 8 lanes, x clamped to [-87, 88] (Cephes' expf: range reduction by ln 2 in two parts, a
 * degree-6 polynomial; within 2 ulp of expf). Also used by _cops.c. */
static inline __m256 exp8(__m256 x) {
    /* operands in this order so that a NaN passes through (MAXPS/MINPS return the second) */
    x = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(_mm256_set1_ps(-87.0f), x));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    /* 2^n in two factors: n reaches 127 at x = 88, one past the largest finite exponent */
    const __m256i ni = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(ni, 1);
    const __m256i rest = _mm256_sub_epi32(ni, half);
    const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
    const __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(rest, _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, a), b);
}

/* e^x for x <= 0 (softmax after subtracting the maximum), 0 below -87 */
static inline __m256 exp_nonpositive(__m256 x) {
    const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
    return _mm256_andnot_ps(under, exp8(x));
}

/* scores[0, len) := e^(scores - top), padded to a multiple of 8 with zeros; returns their
 * sum (8 lanes at a time) */
static float softmax_numerators(float *scores, int64_t len, float top) {
    const int64_t padded = (len + 7) / 8 * 8;
    for (int64_t j = len; j < padded; j++) scores[j] = -INFINITY; /* e^-inf = 0 */
    const __m256 top_v = _mm256_set1_ps(top);
    __m256 total8 = _mm256_setzero_ps();
    for (int64_t j = 0; j < padded; j += 8) {
        const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + j), top_v));
        _mm256_storeu_ps(scores + j, e);
        total8 = _mm256_add_ps(total8, e);
    }
    return hsum(total8);
}

/* ---- The KV pools: float32, or bfloat16 (--kv-cache-dtype; half the bytes the decode
 * attention streams, which bounds it). A bfloat16 element is a float32's upper half, so a load
 * widens exactly (a shift); a write rounds to nearest even, as torch's conversion does. The
 * kernels below take `bf16` as a constant of each caller, so each compiles twice. */
static inline float pool_float(const void *pool, int64_t at, int bf16) {
    if (!bf16) return ((const float *)pool)[at];
    const uint32_t u = (uint32_t)((const uint16_t *)pool)[at] << 16;
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

static inline __m256 pool_load8(const void *pool, int64_t at, int bf16) {
    if (bf16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)pool + at))), 16));
    return _mm256_loadu_ps((const float *)pool + at);
}

#ifdef HAVE_AVX512
static inline __m512 pool_load16(const void *pool, int64_t at, int bf16) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)pool + at))), 16));
    return _mm512_loadu_ps((const float *)pool + at);
}
#endif

/* 8 floats at src rounded to the nearest bfloat16s at dst, ties to even, a NaN to 0x7fc0
 * (c10::BFloat16's rule) */
static inline void bf16_of8(const float *src, uint16_t *dst) {
    const __m256 x = _mm256_loadu_ps(src);
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
    _mm_storeu_si128((__m128i *)dst,
                     _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

/* `count` query heads (q [count, dh], out likewise) over one sequence's keys and values of
 * one kv head: its `len` positions in the pool blocks of `table`. 0, or -2 out of memory. */
static inline __attribute__((always_inline)) int
attend8_pool(const float *q, const void *k_pool, const void *v_pool, const int64_t *table,
             int64_t len, int64_t count, int64_t dh, int64_t block, float scale, float *out,
             int bf16) {
    const int64_t lanes = dh / 8;
    const int whole = block % 8 == 0;
    float *scores = malloc(sizeof(float) * (size_t)(len > 0 ? len + 8 : 8));
    if (!scores) return -2;
    for (int64_t h = 0; h < count; h++) {
        const float *qv = q + h * dh;
        __m256 qr[MAX_HEAD_DIM / 8];
        for (int64_t i = 0; i < lanes; i++)
            qr[i] = _mm256_mul_ps(_mm256_loadu_ps(qv + 8 * i), _mm256_set1_ps(scale));
        __m256 top8 = _mm256_set1_ps(-INFINITY);
        int64_t t = 0;
        for (; t + 8 <= len; t += 8) {
            __m256 acc[8];
            /* blocks of a multiple of 8 positions: the group's keys lie in one block */
            const int64_t base = whole ? (table[t / block] * block + t % block) * dh : 0;
            for (int j = 0; j < 8; j++) {
                const int64_t kp =
                    whole ? base + j * dh : (table[(t + j) / block] * block + (t + j) % block) * dh;
                __m256 a = _mm256_mul_ps(qr[0], pool_load8(k_pool, kp, bf16));
                for (int64_t i = 1; i < lanes; i++)
                    a = _mm256_fmadd_ps(qr[i], pool_load8(k_pool, kp + 8 * i, bf16), a);
                acc[j] = a;
            }
            const __m256 s8 = hsum8(acc);
            _mm256_storeu_ps(scores + t, s8);
            top8 = _mm256_max_ps(top8, s8);
        }
        float top = hmax(top8);
        for (; t < len; t++) {
            const int64_t kp = (table[t / block] * block + t % block) * dh;
            __m256 a = _mm256_mul_ps(qr[0], pool_load8(k_pool, kp, bf16));
            for (int64_t i = 1; i < lanes; i++)
                a = _mm256_fmadd_ps(qr[i], pool_load8(k_pool, kp + 8 * i, bf16), a);
            scores[t] = hsum(a);
            top = scores[t] > top ? scores[t] : top;
        }
        const float total = softmax_numerators(scores, len, top);
        /* one pass over the values, all of a row's lanes at once */
        __m256 acc[MAX_HEAD_DIM / 8];
        for (int64_t i = 0; i < lanes; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t b0 = 0; b0 < len; b0 += block) { /* a block's values, in key order */
            const int64_t base = table[b0 / block] * block * dh;
            const int64_t end = b0 + block < len ? b0 + block : len;
            for (int64_t j = b0; j < end; j++) {
                const int64_t vp = base + (j - b0) * dh;
                const __m256 p = _mm256_set1_ps(scores[j]);
                for (int64_t i = 0; i < lanes; i++)
                    acc[i] = _mm256_fmadd_ps(p, pool_load8(v_pool, vp + 8 * i, bf16), acc[i]);
            }
        }
        float *o = out + h * dh;
        const __m256 inv = _mm256_set1_ps(total);
        for (int64_t i = 0; i < lanes; i++) _mm256_storeu_ps(o + 8 * i, _mm256_div_ps(acc[i], inv));
    }
    free(scores);
    return 0;
}

/* attend8 over float32 pools: also the deterministic rows kernel's reference order */
static int attend8(const float *q, const float *k_pool, const float *v_pool,
                   const int64_t *table, int64_t len, int64_t count, int64_t dh, int64_t block,
                   float scale, float *out) {
    return attend8_pool(q, k_pool, v_pool, table, len, count, dh, block, scale, out, 0);
}

static int attend8_bf16(const float *q, const uint16_t *k_pool, const uint16_t *v_pool,
                        const int64_t *table, int64_t len, int64_t count, int64_t dh,
                        int64_t block, float scale, float *out) {
    return attend8_pool(q, k_pool, v_pool, table, len, count, dh, block, scale, out, 1);
}

#ifdef HAVE_AVX512
/* query heads one pass over a job's keys and values serves (each key loaded, and widened from
 * bfloat16, once for them all) */
#define ATT_HEADS 4

/* attend8 in 16-lane registers (head_dim a multiple of 16): half the instructions a key, which
 * is what the 8-lane loop was bound by; and up to ATT_HEADS query heads a pass, so that a key
 * or value is read (from memory, then from L2 for the other heads) and widened once, not once a
 * head. Each head's arithmetic is attend8's order, operation for operation (the rows kernel of
 * _rows_attention.c relies on it): the same dot product chain per key, hsum8 per group of 8,
 * the same maxima, numerators and value sums in key order. LANES: dh / 16 (a constant where
 * inlined). */
static inline __attribute__((always_inline)) int
attend16_pool(const float *q, const void *k_pool, const void *v_pool, const int64_t *table,
              int64_t len, int64_t count, int64_t dh, int64_t block, float scale, float *out,
              int bf16, const int64_t LANES) {
    const int whole = block % 8 == 0;
    const int64_t width = len + 8; /* a head's row of scores, padded by softmax_numerators */
    float *scores = malloc(sizeof(float) * (size_t)(ATT_HEADS * width));
    if (!scores) return -2;
    for (int64_t h0 = 0; h0 < count; h0 += ATT_HEADS) {
        const int64_t n = count - h0 < ATT_HEADS ? count - h0 : ATT_HEADS;
        __m512 qr[ATT_HEADS][MAX_HEAD_DIM / 16];
        __m256 top8[ATT_HEADS];
        float top[ATT_HEADS], total[ATT_HEADS];
        for (int64_t g = 0; g < n; g++) {
            for (int64_t i = 0; i < LANES; i++)
                qr[g][i] = _mm512_mul_ps(_mm512_loadu_ps(q + (h0 + g) * dh + 16 * i),
                                         _mm512_set1_ps(scale));
            top8[g] = _mm256_set1_ps(-INFINITY);
        }
        int64_t t = 0;
        for (; t + 8 <= len; t += 8) {
            __m256 part[ATT_HEADS][8];
            /* blocks of a multiple of 8 positions: the group's keys lie in one block */
            const int64_t base = whole ? (table[t / block] * block + t % block) * dh : 0;
            for (int j = 0; j < 8; j++) {
                const int64_t kp =
                    whole ? base + j * dh : (table[(t + j) / block] * block + (t + j) % block) * dh;
                __m512 key[MAX_HEAD_DIM / 16];
                for (int64_t i = 0; i < LANES; i++) key[i] = pool_load16(k_pool, kp + 16 * i, bf16);
                for (int64_t g = 0; g < n; g++) {
                    __m512 a = _mm512_mul_ps(qr[g][0], key[0]);
                    for (int64_t i = 1; i < LANES; i++) a = _mm512_fmadd_ps(qr[g][i], key[i], a);
                    part[g][j] = _mm256_add_ps(
                        _mm512_castps512_ps256(a),
                        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
                }
            }
            for (int64_t g = 0; g < n; g++) {
                const __m256 s8 = hsum8(part[g]);
                _mm256_storeu_ps(scores + g * width + t, s8);
                top8[g] = _mm256_max_ps(top8[g], s8);
            }
        }
        for (int64_t g = 0; g < n; g++) top[g] = hmax(top8[g]);
        for (; t < len; t++) {
            const int64_t kp = (table[t / block] * block + t % block) * dh;
            __m512 key[MAX_HEAD_DIM / 16];
            for (int64_t i = 0; i < LANES; i++) key[i] = pool_load16(k_pool, kp + 16 * i, bf16);
            for (int64_t g = 0; g < n; g++) {
                __m512 a = _mm512_mul_ps(qr[g][0], key[0]);
                for (int64_t i = 1; i < LANES; i++) a = _mm512_fmadd_ps(qr[g][i], key[i], a);
                const float s = _mm512_reduce_add_ps(a);
                scores[g * width + t] = s;
                top[g] = s > top[g] ? s : top[g];
            }
        }
        for (int64_t g = 0; g < n; g++)
            total[g] = softmax_numerators(scores + g * width, len, top[g]);
        __m512 acc[ATT_HEADS][MAX_HEAD_DIM / 16];
        for (int64_t g = 0; g < n; g++)
            for (int64_t i = 0; i < LANES; i++) acc[g][i] = _mm512_setzero_ps();
        for (int64_t b0 = 0; b0 < len; b0 += block) { /* a block's values, in key order */
            const int64_t base = table[b0 / block] * block * dh;
            const int64_t end = b0 + block < len ? b0 + block : len;
            for (int64_t j = b0; j < end; j++) {
                const int64_t vp = base + (j - b0) * dh;
                __m512 value[MAX_HEAD_DIM / 16];
                for (int64_t i = 0; i < LANES; i++)
                    value[i] = pool_load16(v_pool, vp + 16 * i, bf16);
                for (int64_t g = 0; g < n; g++) {
                    const __m512 p = _mm512_set1_ps(scores[g * width + j]);
                    for (int64_t i = 0; i < LANES; i++)
                        acc[g][i] = _mm512_fmadd_ps(p, value[i], acc[g][i]);
                }
            }
        }
        for (int64_t g = 0; g < n; g++) {
            float *o = out + (h0 + g) * dh;
            const __m512 inv = _mm512_set1_ps(total[g]);
            for (int64_t i = 0; i < LANES; i++)
                _mm512_storeu_ps(o + 16 * i, _mm512_div_ps(acc[g][i], inv));
        }
    }
    free(scores);
    return 0;
}

/* attend16_pool with its head dimension a constant for the common ones (registers, not
 * memory, for the queries and sums) */
#define ATTEND16_DIMS(BF16)                                                                       \
    dh == 64    ? attend16_pool(q, k_pool, v_pool, table, len, count, dh, block, scale, out, BF16, 4) \
    : dh == 128 ? attend16_pool(q, k_pool, v_pool, table, len, count, dh, block, scale, out, BF16, 8) \
                : attend16_pool(q, k_pool, v_pool, table, len, count, dh, block, scale, out, BF16, dh / 16)

static int attend16(const float *q, const float *k_pool, const float *v_pool,
                    const int64_t *table, int64_t len, int64_t count, int64_t dh, int64_t block,
                    float scale, float *out) {
    return ATTEND16_DIMS(0);
}

static int attend16_bf16(const float *q, const uint16_t *k_pool, const uint16_t *v_pool,
                         const int64_t *table, int64_t len, int64_t count, int64_t dh,
                         int64_t block, float scale, float *out) {
    return ATTEND16_DIMS(1);
}
#endif

/* the M tokens' k and v [M, kv_heads, dh] into the pools (float32, or bfloat16 with `bf16`):
 * row write[h * M + m] of kv head h */
static void write_pools(const float *k, const float *v, void *k_pool, void *v_pool,
                        const int64_t *write, int64_t M, int64_t kv_heads, int64_t dh, int bf16) {
    for (int64_t h = 0; h < kv_heads; h++)
        for (int64_t m = 0; m < M; m++) {
            const int64_t row = write[h * M + m];
            const float *kr = k + (m * kv_heads + h) * dh, *vr = v + (m * kv_heads + h) * dh;
            if (bf16) {
                uint16_t *kd = (uint16_t *)k_pool + row * dh, *vd = (uint16_t *)v_pool + row * dh;
                for (int64_t d = 0; d < dh; d += 8) /* dh a multiple of 8 */
                    bf16_of8(kr + d, kd + d), bf16_of8(vr + d, vd + d);
            } else {
                memcpy((float *)k_pool + row * dh, kr, sizeof(float) * (size_t)dh);
                memcpy((float *)v_pool + row * dh, vr, sizeof(float) * (size_t)dh);
            }
        }
}

/* Writes the M tokens' k and v into the pools (row write[h * M + m] of a pool seen as
 * [rows, dh]; float32 pools, or bfloat16 ones with `kv_bf16`), then attends: token m's query
 * heads over lens[m] keys of its sequence, whose blocks for kv head g are the pool rows
 * tables[(m * kv_heads + g) * max_blocks + j] (each row a block of `block` positions).
 * out [M, heads, dh].
 *
 * One job is a token's kv head and the query heads that share it (all of them, or one each
 * when there are too few jobs for the threads): the job's keys and values come from memory
 * once and from the core's cache for its other heads. Scores are taken 8 keys at a time (one
 * horizontal reduction for 8 dot products), the exponentials 8 at a time. Decode attention
 * over 32 sequences of mixed lengths was a third of a step, reading each head's keys and
 * values anew with one horizontal sum and one expf a key. */
int stoic_decode_attention(const float *q, const float *k, const float *v, void *k_pool,
                           void *v_pool, const int64_t *write, const int64_t *tables,
                           const int64_t *lens, int64_t M, int64_t heads, int64_t kv_heads,
                           int64_t dh, int64_t block, int64_t max_blocks, float scale, float *out,
                           int threads, int kv_bf16) {
    if (dh % 8 != 0 || dh > MAX_HEAD_DIM || heads % kv_heads != 0) return -1;
    write_pools(k, v, k_pool, v_pool, write, M, kv_heads, dh, kv_bf16);
    const int64_t group = heads / kv_heads;
    /* heads a job takes: the whole group, unless that leaves a thread idle */
    const int64_t per_job = M * kv_heads >= 2 * (int64_t)threads ? group : 1;
    const int64_t jobs = M * kv_heads * (group / per_job);
    int failed = 0;
    _Pragma("omp parallel for schedule(dynamic) num_threads(threads) reduction(|: failed)")
    for (int64_t job = 0; job < jobs; job++) {
        const int64_t mg = job / (group / per_job), first = (job % (group / per_job)) * per_job;
        const int64_t m = mg / kv_heads, g = mg % kv_heads;
        const int64_t *table = tables + (m * kv_heads + g) * max_blocks;
        const int64_t h0 = g * group + first;
        const float *qm = q + (m * heads + h0) * dh;
        float *om = out + (m * heads + h0) * dh;
        int rc;
#ifdef HAVE_AVX512
        if (dh % 16 == 0) {
            rc = kv_bf16 ? attend16_bf16(qm, k_pool, v_pool, table, lens[m], per_job, dh, block, scale, om)
                         : attend16(qm, k_pool, v_pool, table, lens[m], per_job, dh, block, scale, om);
            if (rc) failed = 1;
            continue;
        }
#endif
        rc = kv_bf16 ? attend8_bf16(qm, k_pool, v_pool, table, lens[m], per_job, dh, block, scale, om)
                     : attend8(qm, k_pool, v_pool, table, lens[m], per_job, dh, block, scale, om);
        if (rc) failed = 1;
    }
    return failed ? -2 : 0;
}

/* The rest of the layer, hidden [M, D] updated in place: hidden += attn @ o^T; then
 * hidden += down(silu(gate) * up) of RMSNorm(hidden), [gate; up] one fused product of 2F rows. */
int stoic_layer_post(float *hidden, const float *attn, int64_t M, int64_t D, int64_t A,
                     int layout_o, const uint8_t *o, const float *norm, float eps, int layout_gu,
                     const uint8_t *gate_up, int64_t F, int layout_down, const uint8_t *down,
                     int threads) {
    float *t = malloc(sizeof(float) * (size_t)(M * D)), *x = malloc(sizeof(float) * (size_t)(M * D));
    float *gu = malloc(sizeof(float) * (size_t)(M * 2 * F)), *act = malloc(sizeof(float) * (size_t)(M * F));
    int rc = -2;
    if (!t || !x || !gu || !act) goto done;
    if ((rc = stoic_qmm(layout_o, attn, M, A, o, D, NULL, t, threads))) goto done;
    for (int64_t i = 0; i < M * D; i++) hidden[i] += t[i];
    rms_norm(hidden, norm, M, D, eps, x);
    if ((rc = stoic_qmm(layout_gu, x, M, D, gate_up, 2 * F, NULL, gu, threads))) goto done;
    for (int64_t m = 0; m < M; m++)
        for (int64_t i = 0; i < F; i++) {
            const float g = gu[m * 2 * F + i], u = gu[m * 2 * F + F + i];
            act[m * F + i] = g / (1.0f + expf(-g)) * u;
        }
    if ((rc = stoic_qmm(layout_down, act, M, F, down, D, NULL, t, threads))) goto done;
    for (int64_t i = 0; i < M * D; i++) hidden[i] += t[i];
done:
    free(t);
    free(x);
    free(gu);
    free(act);
    return rc;
}
