/* Products of many rows with int8 activations (AVX-512 VNNI): the steps of more than
 * `kernel_rows` tokens (prefill chunks, decode steps of 9 or more sequences) of the default
 * mode with a fast dtype, which otherwise multiply by the bfloat16 dense copy.
 * _qkernels.c's dispatch calls gemm8_mm for the G8 layouts (--deterministic's products too);
 * the rows of x are quantised by _int8rows.c's int8rows_quantize.
 *
 * Why a layout of its own. The one-row loops (_int8rows.c) expand a block of weights for one row
 * of x and reduce its products horizontally; for many rows that costs more than the float tiles
 * (measured: four int8 rows 1.15-1.29x their time). Here, as ggml's repacked GEMMs do, the
 * weights are laid out once at load so that one 64-byte load holds 4 consecutive weights of 16
 * output columns: a vpdpbusd of it by 4 bytes of one row of x, broadcast, adds 64 products into
 * that row's 16 int32 column sums, with no horizontal reduction and no expansion per row; the
 * load serves 4 rows, and each broadcast of x 3 such loads (g8_tile). Measured against the
 * bfloat16 product packed for oneDNN (docs/benchmarks.md, "int8 activations for batched
 * steps"): 0.61-0.77x its time on one thread at 16-256 rows.
 *
 * G8, per tile of 16 output columns (rows of W; N padded to a multiple of 16 with zeros), per
 * block b of 32 columns of x, 640 bytes:
 *     u8 q[8][16][4]   q[g][n][k]: weight 32 b + 4 g + k of output column 16 t + n, unsigned
 *     f32 d[16]        w = q * d + m, exactly the value the file's block gives (gguf-py's
 *     f32 m[16]        de-quantisation), for every type stoic_g8_decode reads
 * Three variants, the layout's bits over G8 (one for a whole matrix, whatever its parts):
 *   +1 halves (H), a matrix with a Q6_K part (a scale per 16 weights): d[2][16] and m[2][16],
 *      one pair for each half of a block (weights 0-15, 16-31); the tile sums each half's
 *      products apart (groups 0-3, then 4-7) and scales each by its own d and m;
 *   +2 symmetric (S), every block's m = -128 d (Q4_0, Q5_0, Q8_0 and Q6_K, whose unsigned
 *      values are offset to centre on 128): no m stored; the tile starts each block's integer
 *      sum at -128 sum(xq) instead of adding m sx afterwards, one float operation fewer a
 *      block and column (the products are bound by those operations: 0.84-0.94x the time,
 *      docs/benchmarks.md), and 0.90x the bytes;
 *   so 640 (G8), 768 (H), 576 (S) or 640 (H and S) bytes a block;
 *   +4 nibbles (G4, neither H nor S), the 4-bit types (Q4_0, Q4_1, Q4_K): two values a byte,
 *      u8 v[4][16][4] (v[j][n][k]: q[j][n][k] in the low nibble, q[j + 4][n][k] in the high),
 *      then d[16] and m[16]: 384 bytes a block, 0.75 a weight (Q4_K's K4 layout takes as
 *      many), where q is the unsigned 4-bit value (Q4_0: m = -8 d). The tile splits each
 *      64-byte load into its two groups (an and, a shift and an and: each load once, both
 *      groups from it; splitting it once per group measured 1.07-1.28x G8's time at 64-256
 *      rows, this 0.82-0.99x) and sums them as G8's:
 *      the integer sums and what follows are G8's, so the bytes of a 4-bit matrix serve steps
 *      of every size, one row (bound by memory: as fast as the one-row loops of _int8rows.c)
 *      to a prefill chunk (bound by arithmetic: about G8's speed, half its bytes);
 *   +4+8 super-block scales (G4K), Q4_K: G4's values, and in place of d and m a byte each of
 *      the sub-block's 6-bit scale sc[16] and min mn[16] (288 bytes a block), with the
 *      super-block's D[16] and -Dmin[16] (float32, 128 bytes per 8 blocks) after the tile's
 *      blocks: d = D sc and m = -Dmin mn, each product exact in float32, so bitwise G8's d and m
 *      (Q4_K's own sums): 0.59 bytes a weight (Q4_K 0.5625). A one-token step reads 0.79x
 *      G4's bytes; the tile widens 32 bytes and multiplies twice more a block and column.
 *   +1+2+8 six bits (G6), Q6_K (stoic_q6k_pack): per block G4's nibbles of the values q (0..63,
 *      w = (q - 32) d), their high bit pairs (128 bytes), the two scales of 16 weights as the
 *      file's int8 (32 bytes), and the super-block's float32 D[16] per 8 blocks after the
 *      tile's blocks: 416 + 8 bytes a block, 0.83 a weight (Q6_K itself 0.82, G8 with halves
 *      1.25). The tile rebuilds each group's values (a shift, two ands, a shift and an or per
 *      64 bytes; with GFNI two affine transforms and an or: g6_values) and starts a half's sum
 *      at -32 sum(xq): its integer sums, d = D sc and everything after are G8 + H + S's, so
 *      its products are bitwise theirs. A one-token step reads 0.66x the bytes (the 1.5B output
 *      layer's product 8.9 -> 7.1 ms; the model's decode step 43 -> 36 ms); over more than
 *      G6_IN_PLACE_ROWS rows (one row tile; three with GFNI) each group of tiles is first
 *      expanded into G8 + H + S in L2 (g6_expand), the rebuilding per row tile being dearer
 *      than the reading it saves there.
 * Types (stoic_g8_decode): the symmetric Q4_0 (q + 120), Q5_0 (q + 112), Q8_0 (q + 128) and
 * Q6_K (q + 96, per sub-block of 16: d = d_super * scale), each with m = -128 d; Q4_1 and Q5_1
 * (the file's m); Q4_K and Q5_K (per sub-block of 32: d = d_super * scale, m = -dmin * min).
 *
 * Numerics: those of _int8rows.c (its header): each block of 32 of a row of x quantised to int8
 * with its scale dx (and sx = dx * sum xq), the integer sums exact, then per block (per half of
 * one with H: sx then dx times the half's sum of xq) y += d dx sum(q xq) + m sx in float32, or
 * with S y += d dx (sum(q xq) - 128 sum(xq)), the sum exact. Not the float product: never with
 * --dtype float32.
 */

