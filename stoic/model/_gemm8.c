/* Products of many rows with int8 activations (AVX-512 VNNI): the steps of more than
 * `kernel_rows` tokens (prefill chunks, decode steps of 9 or more sequences) of the default
 * mode with a fast dtype, which otherwise multiply by the bfloat16 dense copy.
 * Appended after _qkernels.c, _kquants.c and _int8rows.c into one library (_qkernels.py).
 *
 * Why a layout of its own. The one-row loops (_int8rows.c) expand a block of weights for one row
 * of x and reduce its products horizontally; for many rows that costs more than the float tiles
 * (measured: four int8 rows 1.15-1.29x their time). Here, as ggml's repacked GEMMs do, the
 * weights are laid out once at load so that one 64-byte load holds 4 consecutive weights of 16
 * output columns: a vpdpbusd of it by 4 bytes of one row of x, broadcast, adds 64 products into
 * that row's 16 int32 column sums, with no horizontal reduction and no expansion per row; the
 * load serves 4 rows, and each broadcast of x 3 such loads (g8_tile). Measured against the bfloat16 product packed for oneDNN (docs/benchmarks.md,
 * "int8 activations for batched steps"): 0.61-0.77x its time on one thread at 16-256 rows.
 *
 * G8, per tile of 16 output columns (rows of W; N padded to a multiple of 16 with zeros), per
 * block b of 32 columns of x, 640 bytes:
 *     u8 q[8][16][4]   q[g][n][k]: weight 32 b + 4 g + k of output column 16 t + n, unsigned
 *     f32 d[16]        w = q * d + m, exactly the value the file's block gives (gguf-py's
 *     f32 m[16]        de-quantisation), for every type stoic_g8_decode reads
 * Types (stoic_g8_decode): Q4_0 (m = -8 d), Q4_1, Q5_0 (m = -16 d), Q5_1, Q8_0 (q + 128, m =
 * -128 d), Q4_K and Q5_K (per sub-block of 32: d = d_super * scale, m = -dmin * min). Q6_K (a
 * scale per 16 weights) is not read: a matrix with a Q6_K part keeps the bfloat16 copy.
 *
 * Numerics: those of _int8rows.c (its header): each block of 32 of a row of x quantised to int8
 * with its scale dx (and sx = dx * sum xq), the integer sums exact, then per block
 * y += d dx sum(q xq) + m sx in float32. Not the float product: the default mode with a fast
 * dtype only, never --dtype float32 nor --deterministic.
 */

#define G8_BYTES 640
#define G8_TR 4 /* rows of x a tile of the product */
#define G8_TC 3 /* tiles of 16 output columns a tile of the product */

/* The natural-order unsigned q, d and m (w = q d + m) of N rows of GGML blocks of `type`
 * (K weights a row): 0, or -1 for a type this file does not read. */
int stoic_g8_decode(int type, const uint8_t *src, int64_t N, int64_t K, uint8_t *q, float *d,
                    float *m) {
    const int64_t nb = K / QK;
    if (K % QK != 0) return -1;
    if (type == Q4_K || type == Q5_K) {
        if (K % 256 != 0) return -1;
        const int64_t bytes = type == Q4_K ? 144 : 176;
        for (int64_t i = 0; i < N * (K / 256); i++) {
            const uint8_t *b = src + i * bytes;
            const float dd = half_to_float(b), dmin = half_to_float(b + 2);
            uint8_t sc[8], mn[8];
            unpack_scales(b + 4, sc, mn);
            const uint8_t *qh = b + 16, *qs = type == Q4_K ? b + 16 : b + 48;
            for (int j = 0; j < 8; j++) {
                d[i * 8 + j] = dd * (float)sc[j];
                m[i * 8 + j] = -(dmin * (float)mn[j]);
                uint8_t *o = q + (i * 8 + j) * QK;
                for (int l = 0; l < QK; l++) {
                    const uint8_t byte = qs[32 * (j / 2) + l];
                    uint8_t v = (uint8_t)((j & 1) ? byte >> 4 : byte & 0x0F);
                    if (type == Q5_K) v = (uint8_t)(v | (((qh[l] >> j) & 1) << 4));
                    o[l] = v;
                }
            }
        }
        return 0;
    }
    for (int64_t i = 0; i < N * nb; i++) {
        uint8_t *o = q + i * QK;
        switch (type) {
        case Q4_0:
        case Q4_1: {
            const int64_t bytes = type == Q4_0 ? 18 : 20;
            const uint8_t *b = src + i * bytes, *qs = b + (type == Q4_0 ? 2 : 4);
            d[i] = half_to_float(b);
            m[i] = type == Q4_0 ? -8.0f * d[i] : half_to_float(b + 2);
            for (int l = 0; l < 16; l++) {
                o[l] = qs[l] & 0x0F;
                o[l + 16] = qs[l] >> 4;
            }
            break;
        }
        case Q5_0:
        case Q5_1: {
            const int64_t bytes = type == Q5_0 ? 22 : 24, head = type == Q5_0 ? 2 : 4;
            const uint8_t *b = src + i * bytes, *qs = b + head + 4;
            uint32_t qh;
            memcpy(&qh, b + head, 4);
            d[i] = half_to_float(b);
            m[i] = type == Q5_0 ? -16.0f * d[i] : half_to_float(b + 2);
            for (int l = 0; l < 16; l++) {
                o[l] = (uint8_t)((qs[l] & 0x0F) | (((qh >> l) & 1) << 4));
                o[l + 16] = (uint8_t)((qs[l] >> 4) | (((qh >> (l + 16)) & 1) << 4));
            }
            break;
        }
        case Q8_0: {
            const uint8_t *b = src + i * 34;
            d[i] = half_to_float(b);
            m[i] = -128.0f * d[i]; /* exact: a power of two times a half */
            for (int l = 0; l < QK; l++) o[l] = (uint8_t)((int)(int8_t)b[2 + l] + 128);
            break;
        }
        default:
            return -1;
        }
    }
    return 0;
}

