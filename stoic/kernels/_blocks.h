/* The repacked layouts' bytes and readers, and the product loops built on them: what the files
 * that multiply by repacked blocks share. _qkernels.c (S8, U4, Z4) and _kquants.c (K4, K5,
 * K6, Z5, U5) instantiate the loops for their layouts; _bf16fixed.c reads every layout through
 * the 16-lane readers (dequant16_*); _int8rows.c reads the bytes; _gemm8.c and _kquants.c
 * unpack a K-quant's scales. Every reader is `static inline`: it is the body of a product's
 * loop, so each product inlines it. The K layouts are described in _kquants.c's header.
 */
#ifndef STOIC_BLOCKS_H
#define STOIC_BLOCKS_H

#include "_common.h"

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
#define S8_BYTES 36
#define U4_BYTES 24
#define Z4_BYTES 20
#define K4_BYTES 192
#define K5_BYTES 184
#define K6_BYTES 320
#define Z5_BYTES 24
#define U5_BYTES 28

/* the 8 scales and 8 mins of a Q4_K/Q5_K super-block from their 12 bytes (get_scale_min_k4) */
static inline void unpack_scales(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (uint8_t)((s[j + 8] & 0x0F) | ((s[j] >> 6) << 4));
        mn[j + 4] = (uint8_t)((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
    }
}

/* d * sc[j] and -(dmin * mn[j]) of a K4/K5 super-block */
static inline void scale_min(const uint8_t *b, int j, float *d, float *m) {
    float sd, smin;
    memcpy(&sd, b, 4);
    memcpy(&smin, b + 4, 4);
    *d = sd * (float)b[8 + j];
    *m = -(smin * (float)b[16 + j]);
}

/* ---- The 8-lane loops */

/* ROWS rows of x times one row of blocks `wr`: each block is de-quantised once for all the rows.
 * ROWS is a constant, so the accumulators stay in registers; per block and row the four partial
 * products are summed before they meet the accumulator, and with ALT (the one-row tile) one row
 * alternates two accumulators, so no chain of dependent additions bounds the loop. Without ALT
 * every row is summed in the same order whatever ROWS is (the fixed order: _qkernels.c). */
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
 * values rounded to float32: the difference is within float32 rounding of the product.
 * (UNPACK(wr, i, q, &d, &m): the i-th 32 weights of row `wr` as integers q (as floats), their
 * scale d and offset m: w = q * d + m.) */
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

static inline void block_sums(const float *x, int64_t nb, float *sx) {
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
        const int fixed = qkernels_fixed_order;                                               \
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

#ifdef HAVE_AVX512
/* ---- The 16-lane loops and readers (HAVE_AVX512: a build where the CPU has AVX-512F).
 * A 4-bit block widens in one vpmovzxbd of its 16 bytes: the low nibbles are weights 0-7 and
 * 16-23, the high ones 8-15 and 24-31, so x is copied once per product into that order
 * (permute_x); S8 blocks widen in order. Per block half the instructions of the 8-lane code:
 * measured on a Xeon with AVX-512 (2 cores, the default model's matrices), 35% less time at
 * one row (docs/benchmarks.md). The arithmetic is the 8-lane code's: the
 * same de-quantised weights (tiles) or factored blocks (one row); only the order of the sums
 * differs. */

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
        if (M == 1 && nb <= MAX_ROW_BLOCKS && !qkernels_fixed_order) {                        \
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

/* The K layouts' and the 5-bit types' 16-lane readers: the values of _kquants.c's 8-lane ones,
 * 16 weights a register (a Q6_K register is one sub-block of one scale) */
static inline __m512i bits16(const uint8_t *p, __m128i shift, int mask) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm512_and_si512(_mm512_srl_epi32(v, shift), _mm512_set1_epi32(mask));
}

static inline void unpack16_k4(const uint8_t *wr, int64_t i, __m512 q[2], float *d, float *m) {
    const uint8_t *b = wr + (i >> 3) * K4_BYTES;
    const int j = (int)(i & 7);
    memcpy(d, b + 4 * j, 4);
    memcpy(m, b + 32 + 4 * j, 4);
    const uint8_t *qs = b + 64 + 32 * (j >> 1);
    const __m128i shift = _mm_cvtsi32_si128(4 * (j & 1));
    for (int k = 0; k < 2; k++) q[k] = _mm512_cvtepi32_ps(bits16(qs + 16 * k, shift, 0x0F));
}

static inline void unpack16_k5(const uint8_t *wr, int64_t i, __m512 q[2], float *d, float *m) {
    const uint8_t *b = wr + (i >> 3) * K5_BYTES;
    const int j = (int)(i & 7);
    scale_min(b, j, d, m);
    const uint8_t *qh = b + 24, *qs = b + 56 + 32 * (j >> 1);
    const __m128i shift = _mm_cvtsi32_si128(4 * (j & 1)), hshift = _mm_cvtsi32_si128(j);
    for (int k = 0; k < 2; k++) {
        const __m512i hi = _mm512_slli_epi32(bits16(qh + 16 * k, hshift, 0x01), 4);
        q[k] = _mm512_cvtepi32_ps(_mm512_or_si512(bits16(qs + 16 * k, shift, 0x0F), hi));
    }
}

static inline void dequant16_k6(const uint8_t *wr, int64_t i, __m512 w[2]) {
    const uint8_t *b = wr + (i >> 3) * K6_BYTES;
    const int j = (int)(i & 7);
    for (int k = 0; k < 2; k++) {
        const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 64 + 32 * j + 16 * k)));
        float s;
        memcpy(&s, b + 4 * (2 * j + k), 4);
        w[k] = _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(s));
    }
}