#include <omp.h>

#include "_blocks.h"

/* (the layout's bits over G8, qmm_dispatch's G8 .. G8 + 4: G8_HALVES, G8_SYMMETRIC, or
 * G8_NIBBLES alone) */
#define G8_TR 4 /* rows of x a tile of the product */
#define G8_TC 3 /* tiles of 16 output columns a tile of the product */

/* The natural-order unsigned q, and d and m per 16 weights (w = q d + m; both halves of a
 * block of 32 alike but for Q6_K; m = -128 d for the symmetric types), of N rows of GGML blocks
 * of `type` (K weights a row): 0, or -1 for a type this file does not read. */
int stoic_g8_decode(int type, const uint8_t *src, int64_t N, int64_t K, uint8_t *q, float *d,
                    float *m) {
    const int64_t nb = K / QK;
    if (K % QK != 0) return -1;
    if (type == Q6_K) {
        if (K % 256 != 0) return -1;
        _Pragma("omp parallel for schedule(static)")
        for (int64_t i = 0; i < N * (K / 256); i++) {
            const uint8_t *b = src + i * Q6_K_BYTES;
            const float dd = half_to_float(b + 208);
            for (int j = 0; j < 16; j++) {
                d[i * 16 + j] = dd * (float)(int8_t)b[192 + j];
                m[i * 16 + j] = -128.0f * d[i * 16 + j]; /* exact: a power of two */
            }
            for (int w = 0; w < 256; w++) { /* weight 128h + 32r + l (_kquants.c's header) */
                const int h = w >> 7, r = (w >> 5) & 3, l = w & 31;
                const int lo = (b[64 * h + 32 * (r & 1) + l] >> (4 * (r >> 1))) & 0x0F;
                const int hi = (b[128 + 32 * h + l] >> (2 * r)) & 0x03;
                q[i * 256 + w] = (uint8_t)((lo | (hi << 4)) + 96); /* (q - 32) + 128 */
            }
        }
        return 0;
    }
    if (type == Q4_K || type == Q5_K) {
        if (K % 256 != 0) return -1;
        const int64_t bytes = type == Q4_K ? Q4_K_BYTES : Q5_K_BYTES;
        _Pragma("omp parallel for schedule(static)")
        for (int64_t i = 0; i < N * (K / 256); i++) {
            const uint8_t *b = src + i * bytes;
            const float dd = half_to_float(b), dmin = half_to_float(b + 2);
            uint8_t sc[8], mn[8];
            unpack_scales(b + 4, sc, mn);
            const uint8_t *qh = b + 16, *qs = type == Q4_K ? b + 16 : b + 48;
            for (int j = 0; j < 8; j++) {
                const int64_t blk = i * 8 + j;
                d[2 * blk] = d[2 * blk + 1] = dd * (float)sc[j];
                m[2 * blk] = m[2 * blk + 1] = -(dmin * (float)mn[j]);
                uint8_t *o = q + blk * QK;
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
        float di, mi;
        switch (type) {
        case Q4_0:
        case Q4_1: {
            const int64_t bytes = type == Q4_0 ? Q4_0_BYTES : Q4_1_BYTES;
            const uint8_t *b = src + i * bytes, *qs = b + (type == Q4_0 ? 2 : 4);
            const uint8_t off = type == Q4_0 ? 120 : 0; /* (q - 8) + 128 */
            di = half_to_float(b);
            mi = type == Q4_0 ? -128.0f * di : half_to_float(b + 2);
            for (int l = 0; l < 16; l++) {
                o[l] = (uint8_t)((qs[l] & 0x0F) + off);
                o[l + 16] = (uint8_t)((qs[l] >> 4) + off);
            }
            break;
        }
        case Q5_0:
        case Q5_1: {
            const int64_t bytes = type == Q5_0 ? Q5_0_BYTES : Q5_1_BYTES;
            const int64_t head = type == Q5_0 ? 2 : 4;
            const uint8_t *b = src + i * bytes, *qs = b + head + 4;
            uint32_t qh;
            memcpy(&qh, b + head, 4);
            const uint8_t off = type == Q5_0 ? 112 : 0; /* (q - 16) + 128 */
            di = half_to_float(b);
            mi = type == Q5_0 ? -128.0f * di : half_to_float(b + 2);
            for (int l = 0; l < 16; l++) {
                o[l] = (uint8_t)(((qs[l] & 0x0F) | (((qh >> l) & 1) << 4)) + off);
                o[l + 16] = (uint8_t)(((qs[l] >> 4) | (((qh >> (l + 16)) & 1) << 4)) + off);
            }
            break;
        }
        case Q8_0: {
            const uint8_t *b = src + i * Q8_0_BYTES;
            di = half_to_float(b);
            mi = -128.0f * di; /* exact: a power of two times a half */
            for (int l = 0; l < QK; l++) o[l] = (uint8_t)((int)(int8_t)b[2 + l] + 128);
            break;
        }
        default:
            return -1;
        }
        d[2 * i] = d[2 * i + 1] = di;
        m[2 * i] = m[2 * i + 1] = mi;
    }
    return 0;
}

/* The layout N rows of decoded d and m (K weights a row) take: G8, plus G8_HALVES where some
 * block's halves differ, plus G8_SYMMETRIC where every m is -128 d (bit for bit) */
int stoic_g8_layout(const float *d, const float *m, int64_t N, int64_t K) {
    int halves = 0, symmetric = 1;
    /* on every core, as the decoding: serial, this scan took a third of a 1.5B file's Q6_K
     * layouts (0.4 of 1.4 s) */
    _Pragma("omp parallel for schedule(static) reduction(|: halves) reduction(&: symmetric)")
    for (int64_t i = 0; i < N * (K / QK); i++) {
        halves |= memcmp(d + 2 * i, d + 2 * i + 1, 4) || memcmp(m + 2 * i, m + 2 * i + 1, 4);
        for (int h = 0; h < 2; h++) {
            const float want = -128.0f * d[2 * i + h];
            symmetric &= !memcmp(m + 2 * i + h, &want, 4);
        }
    }
    return G8 + (halves ? G8_HALVES : 0) + (symmetric ? G8_SYMMETRIC : 0);
}

/* the bytes of a block of 16 rows by 32 weights: the values (a byte each, or with `nibbles`
 * half a byte), then 16 float32 scales for each of `halves` (1 or 2), and as many offsets
 * unless `symmetric` */
static inline int64_t g8_bytes_of(int halves, int symmetric, int nibbles) {
    return (nibbles ? 256 : 512) + 64 * halves * (symmetric ? 1 : 2);
}

#define G4K_BLOCK 288 /* G4K: 256 bytes of values, sc[16], mn[16] */
#define G4K_SUPER 128 /* G4K: D[16], -Dmin[16] per 8 blocks, after a tile's blocks */
#define G6_BLOCK 416 /* G6: 256 bytes of low nibbles, 128 of high bit pairs, sc[2][16] */
#define G6_SUPER 64  /* G6: D[16] per 8 blocks, after a tile's blocks */

/* g8_bytes_of for `layout` (G4K: a block's own bytes); 0 for another */
static int64_t g8_block_bytes(int layout) {
    if (layout == G8 + G8_NIBBLES + G8_SUPER) return G4K_BLOCK;
    if (layout == G6) return G6_BLOCK;
    if (layout < G8 || layout > G8 + G8_NIBBLES) return 0;
    const int bits = layout - G8;
    return g8_bytes_of(bits & G8_HALVES ? 2 : 1, !!(bits & G8_SYMMETRIC), bits == G8_NIBBLES);
}

/* the bytes of one tile of 16 rows (nb blocks of 32 weights a row) in `layout`; 0 for another
 * (G4K: a multiple of 8 blocks) */
static int64_t g8_tile_bytes(int layout, int64_t nb) {
    if (layout == G8 + G8_NIBBLES + G8_SUPER)
        return nb % 8 ? 0 : nb * G4K_BLOCK + nb / 8 * G4K_SUPER;
    if (layout == G6) return nb % 8 ? 0 : nb * G6_BLOCK + nb / 8 * G6_SUPER;
    return nb * g8_block_bytes(layout);
}

/* N rows of decoded q, d, m into G4 (out: stoic_g8_bytes): each block's values as 4-bit
 * unsigned v with w = v d + m: q itself where a block's q are all below 16, q - 120 with
 * m = -8 d where the block is Q4_0's symmetric form (m = -128 d, q in 120..135: w = (q - 128) d
 * = (v - 8) d, -8 d exact); 0, or -1 where a block is neither (a wider type) or its halves
 * differ */
static int g4_pack(const uint8_t *q, const float *d, const float *m, int64_t N, int64_t K,
                   uint8_t *out) {
    const int64_t nb = K / QK, tiles = (N + 15) / 16;
    memset(out, 0, (size_t)stoic_g8_bytes(N, K, G8 + G8_NIBBLES));
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *blk = out + (t * nb + b) * 384;
            float *bd = (float *)(void *)(blk + 256), *bm = bd + 16;
            for (int n = 0; n < 16 && t * 16 + n < N; n++) {
                const int64_t row = t * 16 + n, i = row * nb + b;
                const uint8_t *qr = q + row * K + b * QK;
                if (memcmp(d + 2 * i, d + 2 * i + 1, 4) || memcmp(m + 2 * i, m + 2 * i + 1, 4))
                    return -1;
                uint8_t lo = 255, hi = 0;
                for (int l = 0; l < QK; l++) {
                    lo = qr[l] < lo ? qr[l] : lo;
                    hi = qr[l] > hi ? qr[l] : hi;
                }
                const float symmetric = -128.0f * d[2 * i];
                int base = 0;
                float mi = m[2 * i];
                if (hi >= 16) {
                    if (memcmp(m + 2 * i, &symmetric, 4) || lo < 120 || hi > 135) return -1;
                    base = 120;
                    mi = -8.0f * d[2 * i];
                }
                for (int j = 0; j < 4; j++)
                    for (int k = 0; k < 4; k++)
                        blk[j * 64 + n * 4 + k] = (uint8_t)((qr[j * 4 + k] - base) |
                                                            ((qr[(j + 4) * 4 + k] - base) << 4));
                bd[n] = d[2 * i];
                bm[n] = mi;
            }
        }
    return 0;
}

/* the bytes of N rows of K weights in `layout` (stoic_g8_layout's); 0 for another */
int64_t stoic_g8_bytes(int64_t N, int64_t K, int layout) {
    return (N + 15) / 16 * g8_tile_bytes(layout, K / QK);
}

/* zero the last tile of N rows in `layout` where it has rows past N (padding, never written by
 * the packs that write every byte of a row's own): the rest is left to them, so each page of
 * the layout is touched once, not twice (a zeroing pass over the whole cost a 1.5B file's
 * layouts 0.3 s) */
static void g8_zero_padding(uint8_t *out, int64_t N, int64_t K, int layout) {
    if (N % 16 == 0) return;
    const int64_t tstride = g8_tile_bytes(layout, K / QK);
    memset(out + N / 16 * tstride, 0, (size_t)tstride);
}

/* N rows of Q4_K blocks (K weights a row) into G4K (out: stoic_g8_bytes): 0, or -1 where K is
 * not a multiple of 256. Rows in parallel (each writes its own bytes), as the decoding of the
 * K-quants and stoic_g8_pack's tiles: a 1.5B file's layouts in 2.3-2.9 s instead of 3.4-3.7 */
int stoic_g4k_pack(const uint8_t *src, int64_t N, int64_t K, uint8_t *out) {
    const int layout = G8 + G8_NIBBLES + G8_SUPER;
    const int64_t nb = K / QK, nsb = K / 256, tstride = g8_tile_bytes(layout, nb);
    if (K % 256 != 0 || !tstride) return -1;
    g8_zero_padding(out, N, K, layout);
    _Pragma("omp parallel for schedule(static)")
    for (int64_t row = 0; row < N; row++) {
        const int64_t t = row / 16, n = row % 16;
        uint8_t *tile = out + t * tstride;
        for (int64_t sb = 0; sb < nsb; sb++) {
            const uint8_t *b = src + (row * nsb + sb) * Q4_K_BYTES, *qs = b + 16;
            float *dm = (float *)(void *)(tile + nb * G4K_BLOCK + sb * G4K_SUPER);
            uint8_t sc[8], mn[8];
            unpack_scales(b + 4, sc, mn);
            dm[n] = half_to_float(b);
            dm[16 + n] = -half_to_float(b + 2);
            for (int j = 0; j < 8; j++) { /* sub-block j: nibbles (j & 1) of qs[32 (j / 2) ..] */
                uint8_t *blk = tile + (sb * 8 + j) * G4K_BLOCK;
                uint8_t q[QK];
                for (int l = 0; l < QK; l++) {
                    const uint8_t byte = qs[32 * (j / 2) + l];
                    q[l] = (uint8_t)((j & 1) ? byte >> 4 : byte & 0x0F);
                }
                for (int g = 0; g < 4; g++)
                    for (int k = 0; k < 4; k++)
                        blk[g * 64 + n * 4 + k] = (uint8_t)(q[g * 4 + k] | (q[(g + 4) * 4 + k] << 4));
                blk[256 + n] = sc[j];
                blk[272 + n] = mn[j];
            }
        }
    }
    return 0;
}

/* N rows of Q6_K blocks (K weights a row) into G6 (out: stoic_g8_bytes), straight from the
 * blocks, rows in parallel: per tile of 16 rows and block of 32 weights, the unsigned 6-bit
 * values v = q (w = (v - 32) d) as G4's nibbles (v[j][n][k]: the low 4 bits of group j's in
 * the low nibble, of group j + 4's in the high one), their high 2 bits (u[j / 2][n][k]: groups
 * j and j + 4 in bits 4 (j & 1) .. 4 (j & 1) + 3, two bits each), and the block's two scales of
 * 16 weights (int8, sc[h][n]); the super-block's d (float32 D[16]) per 8 blocks after the
 * tile's blocks. 0.8125 bytes a weight (Q6_K itself 0.82; G8 with halves 1.25): d = D sc, its
 * products bitwise those of G8 + G8_HALVES + G8_SYMMETRIC over stoic_g8_decode's values. 0, or
 * -1 where K is not a multiple of 256 */
int stoic_q6k_pack(const uint8_t *src, int64_t N, int64_t K, uint8_t *out) {
    const int64_t nb = K / QK, nsb = K / 256, tstride = g8_tile_bytes(G6, nb);
    if (K % 256 != 0 || !tstride) return -1;
    g8_zero_padding(out, N, K, G6);
    _Pragma("omp parallel for schedule(static)")
    for (int64_t row = 0; row < N; row++) {
        const int64_t n = row % 16;
        uint8_t *tile = out + row / 16 * tstride;
        for (int64_t sb = 0; sb < nsb; sb++) {
            const uint8_t *b = src + (row * nsb + sb) * Q6_K_BYTES;
            float *dd = (float *)(void *)(tile + nb * G6_BLOCK + sb * G6_SUPER);
            dd[n] = half_to_float(b + 208);
            uint8_t q[256];
            for (int h = 0; h < 2; h++) /* stoic_g8_decode's, unsigned 0..63 */
                for (int r = 0; r < 4; r++)
                    for (int l = 0; l < 32; l++) {
                        const int lo = (b[64 * h + 32 * (r & 1) + l] >> (4 * (r >> 1))) & 0x0F;
                        const int hi = (b[128 + 32 * h + l] >> (2 * r)) & 0x03;
                        q[128 * h + 32 * r + l] = (uint8_t)(lo | (hi << 4));
                    }
            for (int j = 0; j < 8; j++) {
                uint8_t *blk = tile + (sb * 8 + j) * G6_BLOCK;
                const uint8_t *v = q + 32 * j;
                for (int g = 0; g < 4; g++)
                    for (int k = 0; k < 4; k++) {
                        const uint8_t a = v[4 * g + k], c = v[4 * (g + 4) + k];
                        blk[g * 64 + n * 4 + k] = (uint8_t)((a & 0x0F) | (c << 4));
                        uint8_t *u = blk + 256 + (g >> 1) * 64 + n * 4 + k;
                        const int shift = 4 * (g & 1);
                        *u = (uint8_t)((*u & ~(0x0F << shift)) |
                                       (((a >> 4) | ((c >> 4) << 2)) << shift));
                    }
                blk[384 + n] = b[192 + 2 * j];
                blk[400 + n] = b[192 + 2 * j + 1];
            }
        }
    }
    return 0;
}

/* N rows of decoded q, d, m (stoic_g8_decode's, K weights a row) into `layout` (out: the bytes
 * of stoic_g8_bytes, zeroed padding): 0, or -1 for another layout, K not a multiple of 32, or
 * one the rows do not fit (halves that differ, an m not -128 d) */
int stoic_g8_pack(const uint8_t *q, const float *d, const float *m, int64_t N, int64_t K,
                  int layout, uint8_t *out) {
    const int64_t nb = K / QK, tiles = (N + 15) / 16, bytes = g8_block_bytes(layout);
    if (K % QK != 0 || !bytes) return -1;
    if (layout == G8 + G8_NIBBLES) return g4_pack(q, d, m, N, K, out);
    if (layout == G8 + G8_NIBBLES + G8_SUPER || layout == G6)
        return -1; /* from the blocks: stoic_g4k_pack, stoic_q6k_pack */
    const int bits = layout - G8, fits = stoic_g8_layout(d, m, N, K) - G8;
    if ((bits & G8_HALVES) < (fits & G8_HALVES) || (bits & G8_SYMMETRIC) > (fits & G8_SYMMETRIC))
        return -1;
    const int halves = bits & G8_HALVES ? 2 : 1, offsets = !(bits & G8_SYMMETRIC);
    memset(out, 0, (size_t)stoic_g8_bytes(N, K, layout));
    _Pragma("omp parallel for schedule(static)")
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *blk = out + (t * nb + b) * bytes;
            float *bd = (float *)(void *)(blk + 512), *bm = bd + 16 * halves;
            for (int n = 0; n < 16 && t * 16 + n < N; n++) {
                const int64_t row = t * 16 + n;
                const uint8_t *qr = q + row * K + b * QK;
                for (int g = 0; g < 8; g++) memcpy(blk + g * 64 + n * 4, qr + g * 4, 4);
                for (int h = 0; h < halves; h++) {
                    bd[16 * h + n] = d[2 * (row * nb + b) + h];
                    if (offsets) bm[16 * h + n] = m[2 * (row * nb + b) + h];
                }
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

/* G6's values of group 4 h + j of a block (64 of them, 0..63): from v (the 64 bytes at j * 64:
 * half h's nibbles) and u (at 256 + (j >> 1) * 64: the high bit pairs, at bit 4 (j & 1) + 2 h).
 * With GFNI and `affine`, each bit move is one affine byte transform (GF2P8AFFINEQB: result
 * bit i is the parity of the source byte AND the matrix's byte 7 - i): the pair to bits 4-5,
 * the high nibble to bits 0-3, then a ternary-logic (v & 0x0F) | pair or an or: 2-3 operations
 * where shifts and masks take 5-6. The integers are the same either way. Measured on Zen 4
 * (benchmarks.md, "G6 with GFNI"): 4 rows in place 0.66-0.85x the time; in the expansion
 * (g6_expand, many rows) no faster, so it keeps the shifts. */
static inline __attribute__((always_inline)) __m512i g6_values(__m512i v, __m512i u, int j,
                                                               int h, int affine) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    const int at = 4 * (j & 1) + 2 * h;
#ifdef __GFNI__
    if (affine) {
        /* bit `at` to bit 4 (matrix byte 3), bit at + 1 to bit 5 (byte 2), no other */
        const __m512i to45 = _mm512_set1_epi64((long long)((1ULL << at) << 24 | (2ULL << at) << 16));
        const __m512i pair = _mm512_gf2p8affine_epi64_epi8(u, to45, 0);
        if (!h) return _mm512_ternarylogic_epi32(v, pair, low, 0xEC); /* (v & low) | pair */
        /* bits 4..7 to 0..3: matrix bytes 7..4 hold 1 << 4 .. 1 << 7 */
        const __m512i down = _mm512_set1_epi64((long long)0x1020408000000000ULL);
        return _mm512_or_si512(_mm512_gf2p8affine_epi64_epi8(v, down, 0), pair);
    }
#endif
    (void)affine;
    const __m512i lo = _mm512_and_si512(h ? _mm512_srli_epi16(v, 4) : v, low);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(u, (unsigned)at), _mm512_set1_epi8(0x03));
    return _mm512_or_si512(lo, _mm512_slli_epi16(hi, 4));
}

/* the most rows a G6 product reads in place (in its tiles, row tile by row tile; more are
 * expanded first, g6_expand): with GFNI, whose tiles rebuild the values in 2-3 operations, 3
 * row tiles (5-8 rows then took 0.63-0.67x the expanded product's time, 9-12 0.86-0.92x;
 * benchmarks/g6_gfni_bench.py), else one */
#ifdef __GFNI__
#define G6_IN_PLACE_ROWS (3 * G8_TR)
#else
#define G6_IN_PLACE_ROWS G8_TR
#endif

/* R rows of quantised x by C tiles of 16 output columns (each `tstride` bytes after the last;
 * cols[c]: the valid columns of tile c): y[r][16 C columns]. Each x value loaded (broadcast)
 * feeds C multiply-adds and each load of weights R: 4 rows by 3 tiles measured 1.14x the
 * throughput of 8 rows by one (docs/benchmarks.md, "int8 activations for batched steps").
 * res (or NULL): float32 [R][ldy] added to the result (a residual: y = res + (x W^T + bias)).
 * H, S: the layout's halves and symmetric bits. sx: [R][nb] ([R][nb][2] with H) the float sx
 * of each block (half), or with S the int32 -128 sum(xq). While it runs, the lines from *pf to
 * pf_end go into L2, pf_lines a block (the next tiles this thread multiplies: they would
 * otherwise come from memory at their first row tile). Every element's arithmetic is the same
 * whatever R, C, the prefetches and the row's place in the tile. */
static inline __attribute__((always_inline)) void
g8_tile(const int R, const int C, const int H, const int S, const int NB, const int8_t *xq,
        const float *dx, const void *sx, int64_t K, int64_t nb, const uint8_t *wt,
        int64_t tstride, void *y, int y_bf16, int64_t ldy, const __mmask16 *cols,
        const float *bias, const float *res, const uint8_t **pf, const uint8_t *pf_end,
        int64_t pf_lines) {
    const int64_t bytes = NB == 3   ? G6_BLOCK
                          : NB == 2 ? G4K_BLOCK
                                    : g8_bytes_of(H ? 2 : 1, S, NB),
                  parts = H ? 2 : 1;
    const int64_t values = NB ? 256 : 512;
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[G8_TR][G8_TC];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wt + b * bytes;
        for (int64_t i = 0; i < pf_lines && *pf < pf_end; i++, *pf += 64)
            _mm_prefetch((const char *)*pf, _MM_HINT_T1);
        for (int h = 0; h < parts; h++) {
            __m512i ia[G8_TR][G8_TC];
            for (int r = 0; r < R; r++) {
                const int32_t *offset = (const int32_t *)sx + (r * nb + b) * parts + h;
                /* G6's values are q, not q + 96: -32 sum(xq), exact (a multiple of 4) */
                const int32_t first = NB == 3 ? *offset / 4 : *offset;
                const __m512i start = S ? _mm512_set1_epi32(first) : _mm512_setzero_si512();
                for (int c = 0; c < C; c++) ia[r][c] = start;
            }
            if (NB == 3) /* G6: half h's group 4 h + j from load j's nibble h and its bits */
                for (int j = 0; j < 4; j++) {
                    __m512i w[G8_TC];
                    for (int c = 0; c < C; c++) {
                        const uint8_t *at = blk + c * tstride;
                        const __m512i v = _mm512_loadu_si512((const void *)(at + j * 64));
                        const __m512i u =
                            _mm512_loadu_si512((const void *)(at + 256 + (j >> 1) * 64));
                        w[c] = g6_values(v, u, j, h, 1);
                    }
                    for (int r = 0; r < R; r++) {
                        int32_t xv;
                        memcpy(&xv, xq + r * K + b * QK + (4 * h + j) * 4, 4);
                        const __m512i xb = _mm512_set1_epi32(xv);
                        for (int c = 0; c < C; c++)
                            ia[r][c] = _mm512_dpbusd_epi32(ia[r][c], w[c], xb);
                    }
                }
            if (NB == 1 || NB == 2) /* G4: group j the low nibbles of load j, group j + 4 its high ones */
                for (int j = 0; j < 4; j++) {
                    __m512i v[G8_TC], w[G8_TC];
                    for (int c = 0; c < C; c++) {
                        v[c] = _mm512_loadu_si512((const void *)(blk + c * tstride + j * 64));
                        w[c] = _mm512_and_si512(v[c], low);
                    }
                    for (int r = 0; r < R; r++) {
                        int32_t xv;
                        memcpy(&xv, xq + r * K + b * QK + j * 4, 4);
                        const __m512i xb = _mm512_set1_epi32(xv);
                        for (int c = 0; c < C; c++)
                            ia[r][c] = _mm512_dpbusd_epi32(ia[r][c], w[c], xb);
                    }
                    for (int c = 0; c < C; c++)
                        w[c] = _mm512_and_si512(_mm512_srli_epi16(v[c], 4), low);
                    for (int r = 0; r < R; r++) {
                        int32_t xv;
                        memcpy(&xv, xq + r * K + b * QK + (j + 4) * 4, 4);
                        const __m512i xb = _mm512_set1_epi32(xv);
                        for (int c = 0; c < C; c++)
                            ia[r][c] = _mm512_dpbusd_epi32(ia[r][c], w[c], xb);
                    }
                }
            for (int g = 8 / parts * h; g < 8 / parts * (h + 1) && !NB; g++) {
                __m512i w[G8_TC];
                for (int c = 0; c < C; c++)
                    w[c] = _mm512_loadu_si512((const void *)(blk + c * tstride + g * 64));
                for (int r = 0; r < R; r++) {
                    int32_t xv;
                    memcpy(&xv, xq + r * K + b * QK + g * 4, 4);
                    const __m512i xb = _mm512_set1_epi32(xv);
                    for (int c = 0; c < C; c++)
                        ia[r][c] = _mm512_dpbusd_epi32(ia[r][c], w[c], xb);
                }
            }
            for (int c = 0; c < C; c++) {
                __m512 d, m;
                if (NB == 3) { /* G6: D sc of half h, exact (G8's d) */
                    const int8_t *sc = (const int8_t *)(blk + c * tstride + 384 + 16 * h);
                    const float *dd = (const float *)(const void *)(wt + c * tstride +
                                                                   nb * G6_BLOCK + (b / 8) * G6_SUPER);
                    d = _mm512_mul_ps(_mm512_loadu_ps(dd), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                               _mm_loadu_si128((const __m128i *)sc))));
                    m = d;
                } else if (NB == 2) { /* G4K: D sc and -Dmin mn, exact */
                    const uint8_t *sm = blk + c * tstride + values;
                    const float *dm = (const float *)(const void *)(wt + c * tstride +
                                                                   nb * G4K_BLOCK + (b / 8) * G4K_SUPER);
                    d = _mm512_mul_ps(_mm512_loadu_ps(dm), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                                               _mm_loadu_si128((const __m128i *)sm))));
                    m = _mm512_mul_ps(_mm512_loadu_ps(dm + 16),
                                      _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                          _mm_loadu_si128((const __m128i *)(sm + 16)))));
                } else {
                    const float *dm = (const float *)(const void *)(blk + c * tstride + values);
                    d = _mm512_loadu_ps(dm + 16 * h);
                    m = S ? d : _mm512_loadu_ps(dm + 16 * parts + 16 * h);
                }
                for (int r = 0; r < R; r++) {
                    const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(dx[r * nb + b]));
                    acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[r][c]), scale, acc[r][c]);
                    if (!S) {
                        const float s = ((const float *)sx)[(r * nb + b) * parts + h];
                        acc[r][c] = _mm512_fmadd_ps(m, _mm512_set1_ps(s), acc[r][c]);
                    }
                }
            }
        }
    }
    for (int c = 0; c < C; c++) {
        const __m512 bv =
            bias ? _mm512_maskz_loadu_ps(cols[c], bias + 16 * c) : _mm512_setzero_ps();
        for (int r = 0; r < R; r++) {
            __m512 v = _mm512_add_ps(acc[r][c], bv);
            if (res) v = _mm512_add_ps(_mm512_maskz_loadu_ps(cols[c], res + r * ldy + 16 * c), v);
            if (y_bf16)
                g8_store_bf16((uint16_t *)y + r * ldy + 16 * c, v, cols[c]);
            else
                _mm512_mask_storeu_ps((float *)y + r * ldy + 16 * c, cols[c], v);
        }
    }
}