/* N rows of decoded q, d, m (stoic_g8_decode's, K weights a row) into G8 (out: the bytes of
 * stoic_g8_bytes(N, K), zeroed padding) */
int64_t stoic_g8_bytes(int64_t N, int64_t K) { return (N + 15) / 16 * (K / QK) * G8_BYTES; }

int stoic_g8_pack(const uint8_t *q, const float *d, const float *m, int64_t N, int64_t K,
                  uint8_t *out) {
    const int64_t nb = K / QK, tiles = (N + 15) / 16;
    if (K % QK != 0) return -1;
    memset(out, 0, (size_t)stoic_g8_bytes(N, K));
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *blk = out + (t * nb + b) * G8_BYTES;
            float *bd = (float *)(void *)(blk + 512), *bm = (float *)(void *)(blk + 576);
            for (int n = 0; n < 16 && t * 16 + n < N; n++) {
                const int64_t row = t * 16 + n;
                const uint8_t *qr = q + row * K + b * QK;
                for (int g = 0; g < 8; g++) memcpy(blk + g * 64 + n * 4, qr + g * 4, 4);
                bd[n] = d[row * nb + b];
                bm[n] = m[row * nb + b];
            }
        }
    return 0;
}

#ifdef HAVE_INT8_ROWS
/* 16 float32 values as bfloat16, rounded to nearest even (torch's conversion; a NaN stays a
 * NaN), stored under `cols` */
static inline void g8_store_bf16(uint16_t *p, __m512 v, __mmask16 cols) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    _mm256_mask_storeu_epi16((void *)p, cols, _mm512_cvtepi32_epi16(r));
}

/* R rows of quantised x by C tiles of 16 output columns (each `tstride` bytes after the last;
 * cols[c]: the valid columns of tile c): y[r][16 C columns]. Each x value loaded (broadcast)
 * feeds C multiply-adds and each load of weights R: 4 rows by 3 tiles measured 1.14x the
 * throughput of 8 rows by one (docs/benchmarks.md, "int8 activations for batched steps").
 * Every element's arithmetic is the same whatever R, C and the row's place in the tile. */
