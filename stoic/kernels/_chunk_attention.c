/* Prompt chunks' attention in the default mode: the chunk's queries against its sequence's keys
 * and values where they lie in the paged pools (on _common.h's exp16_nonpositive, pool_float
 * and pool_load16). Called by stoic/model/_cattention.py.
 *
 * What it replaces: torch's SDPA over the chunk (its keys gathered from the pools first when
 * the chunk does not start at position 0). On the CPU, SDPA's flash kernel takes a tile of 512
 * keys, so a causal chunk of a few hundred tokens computes every score above the diagonal too,
 * and bfloat16 queries run at its slower converted path: 1.2-1.3 ms a layer for a 225-token
 * chunk of 9 query heads over 3 (2 threads), a sixth of a prefill step of the fused path
 * (docs/benchmarks.md, "Prompt attention in C").
 *
 * A job is one kv head and CA_ROWS consecutive rows of the chunk with all the query heads that
 * share the kv head. Its scores are computed 16 keys at a time, one 16-lane vector per query
 * (no horizontal sum): the keys are first transposed, per kv head and tile of 16 keys, into
 * kt[tile][d][16], once for all the jobs of the head; a job then multiplies CA_GROUP queries at
 * a time, each load of 16 keys' d-th values feeding CA_GROUP multiply-adds. Only the tiles a
 * row can see are computed (keys past a row's position masked to -inf in the tile it ends in).
 * Then exact softmax numerators (the row's maximum first, e^(s - max) 16 lanes at a time) and
 * one pass over the values, 4 queries at a time for a head dimension of 64 (each value row read
 * once for 4 queries).
 *
 * float32 arithmetic (a bfloat16 pool's keys and values widened exactly); results differ from
 * SDPA's by float32 rounding (tests/model/test_chunk_attention.py). Needs AVX-512 (returns 1 without: the caller keeps SDPA). */
#include "_common.h"

#define CA_ROWS 16  /* chunk rows a job */
#define CA_GROUP 8  /* queries sharing one load of keys in the scores */
#define CA_TILE 16  /* keys a tile */

#ifdef HAVE_AVX512
/* the keys 0..len-1 of one kv head (pool rows table[0..]; bfloat16 with `bf16`) into
 * kt[tile][d][16] as float32, zeros past len */
static void ca_transpose(const void *k_pool, const int64_t *table, int64_t block, int64_t len,
                         int64_t dh, float *kt, int bf16) {
    const int64_t tiles = (len + CA_TILE - 1) / CA_TILE;
    for (int64_t tile = 0; tile < tiles; tile++) {
        float *dst = kt + tile * dh * CA_TILE;
        for (int64_t j = 0; j < CA_TILE; j++) {
            const int64_t t = tile * CA_TILE + j;
            if (t >= len) {
                for (int64_t d = 0; d < dh; d++) dst[d * CA_TILE + j] = 0.0f;
                continue;
            }
            const int64_t at = (table[t / block] * block + t % block) * dh;
            for (int64_t d = 0; d < dh; d++) dst[d * CA_TILE + j] = pool_float(k_pool, at + d, bf16);
        }
    }
}

/* scores[qi][0, width) of `count` queries (scaled, qs [count][dh]) whose last keys are lens[qi]
 * - 1: every tile up to the queries' longest, keys at or past a query's length -inf */
static void ca_scores(const float *qs, int64_t count, const int64_t *lens, const float *kt,
                      int64_t dh, int64_t width, float *scores) {
    for (int64_t q0 = 0; q0 < count; q0 += CA_GROUP) {
        const int64_t g = count - q0 < CA_GROUP ? count - q0 : CA_GROUP;
        int64_t longest = 0;
        for (int64_t j = 0; j < g; j++) longest = lens[q0 + j] > longest ? lens[q0 + j] : longest;
        for (int64_t t0 = 0; t0 < longest; t0 += CA_TILE) {
            const float *kv = kt + (t0 / CA_TILE) * dh * CA_TILE;
            __m512 acc[CA_GROUP];
            for (int j = 0; j < CA_GROUP; j++) acc[j] = _mm512_setzero_ps();
            if (g == CA_GROUP) {
                for (int64_t d = 0; d < dh; d++) {
                    const __m512 k = _mm512_loadu_ps(kv + d * CA_TILE);
                    for (int j = 0; j < CA_GROUP; j++)
                        acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(qs[(q0 + j) * dh + d]), k, acc[j]);
                }
            } else {
                for (int64_t d = 0; d < dh; d++) {
                    const __m512 k = _mm512_loadu_ps(kv + d * CA_TILE);
                    for (int64_t j = 0; j < g; j++)
                        acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(qs[(q0 + j) * dh + d]), k, acc[j]);
                }
            }
            for (int64_t j = 0; j < g; j++) {
                const int64_t left = lens[q0 + j] - t0;
                const __mmask16 seen =
                    left >= CA_TILE ? (__mmask16)0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
                _mm512_storeu_ps(scores + (q0 + j) * width + t0,
                                 _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), seen, acc[j]));
            }
        }
        for (int64_t j = 0; j < g; j++) /* tiles no query of the group reached */
            for (int64_t t = (longest + CA_TILE - 1) / CA_TILE * CA_TILE; t < width; t++)
                scores[(q0 + j) * width + t] = -INFINITY;
    }
}