/* `count` tiles of G6 (each `tstride` bytes after the last; nb blocks a row) into G8 + G8_HALVES
 * + G8_SYMMETRIC (out: count tiles of nb blocks of 640 bytes): the values q + 96 and the scales
 * d = D sc, exactly what stoic_g8_pack makes of the decoded blocks */
static void g6_expand(const uint8_t *wt, int64_t tstride, int64_t count, int64_t nb,
                      uint8_t *out) {
    const __m512i offset = _mm512_set1_epi8(96);
    for (int64_t c = 0; c < count; c++)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = wt + c * tstride + b * G6_BLOCK;
            const float *dd =
                (const float *)(const void *)(wt + c * tstride + nb * G6_BLOCK + (b / 8) * G6_SUPER);
            uint8_t *o = out + (c * nb + b) * g8_bytes_of(2, 1, 0);
            for (int j = 0; j < 4; j++) {
                const __m512i v = _mm512_loadu_si512((const void *)(blk + j * 64));
                const __m512i u = _mm512_loadu_si512((const void *)(blk + 256 + (j >> 1) * 64));
                for (int h = 0; h < 2; h++)
                    _mm512_storeu_si512((void *)(o + (4 * h + j) * 64),
                                        _mm512_add_epi8(g6_values(v, u, j, h, 0), offset));
            }
            for (int h = 0; h < 2; h++) {
                const __m512 sc = _mm512_cvtepi32_ps(
                    _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 384 + 16 * h))));
                _mm512_storeu_ps((float *)(void *)(o + 512 + 64 * h),
                                 _mm512_mul_ps(_mm512_loadu_ps(dd), sc));
            }
        }
}

