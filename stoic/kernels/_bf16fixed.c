/* --deterministic's products in bfloat16 (built where the CPU has AVX512_BF16: HAVE_BF16,
 * _common.h; elsewhere FIXED_ORDER's float32 tiles serve that mode, as before), on the 16-lane
 * de-quantisation of the products (_blocks.h's dequant16_*). _qkernels.c's dispatch calls
 * bf16fixed_mm for the BF16FIXED layout.
 *
 * y[m, n] = sum_k bf16(x[m, k]) * bf16(w[n, k]) (+ bias[n]) with float32 sums: what the default
 * mode's bfloat16 dense copy computes for big steps (the fast dtype's products), but every output
 * element by one instruction sequence, whatever M is and whatever tile it lands in:
 *   - row m of x rounded once to bfloat16 (RNE, vcvtne2ps2bf16), 32 elements a chunk in the
 *     order the layout's 16-lane de-quantisation gives its weights (a 4-bit U4/Z4 chunk comes
 *     out as weights 0-7, 16-23, 8-15, 24-31: x is taken in that order, as permute_x does);
 *   - row n of the weights as bfloat16 in the same order: the float32 value dequant16_* gives
 *     (bitwise gguf-py's), rounded by the same instruction;
 *   - one 16-lane float32 accumulator per (m, n), zero, then vdpbf16ps over the chunks from the
 *     first; then _mm512_reduce_add_ps and the bias.
 * The weights come from one of two sources that hold the same bits: de-quantised in registers
 * from the repacked blocks (steps of at most BF16_REGISTER_ROWS rows: they are bound by reading
 * the weights, and the blocks are 0.6-1.1 bytes a weight), or a bfloat16 copy made at load by the
 * same de-quantise-and-round code (stoic_bf16_pack: 2 bytes a weight), read in tiles of
 * TILE_ROWS rows of x by TILE_COLS weight rows that share their loads. Remainders take smaller
 * tiles of the same per-element sequence. Threads share out the output columns only, so the
 * thread count changes nothing either.
 */

#include "_blocks.h"

#ifdef HAVE_BF16

/* chunks of 32 bfloat16 (as raw 16-bit values: a chunk is one 64-byte register) */
typedef uint16_t bf16_t;

static inline __m512 bf16_dot(__m512 acc, __m512i x, __m512i w) {
    return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w);
}

static inline __m512i bf16_rne32(__m512 lo, __m512 hi) {
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo); /* lo: elements 0-15, hi: 16-31 */
}

/* M rows of x (K wide) to bfloat16 in the layout's chunk order (permuted: 4-bit U4/Z4) */
static void bf16_convert_x(const float *x, int64_t M, int64_t K, int permuted, bf16_t *out) {
    for (int64_t i = 0; i < M * K; i += QK) {
        __m512 lo, hi;
        if (permuted) {
            lo = _mm512_castpd_ps(_mm512_insertf64x4(
                _mm512_castps_pd(_mm512_castps256_ps512(_mm256_loadu_ps(x + i))),
                _mm256_castps_pd(_mm256_loadu_ps(x + i + 16)), 1));
            hi = _mm512_castpd_ps(_mm512_insertf64x4(
                _mm512_castps_pd(_mm512_castps256_ps512(_mm256_loadu_ps(x + i + 8))),
                _mm256_castps_pd(_mm256_loadu_ps(x + i + 24)), 1));
        } else {
            lo = _mm512_loadu_ps(x + i);
            hi = _mm512_loadu_ps(x + i + 16);
        }
        _mm512_storeu_si512(out + i, bf16_rne32(lo, hi));
    }
}

