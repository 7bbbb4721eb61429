/* stoic's CPU kernels: the library's interface. libstoic_qkernels.so exports exactly the
 * functions and constants declared here (and nothing else: what one file calls in another is
 * hidden, _common.h); _qkernels.py binds them with ctypes (its argument lists mirror these
 * prototypes). What the files share inside the library is in _common.h and _blocks.h.
 *
 * The constants both sides need are defined here, once:
 *   - the GGML block types (STOIC_GGML_TYPES), QK, QK_K and MAX_HEAD_DIM, which _constants.py
 *     reads from this file's text at import: a GGUF file's tensors are sorted by their types,
 *     and a model's head dimension checked, before any library is built (and where none can
 *     be). Keep those lines in the forms it parses: `#define NAME number` and one
 *     `X(name, id, bytes, weights, layout)` a line;
 *   - the layouts and flags of stoic_qmm, which it reads from the built library
 *     (stoic_layout_of and the const ints at the end, _constants.c).
 *
 * Built by _build.py: each .c file of this directory compiled to its own object, the objects
 * linked into one shared library. Threads are OpenMP's (the libgomp torch itself loads).
 */
#ifndef STOIC_KERNELS_H
#define STOIC_KERNELS_H

#include <stdint.h>

/* the weights of a 32-weight block (Q4_0 .. Q8_0) and of a K-quant's super-block */
#define QK 32
#define QK_K 256

/* The layouts the products read (stoic_qmm's `type`): GGML blocks repacked once at load
 * (stoic_repack) with float32 scales; _qkernels.c describes S8, U4 and Z4, _kquants.c the
 * K-quants' and the 5-bit types' (their sizes: _blocks.h). */
#define S8 100
#define U4 101
#define Z4 102
#define K4 103
#define K5 104
#define K6 105
#define Z5 106
#define U5 107
/* a matrix stacked from parts of different layouts: `w` points to a descriptor (_qkernels.c) */
#define MIXED 110
/* --deterministic's bfloat16 products: `w` points to a descriptor (_bf16fixed.c) */
#define BF16FIXED 120
/* int8 activations over the G8 layouts, G8 .. G8 + 3, G4 = G8 + G8_NIBBLES, G4K = G4 +
 * G8_SUPER and G6 = G8 + G8_HALVES + G8_SYMMETRIC + G8_SUPER (_gemm8.c: its variants' bits) */
#define G8 130
#define G8_HALVES 1
#define G8_SYMMETRIC 2
#define G8_NIBBLES 4
#define G8_SUPER 8
/* Q6_K's six bits: G4's nibbles, the high bit pairs, the file's scales (_gemm8.c) */
#define G6 (G8 + G8_HALVES + G8_SYMMETRIC + G8_SUPER)
/* or'ed with a layout: every row of y in one order whatever M is (--deterministic) */
#define FIXED_ORDER 0x10000
/* or'ed with a layout: up to eight rows of x quantised to int8 (_int8rows.c) */
#define INT8_ROWS 0x20000

/* The GGML block types the kernels compute on: X(name, GGML type id, bytes a block, weights a
 * block, the layout stoic_repack makes of them). */
#define STOIC_GGML_TYPES(X)           \
    X(Q4_0, 2, 18, QK, Z4)           \
    X(Q4_1, 3, 20, QK, U4)           \
    X(Q5_0, 6, 22, QK, Z5)           \
    X(Q5_1, 7, 24, QK, U5)           \
    X(Q8_0, 8, 34, QK, S8)           \
    X(Q4_K, 12, 144, QK_K, K4)       \
    X(Q5_K, 13, 176, QK_K, K5)       \
    X(Q6_K, 14, 210, QK_K, K6)

/* Q4_0 = 2, ..., and Q4_0_BYTES = 18, ...: a type's id and the bytes of one of its blocks */
#define STOIC_TYPE_ID(name, id, bytes, weights, layout) name = id,
#define STOIC_TYPE_BYTES(name, id, bytes, weights, layout) name##_BYTES = bytes,
enum { STOIC_GGML_TYPES(STOIC_TYPE_ID) };
enum { STOIC_GGML_TYPES(STOIC_TYPE_BYTES) };

/* the largest head dimension the attention kernels take */
#define MAX_HEAD_DIM 256

/* ---- The quantised products (_qkernels.c, _kquants.c, _int8rows.c, _bf16fixed.c) */
int stoic_qmm(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
              const float *bias, float *y, int threads);