/* all the rows of M by C tiles from tile t: G8_TR rows at a time, then the rest */
#define G8_ROWS(R, C, H, S)                                                                     \
    g8_tile(R, C, H, S, NIBBLES, xq + r * K, dx + r * nb, (const char *)sums + 4 * r * nb * (H ? 2 : 1), \
            K, nb, wt, tstride,                                                                 \
            y_bf16 ? (void *)((uint16_t *)y + r * ldy + c0)                                     \
                   : (void *)((float *)y + r * ldy + c0),                                       \
            y_bf16, ldy, cols, bt, residual ? residual + r * ldy + c0 : NULL, &pf, pf_end, pf_lines)
#define G8_ALL_ROWS(C, H, S)                                                                    \
    do {                                                                                        \
        int64_t r = 0;                                                                          \
        for (; r + G8_TR <= M; r += G8_TR) G8_ROWS(G8_TR, C, H, S);                             \
        switch (M - r) {                                                                        \
        case 3: G8_ROWS(3, C, H, S); break;                                                     \
        case 2: G8_ROWS(2, C, H, S); break;                                                     \
        case 1: G8_ROWS(1, C, H, S); break;                                                     \
        default: break;                                                                         \
        }                                                                                       \
    } while (0)
#define G8_GROUP(H, S)                                                                          \
    do {                                                                                        \
        if (count == G8_TC)                                                                     \
            G8_ALL_ROWS(G8_TC, H, S);                                                           \
        else if (count == 2)                                                                    \
            G8_ALL_ROWS(2, H, S);                                                               \
        else                                                                                    \
            G8_ALL_ROWS(1, H, S);                                                               \
    } while (0)

