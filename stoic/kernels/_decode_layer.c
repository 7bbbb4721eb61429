/* One decoder layer of a decode step (Llama: RMSNorm, rotary, grouped-query attention over the
 * paged cache, gated SiLU MLP), for steps where every projection runs on repacked blocks
 * (stoic_qmm). Three calls a layer (stoic_layer_pre, stoic_decode_attention, stoic_layer_post)
 * replace ~40 torch operators, whose dispatch, not arithmetic, was half of a one-sequence step.
 * float32 throughout; the same formulas as transformers' Llama, so the results differ from the
 * torch path's by float32 rounding only. The decode attention here (attend8, attend16) is also
 * the reference order of _rows_attention.c, which shares its softmax and pool writes.
 * Called by stoic/model/_cdecode.py.
 */
#include "_common.h"

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

/* scores[0, len) := e^(scores - top), padded to a multiple of 8 with zeros; returns their
 * sum (8 lanes at a time) */
float decode_layer_softmax_numerators(float *scores, int64_t len, float top) {
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
        const float total = decode_layer_softmax_numerators(scores, len, top);
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
                    part[g][j] = fold16(a);
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
            total[g] = decode_layer_softmax_numerators(scores + g * width, len, top[g]);
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
void decode_layer_write_pools(const float *k, const float *v, void *k_pool, void *v_pool,
                              const int64_t *write, int64_t M, int64_t kv_heads, int64_t dh,
                              int bf16) {
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
    decode_layer_write_pools(k, v, k_pool, v_pool, write, M, kv_heads, dh, kv_bf16);
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
