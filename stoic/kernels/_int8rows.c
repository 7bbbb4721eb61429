/* Products of one row (and two: tile_int8) with int8 activations (AVX-512 VNNI: HAVE_INT8_ROWS,
 * _common.h; elsewhere, and outside the flag, the float32 paths of _qkernels.c and _kquants.c, as
 * before), and the quantisation of rows of x to int8 that _gemm8.c's products take too
 * (int8rows_quantize). _qkernels.c's dispatch calls int8rows_mm.
 *
 * A one-sequence decode step multiplies one row of activations by every matrix, and on 2 cores
 * that is bound by instructions, not bytes: the float32 one-row loops (DEFINE_ROW16) widen each
 * 4-bit weight to int32, convert it to float and multiply (~12 512-bit instructions per 32
 * weights, which Zen 4 runs as twice as many 256-bit ones). Here, as ggml does (Q8_0 blocks of
 * the activations, integer dot products), the row of x is quantised once per product, and a
 * block of 32 weights costs one vpdpbusd (32 u8 x s8 products summed in fours into 8 int32
 * lanes) and a handful of 256-bit instructions.
 *
 * Numerics. Per block b of 32 elements of x:
 *     dx[b] = max|x| / 127,   xq[j] = rint(x[j] * (127 / max|x|))  (int8, |xq| <= 127;
 *     a block of zeros: dx = 0, xq = 0),   sx[b] = dx[b] * sum_j xq[j]
 * and a block of weights w_j = q_j d + m (q the block's unsigned integers) contributes
 *     d dx[b] sum_j q_j xq[j] + m sx[b]
 * (U4/Q4_1: q 0..15, m its offset; Z4/Q4_0: m = -8 d; Z5/Q5_0: q 0..31, m = -16 d; K4/Q4_K: per
 * sub-block of 32, d and m its float32 scale and offset; S8/Q8_0: q signed, m = 0, and K6/Q6_K:
 * q - 32 signed under a scale per 16 weights, both by vpdpbusd(|w|, sign(xq, w)): |w| <= 128
 * fits u8 and xq * sign(w) an s8, since |xq| <= 127 — llama.cpp's trick, one extra instruction
 * (vpsignb) where the alternative, (xq + 128) w minus 128 sum(w), takes a second vpdpbusd for
 * sum(w) and a subtraction: a layout without stored weight sums, which S8 and K6 are).
 * The integer sums are exact; the result is the float32 product of the de-quantised weights by
 * x rounded to 8 bits per block (a relative error of up to 1/254 of each
 * block's largest |x| per element), then float32 rounding of the per-block scaling and sums.
 * So it is not the float path's result: it is used only where the model runs with a fast dtype
 * (the default mode where ``--dtype auto`` picked bfloat16 for dense products), never with
 * ``--dtype float32`` nor in the fixed order (--deterministic), which keep their float paths.
 * The flag (INT8_ROWS, or'ed with a layout) reaches here like FIXED_ORDER: qmm_into sets
 * `int8_rows` for the calling thread; qmm_dispatch hands a product of one row of a layout this
 * file knows (S8, U4, Z4, Z5, K4, K6), or of 2-8 rows (the same), or of more (Z5), to int8rows_mm
 * (with VNNI, only Z5 of these runs in the default mode: the others' G8 layouts take their
 * place, _constants.py's G8_ALONE_TYPES; the fixed order keeps its float paths); the others
 * (U5/Q5_1, K5/Q5_K; more rows) keep their float paths. Measured (docs/benchmarks.md, "int8
 * activations"): 0.40-0.76x the float rows' time per matrix of the default model's Q4_1 and
 * Q4_K_M files on one thread, two rows 0.51-0.81x; K4/K6 ~1.0x (bound by their bytes there).
 */

#include "_blocks.h"

#ifdef HAVE_INT8_ROWS
/* the widest row the int8 path takes (its copy of x lives on the stack: 40 KiB at this width) */
#define INT8_MAX_BLOCKS 1024

/* x (nb blocks of 32) into xq (in the layout's order: `permuted`: each block as weights 0-7,
 * 16-23, 8-15, 24-31, the order U4/Z4's nibbles come out in), dx and sx (above) */