/* What the tiles add per block (per half with H) besides the integer sums, from x's int8 copy
 * and scales: S, the int32 -128 sum(xq); else the float sx (dx sum(xq): int8rows_quantize's sx
 * without H). [M][nb] or [M][nb][2]; NULL where it cannot be allocated. */
static void *g8_sums(const int8_t *xq, const float *dx, int64_t M, int64_t nb, int halves,
                     int symmetric) {
    void *out = malloc(4 * (size_t)(M * nb * halves));
    if (!out) return NULL;
    for (int64_t i = 0; i < M * nb; i++)
        for (int h = 0; h < halves; h++) {
            int32_t sum = 0;
            for (int l = 0; l < QK / halves; l++) sum += xq[i * QK + QK / halves * h + l];
            if (symmetric)
                ((int32_t *)out)[halves * i + h] = -128 * sum;
            else
                ((float *)out)[halves * i + h] = dx[i] * (float)sum;
        }
    return out;
}

/* y[M, N] (row stride ldy) = (residual +) x[M, K] @ W^T (+ bias) over W in `layout` (G8 ..
 * G8 + 3), x and y float32 or (x_bf16, y_bf16) bfloat16, the residual float32 (row stride ldy;
 * it may be y itself): 0; 1 where this build has no VNNI (nothing
 * computed); -1 for another layout; -2 if the scratch copy of x cannot be allocated.
 * Each row of y is computed in one order whatever M is and wherever the row falls in the tiles
 * (its own int8 copy and scales, exact integer sums, then the blocks' scaled sums added in
 * block order): bitwise the same alone or in any batch, so --deterministic multiplies on it too
 * (the G8 layouts of qmm_dispatch).
 *
 * Each thread takes a run of groups of G8_TC tiles and, while it runs a group's rows, brings
 * the next group's weights into L2 (g8_tile): a 32-row product over weights that come from
 * memory, as a step's do (the model's weights are larger than the caches), took 0.90x the
 * time (docs/benchmarks.md). */
