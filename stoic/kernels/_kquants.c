/* Products over GGML's K-quants (Q4_K, Q5_K, Q6_K) and the 5-bit Q5_0 and Q5_1 (what
 * llama-quantize writes instead of Q4_K where a matrix's width is not a multiple of 256: most
 * matrices of a Q4_K_M file of a model 576 or 896 wide), on the product loops of _blocks.h
 * (DEFINE_MM, DEFINE_MM16; the 16-lane readers of these layouts are there too, for
 * _bf16fixed.c). _qkernels.c's stoic_repack, stoic_qmm and stoic_dequantize call kquants_*.
 *
 * A K-quant row is made of 256-weight super-blocks (llama.cpp's ggml-quants.c, gguf-py's
 * gguf.quants):
 *   Q4_K (144 bytes): {fp16 d; fp16 dmin; u8 scales[12]; u8 qs[128]}
 *       8 sub-blocks of 32, each with a 6-bit scale sc and min mn (packed in the 12 bytes);
 *       w = (d * sc) * q - (dmin * mn), q the 4-bit value: sub-blocks 2c and 2c + 1 are the
 *       low and the high nibbles of qs[32c .. 32c + 31]
 *   Q5_K (176 bytes): {fp16 d; fp16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}
 *       as Q4_K with a fifth bit: bit j of qh[l] is the high bit of weight l of sub-block j
 *   Q6_K (210 bytes): {u8 ql[128]; u8 qh[64]; i8 scales[16]; fp16 d}
 *       16 sub-blocks of 16 with an int8 scale; w = (d * sc) * (q - 32), q 6 bits: weight
 *       128h + 32r + l (r < 4, l < 32) has its low 4 bits in nibble r / 2 of ql[64h + 32(r % 2) + l]
 *       and its high 2 in bits 2r, 2r + 1 of qh[32h + l]
 * Repacked once at load (kquants_repack) so that a sub-block costs fewer instructions: Q4_K's
 * sub-block scales and offsets as float32 (d * sc and -(dmin * mn), each exact), Q6_K's values
 * one signed byte each (q - 32) under float32 sub-block scales d * sc; Q5_K keeps its values
 * and gets float32 d, dmin and one byte a 6-bit scale and min (192, 184 and 320 bytes a
 * super-block: 1.33, 1.05 and 1.52x the file's).
 *   K4: {f32 s[8]; f32 m[8]; u8 qs[128]}                     w = s[j] * q + m[j]
 *   K5: {f32 d; f32 dmin; u8 sc[8]; u8 mn[8]; u8 qh[32]; u8 qs[128]}
 *   K6: {f32 s[16]; i8 q[256]}                               w = s[w / 16] * q[w]
 * Why the bytes: over the default model's Q4_K_M file (benchmarks/kquant_bench.py, one thread,
 * docs/benchmarks.md) the one-row products of ffn_down (Q4_K and Q6_K) took 0.45x the time of
 * the old layouts (152 and 212 bytes, which unpacked scales and 6-bit values per 32 weights:
 * as many scalar instructions as vector ones) and 0.86x at 32 rows; 1.13x at 8 rows, where the
 * extra bytes of K6 cost more than its unpacking saves.
 * Every 32 weights come out in order (no copy of x in another order, unlike U4 and Z4).
 *
 * Q5_0 (22 bytes): {fp16 d; u32 qh; u8 qs[16]}          w = (q - 16) * d
 * Q5_1 (24 bytes): {fp16 d; fp16 m; u32 qh; u8 qs[16]}  w = q * d + m
 *   weight l < 16: low nibble of qs[l], l >= 16: high nibble of qs[l - 16]; bit l of qh its
 *   fifth bit. Repacked with float32 d (and m): Z5 {f32 d; u32 ~qh; u8 qs[16]} (24 bytes: the
 *   fifth bits inverted, the lanes where 16 is subtracted), U5 {f32 d; f32 m; u32 qh; u8 qs[16]}
 *   (28 bytes).
 * d * sc and dmin * mn are exact in float32 (11 by at most 8 significant bits), so each weight is
 * rounded once, as gguf-py rounds it: the de-quantised weights are bitwise gguf-py's (hence
 * transformers'), and the products are the float32 product over them up to the order of the sums
 * (several rows: tiles of de-quantised weights; one row of Q4_K/Q5_K: the factored
 * s * sum(q x) + m * sum(x), as for Q4_1, Q4_K a super-block at a time; one row of Q6_K
 * multiplies the de-quantised weights; one row of Q5_0: d * sum((q - 16) x)).
 */