/* a row of scores [0, width) := e^(s - max); returns their sum */
static float ca_numerators(float *s, int64_t width) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < width; t += CA_TILE) top = _mm512_max_ps(top, _mm512_loadu_ps(s + t));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 total = _mm512_setzero_ps();
    for (int64_t t = 0; t < width; t += CA_TILE) {
        const __m512 e = exp16_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + t), m));
        _mm512_storeu_ps(s + t, e);
        total = _mm512_add_ps(total, e);
    }
    return _mm512_reduce_add_ps(total);
}

/* out[qi] = sum_t p[qi][t] v_t / totals[qi] for `count` queries, keys up to lens[qi]; LANES
 * 16-float vectors a head (a constant where inlined), G queries a pass over the values, a
 * bfloat16 pool with `bf16` (a constant too) */
static inline __attribute__((always_inline)) void
ca_values(const int LANES, const int G, const float *p, int64_t count, const int64_t *lens,
          const float *totals, const void *v_pool, const int64_t *table, int64_t block,
          int64_t dh, int64_t width, float *const *outs, const int bf16) {
    for (int64_t q0 = 0; q0 < count; q0 += G) {
        const int64_t g = count - q0 < G ? count - q0 : G;
        int64_t longest = 0;
        for (int64_t j = 0; j < g; j++) longest = lens[q0 + j] > longest ? lens[q0 + j] : longest;
        __m512 acc[4][8]; /* G <= 4 queries of LANES <= 8 vectors: (4, 4) and (2, 8) */
        for (int j = 0; j < G; j++)
            for (int i = 0; i < LANES; i++) acc[j][i] = _mm512_setzero_ps();
        for (int64_t t = 0; t < longest; t++) {
            const int64_t vp = (table[t / block] * block + t % block) * dh;
            __m512 v[8];
            for (int i = 0; i < LANES; i++) v[i] = pool_load16(v_pool, vp + 16 * i, bf16);
            for (int j = 0; j < G; j++) {
                if (j >= g) break;
                const __m512 pj = _mm512_set1_ps(p[(q0 + j) * width + t]);
                for (int i = 0; i < LANES; i++) acc[j][i] = _mm512_fmadd_ps(pj, v[i], acc[j][i]);
            }
        }
        for (int64_t j = 0; j < g; j++) {
            const __m512 inv = _mm512_set1_ps(totals[q0 + j]);
            for (int i = 0; i < LANES; i++)
                _mm512_storeu_ps(outs[q0 + j] + 16 * i, _mm512_div_ps(acc[j][i], inv));
        }
    }
}

/* any head dimension (a multiple of 16 up to MAX_HEAD_DIM): one query a pass */
static void ca_values_any(const float *p, int64_t count, const int64_t *lens, const float *totals,
                          const void *v_pool, const int64_t *table, int64_t block, int64_t dh,
                          int64_t width, float *const *outs, int bf16) {
    const int64_t lanes = dh / 16;
    for (int64_t qi = 0; qi < count; qi++) {
        __m512 acc[MAX_HEAD_DIM / 16];
        for (int64_t i = 0; i < lanes; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t t = 0; t < lens[qi]; t++) {
            const int64_t vp = (table[t / block] * block + t % block) * dh;
            const __m512 pj = _mm512_set1_ps(p[qi * width + t]);
            for (int64_t i = 0; i < lanes; i++)
                acc[i] = _mm512_fmadd_ps(pj, pool_load16(v_pool, vp + 16 * i, bf16), acc[i]);
        }
        const __m512 inv = _mm512_set1_ps(totals[qi]);
        for (int64_t i = 0; i < lanes; i++)
            _mm512_storeu_ps(outs[qi] + 16 * i, _mm512_div_ps(acc[i], inv));
    }
}

