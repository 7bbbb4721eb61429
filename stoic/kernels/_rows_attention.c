/* Prefill rows' attention (--deterministic): the rows of a chunk attend together, each bitwise
 * as it would alone. On _common.h's hsum, hsum8, hmax and fold16 and _decode_layer.c's softmax
 * (decode_layer_softmax_numerators) and pool writes (decode_layer_write_pools).
 *
 * In deterministic mode every prefill token is a row of the decode attention (attend8 and
 * attend16 in _decode_layer.c): its query over its sequence's first position + 1 keys, reduced in an
 * order that depends on that length alone. One row at a time, each row of a chunk streams the
 * same keys and values from L2 anew and finds each key's pool row by a division (two a key and
 * query head). Here a job is a tile of ROWS_TILE rows of one run (rows of one sequence, sharing
 * its block table) and one kv head with all its query heads: keys and values are taken
 * KEY_TILE at a time and each tile serves every query of the job from L1 before the next is
 * read; each key's pool row is looked up once a job.
 *
 * A row's arithmetic is attend8's/attend16's operation for operation: the same q * scale, the
 * same multiply-add chain over the head dimension for each key; the keys of whole groups of 8
 * from key 0 reduced by hsum8 (16 lanes: each key's halves added first), the last len % 8 keys
 * by hsum (16 lanes: _mm512_reduce_add_ps); the maximum of the groups' lanes (hmax), then of
 * the tail keys in order; softmax_numerators; one multiply-add a key into each output lane, in
 * key order; the division by the total. Only which row is worked on when changes (partial sums
 * wait in memory, which holds a float exactly), so each row's result is bitwise the decode
 * kernel's for that row alone, whatever the tiles and the number of threads
 * (tests/model/test_rows_attention.py).
 */
#include "_common.h"

#define ROWS_TILE 16
#define KEY_TILE 64 /* a multiple of 8: a tile holds whole groups */

/* one job: `rows` rows of one run, `count` query heads of one kv head */
struct rows_job {
    const float *q;         /* the first row's first query head; rows `stride` floats apart */
    float *out;             /* likewise */
    int64_t stride, rows, count, dh;
    const int64_t *lens;    /* [rows] keys each row attends */
    const float *k_pool, *v_pool;
    const int64_t *off;     /* [longest] where key t is in the pools (floats) */
    int64_t longest, width; /* the most keys a row attends; a row of scores (longest + 8) */
    float scale;
    float *scores;          /* [rows * count, width] */
    float *qs, *acc;        /* [rows * count, dh]: scaled queries, value sums */
    float *tops;            /* [rows * count, 8]: the groups' lane maxima */
    float *totals;          /* [rows * count] */
};

/* DEFINE_ROWS(NAME, V, W, ...): the job in W-lane vectors V; FOLD(a) is a group key's 8 lanes
 * as attend8/attend16 feed them to hsum8, REDUCE(a) a tail key's score */