static inline void unpack16_k6(const uint8_t *wr, int64_t i, __m512 q[2], float *d, float *m) {
    dequant16_k6(wr, i, q);
    *d = 1.0f;
    *m = 0.0f;
}

/* 16 lanes of Q5_0/Q5_1: low nibbles of the 16 bytes are weights 0-15, high ones 16-31; the
 * fifth bits (bit l of qh: weight l) are the lanes of two mask registers, so a fifth bit costs
 * one masked add (Q5_1: q + 16) or subtract (Q5_0: q - 16 where the bit is clear, which is the
 * value q - 16 itself: the block's offset goes into the integers, exactly). The 8-lane code's
 * per-lane variable shifts took 10 instructions per 16 weights, these 4 (one vpmovzxbd for
 * all 32). */
static inline void values16_5(const uint8_t *at, __m512 q[2], int z5) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(at + 4)));
    const __m512i sixteen = _mm512_set1_epi32(16);
    const __m512i half[2] = {_mm512_and_si512(v, _mm512_set1_epi32(0x0F)), _mm512_srli_epi32(v, 4)};
    for (int k = 0; k < 2; k++) { /* (Z5 holds the clear bits: no inversion here) */
        uint16_t bits;
        memcpy(&bits, at + 2 * k, 2);
        q[k] = _mm512_cvtepi32_ps(
            z5 ? _mm512_mask_sub_epi32(half[k], (__mmask16)bits, half[k], sixteen)
               : _mm512_mask_add_epi32(half[k], (__mmask16)bits, half[k], sixteen));
    }
}

static inline void unpack16_z5(const uint8_t *wr, int64_t i, __m512 q[2], float *d, float *m) {
    const uint8_t *b = wr + i * Z5_BYTES;
    memcpy(d, b, 4);
    *m = 0.0f;
    values16_5(b + 4, q, 1);
}

static inline void unpack16_u5(const uint8_t *wr, int64_t i, __m512 q[2], float *d, float *m) {
    const uint8_t *b = wr + i * U5_BYTES;
    memcpy(d, b, 4);
    memcpy(m, b + 4, 4);
    values16_5(b + 8, q, 0);
}

/* q * d + m: two roundings (no contraction), as the 8-lane DEFINE_DEQUANT (_kquants.c) */
#define DEFINE_DEQUANT16(NAME, UNPACK)                                                         \
    static inline void NAME(const uint8_t *wr, int64_t i, __m512 w[2]) {                       \
        float d, m;                                                                            \
        UNPACK(wr, i, w, &d, &m);                                                              \
        const __m512 dv = _mm512_set1_ps(d), mv = _mm512_set1_ps(m);                           \
        for (int k = 0; k < 2; k++) w[k] = _mm512_add_ps(_mm512_mul_ps(w[k], dv), mv);          \
    }

DEFINE_DEQUANT16(dequant16_k4, unpack16_k4)
DEFINE_DEQUANT16(dequant16_k5, unpack16_k5)
DEFINE_DEQUANT16(dequant16_z5, unpack16_z5)
DEFINE_DEQUANT16(dequant16_u5, unpack16_u5)
#endif

#endif