/* one job: rows [r0, r0 + rows) of the chunk, kv head h and its `group` query heads */
static int ca_job(const float *q, const float *kt, const void *v_pool, const int64_t *table,
                  int64_t start_pos, int64_t r0, int64_t rows, int64_t h, int64_t heads,
                  int64_t group, int64_t dh, int64_t block, float scale, float *out, int bf16) {
    const int64_t count = rows * group, longest = start_pos + r0 + rows;
    const int64_t width = (longest + CA_TILE - 1) / CA_TILE * CA_TILE;
    float *qs = malloc(sizeof(float) * (size_t)(count * dh));
    float *scores = malloc(sizeof(float) * (size_t)(count * width));
    float *totals = malloc(sizeof(float) * (size_t)count);
    int64_t *lens = malloc(sizeof(int64_t) * (size_t)count);
    float **outs = malloc(sizeof(float *) * (size_t)count);
    if (!qs || !scores || !totals || !lens || !outs) {
        free(qs), free(scores), free(totals), free(lens), free(outs);
        return -2;
    }
    /* queries ordered row by row, the heads of a row together */
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < group; g++) {
            const int64_t qi = r * group + g, off = ((r0 + r) * heads + h * group + g) * dh;
            for (int64_t d = 0; d < dh; d++) qs[qi * dh + d] = q[off + d] * scale;
            lens[qi] = start_pos + r0 + r + 1;
            outs[qi] = out + off;
        }
    ca_scores(qs, count, lens, kt, dh, width, scores);
    for (int64_t qi = 0; qi < count; qi++) totals[qi] = ca_numerators(scores + qi * width, width);
    if (dh == 64 && bf16)
        ca_values(4, 4, scores, count, lens, totals, v_pool, table, block, dh, width, outs, 1);
    else if (dh == 64)
        ca_values(4, 4, scores, count, lens, totals, v_pool, table, block, dh, width, outs, 0);
    else if (dh == 128 && bf16)
        ca_values(8, 2, scores, count, lens, totals, v_pool, table, block, dh, width, outs, 1);
    else if (dh == 128)
        ca_values(8, 2, scores, count, lens, totals, v_pool, table, block, dh, width, outs, 0);
    else
        ca_values_any(scores, count, lens, totals, v_pool, table, block, dh, width, outs, bf16);
    free(qs), free(scores), free(totals), free(lens), free(outs);
    return 0;
}
#endif

/* The causal attention of a prompt chunk of n rows at positions start_pos.. of one sequence:
 * q [n, heads, dh] float32, out likewise; row r attends the sequence's keys and values 0 ..
 * start_pos + r, which lie (already written) in the pools (each [rows, block, dh]): key t of kv
 * head g at pool row table[g * nblocks + t / block], offset t % block. Query head i reads kv
 * head i / (heads / kv_heads). The pools are float32, or bfloat16 with `kv_bf16`. Returns 0; 1
 * where this build has no AVX-512 (nothing computed); -1 for shapes it does not take (dh not a multiple of 16 or over MAX_HEAD_DIM,
 * heads not a multiple of kv_heads, the table too short); -2 out of memory. */
int stoic_chunk_attention(const float *q, const void *k_pool, const void *v_pool,
                          const int64_t *table, int64_t nblocks, int64_t start_pos, int64_t n,
                          int64_t heads, int64_t kv_heads, int64_t dh, int64_t block, float scale,
                          float *out, int threads, int kv_bf16) {
#ifdef HAVE_AVX512
    if (dh % 16 || dh > MAX_HEAD_DIM || kv_heads <= 0 || heads % kv_heads || n < 0 ||
        start_pos < 0 || block <= 0 || nblocks * block < start_pos + n)
        return -1;
    if (n == 0) return 0;
    const int64_t len = start_pos + n, tiles = (len + CA_TILE - 1) / CA_TILE;
    const int64_t group = heads / kv_heads, jobs_per_head = (n + CA_ROWS - 1) / CA_ROWS;
    float *kt = malloc(sizeof(float) * (size_t)(kv_heads * tiles * dh * CA_TILE));
    if (!kt) return -2;
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int64_t h = 0; h < kv_heads; h++)
        ca_transpose(k_pool, table + h * nblocks, block, len, dh, kt + h * tiles * dh * CA_TILE,
                     kv_bf16);
    int failed = 0;
    /* the longest rows (last jobs) first: dynamic scheduling then evens out the threads */
    _Pragma("omp parallel for schedule(dynamic) num_threads(threads) reduction(|:failed)")
    for (int64_t j = 0; j < kv_heads * jobs_per_head; j++) {
        const int64_t h = j % kv_heads, tile = jobs_per_head - 1 - j / kv_heads;
        const int64_t r0 = tile * CA_ROWS, rows = n - r0 < CA_ROWS ? n - r0 : CA_ROWS;
        failed |= ca_job(q, kt + h * tiles * dh * CA_TILE, v_pool, table + h * nblocks, start_pos,
                         r0, rows, h, heads, group, dh, block, scale, out, kv_bf16) != 0;
    }
    free(kt);
    return failed ? -2 : 0;
#else
    (void)q, (void)k_pool, (void)v_pool, (void)table, (void)nblocks, (void)start_pos, (void)n;
    (void)heads, (void)kv_heads, (void)dh, (void)block, (void)scale, (void)out, (void)threads;
    (void)kv_bf16;
    return 1;
#endif
}

/* whether stoic_chunk_attention computes here (this build has AVX-512) */
int stoic_chunk_attention_available(void) {
#ifdef HAVE_AVX512
    return 1;
#else
    return 0;
#endif
}
