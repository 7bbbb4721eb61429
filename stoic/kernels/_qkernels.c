/* stoic's matrix products over GGML-quantised weights, for x86-64 CPUs with AVX2, FMA and F16C
 * (and 16-lane variants where the build has AVX-512F: HAVE_AVX512), and what every product goes
 * through: the repacking (stoic_repack), the dispatch on the layout (stoic_qmm) and the fixed
 * order's per-thread flag.
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
 * takes up to eight rows of x quantised to int8 instead where the build has AVX-512 VNNI
 * (_int8rows.c: not the float product; its numerics are stated there).
 * The K-quants (Q4_K, Q5_K, Q6_K: 256-weight super-blocks) and Q5_0/Q5_1 are in _kquants.c, on
 * the same loops (_blocks.h: DEFINE_MM, DEFINE_MM16); a matrix stacked from parts of different
 * types (a fused projection of a mixed file) is the MIXED layout. The layouts (S8, U4, Z4 here)
 * are described in _blocks.h with their bytes.
 */
#include "_blocks.h"

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

/* The fixed order (--deterministic): a layout or'ed with FIXED_ORDER computes every row of y
 * in one order whatever M is, so a row's result is bitwise the same alone or in any batch: the
 * tiles only (no one-row factored routine, no alternating accumulators), and where AVX-512 is
 * built its 16-lane tiles for every M (not the 8-lane ones above MAX_ROWS_16). The flag reaches
 * the products (and _kquants.c's) through `qkernels_fixed_order`, set by qmm_into for the
 * calling thread and read by each product before its parallel region. */
_Thread_local int qkernels_fixed_order;
/* int8 activations for products of up to eight rows (the default mode's fast dtype;
 * _int8rows.c): a layout or'ed with INT8_ROWS sets `int8_rows` for the calling thread as
 * FIXED_ORDER sets qkernels_fixed_order; the fixed order wins where both are set */
#define INT8_MAX_ROWS 8 /* steps of up to this many rows (_int8rows.c: one, or tiles of 2-8) */
static _Thread_local int int8_rows;

/* the one-row loops' readers (DEFINE_ROW, _blocks.h) */
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

DEFINE_ROW(row_u4, unpack_u4)
DEFINE_ROW(row_z4, unpack_z4)
DEFINE_ROW(row_s8, unpack_s8)

DEFINE_MM(mm_s8, 8 * S8_BYTES, dequant_s8, row_s8)
DEFINE_MM(mm_u4, 8 * U4_BYTES, dequant_u4, row_u4)
DEFINE_MM(mm_z4, 8 * Z4_BYTES, dequant_z4, row_z4)

#ifdef HAVE_AVX512
/* more rows take the 8-lane tiles: over the default model's matrices the 16-lane ones took
 * 0.65x the time at 1 row, 0.68x at 4, 0.78x at 8, 0.94x at 16 and 1.11x at 32 */
#define MAX_ROWS_16 16

DEFINE_MM16(mm16_s8, 8 * S8_BYTES, dequant16_s8, unpack16_s8, 0)
DEFINE_MM16(mm16_u4, 8 * U4_BYTES, dequant16_u4, unpack16_u4, 1)
DEFINE_MM16(mm16_z4, 8 * Z4_BYTES, dequant16_z4, unpack16_z4, 1)
#endif

/* The repacked size of one block of GGML type `type` (32 weights; 256 for a K-quant), 0 for a
 * type the kernels do not know. */
int64_t stoic_repacked_bytes(int type) {
    if (IS_KTYPE(type)) return kquants_repacked_bytes(type);
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
    if (IS_KTYPE(type)) return kquants_repack(type, src, N, K, dst);
    if (K % QK != 0 || !stoic_repacked_bytes(type)) return -1;
    const int64_t blocks = N * (K / QK);
    for (int64_t i = 0; i < blocks; i++) {
        if (type == Q4_1) {
            const uint8_t *b = src + i * Q4_1_BYTES;
            uint8_t *o = dst + i * U4_BYTES;
            const float d = half_to_float(b), m = half_to_float(b + 2);
            memcpy(o, &d, 4);
            memcpy(o + 4, &m, 4);
            reorder_nibbles(b + 4, o + 8);
        } else if (type == Q4_0) {
            const uint8_t *b = src + i * Q4_0_BYTES;
            uint8_t *o = dst + i * Z4_BYTES;
            const float d = half_to_float(b);
            memcpy(o, &d, 4);
            reorder_nibbles(b + 2, o + 4);
        } else {
            const uint8_t *b = src + i * Q8_0_BYTES;
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
 * activations for up to eight rows while an INT8_ROWS one does) */
static int qmm_into(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                    const float *bias, float *y, int64_t ldy, int threads) {
    const int before = qkernels_fixed_order, before8 = int8_rows;
    qkernels_fixed_order = before || (type & FIXED_ORDER);
    int8_rows = before8 || (type & INT8_ROWS);
    const int rc = qmm_dispatch(type & ~(FIXED_ORDER | INT8_ROWS), x, M, K, w, N, bias, y, ldy,
                                threads);
    qkernels_fixed_order = before;
    int8_rows = before8;
    return rc;
}

static int qmm_dispatch(int type, const float *x, int64_t M, int64_t K, const uint8_t *w,
                        int64_t N, const float *bias, float *y, int64_t ldy, int threads) {
    if (K % QK != 0 || M < 0 || N < 0) return -1;
    if (type >= G8 && type <= G8 + G8_NIBBLES + G8_SUPER) {
        const int rc = gemm8_mm(x, 0, M, K, w, N, type, bias, NULL, y, 0, ldy, threads);
        return rc == 1 ? -1 : rc;
    }
    if (type == BF16FIXED)
        return bf16fixed_mm((const int64_t *)w, x, M, K, N, bias, y, ldy, threads);
    if (type == MIXED) return qmm_mixed(x, M, K, (const int64_t *)w, N, bias, y, ldy, threads);
    if (M >= 1 && int8_rows && !qkernels_fixed_order) {
        const int rc = int8rows_mm(type, x, M, K, w, N, bias, y, ldy, threads);
        if (rc != 1) return rc;
    }
    if (IS_KLAYOUT(type)) return kquants_mm(type, x, M, K, w, N, bias, y, ldy, threads);
#ifdef HAVE_AVX512
    if (M <= MAX_ROWS_16 || qkernels_fixed_order) switch (type) {
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
    if (IS_KTYPE(type)) return kquants_dequantize(type, w, N, K, out);
    const int64_t bytes = type == Q4_0   ? Q4_0_BYTES
                          : type == Q4_1 ? Q4_1_BYTES
                          : type == Q8_0 ? Q8_0_BYTES
                                         : 0;
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