int gemm8_mm(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *w, int64_t N,
             int layout, const float *bias, const float *residual, void *y, int y_bf16, int64_t ldy,
             int threads) {
    const int64_t nb = K / QK, tiles = (N + 15) / 16, groups = (tiles + G8_TC - 1) / G8_TC;
    const int64_t tstride = g8_tile_bytes(layout, nb);
    const int bits = layout - G8;
    const int halves = bits & G8_HALVES ? 2 : 1, symmetric = !!(bits & G8_SYMMETRIC);
    if (!tstride) return -1;
    if (M <= 0) return 0;
    int8_t *xq;
    float *scales;
    if (int8rows_quantize(x, x_bf16, M, K, 0, threads, &xq, &scales) != 0) return -2;
    float *dx = scales;
    void *own = halves == 2 || symmetric ? g8_sums(xq, dx, M, nb, halves, symmetric) : NULL;
    const void *sums = halves == 2 || symmetric ? own : (const void *)(scales + M * nb);
    if (!sums) {
        free(xq);
        free(scales);
        return -2;
    }
    const int64_t row_tiles = (M + G8_TR - 1) / G8_TR;
    const int NIBBLES = 0; /* G4's case shadows it */
    /* G6 over more than G6_IN_PLACE_ROWS rows: each group of tiles expanded once into G8 + H
     * + S (its unpacking per tile and row tile made 8-64 rows 1.5-1.7x G8's time; expanded,
     * every row tile after the first runs G8's tile on it, in L2) */
    const int expand = layout == G6 && M > G6_IN_PLACE_ROWS;
    int failed = 0;
    _Pragma("omp parallel num_threads(threads) reduction(|: failed)") {
        const int64_t nth = omp_get_num_threads(), tid = omp_get_thread_num();
        uint8_t *expanded = expand ? malloc((size_t)(G8_TC * nb * g8_bytes_of(2, 1, 0))) : NULL;
        failed |= expand && !expanded;
        const int64_t lo = groups * tid / nth, hi = groups * (tid + 1) / nth;
        for (int64_t grp = lo; grp < hi && !(expand && !expanded); grp++) {
            const int64_t t = grp * G8_TC, c0 = t * 16;
            const int64_t count = tiles - t < G8_TC ? tiles - t : G8_TC;
            const uint8_t *wt = w + t * tstride;
            /* this thread's next group, spread over this group's row tiles and blocks */
            const int64_t next = tiles < t + 2 * G8_TC ? tiles : t + 2 * G8_TC;
            const uint8_t *pf = grp + 1 < hi ? wt + G8_TC * tstride : NULL;
            const uint8_t *pf_end = pf ? w + next * tstride : NULL;
            const int64_t pf_lines =
                pf ? ((pf_end - pf) / 64 + row_tiles * nb - 1) / (row_tiles * nb) : 0;
            __mmask16 cols[G8_TC];
            for (int64_t c = 0; c < count; c++) {
                const int64_t left = N - c0 - 16 * c;
                cols[c] = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
            }
            const float *bt = bias ? bias + c0 : NULL;
            switch (layout - G8) {
            case G8_NIBBLES: {
                const int NIBBLES = 1;
                G8_GROUP(0, 0);
                break;
            }
            case G8_NIBBLES + G8_SUPER: {
                const int NIBBLES = 2;
                G8_GROUP(0, 0);
                break;
            }
            case G6 - G8:
                if (expanded) { /* many rows: the group's tiles in G8 + H + S, then its tile */
                    g6_expand(wt, tstride, count, nb, expanded);
                    const uint8_t *wt = expanded;
                    const int64_t tstride = nb * g8_bytes_of(2, 1, 0);
                    G8_GROUP(1, 1);
                } else { /* few rows: G6's bytes read once, then from L2 */
                    const int NIBBLES = 3;
                    G8_GROUP(1, 1);
                }
                break;
            case 0: G8_GROUP(0, 0); break;
            case G8_HALVES: G8_GROUP(1, 0); break;
            case G8_SYMMETRIC: G8_GROUP(0, 1); break;
            case G8_HALVES + G8_SYMMETRIC: G8_GROUP(1, 1); break;
            default: break;
            }
        }
        free(expanded);
    }
    free(own);
    free(xq);
    free(scales);
    return failed ? -2 : 0;
}
#else
int gemm8_mm(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *w, int64_t N,
             int layout, const float *bias, const float *residual, void *y, int y_bf16, int64_t ldy,
             int threads) {
    (void)x, (void)x_bf16, (void)M, (void)K, (void)w, (void)N, (void)layout, (void)bias;
    (void)residual, (void)y, (void)y_bf16, (void)ldy, (void)threads;
    return 1;
}
#endif

int stoic_g8_mm(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                int layout, const float *bias, const float *residual, void *y, int y_bf16,
                int threads) {
    return gemm8_mm(x, x_bf16, M, K, w, N, layout, bias, residual, y, y_bf16, N, threads);
}