#include "_blocks.h"

int64_t kquants_repacked_bytes(int type) {
    switch (type) {
    case Q4_K: return K4_BYTES;
    case Q5_K: return K5_BYTES;
    case Q6_K: return K6_BYTES;
    case Q5_0: return Z5_BYTES;
    case Q5_1: return U5_BYTES;
    default: return 0;
    }
}

static int64_t kquant_block_bytes(int type) {
    switch (type) {
    case Q4_K: return Q4_K_BYTES;
    case Q5_K: return Q5_K_BYTES;
    case Q6_K: return Q6_K_BYTES;
    case Q5_0: return Q5_0_BYTES;
    case Q5_1: return Q5_1_BYTES;
    default: return 0;
    }
}

static int64_t kquant_block_weights(int type) { return type == Q5_0 || type == Q5_1 ? QK : QK_K; }

int kquants_repack(int type, const uint8_t *src, int64_t N, int64_t K, uint8_t *dst) {
    const int64_t in = kquant_block_bytes(type), out = kquants_repacked_bytes(type);
    if (!in || K % kquant_block_weights(type) != 0) return -1;
    for (int64_t i = 0; i < N * (K / kquant_block_weights(type)); i++) {
        const uint8_t *b = src + i * in;
        uint8_t *o = dst + i * out;
        if (type == Q5_0 || type == Q5_1) {
            const int64_t scales = type == Q5_1 ? 2 : 1;
            for (int64_t k = 0; k < scales; k++) {
                const float v = half_to_float(b + 2 * k);
                memcpy(o + 4 * k, &v, 4);
            }
            uint32_t qh;
            memcpy(&qh, b + 2 * scales, 4);
            if (type == Q5_0) qh = ~qh; /* Z5: the clear fifth bits (values16_5) */
            memcpy(o + 4 * scales, &qh, 4);
            memcpy(o + 4 * scales + 4, b + 2 * scales + 4, 16); /* qs */
        } else if (type == Q6_K) {
            const float d = half_to_float(b + 208);
            for (int j = 0; j < 16; j++) {
                const float s = d * (float)(int8_t)b[192 + j];
                memcpy(o + 4 * j, &s, 4);
            }
            for (int w = 0; w < QK_K; w++) { /* weight 128h + 32r + l */
                const int h = w >> 7, r = (w >> 5) & 3, l = w & 31;
                const int lo = (b[64 * h + 32 * (r & 1) + l] >> (4 * (r >> 1))) & 0x0F;
                const int hi = (b[128 + 32 * h + l] >> (2 * r)) & 0x03;
                o[64 + w] = (uint8_t)(int8_t)((lo | (hi << 4)) - 32);
            }
        } else if (type == Q4_K) {
            const float d = half_to_float(b), dmin = half_to_float(b + 2);
            uint8_t sc[8], mn[8];
            unpack_scales(b + 4, sc, mn);
            for (int j = 0; j < 8; j++) {
                const float s = d * (float)sc[j], m = -(dmin * (float)mn[j]);
                memcpy(o + 4 * j, &s, 4);
                memcpy(o + 32 + 4 * j, &m, 4);
            }
            memcpy(o + 64, b + 16, 128); /* qs */
        } else {
            const float d = half_to_float(b), dmin = half_to_float(b + 2);
            memcpy(o, &d, 4);
            memcpy(o + 4, &dmin, 4);
            unpack_scales(b + 4, o + 8, o + 16);
            memcpy(o + 24, b + 16, (size_t)(in - 16)); /* (qh and) qs */
        }
    }
    return 0;
}

/* ---- 8 lanes: the i-th 32 weights of a row, as integers (as floats) and their scale d and
 * offset m (w = q * d + m), or de-quantised */