int64_t stoic_repacked_bytes(int type);
int stoic_repack(int type, const uint8_t *src, int64_t N, int64_t K, uint8_t *dst);
int stoic_dequantize(int type, const uint8_t *w, int64_t N, int64_t K, float *out);
int stoic_int8_rows(void);
int stoic_bf16_fixed(void);
int stoic_bf16_pack(int layout, const uint8_t *w, int64_t N, int64_t K, uint16_t *out,
                    int threads);

/* ---- Products of many rows on int8 activations over the G8 layouts (_gemm8.c) */
int stoic_g8_decode(int type, const uint8_t *src, int64_t N, int64_t K, uint8_t *q, float *d,
                    float *m);
int stoic_g8_layout(const float *d, const float *m, int64_t N, int64_t K);
int64_t stoic_g8_bytes(int64_t N, int64_t K, int layout);
int stoic_g8_pack(const uint8_t *q, const float *d, const float *m, int64_t N, int64_t K,
                  int layout, uint8_t *out);
int stoic_g8_mm(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                int layout, const float *bias, const float *residual, void *y, int y_bf16,
                int threads);
int stoic_g4k_pack(const uint8_t *src, int64_t N, int64_t K, uint8_t *out);
int stoic_q6k_pack(const uint8_t *src, int64_t N, int64_t K, uint8_t *out);

/* ---- A decode step's layer (_decode_layer.c) and attention (_rows_attention.c,
 * _chunk_attention.c) */
int stoic_layer_pre(const float *hidden, int64_t M, int64_t D, const float *norm, float eps,
                    int layout, const uint8_t *qkv, const float *bias, int64_t heads,
                    int64_t kv_heads, int64_t dh, const float *cos, const float *sin, float *q,
                    float *k, float *v, int threads);
int stoic_decode_attention(const float *q, const float *k, const float *v, void *k_pool,
                           void *v_pool, const int64_t *write, const int64_t *tables,
                           const int64_t *lens, int64_t M, int64_t heads, int64_t kv_heads,
                           int64_t dh, int64_t block, int64_t max_blocks, float scale, float *out,
                           int threads, int kv_bf16);
int stoic_layer_post(float *hidden, const float *attn, int64_t M, int64_t D, int64_t A,
                     int layout_o, const uint8_t *o, const float *norm, float eps, int layout_gu,
                     const uint8_t *gate_up, int64_t F, int layout_down, const uint8_t *down,
                     int threads);
int stoic_prefill_attention(const float *q, const float *k, const float *v, float *k_pool,
                            float *v_pool, const int64_t *write, const int64_t *tables,
                            const int64_t *lens, const int64_t *runs, int64_t n_runs, int64_t M,
                            int64_t heads, int64_t kv_heads, int64_t dh, int64_t block,
                            int64_t max_blocks, float scale, float *out, int threads,
                            int kv_bf16);
int stoic_chunk_attention(const float *q, const void *k_pool, const void *v_pool,
                          const int64_t *table, int64_t nblocks, int64_t start_pos, int64_t n,
                          int64_t heads, int64_t kv_heads, int64_t dh, int64_t block, float scale,
                          float *out, int threads, int kv_bf16);
int stoic_chunk_attention_available(void);

/* ---- The bfloat16 prefill's elementwise operators (_cops.c) */
int stoic_rms_norm_bf16(const float *x, int64_t M, int64_t D, const float *w, float eps,
                        uint16_t *out, int threads);
int stoic_rope_bf16(uint16_t *y, int64_t N, int64_t stride, int64_t heads, int64_t dh,
                    const float *cos, const float *sin, int threads);
int stoic_silu_mul_bf16(const uint16_t *gate, int64_t gs, const uint16_t *up, int64_t us,
                        int64_t M, int64_t F, uint16_t *out, int threads);

/* ---- The constants the bindings read from the library (_constants.c) */
/* the layout stoic_repack makes of GGML type `type` (STOIC_GGML_TYPES), 0 for another */
int stoic_layout_of(int type);
extern const int stoic_layout_mixed;      /* MIXED */
extern const int stoic_layout_bf16fixed;  /* BF16FIXED */
extern const int stoic_layout_g8;         /* G8 */
extern const int stoic_layout_g4;         /* G8 + G8_NIBBLES */
extern const int stoic_layout_g4k;        /* G8 + G8_NIBBLES + G8_SUPER */
extern const int stoic_layout_g6;         /* G8 + G8_HALVES + G8_SYMMETRIC + G8_SUPER */
extern const int stoic_flag_fixed_order;  /* FIXED_ORDER */
extern const int stoic_flag_int8_rows;    /* INT8_ROWS */
extern const int stoic_max_head_dim;      /* MAX_HEAD_DIM */

#endif