static void quantize_x8(const float *x, int64_t nb, int permuted, int8_t *xq, float *dx,
                        float *sx) {
    for (int64_t b = 0; b < nb; b++) {
        const __m512 v0 = _mm512_loadu_ps(x + b * QK), v1 = _mm512_loadu_ps(x + b * QK + 16);
        const float amax =
            _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m512 iv = _mm512_set1_ps(inv);
        /* rint: the default rounding (to nearest, ties to even) */
        const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, iv));
        const __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, iv));
        const __m128i q0 = _mm512_cvtepi32_epi8(i0), q1 = _mm512_cvtepi32_epi8(i1);
        int8_t *o = xq + b * QK;
        if (permuted) { /* q0: elements 0-15, q1: 16-31 -> 0-7, 16-23, 8-15, 24-31 */
            _mm_storeu_si128((__m128i *)o, _mm_unpacklo_epi64(q0, q1));
            _mm_storeu_si128((__m128i *)(o + 16), _mm_unpackhi_epi64(q0, q1));
        } else {
            _mm_storeu_si128((__m128i *)o, q0);
            _mm_storeu_si128((__m128i *)(o + 16), q1);
        }
        /* a NaN in the block makes its scale NaN, so the products are NaN as the float ones */
        const __mmask16 nan =
            _mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q);
        dx[b] = nan ? __builtin_nanf("") : amax / 127.0f;
        sx[b] = dx[b] * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
    }
}

/* M rows of x (float32, or bfloat16 with x_bf16: each block widened exactly first), K a multiple
 * of 32, quantised as quantize_x8 does, row by row with `threads`: xq [M][K] and scales (dx
 * [M][nb] then sx [M][nb]) allocated here (the caller frees both); -2 where they cannot be */
int int8rows_quantize(const void *x, int x_bf16, int64_t M, int64_t K, int permuted,
                      int threads, int8_t **xq, float **scales) {
    const int64_t nb = K / QK;
    *xq = malloc((size_t)(M * K));
    *scales = malloc(sizeof(float) * (size_t)(2 * M * nb));
    if (!*xq || !*scales) {
        free(*xq);
        free(*scales);
        return -2;
    }
    int8_t *q = *xq;
    float *dx = *scales, *sx = *scales + M * nb;
    _Pragma("omp parallel for schedule(static) num_threads(threads) if (M > 1)")
    for (int64_t r = 0; r < M; r++) {
        if (!x_bf16) {
            quantize_x8((const float *)x + r * K, nb, permuted, q + r * K, dx + r * nb, sx + r * nb);
            continue;
        }
        for (int64_t b = 0; b < nb; b++) { /* a block widened to float32 (exact), then as above */
            float block[QK] __attribute__((aligned(64)));
            const uint16_t *xb = (const uint16_t *)x + r * K + b * QK;
            _mm512_store_ps(block, bf16x16_load(xb));
            _mm512_store_ps(block + 16, bf16x16_load(xb + 16));
            quantize_x8(block, 1, permuted, q + r * K + b * QK, dx + r * nb + b, sx + r * nb + b);
        }
    }
    return 0;
}

/* the 16 bytes of 4-bit values at q as 32 u8 (0..15): bytes 0-15 the low nibbles, 16-31 the
 * high ones (U4/Z4: weights 0-7, 16-23, 8-15, 24-31; Z5: weights 0-31 in order) */
static inline __m256i nibbles32(const uint8_t *q) {
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)q));
    return _mm256_and_si256(_mm256_blend_epi32(v, _mm256_srli_epi16(v, 4), 0xF0),
                            _mm256_set1_epi8(0x0F));
}

/* Block b of a row of weights by the quantised x: the 8 int32 lanes of sum q xq (each the sum
 * of 4 products), the block's scale d and offset m. LAYOUT: U4, Z4, Z5 or S8 (a constant where
 * it is inlined: one loop each). */
static inline __m256i block_int8(int layout, const int8_t *xq, const uint8_t *wr, int64_t b,
                                 float *d, float *m) {
    const __m256i x8 = _mm256_loadu_si256((const __m256i *)(xq + b * QK));
    if (layout == U4) {
        const uint8_t *blk = wr + b * U4_BYTES;
        memcpy(d, blk, 4);
        memcpy(m, blk + 4, 4);
        return _mm256_dpbusd_epi32(_mm256_setzero_si256(), nibbles32(blk + 8), x8);
    }
    if (layout == Z4) {
        const uint8_t *blk = wr + b * Z4_BYTES;
        memcpy(d, blk, 4);
        *m = -8.0f * *d; /* exact */
        return _mm256_dpbusd_epi32(_mm256_setzero_si256(), nibbles32(blk + 4), x8);
    }
    if (layout == Z5) {
        const uint8_t *blk = wr + b * Z5_BYTES;
        uint32_t clear; /* Z5 holds the fifth bits inverted */
        memcpy(d, blk, 4);
        memcpy(&clear, blk + 4, 4);
        *m = -16.0f * *d; /* exact */
        const __m256i lo = nibbles32(blk + 8);
        const __m256i q = _mm256_mask_add_epi8(lo, (__mmask32)~clear, lo, _mm256_set1_epi8(16));
        return _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, x8);
    }
    const uint8_t *blk = wr + b * S8_BYTES; /* S8 */
    memcpy(d, blk, 4);
    *m = 0.0f;
    const __m256i w = _mm256_loadu_si256((const __m256i *)(blk + 4));
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_abs_epi8(w), _mm256_sign_epi8(x8, w));
}