/* ---- from the bfloat16 copy: R rows of x by C weight rows, each chunk of each loaded once */
#define DEFINE_CTILE(NAME, R, C)                                                               \
    static inline void NAME(const bf16_t *xb, const bf16_t *wb, int64_t K, float *y,          \
                            int64_t ldy, const float *add) {                                   \
        __m512 acc[R][C];                                                                      \
        for (int r = 0; r < R; r++)                                                            \
            for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();                       \
        for (int64_t k = 0; k < K; k += QK) {                                                  \
            __m512i w[C];                                                                      \
            for (int c = 0; c < C; c++) w[c] = _mm512_loadu_si512(wb + c * K + k);             \
            for (int r = 0; r < R; r++) {                                                      \
                const __m512i xv = _mm512_loadu_si512(xb + r * K + k);                         \
                for (int c = 0; c < C; c++) acc[r][c] = bf16_dot(acc[r][c], xv, w[c]);         \
            }                                                                                  \
        }                                                                                      \
        for (int r = 0; r < R; r++)                                                            \
            for (int c = 0; c < C; c++)                                                        \
                y[r * ldy + c] = _mm512_reduce_add_ps(acc[r][c]) + add[c];                     \
    }

/* 4 rows by 6 weight rows: 24 accumulators, 6 weight chunks and one of x in the 32 registers.
 * Measured on an EPYC with AVX512_BF16 (1 thread, a busy machine; Q8_0 matrices of the default
 * model's shapes at 32 rows): 4x4, 8x3, 4x6 and 2x8 took 2.4, 2.6, 2.3 and 2.2 ms, within the
 * noise of each other, all 0.3-0.45x the float32 tiles' time. A 4x4 tile reducing its 16
 * accumulators at once (the same tree as _mm512_reduce_add_ps, 15 vector additions for 64) was
 * measured no faster: 0.97-1.11x the 4x6 tile's time at 16-64 rows. */
#define TILE_ROWS 4
#define TILE_COLS 6
DEFINE_CTILE(ctile_rc, TILE_ROWS, TILE_COLS)
DEFINE_CTILE(ctile_1c, 1, TILE_COLS)
DEFINE_CTILE(ctile_r1, TILE_ROWS, 1)
DEFINE_CTILE(ctile_11, 1, 1)

/* Each thread's column groups over every row of x: passes of 64 rows at a time (x kept in the
 * core's cache for prefill chunks) measured no faster, 1.01-1.04x at 32-512 rows. */
static void bf16_mm_copy(const bf16_t *xb, int64_t M, int64_t K, const bf16_t *wb, int64_t N,
                         const float *bias, float *y, int64_t ldy, int threads) {
    const int64_t groups = (N + TILE_COLS - 1) / TILE_COLS;
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int64_t g = 0; g < groups; g++) {
        const int64_t n0 = g * TILE_COLS, cols = N - n0 < TILE_COLS ? N - n0 : TILE_COLS;
        float add[TILE_COLS];
        for (int64_t c = 0; c < cols; c++) add[c] = bias ? bias[n0 + c] : 0.0f;
        if (cols == TILE_COLS) {
            int64_t r = 0;
            for (; r + TILE_ROWS <= M; r += TILE_ROWS)
                ctile_rc(xb + r * K, wb + n0 * K, K, y + r * ldy + n0, ldy, add);
            for (; r < M; r++) ctile_1c(xb + r * K, wb + n0 * K, K, y + r * ldy + n0, ldy, add);
        } else {
            for (int64_t c = 0; c < cols; c++) {
                const bf16_t *wr = wb + (n0 + c) * K;
                int64_t r = 0;
                for (; r + TILE_ROWS <= M; r += TILE_ROWS)
                    ctile_r1(xb + r * K, wr, K, y + r * ldy + n0 + c, ldy, add + c);
                for (; r < M; r++) ctile_11(xb + r * K, wr, K, y + r * ldy + n0 + c, ldy, add + c);
            }
        }
    }
}

