"""stoic's CPU kernels in C: products over a GGUF file's quantised blocks (one row, rows, tiles,
int8 activations), the decode step's fused layer operators, paged attention over the blocks in
place, and the bfloat16 prefill's elementwise operators.

The C files here are one library, as ggml's are: each ``.c`` file its own translation unit on
the shared headers (``stoic_kernels.h``, the library's interface; ``_common.h``, ``_blocks.h``),
compiled to objects in parallel and linked into one shared library once per (sources, compiler,
flags) in the cache directory (:mod:`._build`), and loaded with :mod:`ctypes`
(:func:`load_kernels`); the Python classes are their typed bindings (:mod:`._qkernels`,
:mod:`._gemm8`, :mod:`._cops`), the constants read from the header and the library
(:mod:`._constants`). Nothing here knows a model, a request or an actor.
"""

from ._arena import LayoutEntry, SharedLayouts, current_layouts, use_layouts
from ._cops import PrefillOps
from ._gemm8 import Gemm8
from ._qkernels import (
    C_POOL_DTYPES,
    G4_TYPES,
    G8_ALONE_TYPES,
    G8_TYPES,
    GGML_TYPES,
    MAX_HEAD_DIM,
    G8Layout,
    GgmlType,
    Kernels,
    KernelsUnavailable,
    Product,
    load_kernels,
)

__all__ = [
    "C_POOL_DTYPES",
    "G4_TYPES",
    "G8_ALONE_TYPES",
    "G8_TYPES",
    "GGML_TYPES",
    "MAX_HEAD_DIM",
    "G8Layout",
    "Gemm8",
    "GgmlType",
    "Kernels",
    "KernelsUnavailable",
    "LayoutEntry",
    "PrefillOps",
    "Product",
    "SharedLayouts",
    "current_layouts",
    "load_kernels",
    "use_layouts",
]