/* One row of weights by the quantised x: per block the lanes of sum q xq, scaled by d dx into
 * one of two float accumulators (two blocks a pass: no chain of dependent additions, and both
 * stay in registers), the offsets m sx in two scalar sums. */
static inline float row_int8(int layout, const int8_t *xq, const float *dx, const float *sx,
                             const uint8_t *wr, int64_t nb) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    float off0 = 0.0f, off1 = 0.0f;
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        float d0, m0, d1, m1;
        const __m256i p0 = block_int8(layout, xq, wr, b, &d0, &m0);
        const __m256i p1 = block_int8(layout, xq, wr, b + 1, &d1, &m1);
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(d0 * dx[b]), _mm256_cvtepi32_ps(p0), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_set1_ps(d1 * dx[b + 1]), _mm256_cvtepi32_ps(p1), acc1);
        off0 += m0 * sx[b];
        off1 += m1 * sx[b + 1];
    }
    if (b < nb) {
        float d0, m0;
        const __m256i p0 = block_int8(layout, xq, wr, b, &d0, &m0);
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(d0 * dx[b]), _mm256_cvtepi32_ps(p0), acc0);
        off0 += m0 * sx[b];
    }
    return hsum(_mm256_add_ps(acc0, acc1)) + (off0 + off1);
}

/* One row of x by a K4 row (Q4_K), a super-block at a time: chunk c of its qs holds sub-block
 * 2c in its low nibbles and 2c + 1 in its high ones, each weight in order, so one load gives
 * two sub-blocks of u8 values (0..15) for two vpdpbusd with x's blocks 8 sb + 2c and + 1; each
 * sub-block's scale s[j] dx and the super-block's eight offsets m[j] sx in one 8-lane product,
 * as row16_k4 does. */
static inline float row_int8_k4(const int8_t *xq, const float *dx, const float *sx,
                                const uint8_t *wr, int64_t nb) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), offset = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int64_t sb = 0; sb < nb / 8; sb++) {
        const uint8_t *b = wr + sb * K4_BYTES;
        const int8_t *xs = xq + sb * QK_K;
        float s[8];
        _mm256_storeu_ps(s, _mm256_mul_ps(_mm256_loadu_ps((const float *)b), _mm256_loadu_ps(dx + 8 * sb)));
        offset = _mm256_fmadd_ps(_mm256_loadu_ps((const float *)(b + 32)), _mm256_loadu_ps(sx + 8 * sb), offset);
        for (int c = 0; c < 4; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(b + 64 + 32 * c));
            const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            const __m256i p0 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), lo,
                                                   _mm256_loadu_si256((const __m256i *)(xs + 64 * c)));
            const __m256i p1 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), hi,
                                                   _mm256_loadu_si256((const __m256i *)(xs + 64 * c + 32)));
            acc0 = _mm256_fmadd_ps(_mm256_set1_ps(s[2 * c]), _mm256_cvtepi32_ps(p0), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_set1_ps(s[2 * c + 1]), _mm256_cvtepi32_ps(p1), acc1);
        }
    }
    return hsum(_mm256_add_ps(acc0, acc1)) + hsum(offset);
}

/* One row of x by a K6 row (Q6_K): signed values q - 32 (-32..31) under a scale per 16, so a
 * block of 32 is two sub-blocks: lanes 0-3 of its vpdpbusd (|w| by sign(xq, w), as S8) sum
 * the first, lanes 4-7 the second, scaled by [s0 x 4, s1 x 4] dx. */
static inline float row_int8_k6(const int8_t *xq, const float *dx, const float *sx,
                                const uint8_t *wr, int64_t nb) {
    (void)sx;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    const __m256i pairs = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    for (int64_t sb = 0; sb < nb / 8; sb++) {
        const uint8_t *b = wr + sb * K6_BYTES;
        for (int k = 0; k < 8; k++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(b + 64 + 32 * k));
            const __m256i x8 = _mm256_loadu_si256((const __m256i *)(xq + sb * QK_K + 32 * k));
            const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_abs_epi8(w),
                                                  _mm256_sign_epi8(x8, w));
            const __m256 s2 = _mm256_castps128_ps256(
                _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(b + 8 * k))));
            const __m256 scale = _mm256_mul_ps(_mm256_permutevar8x32_ps(s2, pairs),
                                               _mm256_set1_ps(dx[8 * sb + k]));
            if (k & 1) acc1 = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(p), acc1);
            else acc0 = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(p), acc0);
        }
    }
    return hsum(_mm256_add_ps(acc0, acc1));
}