static inline __m256 bits8(const uint8_t *p, __m128i shift, int mask) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_srl_epi32(v, shift), _mm256_set1_epi32(mask)));
}

static inline __m256 as_float8(__m256 bits) { return _mm256_cvtepi32_ps(_mm256_castps_si256(bits)); }

static inline void unpack_k4(const uint8_t *wr, int64_t i, __m256 q[4], float *d, float *m) {
    const uint8_t *b = wr + (i >> 3) * K4_BYTES;
    const int j = (int)(i & 7);
    memcpy(d, b + 4 * j, 4);
    memcpy(m, b + 32 + 4 * j, 4);
    const uint8_t *qs = b + 64 + 32 * (j >> 1);
    const __m128i shift = _mm_cvtsi32_si128(4 * (j & 1));
    for (int k = 0; k < 4; k++) q[k] = as_float8(bits8(qs + 8 * k, shift, 0x0F));
}

static inline void unpack_k5(const uint8_t *wr, int64_t i, __m256 q[4], float *d, float *m) {
    const uint8_t *b = wr + (i >> 3) * K5_BYTES;
    const int j = (int)(i & 7);
    scale_min(b, j, d, m);
    const uint8_t *qh = b + 24, *qs = b + 56 + 32 * (j >> 1);
    const __m128i shift = _mm_cvtsi32_si128(4 * (j & 1)), hshift = _mm_cvtsi32_si128(j);
    for (int k = 0; k < 4; k++) {
        const __m256i lo = _mm256_castps_si256(bits8(qs + 8 * k, shift, 0x0F));
        const __m256i hi = _mm256_castps_si256(bits8(qh + 8 * k, hshift, 0x01));
        q[k] = _mm256_cvtepi32_ps(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)));
    }
}

/* the 32 weights' 6-bit values minus 32, as floats, and the scales of their two halves */
static inline void values_k6(const uint8_t *wr, int64_t i, __m256 q[4], float s[2]) {
    const uint8_t *b = wr + (i >> 3) * K6_BYTES;
    const int j = (int)(i & 7);
    memcpy(s, b + 8 * j, 8);
    for (int k = 0; k < 4; k++)
        q[k] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 64 + 32 * j + 8 * k))));
}

static inline void dequant_k6(const uint8_t *wr, int64_t i, __m256 w[4]) {
    float s[2];
    values_k6(wr, i, w, s);
    for (int k = 0; k < 4; k++) w[k] = _mm256_mul_ps(w[k], _mm256_set1_ps(s[k >> 1]));
}

/* Q6_K has two scales in 32 weights: its one-row path multiplies the de-quantised weights */
static inline void unpack_k6(const uint8_t *wr, int64_t i, __m256 q[4], float *d, float *m) {
    dequant_k6(wr, i, q);
    *d = 1.0f;
    *m = 0.0f;
}

/* Q5_0/Q5_1: 32 5-bit values in order; `b` the repacked block, `at` its qh */
static inline void values_5(const uint8_t *at, __m256 q[4], int bias) {
    uint32_t qh;
    memcpy(&qh, at, 4);
    if (bias) qh = ~qh; /* Z5 holds the clear bits */
    const __m256i high = _mm256_set1_epi32((int)qh), lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i one = _mm256_set1_epi32(1), offset = _mm256_set1_epi32(bias);
    for (int k = 0; k < 4; k++) { /* weights 8k .. 8k + 7: nibble k / 2 of bytes 8 (k % 2) .. */
        const __m128i shift = _mm_cvtsi32_si128(4 * (k >> 1));
        const __m256i lo = _mm256_castps_si256(bits8(at + 4 + 8 * (k & 1), shift, 0x0F));
        const __m256i bit = _mm256_and_si256(
            _mm256_srlv_epi32(high, _mm256_add_epi32(lanes, _mm256_set1_epi32(8 * k))), one);
        q[k] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(bit, 4)), offset));
    }
}

static inline void unpack_z5(const uint8_t *wr, int64_t i, __m256 q[4], float *d, float *m) {
    const uint8_t *b = wr + i * Z5_BYTES;
    memcpy(d, b, 4);
    *m = 0.0f;
    values_5(b + 4, q, 16); /* (q - 16) * d: exact */
}