static inline __attribute__((always_inline)) void
g8_tile(const int R, const int C, const int8_t *xq, const float *dx, const float *sx, int64_t K,
        int64_t nb, const uint8_t *wt, int64_t tstride, void *y, int y_bf16, int64_t ldy,
        const __mmask16 *cols, const float *bias) {
    __m512 acc[G8_TR][G8_TC];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wt + b * G8_BYTES;
        __m512i ia[G8_TR][G8_TC];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) ia[r][c] = _mm512_setzero_si512();
        for (int g = 0; g < 8; g++) {
            __m512i w[G8_TC];
            for (int c = 0; c < C; c++)
                w[c] = _mm512_loadu_si512((const void *)(blk + c * tstride + g * 64));
            for (int r = 0; r < R; r++) {
                int32_t xv;
                memcpy(&xv, xq + r * K + b * QK + g * 4, 4);
                const __m512i xb = _mm512_set1_epi32(xv);
                for (int c = 0; c < C; c++) ia[r][c] = _mm512_dpbusd_epi32(ia[r][c], w[c], xb);
            }
        }
        for (int c = 0; c < C; c++) {
            const __m512 d = _mm512_loadu_ps((const void *)(blk + c * tstride + 512));
            const __m512 m = _mm512_loadu_ps((const void *)(blk + c * tstride + 576));
            for (int r = 0; r < R; r++) {
                const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(dx[r * nb + b]));
                acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[r][c]), scale, acc[r][c]);
                acc[r][c] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[r * nb + b]), acc[r][c]);
            }
        }
    }
    for (int c = 0; c < C; c++) {
        const __m512 bv =
            bias ? _mm512_maskz_loadu_ps(cols[c], bias + 16 * c) : _mm512_setzero_ps();
        for (int r = 0; r < R; r++) {
            const __m512 v = _mm512_add_ps(acc[r][c], bv);
            if (y_bf16)
                g8_store_bf16((uint16_t *)y + r * ldy + 16 * c, v, cols[c]);
            else
                _mm512_mask_storeu_ps((float *)y + r * ldy + 16 * c, cols[c], v);
        }
    }
}

/* all the rows of M by C tiles from tile t: G8_TR rows at a time, then the rest */
#define G8_ROWS(R, C)                                                                           \
    g8_tile(R, C, xq + r * K, dx + r * nb, sx + r * nb, K, nb, wt, tstride,                     \
            y_bf16 ? (void *)((uint16_t *)y + r * ldy + c0)                                     \
                   : (void *)((float *)y + r * ldy + c0),                                       \
            y_bf16, ldy, cols, bt)
#define G8_ALL_ROWS(C)                                                                          \
    do {                                                                                        \
        int64_t r = 0;                                                                          \
        for (; r + G8_TR <= M; r += G8_TR) G8_ROWS(G8_TR, C);                                   \
        switch (M - r) {                                                                        \
        case 3: G8_ROWS(3, C); break;                                                           \
        case 2: G8_ROWS(2, C); break;                                                           \
        case 1: G8_ROWS(1, C); break;                                                           \
        default: break;                                                                         \
        }                                                                                       \
    } while (0)

/* y[M, N] (row stride ldy) = x[M, K] @ W^T (+ bias) over W in G8, x and y float32 or (x_bf16,
 * y_bf16) bfloat16: 0; 1 where this build has no VNNI (nothing computed); -2 if the scratch copy
 * of x cannot be allocated. Each row of y is computed in one order whatever M is and wherever
 * the row falls in the tiles (its own int8 copy and scales, exact integer sums, then the
 * blocks' scaled sums added in block order): bitwise the same alone or in any batch, so
 * --deterministic multiplies on it too (the G8 layout of qmm_dispatch). */
static int g8_mm(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                 const float *bias, void *y, int y_bf16, int64_t ldy, int threads) {
    const int64_t nb = K / QK, tiles = (N + 15) / 16, groups = (tiles + G8_TC - 1) / G8_TC;
    const int64_t tstride = nb * G8_BYTES;
    if (M <= 0) return 0;
    int8_t *xq;
    float *scales;
    if (quantize_rows8(x, x_bf16, M, K, 0, threads, &xq, &scales) != 0) return -2;
    float *dx = scales, *sx = scales + M * nb;
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int64_t grp = 0; grp < groups; grp++) {
        const int64_t t = grp * G8_TC, c0 = t * 16;
        const int64_t count = tiles - t < G8_TC ? tiles - t : G8_TC;
        const uint8_t *wt = w + t * tstride;
        __mmask16 cols[G8_TC];
        for (int64_t c = 0; c < count; c++) {
            const int64_t left = N - c0 - 16 * c;
            cols[c] = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
        }
        const float *bt = bias ? bias + c0 : NULL;
        if (count == G8_TC)
            G8_ALL_ROWS(G8_TC);
        else if (count == 2)
            G8_ALL_ROWS(2);
        else
            G8_ALL_ROWS(1);
    }
    free(xq);
    free(scales);
    return 0;
}
#else
static int g8_mm(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                 const float *bias, void *y, int y_bf16, int64_t ldy, int threads) {
    (void)x, (void)x_bf16, (void)M, (void)K, (void)w, (void)N, (void)bias, (void)y;
    (void)y_bf16, (void)ldy, (void)threads;
    return 1;
}
#endif

int stoic_g8_mm(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                const float *bias, void *y, int y_bf16, int threads) {
    return g8_mm(x, x_bf16, M, K, w, N, bias, y, y_bf16, N, threads);
}