#define DEFINE_ROW_INT8(NAME, LAYOUT, BYTES_256)                                               \
    static void NAME(const int8_t *xq, const float *dx, const float *sx, int64_t nb,          \
                     const uint8_t *w, int64_t N, const float *bias, float *y, int threads) { \
        const int64_t row_bytes = nb * (BYTES_256) / 8;                                       \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                     \
        for (int64_t n = 0; n < N; n++)                                                       \
            y[n] = row_int8(LAYOUT, xq, dx, sx, w + n * row_bytes, nb) + (bias ? bias[n] : 0.0f); \
    }

DEFINE_ROW_INT8(int8_u4, U4, 8 * U4_BYTES)
DEFINE_ROW_INT8(int8_z4, Z4, 8 * Z4_BYTES)
DEFINE_ROW_INT8(int8_z5, Z5, 8 * Z5_BYTES)
DEFINE_ROW_INT8(int8_s8, S8, 8 * S8_BYTES)

#define DEFINE_KROW_INT8(NAME, ROW, BYTES_256)                                                 \
    static void NAME(const int8_t *xq, const float *dx, const float *sx, int64_t nb,          \
                     const uint8_t *w, int64_t N, const float *bias, float *y, int threads) { \
        const int64_t row_bytes = nb / 8 * (BYTES_256);                                       \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                     \
        for (int64_t n = 0; n < N; n++)                                                       \
            y[n] = ROW(xq, dx, sx, w + n * row_bytes, nb) + (bias ? bias[n] : 0.0f);          \
    }

DEFINE_KROW_INT8(int8_k4, row_int8_k4, K4_BYTES)
DEFINE_KROW_INT8(int8_k6, row_int8_k6, K6_BYTES)

/* ROWS rows of x (2 to INT8_TILE_ROWS) by one row of weights: each block's weights made ready
 * once (nibbles split; S8: |w|), then every row's block exactly as row_int8 takes it (the same
 * instructions, accumulators and order), so a row's result is bitwise its one-row result: a
 * product of up to 8 rows (a few sequences decoding, a sequence's draft tokens to verify) gives
 * each row what it would alone. Per row and block: the load of its x, vpdpbusd, the conversion,
 * the scale d dx (d broadcast once a block, dx from memory) and one multiply-add; the offsets m
 * sx of all the rows in one 8-lane multiply and add a block (sxt: sx transposed, [nb][8]: lane
 * t is row t's scalar m sx sum, the same roundings in the same order). Measured over the default
 * model's matrices (Q4_1, one thread, ms a layer): 1 row 0.15, 2: 0.30 (the float tiles: 0.30),
 * 3: 0.45 (0.83), 5: 0.63 (0.80), 8: 0.95 (0.90-1.18) before the offsets were vectorised; after,
 * 2: 0.28, 3: 0.39, 4: 0.43, 5: 0.49, 6: 0.57, 7: 0.66; 8 as two tiles of 4 (one of 8: 1.14). */