#define DEFINE_ROWS(NAME, V, W, LOAD, STORE, MUL, FMADD, SET1, DIV, ZERO, FOLD, REDUCE, PAIRS) \
    static inline __attribute__((always_inline)) void NAME(const struct rows_job *J,          \
                                                           const int64_t lanes) {             \
        const int64_t nq = J->rows * J->count, dh = J->dh;                                    \
        for (int64_t qi = 0; qi < nq; qi++) {                                                 \
            const float *qv = J->q + (qi / J->count) * J->stride + (qi % J->count) * dh;      \
            for (int64_t i = 0; i < lanes; i++)                                               \
                STORE(J->qs + qi * dh + W * i, MUL(LOAD(qv + W * i), SET1(J->scale)));        \
            _mm256_storeu_ps(J->tops + 8 * qi, _mm256_set1_ps(-INFINITY));                    \
        }                                                                                     \
        /* the whole groups' scores, a tile of keys for every query at a time */              \
        for (int64_t t0 = 0; t0 < J->longest; t0 += KEY_TILE) {                               \
            for (int64_t qi = 0; qi < nq; qi++) {                                             \
                const int64_t full = J->lens[qi / J->count] / 8 * 8;                          \
                const int64_t end = full < t0 + KEY_TILE ? full : t0 + KEY_TILE;             \
                if (end <= t0) continue;                                                      \
                V qr[MAX_HEAD_DIM / W];                                                       \
                for (int64_t i = 0; i < lanes; i++) qr[i] = LOAD(J->qs + qi * dh + W * i);    \
                float *s = J->scores + qi * J->width;                                         \
                __m256 top8 = _mm256_loadu_ps(J->tops + 8 * qi);                              \
                for (int64_t t = t0; t < end; t += 8) {                                       \
                    __m256 acc[8];                                                            \
                    for (int j = 0; j < 8; j++) {                                             \
                        const float *kp = J->k_pool + J->off[t + j];                          \
                        V a = MUL(qr[0], LOAD(kp));                                           \
                        for (int64_t i = 1; i < lanes; i++) a = FMADD(qr[i], LOAD(kp + W * i), a); \
                        acc[j] = FOLD(a);                                                     \
                    }                                                                         \
                    const __m256 s8 = hsum8(acc);                                             \
                    _mm256_storeu_ps(s + t, s8);                                              \
                    top8 = _mm256_max_ps(top8, s8);                                           \
                }                                                                             \
                _mm256_storeu_ps(J->tops + 8 * qi, top8);                                     \
            }                                                                                 \
        }                                                                                     \
        /* each query's last len % 8 keys, its maximum and numerators */                      \
        for (int64_t qi = 0; qi < nq; qi++) {                                                 \
            const int64_t len = J->lens[qi / J->count];                                       \
            float *s = J->scores + qi * J->width;                                             \
            float top = hmax(_mm256_loadu_ps(J->tops + 8 * qi));                              \
            V qr[MAX_HEAD_DIM / W];                                                           \
            for (int64_t i = 0; i < lanes; i++) qr[i] = LOAD(J->qs + qi * dh + W * i);        \
            for (int64_t t = len / 8 * 8; t < len; t++) {                                     \
                const float *kp = J->k_pool + J->off[t];                                      \
                V a = MUL(qr[0], LOAD(kp));                                                   \
                for (int64_t i = 1; i < lanes; i++) a = FMADD(qr[i], LOAD(kp + W * i), a);    \
                s[t] = REDUCE(a);                                                             \
                top = s[t] > top ? s[t] : top;                                                \
            }                                                                                 \
            J->totals[qi] = decode_layer_softmax_numerators(s, len, top);                     \
            for (int64_t i = 0; i < lanes; i++) STORE(J->acc + qi * dh + W * i, ZERO());      \
        }                                                                                     \
        /* the values, a tile of keys for every query at a time; two queries together where  \
         * PAIRS (the key's values loaded once for both, twice the chains of multiply-adds) */ \
        for (int64_t j0 = 0; j0 < J->longest; j0 += KEY_TILE) {                               \
            for (int64_t qi = 0; qi < nq; qi += 1 + PAIRS) {                                  \
                const int64_t qb = PAIRS && qi + 1 < nq ? qi + 1 : qi;                        \
                const int64_t la = J->lens[qi / J->count], lb = J->lens[qb / J->count];       \
                const int64_t ea = la < j0 + KEY_TILE ? la : j0 + KEY_TILE;                   \
                const int64_t eb = qb == qi ? j0 : lb < j0 + KEY_TILE ? lb : j0 + KEY_TILE;   \
                const float *sa = J->scores + qi * J->width, *sb = J->scores + qb * J->width; \
                float *suma = J->acc + qi * dh, *sumb = J->acc + qb * dh;                     \
                V acca[MAX_HEAD_DIM / W], accb[MAX_HEAD_DIM / W];                             \
                for (int64_t i = 0; i < lanes; i++) {                                         \
                    acca[i] = LOAD(suma + W * i);                                             \
                    accb[i] = LOAD(sumb + W * i);                                             \
                }                                                                             \
                int64_t j = j0;                                                               \
                for (; j < ea && j < eb; j++) {                                               \
                    const float *vp = J->v_pool + J->off[j];                                  \
                    const V pa = SET1(sa[j]), pb = SET1(sb[j]);                               \
                    for (int64_t i = 0; i < lanes; i++) {                                     \
                        const V x = LOAD(vp + W * i);                                         \
                        acca[i] = FMADD(pa, x, acca[i]);                                      \
                        accb[i] = FMADD(pb, x, accb[i]);                                      \
                    }                                                                         \
                }                                                                             \
                for (int64_t ja = j; ja < ea; ja++) {                                         \
                    const float *vp = J->v_pool + J->off[ja];                                 \
                    const V p = SET1(sa[ja]);                                                 \
                    for (int64_t i = 0; i < lanes; i++) acca[i] = FMADD(p, LOAD(vp + W * i), acca[i]); \
                }                                                                             \
                for (int64_t jb = j; jb < eb; jb++) {                                         \
                    const float *vp = J->v_pool + J->off[jb];                                 \
                    const V p = SET1(sb[jb]);                                                 \
                    for (int64_t i = 0; i < lanes; i++) accb[i] = FMADD(p, LOAD(vp + W * i), accb[i]); \
                }                                                                             \
                for (int64_t i = 0; i < lanes; i++) {                                         \
                    STORE(suma + W * i, acca[i]);                                             \
                    if (qb != qi) STORE(sumb + W * i, accb[i]);                               \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        for (int64_t qi = 0; qi < nq; qi++) {                                                 \
            float *o = J->out + (qi / J->count) * J->stride + (qi % J->count) * dh;           \
            const V inv = SET1(J->totals[qi]);                                                \
            for (int64_t i = 0; i < lanes; i++)                                               \
                STORE(o + W * i, DIV(LOAD(J->acc + qi * dh + W * i), inv));                   \
        }                                                                                     \
    }

#define ROWS_FOLD8(a) (a)
DEFINE_ROWS(rows8, __m256, 8, _mm256_loadu_ps, _mm256_storeu_ps, _mm256_mul_ps, _mm256_fmadd_ps,
            _mm256_set1_ps, _mm256_div_ps, _mm256_setzero_ps, ROWS_FOLD8, hsum, 0)

#ifdef HAVE_AVX512
DEFINE_ROWS(rows16, __m512, 16, _mm512_loadu_ps, _mm512_storeu_ps, _mm512_mul_ps,
            _mm512_fmadd_ps, _mm512_set1_ps, _mm512_div_ps, _mm512_setzero_ps, fold16,
            _mm512_reduce_add_ps, 1)
#endif

/* the job with its head dimension's lanes a constant where it is a common one (the loops over
 * the lanes unrolled, the vectors in registers): the same operations in the same order */
static void rows_job_run(const struct rows_job *J) {
#ifdef HAVE_AVX512
    if (J->dh % 16 == 0) {
        switch (J->dh / 16) {
        case 4: rows16(J, 4); return;
        case 8: rows16(J, 8); return;
        default: rows16(J, J->dh / 16); return;
        }
    }
#endif
    switch (J->dh / 8) {
    case 8: rows8(J, 8); return;
    case 16: rows8(J, 16); return;
    default: rows8(J, J->dh / 8); return;
    }
}

/* `rows` rows (token m0's first, `stride` floats apart in q and out) of `count` query heads
 * over one kv head's keys in the pool rows of `table`: row r over its first lens[r] positions.
 * 0, or -2 out of memory. */
static int attend_rows(const float *q, const float *k_pool, const float *v_pool,
                       const int64_t *table, const int64_t *lens, int64_t rows, int64_t count,
                       int64_t stride, int64_t dh, int64_t block, float scale, float *out) {
    const int64_t nq = rows * count;
    int64_t longest = 0;
    for (int64_t r = 0; r < rows; r++) longest = lens[r] > longest ? lens[r] : longest;
    const int64_t width = longest + 8; /* softmax_numerators pads a row to a multiple of 8 */
    float *scores = malloc(sizeof(float) * (size_t)(nq * width));
    float *work = malloc(sizeof(float) * (size_t)(nq * (2 * dh + 9)));
    int64_t *off = malloc(sizeof(int64_t) * (size_t)(longest + 1));
    int rc = -2;
    if (scores && work && off) {
        for (int64_t t = 0, b = 0; t < longest; b++)
            for (int64_t i = 0; i < block && t < longest; i++, t++) off[t] = (table[b] * block + i) * dh;
        const struct rows_job job = {
            .q = q, .out = out, .stride = stride, .rows = rows, .count = count, .dh = dh,
            .lens = lens, .k_pool = k_pool, .v_pool = v_pool, .off = off, .longest = longest,
            .width = width, .scale = scale, .scores = scores, .qs = work, .acc = work + nq * dh,
            .tops = work + 2 * nq * dh, .totals = work + 2 * nq * dh + 8 * nq,
        };
        rows_job_run(&job);
        rc = 0;
    }
    free(scores);
    free(work);
    free(off);
    return rc;
}

/* stoic_decode_attention's contract (the M tokens' k and v written into the pools, then token
 * m's query heads over lens[m] keys of the pool rows tables[(m * kv_heads + g) * max_blocks +
 * j]; out [M, heads, dh]; float32 pools), for tokens in `runs`: runs[2 i] is a run's first token, runs[2 i + 1]
 * its number of tokens, which share the first one's block tables (a prefill chunk's tokens; a
 * decode token is a run of one). Every token's result is bitwise stoic_decode_attention's.
 * 0; -1 for shapes the kernel lacks or a run outside [0, M); -2 out of memory. */
int stoic_prefill_attention(const float *q, const float *k, const float *v, float *k_pool,
                            float *v_pool, const int64_t *write, const int64_t *tables,
                            const int64_t *lens, const int64_t *runs, int64_t n_runs, int64_t M,
                            int64_t heads, int64_t kv_heads, int64_t dh, int64_t block,
                            int64_t max_blocks, float scale, float *out, int threads,
                            int kv_bf16) {
    /* float32 pools only: deterministic mode keeps a float32 KV cache (the rows' order is
     * attend8's/attend16's over float32 keys) */
    if (dh % 8 != 0 || dh > MAX_HEAD_DIM || heads % kv_heads != 0 || n_runs < 0 || kv_bf16)
        return -1;
    int64_t tiles = 0;
    for (int64_t i = 0; i < n_runs; i++) {
        const int64_t first = runs[2 * i], n = runs[2 * i + 1];
        if (first < 0 || n < 1 || first + n > M) return -1;
        tiles += (n + ROWS_TILE - 1) / ROWS_TILE;
    }
    decode_layer_write_pools(k, v, k_pool, v_pool, write, M, kv_heads, dh, 0);
    int64_t *tile = malloc(sizeof(int64_t) * (size_t)(2 * tiles + 1));
    if (!tile) return -2;
    for (int64_t i = 0, t = 0; i < n_runs; i++)
        for (int64_t r = 0; r < runs[2 * i + 1]; r += ROWS_TILE, t++) {
            const int64_t left = runs[2 * i + 1] - r;
            tile[2 * t] = runs[2 * i] + r;
            tile[2 * t + 1] = left < ROWS_TILE ? left : ROWS_TILE;
        }
    const int64_t group = heads / kv_heads, jobs = tiles * kv_heads;
    int failed = 0;
    /* the last tiles first: a run's later rows attend more keys */
    _Pragma("omp parallel for schedule(dynamic) num_threads(threads) reduction(|: failed)")
    for (int64_t job = 0; job < jobs; job++) {
        const int64_t t = tiles - 1 - job / kv_heads, g = job % kv_heads;
        const int64_t m0 = tile[2 * t], rows = tile[2 * t + 1];
        const int64_t at = (m0 * heads + g * group) * dh;
        if (attend_rows(q + at, k_pool, v_pool, tables + (m0 * kv_heads + g) * max_blocks,
                        lens + m0, rows, group, heads * dh, dh, block, scale, out + at))
            failed = 1;
    }
    free(tile);
    return failed ? -2 : 0;
}
