/* The constants of stoic_kernels.h that the Python bindings (_constants.py) read from the built
 * library rather than restate: the layout each GGML type is repacked into, the layouts and
 * flags stoic_qmm takes, MAX_HEAD_DIM. Only the interface header: no code of the products.
 */
#include "stoic_kernels.h"

int stoic_layout_of(int type) {
#define STOIC_LAYOUT_OF(name, id, bytes, weights, layout) \
    if (type == (id)) return (layout);
    STOIC_GGML_TYPES(STOIC_LAYOUT_OF)
#undef STOIC_LAYOUT_OF
    return 0;
}

const int stoic_layout_mixed = MIXED;
const int stoic_layout_bf16fixed = BF16FIXED;
const int stoic_layout_g8 = G8;
const int stoic_layout_g4 = G8 + G8_NIBBLES;
const int stoic_layout_g4k = G8 + G8_NIBBLES + G8_SUPER;
const int stoic_layout_g6 = G6;
const int stoic_flag_fixed_order = FIXED_ORDER;
const int stoic_flag_int8_rows = INT8_ROWS;
const int stoic_max_head_dim = MAX_HEAD_DIM;