#define INT8_TILE_ROWS 8
#define DEFINE_TILE_INT8(NAME, ROWS)                                                           \
    static inline void NAME(int layout, const int8_t *xq, const float *dx, const float *sxt,  \
                            int64_t nb, const uint8_t *wr, float *out, int64_t stride,        \
                            float add) {                                                      \
        __m256 acc[2][ROWS], off[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};             \
        for (int t = 0; t < ROWS; t++) acc[0][t] = acc[1][t] = _mm256_setzero_ps();           \
        for (int64_t b = 0; b < nb; b++) {                                                    \
            const int k = (int)(b & 1);                                                       \
            float d, m = 0.0f;                                                                \
            __m256i q, sgn = _mm256_setzero_si256();                                          \
            if (layout == U4) {                                                               \
                const uint8_t *blk = wr + b * U4_BYTES;                                       \
                memcpy(&d, blk, 4);                                                           \
                memcpy(&m, blk + 4, 4);                                                       \
                q = nibbles32(blk + 8);                                                       \
            } else if (layout == Z4) {                                                        \
                const uint8_t *blk = wr + b * Z4_BYTES;                                       \
                memcpy(&d, blk, 4);                                                           \
                m = -8.0f * d;                                                                \
                q = nibbles32(blk + 4);                                                       \
            } else if (layout == Z5) {                                                        \
                const uint8_t *blk = wr + b * Z5_BYTES;                                       \
                uint32_t clear;                                                               \
                memcpy(&d, blk, 4);                                                           \
                memcpy(&clear, blk + 4, 4);                                                   \
                m = -16.0f * d;                                                               \
                const __m256i lo = nibbles32(blk + 8);                                        \
                q = _mm256_mask_add_epi8(lo, (__mmask32)~clear, lo, _mm256_set1_epi8(16));    \
            } else {                                                                          \
                const uint8_t *blk = wr + b * S8_BYTES;                                       \
                memcpy(&d, blk, 4);                                                           \
                sgn = _mm256_loadu_si256((const __m256i *)(blk + 4));                         \
                q = _mm256_abs_epi8(sgn);                                                     \
            }                                                                                 \
            const __m256 dv = _mm256_set1_ps(d);                                              \
            for (int t = 0; t < ROWS; t++) {                                                  \
                const int64_t at = t * nb;                                                    \
                __m256i x8 = _mm256_loadu_si256((const __m256i *)(xq + (at + b) * QK));       \
                if (layout == S8) x8 = _mm256_sign_epi8(x8, sgn);                             \
                const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, x8);         \
                acc[k][t] = _mm256_fmadd_ps(_mm256_mul_ps(dv, _mm256_set1_ps(dx[at + b])),    \
                                            _mm256_cvtepi32_ps(p), acc[k][t]);                \
            }                                                                                 \
            off[k] = _mm256_add_ps(off[k], _mm256_mul_ps(_mm256_set1_ps(m),                   \
                                                         _mm256_loadu_ps(sxt + 8 * b)));      \
        }                                                                                     \
        float o0[8], o1[8];                                                                   \
        _mm256_storeu_ps(o0, off[0]);                                                         \
        _mm256_storeu_ps(o1, off[1]);                                                         \
        for (int t = 0; t < ROWS; t++)                                                        \
            out[t * stride] = hsum(_mm256_add_ps(acc[0][t], acc[1][t])) + (o0[t] + o1[t]) + add; \
    }

DEFINE_TILE_INT8(tile_int8_2, 2)
DEFINE_TILE_INT8(tile_int8_3, 3)
DEFINE_TILE_INT8(tile_int8_4, 4)
DEFINE_TILE_INT8(tile_int8_5, 5)
DEFINE_TILE_INT8(tile_int8_6, 6)
DEFINE_TILE_INT8(tile_int8_7, 7)

#define DEFINE_TILES_INT8(NAME, LAYOUT, BYTES_256)                                             \
    static void NAME(const int8_t *xq, const float *dx, const float *sxt, int64_t nb,         \
                     int64_t M, const uint8_t *w, int64_t N, const float *bias, float *y,     \
                     int64_t ldy, int threads) {                                              \
        const int64_t row_bytes = nb * (BYTES_256) / 8;                                       \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                     \
        for (int64_t n = 0; n < N; n++) {                                                     \
            const float add = bias ? bias[n] : 0.0f;                                          \
            const uint8_t *wr = w + n * row_bytes;                                            \
            float *o = y + n;                                                                 \
            switch (M) { /* a constant each: the row loops unrolled, accumulators in registers */ \
            case 2: tile_int8_2(LAYOUT, xq, dx, sxt, nb, wr, o, ldy, add); break;             \
            case 3: tile_int8_3(LAYOUT, xq, dx, sxt, nb, wr, o, ldy, add); break;             \
            case 4: tile_int8_4(LAYOUT, xq, dx, sxt, nb, wr, o, ldy, add); break;             \
            case 5: tile_int8_5(LAYOUT, xq, dx, sxt, nb, wr, o, ldy, add); break;             \
            case 6: tile_int8_6(LAYOUT, xq, dx, sxt, nb, wr, o, ldy, add); break;             \
            case 7: tile_int8_7(LAYOUT, xq, dx, sxt, nb, wr, o, ldy, add); break;             \
            default: /* two tiles of 4: the 8-row tile measured slower (its registers spill) */ \
                tile_int8_4(LAYOUT, xq, dx, sxt, nb, wr, o, ldy, add);                        \
                tile_int8_4(LAYOUT, xq + 4 * nb * QK, dx + 4 * nb, sxt + 4, nb, wr,           \
                            o + 4 * ldy, ldy, add);                                           \
                break;                                                                        \
            }                                                                                 \
        }                                                                                     \
    }

DEFINE_TILES_INT8(tiles_u4, U4, 8 * U4_BYTES)
DEFINE_TILES_INT8(tiles_z4, Z4, 8 * Z4_BYTES)
DEFINE_TILES_INT8(tiles_z5, Z5, 8 * Z5_BYTES)
DEFINE_TILES_INT8(tiles_s8, S8, 8 * S8_BYTES)

