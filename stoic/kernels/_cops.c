/* The elementwise operators around a bfloat16 prefill's matrix products, one pass each.
 *
 * With `--dtype auto`'s precision split (float32 residual stream and norms, bfloat16 products
 * and the values between them) a prefill step of 243 tokens spent ~30 of its ~100 ms outside
 * the products and attention: RMSNorm as six torch operators plus a conversion to bfloat16, the
 * rotary embedding as five (a concatenation, a negation, two products, a sum), SiLU and the
 * product with `up` as two. Each is one pass here, over rows in parallel (OpenMP, the libgomp
 * torch loads). Arithmetic is float32, rounded once to bfloat16 (round to nearest even, as
 * torch's conversion): results differ from torch's by bfloat16 rounding where torch rounds an
 * intermediate too. AVX2 and FMA, AVX-512F where the build has it (HAVE_AVX512; the exponential
 * and the bfloat16 loads are _common.h's). Called by _cops.py.
 */
#include "_common.h"

/* round to nearest even, NaN kept quiet; 8 floats to 8 bfloat16 */
static inline void bf16x8_store(uint16_t *p, __m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan);
    r = _mm256_srli_epi32(r, 16);
    _mm_storeu_si128((__m128i *)p,
                     _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return (uint16_t)((u | 0x400000u) >> 16);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* out[m] = bfloat16(w * (x[m] * rsqrt(mean(x[m]^2) + eps))), x float32 [M, D] (transformers'
 * LlamaRMSNorm, then the conversion the next product's input needs) */
int stoic_rms_norm_bf16(const float *x, int64_t M, int64_t D, const float *w, float eps,
                        uint16_t *out, int threads) {
    if (D % 8 != 0) return -1;
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * D;
        uint16_t *o = out + m * D;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < D; i += 8) {
            const __m256 v = _mm256_loadu_ps(xr + i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        const __m256 r = _mm256_set1_ps(1.0f / sqrtf(hsum(acc) / (float)D + eps));
        for (int64_t i = 0; i < D; i += 8)
            bf16x8_store(o + i, _mm256_mul_ps(_mm256_loadu_ps(w + i),
                                              _mm256_mul_ps(_mm256_loadu_ps(xr + i), r)));
    }
    return 0;
}

/* The rotary embedding in place on the first `heads` heads of each of N rows of y (bfloat16,
 * rows `stride` apart, heads of dh values): v * cos + rotate_half(v) * sin, cos/sin float32
 * [N, dh] */
int stoic_rope_bf16(uint16_t *y, int64_t N, int64_t stride, int64_t heads, int64_t dh,
                    const float *cos, const float *sin, int threads) {
    const int64_t half = dh / 2;
    if (half % 8 != 0) return -1;
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int64_t n = 0; n < N; n++) {
        const float *c = cos + n * dh, *s = sin + n * dh;
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *v = y + n * stride + h * dh;
            for (int64_t i = 0; i < half; i += 8) {
                const __m256 a = bf16x8_load(v + i), b = bf16x8_load(v + half + i);
                const __m256 lo = _mm256_sub_ps(_mm256_mul_ps(a, _mm256_loadu_ps(c + i)),
                                                _mm256_mul_ps(b, _mm256_loadu_ps(s + i)));
                const __m256 hi = _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(c + half + i)),
                                                _mm256_mul_ps(a, _mm256_loadu_ps(s + half + i)));
                bf16x8_store(v + i, lo);
                bf16x8_store(v + half + i, hi);
            }
        }
    }
    return 0;
}

#ifdef HAVE_AVX512
/* 16-lane forms of the above (AVX-512F; the build defines HAVE_AVX512 where it has it): SiLU's
 * exponential is the operator's whole cost, and torch's own runs 16 lanes wide there */
static inline void bf16x16_store(uint16_t *p, __m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
}
#endif

/* out[m, i] = bfloat16(silu(gate[m, i]) * up[m, i]) for M rows of F (gate, up bfloat16, their
 * rows `gs` and `us` apart; out contiguous) */
int stoic_silu_mul_bf16(const uint16_t *gate, int64_t gs, const uint16_t *up, int64_t us,
                        int64_t M, int64_t F, uint16_t *out, int threads) {
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *g = gate + m * gs, *u = up + m * us;
        uint16_t *o = out + m * F;
        int64_t i = 0;
#ifdef HAVE_AVX512
        for (; i + 16 <= F; i += 16) {
            const __m512 gv = bf16x16_load(g + i);
            const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
            /* g / (1 + e) as g times a reciprocal: 14-bit estimate, one Newton step (~28 bits,
             * below bfloat16's rounding; a division took most of the loop's time) */
            const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.0f), e);
            __m512 inv = _mm512_rcp14_ps(d);
            inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(d, inv, _mm512_set1_ps(2.0f)));
            const __m512 silu = _mm512_mul_ps(gv, inv);
            bf16x16_store(o + i, _mm512_mul_ps(silu, bf16x16_load(u + i)));
        }
#endif
        for (; i + 8 <= F; i += 8) {
            const __m256 gv = bf16x8_load(g + i);
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            const __m256 d = _mm256_add_ps(_mm256_set1_ps(1.0f), e);
            __m256 inv = _mm256_rcp_ps(d); /* 12-bit estimate, one Newton step: ~23 bits */
            inv = _mm256_mul_ps(inv, _mm256_fnmadd_ps(d, inv, _mm256_set1_ps(2.0f)));
            const __m256 silu = _mm256_mul_ps(gv, inv);
            bf16x8_store(o + i, _mm256_mul_ps(silu, bf16x8_load(u + i)));
        }
        for (; i < F; i++) {
            const float gv = bf16_to_float(g[i]);
            o[i] = bf16_round(gv / (1.0f + expf(-gv)) * bf16_to_float(u[i]));
        }
    }
    return 0;
}
