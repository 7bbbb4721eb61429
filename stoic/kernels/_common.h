/* What the kernel files share inside the library (its interface is stoic_kernels.h): what the
 * build has (HAVE_AVX512, HAVE_INT8_ROWS, HAVE_BF16), the SIMD helpers each file inlines
 * (half_to_float, hsum, hsum8, hmax, the exponential, the bfloat16 loads, the KV pools' loads),
 * and the functions and the per-thread flag one file uses from another: hidden (the library
 * does not export them), each named after the file that defines it. Each is defined once, here
 * or in that file; the repacked layouts' readers and the product loops are in _blocks.h.
 */
#ifndef STOIC_COMMON_H
#define STOIC_COMMON_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "stoic_kernels.h"

/* a function or variable of one file that another calls: not exported from the library */
#define STOIC_HIDDEN __attribute__((visibility("hidden")))

/* ---- What the build has (_build.py passes the flags for the CPU it runs on) */
/* AVX-512F: the 16-lane products, attention and operators */
#ifdef __AVX512F__
#define HAVE_AVX512 1
#endif
/* AVX-512 VNNI (with BW and VL): int8 activations (_int8rows.c, _gemm8.c) */
#if defined(HAVE_AVX512) && defined(__AVX512VNNI__) && defined(__AVX512VL__) &&                   \
    defined(__AVX512BW__)
#define HAVE_INT8_ROWS 1
#endif
/* AVX512_BF16: --deterministic's products in bfloat16 (_bf16fixed.c) */
#if defined(HAVE_AVX512) && defined(__AVX512BF16__)
#define HAVE_BF16 1
#endif

/* the K-quants' and the 5-bit types' layouts and GGML types (_kquants.c's) */
#define IS_KLAYOUT(t) ((t) >= K4 && (t) <= U5)
#define IS_KTYPE(t) ((t) == Q4_K || (t) == Q5_K || (t) == Q6_K || (t) == Q5_0 || (t) == Q5_1)

/* ---- SIMD helpers */
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

#ifdef HAVE_AVX512
/* a 16-lane vector's halves added, 8 lanes: lane j = a[j] + a[j + 8] (how a 16-lane dot
 * product meets hsum8, in attend16 and the rows kernel alike) */
static inline __m256 fold16(__m512 a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}
#endif

/* e^x, x clamped to [-87, 88] (Cephes' expf: range reduction by ln 2 in two parts, a degree-6
 * polynomial; within 2 ulp of expf): exp8 on 8 lanes, exp16 on 16. One text for both widths (V
 * the float vector, VI the integer one, P the intrinsics' prefix; ROUND and CAST the two whose
 * names differ otherwise), so each lane of exp16 is bitwise exp8's. */