/* The K layouts' tiles: ROWS rows of x by one K4 (Q4_K) or K6 (Q6_K) row, each row's super-blocks
 * exactly as row_int8_k4 / row_int8_k6 take them (so bitwise its one-row result), the weights'
 * nibbles (K4) or |w| and scale pairs (K6) made ready once for all the rows. Tiles of up to 4
 * rows (three accumulators a row); 5-8 rows run as a tile of 4 and one of the rest. */
#define DEFINE_TILE_INT8_K4(NAME, ROWS)                                                        \
    static inline void NAME(const int8_t *xq, const float *dx, const float *sx, int64_t nb,   \
                            const uint8_t *wr, float *out, int64_t stride, float add) {       \
        __m256 acc0[ROWS], acc1[ROWS], offset[ROWS];                                          \
        for (int t = 0; t < ROWS; t++)                                                        \
            acc0[t] = acc1[t] = offset[t] = _mm256_setzero_ps();                              \
        const __m256i low = _mm256_set1_epi8(0x0F);                                           \
        for (int64_t sb = 0; sb < nb / 8; sb++) {                                             \
            const uint8_t *b = wr + sb * K4_BYTES;                                            \
            const __m256 scales = _mm256_loadu_ps((const float *)b);                          \
            const __m256 mins = _mm256_loadu_ps((const float *)(b + 32));                     \
            float s[ROWS][8];                                                                 \
            for (int t = 0; t < ROWS; t++) {                                                  \
                _mm256_storeu_ps(s[t], _mm256_mul_ps(scales, _mm256_loadu_ps(dx + t * nb + 8 * sb))); \
                offset[t] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(sx + t * nb + 8 * sb), offset[t]); \
            }                                                                                 \
            for (int c = 0; c < 4; c++) {                                                     \
                const __m256i v = _mm256_loadu_si256((const __m256i *)(b + 64 + 32 * c));     \
                const __m256i lo = _mm256_and_si256(v, low);                                  \
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);            \
                for (int t = 0; t < ROWS; t++) {                                              \
                    const int8_t *xs = xq + t * nb * QK + sb * QK_K + 64 * c;                 \
                    const __m256i p0 = _mm256_dpbusd_epi32(                                   \
                        _mm256_setzero_si256(), lo, _mm256_loadu_si256((const __m256i *)xs)); \
                    const __m256i p1 = _mm256_dpbusd_epi32(                                   \
                        _mm256_setzero_si256(), hi,                                           \
                        _mm256_loadu_si256((const __m256i *)(xs + 32)));                      \
                    acc0[t] = _mm256_fmadd_ps(_mm256_set1_ps(s[t][2 * c]),                    \
                                              _mm256_cvtepi32_ps(p0), acc0[t]);               \
                    acc1[t] = _mm256_fmadd_ps(_mm256_set1_ps(s[t][2 * c + 1]),                \
                                              _mm256_cvtepi32_ps(p1), acc1[t]);               \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        for (int t = 0; t < ROWS; t++)                                                        \
            out[t * stride] =                                                                 \
                hsum(_mm256_add_ps(acc0[t], acc1[t])) + hsum(offset[t]) + add;                \
    }

#define DEFINE_TILE_INT8_K6(NAME, ROWS)                                                        \
    static inline void NAME(const int8_t *xq, const float *dx, const float *sx, int64_t nb,   \
                            const uint8_t *wr, float *out, int64_t stride, float add) {       \
        (void)sx;                                                                             \
        __m256 acc0[ROWS], acc1[ROWS];                                                        \
        for (int t = 0; t < ROWS; t++) acc0[t] = acc1[t] = _mm256_setzero_ps();               \
        const __m256i pairs = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);                      \
        for (int64_t sb = 0; sb < nb / 8; sb++) {                                             \
            const uint8_t *b = wr + sb * K6_BYTES;                                            \
            for (int k = 0; k < 8; k++) {                                                     \
                const __m256i w = _mm256_loadu_si256((const __m256i *)(b + 64 + 32 * k));     \
                const __m256i aw = _mm256_abs_epi8(w);                                        \
                const __m256 s2 = _mm256_castps128_ps256(                                     \
                    _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(b + 8 * k))));         \
                const __m256 pair = _mm256_permutevar8x32_ps(s2, pairs);                      \
                for (int t = 0; t < ROWS; t++) {                                              \
                    const __m256i x8 = _mm256_loadu_si256(                                    \
                        (const __m256i *)(xq + t * nb * QK + sb * QK_K + 32 * k));            \
                    const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), aw,         \
                                                          _mm256_sign_epi8(x8, w));           \
                    const __m256 scale =                                                      \
                        _mm256_mul_ps(pair, _mm256_set1_ps(dx[t * nb + 8 * sb + k]));         \
                    if (k & 1) acc1[t] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(p), acc1[t]); \
                    else acc0[t] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(p), acc0[t]);     \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        for (int t = 0; t < ROWS; t++)                                                        \
            out[t * stride] = hsum(_mm256_add_ps(acc0[t], acc1[t])) + add;                    \
    }