/* ---- from the blocks: one weight row de-quantised and rounded chunk by chunk, for ROWS rows */
#define DEFINE_RTILE(NAME, DEQUANT, ROWS)                                                      \
    static inline void NAME(const bf16_t *xb, int64_t K, const uint8_t *wr, float *out,       \
                            int64_t stride, float add) {                                       \
        __m512 acc[ROWS];                                                                      \
        for (int t = 0; t < ROWS; t++) acc[t] = _mm512_setzero_ps();                           \
        for (int64_t b = 0; b < K / QK; b++) {                                                 \
            __m512 v[2];                                                                       \
            DEQUANT(wr, b, v);                                                                 \
            const __m512i w = bf16_rne32(v[0], v[1]);                                          \
            for (int t = 0; t < ROWS; t++)                                                     \
                acc[t] = bf16_dot(acc[t], _mm512_loadu_si512(xb + t * K + b * QK), w);         \
        }                                                                                      \
        for (int t = 0; t < ROWS; t++) out[t * stride] = _mm512_reduce_add_ps(acc[t]) + add;   \
    }

/* per layout: the in-register product and the copy's packing, both through DEQUANT */
#define DEFINE_BF16(NAME, DEQUANT, BYTES_256)                                                  \
    DEFINE_RTILE(NAME##_4, DEQUANT, 4)                                                         \
    DEFINE_RTILE(NAME##_1, DEQUANT, 1)                                                         \
    static void NAME##_regs(const bf16_t *xb, int64_t M, int64_t K, const uint8_t *w,          \
                            int64_t N, const float *bias, float *y, int64_t ldy, int threads) { \
        const int64_t row_bytes = K / QK * (BYTES_256) / 8;                                    \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                      \
        for (int64_t n = 0; n < N; n++) {                                                      \
            const uint8_t *wr = w + n * row_bytes;                                             \
            const float add = bias ? bias[n] : 0.0f;                                           \
            int64_t r = 0;                                                                     \
            for (; r + 4 <= M; r += 4) NAME##_4(xb + r * K, K, wr, y + r * ldy + n, ldy, add); \
            for (; r < M; r++) NAME##_1(xb + r * K, K, wr, y + r * ldy + n, ldy, add);         \
        }                                                                                      \
    }                                                                                          \
    static void NAME##_pack(const uint8_t *w, int64_t N, int64_t K, bf16_t *out, int threads) { \
        const int64_t row_bytes = K / QK * (BYTES_256) / 8;                                    \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                      \
        for (int64_t n = 0; n < N; n++)                                                        \
            for (int64_t b = 0; b < K / QK; b++) {                                             \
                __m512 v[2];                                                                   \
                DEQUANT(w + n * row_bytes, b, v);                                              \
                _mm512_storeu_si512(out + n * K + b * QK, bf16_rne32(v[0], v[1]));             \
            }                                                                                  \
    }

DEFINE_BF16(bf16_s8, dequant16_s8, 8 * S8_BYTES)
DEFINE_BF16(bf16_u4, dequant16_u4, 8 * U4_BYTES)
DEFINE_BF16(bf16_z4, dequant16_z4, 8 * Z4_BYTES)
DEFINE_BF16(bf16_k4, dequant16_k4, K4_BYTES)
DEFINE_BF16(bf16_k5, dequant16_k5, K5_BYTES)
DEFINE_BF16(bf16_k6, dequant16_k6, K6_BYTES)
DEFINE_BF16(bf16_z5, dequant16_z5, 8 * Z5_BYTES)
DEFINE_BF16(bf16_u5, dequant16_u5, 8 * U5_BYTES)

/* steps of at most this many rows de-quantise in registers, more read the bfloat16 copy.
 * Measured as the tiles above: in registers against the copy, 0.8-0.98x the time at 8 rows,
 * 1.07x at 12, 1.2x at 16, 1.4x at 32 (at 1 row the blocks are a quarter of the copy's bytes) */
#define BF16_REGISTER_ROWS 8

static int bf16_layout_ok(int layout, int64_t K) {
    const int k_quant = layout == K4 || layout == K5 || layout == K6;
    const int known = k_quant || layout == S8 || layout == U4 || layout == Z4 || layout == Z5 ||
                      layout == U5;
    return known && K % (k_quant ? QK_K : QK) == 0;
}
#endif