static inline void unpack_u5(const uint8_t *wr, int64_t i, __m256 q[4], float *d, float *m) {
    const uint8_t *b = wr + i * U5_BYTES;
    memcpy(d, b, 4);
    memcpy(m, b + 4, 4);
    values_5(b + 8, q, 0);
}

/* q * d + m: two roundings (no contraction), q * d exact, as gguf-py's (d * sc) * q - dmin * mn
 * (and Q5_1's d * q + m; Q5_0's m is 0: adding it changes nothing) */
#define DEFINE_DEQUANT(NAME, UNPACK)                                                           \
    static inline void NAME(const uint8_t *wr, int64_t i, __m256 w[4]) {                       \
        float d, m;                                                                            \
        UNPACK(wr, i, w, &d, &m);                                                              \
        const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);                           \
        for (int k = 0; k < 4; k++) w[k] = _mm256_add_ps(_mm256_mul_ps(w[k], dv), mv);          \
    }

DEFINE_DEQUANT(dequant_k4, unpack_k4)
DEFINE_DEQUANT(dequant_k5, unpack_k5)
DEFINE_DEQUANT(dequant_z5, unpack_z5)
DEFINE_DEQUANT(dequant_u5, unpack_u5)
DEFINE_ROW(row_k4, unpack_k4)
DEFINE_ROW(row_k5, unpack_k5)
DEFINE_ROW(row_k6, unpack_k6)
DEFINE_ROW(row_z5, unpack_z5)
DEFINE_ROW(row_u5, unpack_u5)
DEFINE_MM(mm_k4, K4_BYTES, dequant_k4, row_k4)
DEFINE_MM(mm_k5, K5_BYTES, dequant_k5, row_k5)
DEFINE_MM(mm_k6, K6_BYTES, dequant_k6, row_k6)
DEFINE_MM(mm_z5, 8 * Z5_BYTES, dequant_z5, row_z5)
DEFINE_MM(mm_u5, 8 * U5_BYTES, dequant_u5, row_u5)

#ifdef HAVE_AVX512
/* the K layouts take the 16-lane products up to this many rows of x, the 8-lane tiles above */
#define KQUANT_ROWS_16 (1 << 30)
/* ROWS rows of x by one weight row outside the fixed order: each row's two products of a block
 * go straight into its accumulator (two floating-point instructions a row and block where
 * DEFINE_TILE16, whose order the fixed order keeps, takes three) */
#define DEFINE_FAST_TILE16(NAME, DEQUANT, ROWS)                                                \
    static inline void NAME(const float *x, int64_t K, const uint8_t *wr, int64_t nb,         \
                            float *out, int64_t stride, float add) {                          \
        __m512 acc[ROWS];                                                                     \
        for (int t = 0; t < ROWS; t++) acc[t] = _mm512_setzero_ps();                          \
        for (int64_t b = 0; b < nb; b++) {                                                    \
            __m512 w[2];                                                                      \
            DEQUANT(wr, b, w);                                                                \
            for (int t = 0; t < ROWS; t++) {                                                  \
                const float *xr = x + t * K + b * QK;                                         \
                acc[t] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xr + 16),                      \
                                         _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xr), acc[t])); \
            }                                                                                 \
        }                                                                                     \
        for (int t = 0; t < ROWS; t++) out[t * stride] = _mm512_reduce_add_ps(acc[t]) + add;  \
    }

/* as DEFINE_MM16 (no permuted x: these layouts widen in order), one row of x by ROW (a
 * layout's own one-row loop), more rows by the 16-lane tiles at every M (kquants_mm: the
 * 8-lane ones' unpacking costs twice the instructions here), outside the fixed order the
 * DEFINE_FAST_TILE16 ones. The fixed order is DEFINE_MM16's: DEFINE_TILE16 for every M.
 * Tried and dropped: four weight rows a pass at one row of x (x loaded once for four rows):
 * 0.8x the time in one harness, 1.1-1.3x in another on the same matrices; and 16-row tiles
 * at 32 rows: 1.03-1.06x the 8-row ones. */