DEFINE_TILE_INT8_K4(tile_k4_1, 1)
DEFINE_TILE_INT8_K4(tile_k4_2, 2)
DEFINE_TILE_INT8_K4(tile_k4_3, 3)
DEFINE_TILE_INT8_K4(tile_k4_4, 4)
DEFINE_TILE_INT8_K6(tile_k6_1, 1)
DEFINE_TILE_INT8_K6(tile_k6_2, 2)
DEFINE_TILE_INT8_K6(tile_k6_3, 3)
DEFINE_TILE_INT8_K6(tile_k6_4, 4)

/* up to 4 rows from row r0 of a K tile's inputs: xq, dx and sx [M][...] row-major */
#define K_TILE(PREFIX, ROWS, r0)                                                               \
    PREFIX##_##ROWS(xq + (r0) * nb * QK, dx + (r0) * nb, sx + (r0) * nb, nb, wr,              \
                    y + (r0) * ldy + n, ldy, add)

#define DEFINE_KTILES_INT8(NAME, PREFIX, BYTES)                                                \
    static void NAME(const int8_t *xq, const float *dx, const float *sx, int64_t nb,          \
                     int64_t M, const uint8_t *w, int64_t N, const float *bias, float *y,     \
                     int64_t ldy, int threads) {                                              \
        const int64_t row_bytes = nb / 8 * (BYTES);                                           \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                     \
        for (int64_t n = 0; n < N; n++) {                                                     \
            const float add = bias ? bias[n] : 0.0f;                                          \
            const uint8_t *wr = w + n * row_bytes;                                            \
            int64_t r = 0;                                                                    \
            if (M >= 4) { K_TILE(PREFIX, 4, 0); r = 4; }                                       \
            switch (M - r) {                                                                  \
            case 1: K_TILE(PREFIX, 1, r); break;                                              \
            case 2: K_TILE(PREFIX, 2, r); break;                                              \
            case 3: K_TILE(PREFIX, 3, r); break;                                              \
            case 4: K_TILE(PREFIX, 4, r); break;                                              \
            default: break;                                                                   \
            }                                                                                 \
        }                                                                                     \
    }

DEFINE_KTILES_INT8(ktiles_k4, tile_k4, K4_BYTES)
DEFINE_KTILES_INT8(ktiles_k6, tile_k6, K6_BYTES)

/* More than INT8_TILE_ROWS rows of Z5 (Q5_0; the other layouts here have G8 layouts no larger
 * than their blocks, which serve every step: G8_ALONE_TYPES): a prefill chunk or a decode step
 * of many sequences where no batched layout was made (--weight-layouts compact). The same tiles,
 * 4 rows each (the rest one at a time), over chunks of MANY_COLS output columns: a chunk's
 * weight rows stay in L1 while every group of 4 rows of x passes over them. Each row's result
 * is still bitwise its one-row result. Measured on 1.5B-shaped matrices (the K4 layout, 16-256
 * rows): 2.0-2.9x faster than the float path's tiles. */
#define MANY_COLS 8
static void many_z5(const int8_t *xq, const float *dx, const float *sx, const float *sxt,
                    int64_t nb, int64_t M, const uint8_t *w, int64_t N, const float *bias,
                    float *y, int64_t ldy, int threads) {
    const int64_t row_bytes = nb * Z5_BYTES, chunks = (N + MANY_COLS - 1) / MANY_COLS;
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t n1 = (c + 1) * MANY_COLS < N ? (c + 1) * MANY_COLS : N;
        int64_t r = 0;
        for (; r + 4 <= M; r += 4) {
            const float *g = sxt + (r / 8) * 8 * nb + (r % 8);
            for (int64_t n = c * MANY_COLS; n < n1; n++)
                tile_int8_4(Z5, xq + r * nb * QK, dx + r * nb, g, nb, w + n * row_bytes,
                            y + r * ldy + n, ldy, bias ? bias[n] : 0.0f);
        }
        for (; r < M; r++) /* at most 3 rows: one at a time */
            for (int64_t n = c * MANY_COLS; n < n1; n++)
                y[r * ldy + n] = row_int8(Z5, xq + r * nb * QK, dx + r * nb, sx + r * nb,
                                          w + n * row_bytes, nb) + (bias ? bias[n] : 0.0f);
    }
}