#define STOIC_DEFINE_EXP(NAME, V, VI, P, ROUND, CAST)                                          \
    static inline V NAME(V x) {                                                                \
        /* operands in this order so that a NaN passes through (MAXPS/MINPS return the         \
         * second) */                                                                          \
        x = P##min_ps(P##set1_ps(88.0f), P##max_ps(P##set1_ps(-87.0f), x));                   \
        const V n = ROUND(P##mul_ps(x, P##set1_ps(1.44269504088896341f)),                      \
                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);                      \
        V r = P##fnmadd_ps(n, P##set1_ps(0.693359375f), x);                                    \
        r = P##fnmadd_ps(n, P##set1_ps(-2.12194440e-4f), r);                                   \
        V p = P##set1_ps(1.9875691500e-4f);                                                    \
        p = P##fmadd_ps(p, r, P##set1_ps(1.3981999507e-3f));                                   \
        p = P##fmadd_ps(p, r, P##set1_ps(8.3334519073e-3f));                                   \
        p = P##fmadd_ps(p, r, P##set1_ps(4.1665795894e-2f));                                   \
        p = P##fmadd_ps(p, r, P##set1_ps(1.6666665459e-1f));                                   \
        p = P##fmadd_ps(p, r, P##set1_ps(5.0000001201e-1f));                                   \
        p = P##fmadd_ps(p, P##mul_ps(r, r), P##add_ps(r, P##set1_ps(1.0f)));                   \
        /* 2^n in two factors: n reaches 127 at x = 88, one past the largest finite exponent */ \
        const VI ni = P##cvtps_epi32(n), half = P##srai_epi32(ni, 1);                          \
        const VI rest = P##sub_epi32(ni, half);                                                \
        const V a = CAST(P##slli_epi32(P##add_epi32(half, P##set1_epi32(127)), 23));           \
        const V b = CAST(P##slli_epi32(P##add_epi32(rest, P##set1_epi32(127)), 23));           \
        return P##mul_ps(P##mul_ps(p, a), b);                                                  \
    }

STOIC_DEFINE_EXP(exp8, __m256, __m256i, _mm256_, _mm256_round_ps, _mm256_castsi256_ps)

/* e^x for x <= 0 (softmax after subtracting the maximum), 0 below -87 */
static inline __m256 exp_nonpositive(__m256 x) {
    const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
    return _mm256_andnot_ps(under, exp8(x));
}

#ifdef HAVE_AVX512
STOIC_DEFINE_EXP(exp16, __m512, __m512i, _mm512_, _mm512_roundscale_ps, _mm512_castsi512_ps)

/* exp_nonpositive on 16 lanes (each lane bitwise exp_nonpositive's) */
static inline __m512 exp16_nonpositive(__m512 x) {
    const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
    return _mm512_maskz_mov_ps((__mmask16)~under, exp16(x));
}
#endif

/* ---- bfloat16: a float32's upper half, so a load widens exactly (a shift) */
static inline float bf16_to_float(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline __m256 bf16x8_load(const uint16_t *p) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

#ifdef HAVE_AVX512
static inline __m512 bf16x16_load(const uint16_t *p) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)(const void *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

/* ---- The KV pools: float32, or bfloat16 (--kv-cache-dtype; half the bytes the decode
 * attention streams, which bounds it). The kernels take `bf16` as a constant of each caller, so
 * each compiles twice. (A write rounds to nearest even, as torch's conversion does:
 * decode_layer_write_pools.) */
static inline float pool_float(const void *pool, int64_t at, int bf16) {
    if (!bf16) return ((const float *)pool)[at];
    return bf16_to_float(((const uint16_t *)pool)[at]);
}

static inline __m256 pool_load8(const void *pool, int64_t at, int bf16) {
    if (bf16) return bf16x8_load((const uint16_t *)pool + at);
    return _mm256_loadu_ps((const float *)pool + at);
}

#ifdef HAVE_AVX512
static inline __m512 pool_load16(const void *pool, int64_t at, int bf16) {
    if (bf16) return bf16x16_load((const uint16_t *)pool + at);
    return _mm512_loadu_ps((const float *)pool + at);
}
#endif

/* ---- Between the files: defined in the file each is named after */

/* _qkernels.c: whether the calling thread's product runs in the fixed order (FIXED_ORDER): set
 * by stoic_qmm for the call, read by each product (and _kquants.c's) before its parallel
 * region */
STOIC_HIDDEN extern _Thread_local int qkernels_fixed_order;

/* _kquants.c: the K-quants' and the 5-bit types' repacking, products and de-quantisation,
 * as stoic_repacked_bytes, stoic_repack, stoic_qmm (row stride ldy) and stoic_dequantize */
STOIC_HIDDEN int64_t kquants_repacked_bytes(int type);
STOIC_HIDDEN int kquants_repack(int type, const uint8_t *src, int64_t N, int64_t K, uint8_t *dst);
STOIC_HIDDEN int kquants_mm(int layout, const float *x, int64_t M, int64_t K, const uint8_t *w,
                            int64_t N, const float *bias, float *y, int64_t ldy, int threads);
STOIC_HIDDEN int kquants_dequantize(int type, const uint8_t *w, int64_t N, int64_t K,
                                    float *out);

/* _int8rows.c: a product of up to eight rows with int8 activations: 0, or 1 where the build or
 * the layout has none (the float path then runs) */
STOIC_HIDDEN int int8rows_mm(int layout, const float *x, int64_t M, int64_t K, const uint8_t *w,
                             int64_t N, const float *bias, float *y, int64_t ldy, int threads);
#ifdef HAVE_INT8_ROWS
/* _int8rows.c: M rows of x (float32, or bfloat16 with x_bf16) quantised to int8 per block of
 * 32: xq [M][K] and scales (dx [M][nb] then sx [M][nb]) allocated there (the caller frees
 * both); 0, or -2 where they cannot be */
STOIC_HIDDEN int int8rows_quantize(const void *x, int x_bf16, int64_t M, int64_t K, int permuted,
                                   int threads, int8_t **xq, float **scales);
#endif

/* _gemm8.c: stoic_g8_mm with a row stride ldy; 1 where the build has no VNNI */
STOIC_HIDDEN int gemm8_mm(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *w,
                          int64_t N, int layout, const float *bias, const float *residual,
                          void *y, int y_bf16, int64_t ldy, int threads);

/* _bf16fixed.c: the bfloat16 fixed-order product for the descriptor `desc` (BF16FIXED) */
STOIC_HIDDEN int bf16fixed_mm(const int64_t *desc, const float *x, int64_t M, int64_t K,
                              int64_t N, const float *bias, float *y, int64_t ldy, int threads);

/* _decode_layer.c: scores[0, len) := e^(scores - top), padded to a multiple of 8 with zeros;
 * returns their sum (8 lanes at a time) */
STOIC_HIDDEN float decode_layer_softmax_numerators(float *scores, int64_t len, float top);
/* _decode_layer.c: the M tokens' k and v [M, kv_heads, dh] into the pools (float32, or
 * bfloat16 with `bf16`): row write[h * M + m] of kv head h */
STOIC_HIDDEN void decode_layer_write_pools(const float *k, const float *v, void *k_pool,
                                           void *v_pool, const int64_t *write, int64_t M,
                                           int64_t kv_heads, int64_t dh, int bf16);

#endif