#define DEFINE_KMM16(NAME, BYTES_256, DEQUANT, ROW, OFFSET)                                    \
    DEFINE_TILE16(NAME##_1, DEQUANT, 1)                                                       \
    DEFINE_TILE16(NAME##_4, DEQUANT, 4)                                                       \
    DEFINE_TILE16(NAME##_8, DEQUANT, 8)                                                       \
    DEFINE_FAST_TILE16(NAME##_f4, DEQUANT, 4)                                                 \
    DEFINE_FAST_TILE16(NAME##_f8, DEQUANT, 8)                                                 \
    static int NAME(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,        \
                    const float *bias, float *y, int64_t ldy, int threads) {                  \
        const int64_t nb = K / QK, row_bytes = nb * (BYTES_256) / 8;                          \
        const int fixed = qkernels_fixed_order; /* this thread's: before the parallel region */ \
        if (M == 1 && nb <= MAX_ROW_BLOCKS && !fixed) {                                       \
            float sx[MAX_ROW_BLOCKS];                                                         \
            if (OFFSET) block_sums(x, nb, sx);                                                \
            _Pragma("omp parallel for schedule(static) num_threads(threads)")                 \
            for (int64_t n = 0; n < N; n++)                                                   \
                y[n] = ROW(x, sx, w + n * row_bytes, nb) + (bias ? bias[n] : 0.0f);           \
            return 0;                                                                         \
        }                                                                                     \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                     \
        for (int64_t n = 0; n < N; n++) {                                                     \
            const uint8_t *wr = w + n * row_bytes;                                            \
            const float add = bias ? bias[n] : 0.0f;                                          \
            int64_t r = 0;                                                                    \
            if (fixed) {                                                                      \
                for (; r + 8 <= M; r += 8) NAME##_8(x + r * K, K, wr, nb, y + r * ldy + n, ldy, add); \
                for (; r + 4 <= M; r += 4) NAME##_4(x + r * K, K, wr, nb, y + r * ldy + n, ldy, add); \
            } else {                                                                          \
                for (; r + 8 <= M; r += 8) NAME##_f8(x + r * K, K, wr, nb, y + r * ldy + n, ldy, add); \
                for (; r + 4 <= M; r += 4) NAME##_f4(x + r * K, K, wr, nb, y + r * ldy + n, ldy, add); \
            }                                                                                 \
            for (; r < M; r++) NAME##_1(x + r * K, K, wr, nb, y + r * ldy + n, ldy, add);     \
        }                                                                                     \
        return 0;                                                                             \
    }

/* One row of x by a K4 row, a super-block at a time: its eight float32 scales multiply the
 * sub-blocks' sums of q x, and its eight offsets meet the sub-blocks' sums of x in one 8-lane
 * product (the generic one-row loop spent as many scalar instructions finding a sub-block's
 * scale and offset as vector ones multiplying it). */
static inline float row16_k4(const float *x, const float *sx, const uint8_t *wr, int64_t nb) {
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    __m256 offset = _mm256_setzero_ps();
    const __m512i low = _mm512_set1_epi32(0x0F);
    for (int64_t sb = 0; sb < nb / 8; sb++) {
        const uint8_t *b = wr + sb * K4_BYTES;
        const float *xs = x + sb * QK_K;
        float s[8];
        memcpy(s, b, 32);
        offset = _mm256_fmadd_ps(_mm256_loadu_ps((const float *)(b + 32)), _mm256_loadu_ps(sx + 8 * sb), offset);
        for (int c = 0; c < 4; c++) { /* sub-blocks 2c (low nibbles) and 2c + 1 (high) */
            const uint8_t *qs = b + 64 + 32 * c;
            const __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
            const __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16)));
            const float *xc = xs + 64 * c;
            const __m512 p = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v1, low)), _mm512_loadu_ps(xc + 16),
                                             _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v0, low)), _mm512_loadu_ps(xc)));
            const __m512 r = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v1, 4)), _mm512_loadu_ps(xc + 48),
                                             _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v0, 4)), _mm512_loadu_ps(xc + 32)));
            acc[0] = _mm512_fmadd_ps(_mm512_set1_ps(s[2 * c]), p, acc[0]);
            acc[1] = _mm512_fmadd_ps(_mm512_set1_ps(s[2 * c + 1]), r, acc[1]);
        }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1])) + hsum(offset);
}