/* y[M, N] (row stride ldy) with int8 activations: 0, or 1 where this layout or width has none
 * here (the float path then runs) */
int int8rows_mm(int layout, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                const float *bias, float *y, int64_t ldy, int threads) {
    const int64_t nb = K / QK;
    const int super = layout == K4 || layout == K6; /* 256-weight super-blocks */
    if (nb > INT8_MAX_BLOCKS || (super && nb % 8 != 0) ||
        !(super || layout == U4 || layout == Z4 || layout == Z5 || layout == S8))
        return 1;
    if (M > INT8_TILE_ROWS) {
        if (layout != Z5) return 1;
        int8_t *xq;
        float *scales;
        if (int8rows_quantize(x, 0, M, K, 0, threads, &xq, &scales) != 0) return -2;
        float *dx = scales, *sx = scales + M * nb;
        /* sx transposed per group of 8 rows ([M / 8][nb][8], rows past M 0; 8 more: a tile of
         * the last group's rows 4-7 reads from lane 4) */
        const int64_t groups = (M + 7) / 8;
        float *sxt = calloc((size_t)(groups * 8 * nb + 8), sizeof(float));
        if (!sxt) {
            free(xq);
            free(scales);
            return -2;
        }
        for (int64_t r = 0; r < M; r++)
            for (int64_t b = 0; b < nb; b++) sxt[(r / 8) * 8 * nb + 8 * b + r % 8] = sx[r * nb + b];
        many_z5(xq, dx, sx, sxt, nb, M, w, N, bias, y, ldy, threads);
        free(sxt);
        free(xq);
        free(scales);
        return 0;
    }
    if (M > 1) {
        int8_t *xq;
        float *scales;
        if (int8rows_quantize(x, 0, M, K, layout == U4 || layout == Z4, 1, &xq, &scales) != 0)
            return -2;
        float *dx = scales, *sx = scales + M * nb;
        if (super) {
            if (layout == K4) ktiles_k4(xq, dx, sx, nb, M, w, N, bias, y, ldy, threads);
            else ktiles_k6(xq, dx, sx, nb, M, w, N, bias, y, ldy, threads);
            free(xq);
            free(scales);
            return 0;
        }
        /* [nb][8], rows past M 0; 8 more: the second 4-row tile of 8 rows reads from lane 4 */
        float *sxt = calloc((size_t)(8 * nb + 8), sizeof(float));
        if (!sxt) {
            free(xq);
            free(scales);
            return -2;
        }
        for (int64_t r = 0; r < M; r++)
            for (int64_t b = 0; b < nb; b++) sxt[8 * b + r] = sx[r * nb + b];
        switch (layout) {
        case U4: tiles_u4(xq, dx, sxt, nb, M, w, N, bias, y, ldy, threads); break;
        case Z4: tiles_z4(xq, dx, sxt, nb, M, w, N, bias, y, ldy, threads); break;
        case Z5: tiles_z5(xq, dx, sxt, nb, M, w, N, bias, y, ldy, threads); break;
        default: tiles_s8(xq, dx, sxt, nb, M, w, N, bias, y, ldy, threads); break;
        }
        free(sxt);
        free(xq);
        free(scales);
        return 0;
    }
    int8_t xq[INT8_MAX_BLOCKS * QK] __attribute__((aligned(64)));
    float dx[INT8_MAX_BLOCKS], sx[INT8_MAX_BLOCKS];
    quantize_x8(x, nb, layout == U4 || layout == Z4, xq, dx, sx);
    switch (layout) {
    case U4: int8_u4(xq, dx, sx, nb, w, N, bias, y, threads); break;
    case Z4: int8_z4(xq, dx, sx, nb, w, N, bias, y, threads); break;
    case Z5: int8_z5(xq, dx, sx, nb, w, N, bias, y, threads); break;
    case K4: int8_k4(xq, dx, sx, nb, w, N, bias, y, threads); break;
    case K6: int8_k6(xq, dx, sx, nb, w, N, bias, y, threads); break;
    default: int8_s8(xq, dx, sx, nb, w, N, bias, y, threads); break;
    }
    return 0;
}
#else
int int8rows_mm(int layout, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                const float *bias, float *y, int64_t ldy, int threads) {
    (void)layout, (void)x, (void)M, (void)K, (void)w, (void)N, (void)bias, (void)y, (void)ldy;
    (void)threads;
    return 1;
}
#endif

/* Whether this build has the int8 products (AVX-512 VNNI): 1 or 0. A layout or'ed with
 * INT8_ROWS runs its products of up to eight rows here where it has, on the float path
 * elsewhere. */
int stoic_int8_rows(void) {
#ifdef HAVE_INT8_ROWS
    return 1;
#else
    return 0;
#endif
}