/* y = x @ W^T (+ bias) in bfloat16, fixed order, for W described at `desc`: int64 layout of the
 * repacked blocks (S8, U4, Z4 or a K layout; not MIXED: a stack's parts are each a BF16FIXED
 * product), int64 address of the blocks, int64 address of their bfloat16 copy (0: none, every
 * step de-quantises in registers). -1: not built here, or a layout it lacks; -2: out of memory. */
int bf16fixed_mm(const int64_t *desc, const float *x, int64_t M, int64_t K, int64_t N,
                 const float *bias, float *y, int64_t ldy, int threads) {
#ifdef HAVE_BF16
    const int layout = (int)desc[0];
    const uint8_t *w = (const uint8_t *)(intptr_t)desc[1];
    const bf16_t *copy = (const bf16_t *)(intptr_t)desc[2];
    if (!bf16_layout_ok(layout, K)) return -1;
    bf16_t *xb = malloc(sizeof(bf16_t) * (size_t)(M * K > 0 ? M * K : 1));
    if (!xb) return -2;
    bf16_convert_x(x, M, K, layout == U4 || layout == Z4, xb);
    if (copy && M > BF16_REGISTER_ROWS) {
        bf16_mm_copy(xb, M, K, copy, N, bias, y, ldy, threads);
    } else {
        switch (layout) {
        case S8: bf16_s8_regs(xb, M, K, w, N, bias, y, ldy, threads); break;
        case U4: bf16_u4_regs(xb, M, K, w, N, bias, y, ldy, threads); break;
        case Z4: bf16_z4_regs(xb, M, K, w, N, bias, y, ldy, threads); break;
        case K4: bf16_k4_regs(xb, M, K, w, N, bias, y, ldy, threads); break;
        case K5: bf16_k5_regs(xb, M, K, w, N, bias, y, ldy, threads); break;
        case K6: bf16_k6_regs(xb, M, K, w, N, bias, y, ldy, threads); break;
        case Z5: bf16_z5_regs(xb, M, K, w, N, bias, y, ldy, threads); break;
        default: bf16_u5_regs(xb, M, K, w, N, bias, y, ldy, threads); break;
        }
    }
    free(xb);
    return 0;
#else
    (void)desc, (void)x, (void)M, (void)K, (void)N, (void)bias, (void)y, (void)ldy, (void)threads;
    return -1;
#endif
}

/* Whether this build has the bfloat16 fixed-order products (1) or not (0). */
int stoic_bf16_fixed(void) {
#ifdef HAVE_BF16
    return 1;
#else
    return 0;
#endif
}

/* out [N, K] bfloat16 = the N rows of repacked blocks at w (layout S8, U4, Z4 or a K layout) as
 * bf16fixed_mm's in-register path rounds them, each chunk of 32 in its order: the copy
 * bf16fixed_mm reads for larger steps. -1: not built here, or a layout or width it lacks. */
int stoic_bf16_pack(int layout, const uint8_t *w, int64_t N, int64_t K, uint16_t *out,
                    int threads) {
#ifdef HAVE_BF16
    if (!bf16_layout_ok(layout, K) || N < 0) return -1;
    switch (layout) {
    case S8: bf16_s8_pack(w, N, K, out, threads); break;
    case U4: bf16_u4_pack(w, N, K, out, threads); break;
    case Z4: bf16_z4_pack(w, N, K, out, threads); break;
    case K4: bf16_k4_pack(w, N, K, out, threads); break;
    case K5: bf16_k5_pack(w, N, K, out, threads); break;
    case K6: bf16_k6_pack(w, N, K, out, threads); break;
    case Z5: bf16_z5_pack(w, N, K, out, threads); break;
    default: bf16_u5_pack(w, N, K, out, threads); break;
    }
    return 0;
#else
    (void)layout, (void)w, (void)N, (void)K, (void)out, (void)threads;
    return -1;
#endif
}