/* One row of x by a K6 row: 16 weights a register, de-quantised (one int8 widening and one
 * scale), two accumulators */
static inline float row16_k6(const float *x, const float *sx, const uint8_t *wr, int64_t nb) {
    (void)sx;
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t sb = 0; sb < nb / 8; sb++) {
        const uint8_t *b = wr + sb * K6_BYTES;
        const float *xs = x + sb * QK_K;
        float s[16];
        memcpy(s, b, 64);
        for (int j = 0; j < 16; j++) {
            const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 64 + 16 * j)));
            const __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(s[j]));
            acc[j & 1] = _mm512_fmadd_ps(w, _mm512_loadu_ps(xs + 16 * j), acc[j & 1]);
        }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
}

DEFINE_ROW16(row16_k5, unpack16_k5)
DEFINE_ROW16(row16_u5, unpack16_u5)
DEFINE_ROW16(row16_z5, unpack16_z5)

DEFINE_KMM16(mm16_k4, K4_BYTES, dequant16_k4, row16_k4, 1)
DEFINE_KMM16(mm16_k5, K5_BYTES, dequant16_k5, row16_k5, 1)
DEFINE_KMM16(mm16_k6, K6_BYTES, dequant16_k6, row16_k6, 0)
DEFINE_KMM16(mm16_z5, 8 * Z5_BYTES, dequant16_z5, row16_z5, 0)
DEFINE_KMM16(mm16_u5, 8 * U5_BYTES, dequant16_u5, row16_u5, 1)
#endif

int kquants_mm(int layout, const float *x, int64_t M, int64_t K, const uint8_t *w,
                     int64_t N, const float *bias, float *y, int64_t ldy, int threads) {
    if (K % (layout == Z5 || layout == U5 ? QK : QK_K) != 0) return -1;
#ifdef HAVE_AVX512
    if (M <= KQUANT_ROWS_16 || qkernels_fixed_order) switch (layout) {
    case K4: return mm16_k4(x, M, K, w, N, bias, y, ldy, threads);
    case K5: return mm16_k5(x, M, K, w, N, bias, y, ldy, threads);
    case K6: return mm16_k6(x, M, K, w, N, bias, y, ldy, threads);
    case Z5: return mm16_z5(x, M, K, w, N, bias, y, ldy, threads);
    case U5: return mm16_u5(x, M, K, w, N, bias, y, ldy, threads);
    default: return -1;
    }
#endif
    switch (layout) {
    case K4: mm_k4(x, M, K, w, N, bias, y, ldy, threads); return 0;
    case K5: mm_k5(x, M, K, w, N, bias, y, ldy, threads); return 0;
    case K6: mm_k6(x, M, K, w, N, bias, y, ldy, threads); return 0;
    case Z5: mm_z5(x, M, K, w, N, bias, y, ldy, threads); return 0;
    case U5: mm_u5(x, M, K, w, N, bias, y, ldy, threads); return 0;
    default: return -1;
    }
}

int kquants_dequantize(int type, const uint8_t *w, int64_t N, int64_t K, float *out) {
    const int64_t in = kquant_block_bytes(type), size = in ? kquant_block_weights(type) : 1;
    if (!in || K % size != 0) return -1;
    uint8_t packed[K6_BYTES]; /* the largest repacked block */
    for (int64_t i = 0; i < N * (K / size); i++) {
        kquants_repack(type, w + i * in, 1, size, packed);
        for (int j = 0; j < size / QK; j++) {
            __m256 v[4];
            switch (type) {
            case Q4_K: dequant_k4(packed, j, v); break;
            case Q5_K: dequant_k5(packed, j, v); break;
            case Q6_K: dequant_k6(packed, j, v); break;
            case Q5_0: dequant_z5(packed, j, v); break;
            default: dequant_u5(packed, j, v); break;
            }
            for (int k = 0; k < 4; k++) _mm256_storeu_ps(out + i * size + j * QK + 8 * k, v[k]);
        }
    }
    return 0;
}
