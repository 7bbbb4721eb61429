"""The constants stoic's C kernels and their bindings share, each defined once in C
(``stoic_kernels.h``): the GGML types the kernels compute on (:data:`GGML_TYPES`) and the
largest head dimension the attention takes (:data:`MAX_HEAD_DIM`), read from the header's text
at import (they are needed before any library is built, and where none can be); and the layout
ids and flags the products take (:class:`Layouts`), read from the loaded library (its
``_constants.c``).
"""

from __future__ import annotations

import ctypes
import importlib.resources
import re
from typing import NamedTuple

import torch

__all__ = [
    "C_POOL_DTYPES",
    "G4_TYPES",
    "G8_ALONE_TYPES",
    "G8_TYPES",
    "GGML_TYPES",
    "MAX_HEAD_DIM",
    "GgmlType",
    "Layouts",
    "const",
]


class GgmlType(NamedTuple):
    """A GGML block type the kernels compute on."""

    type_id: int
    #: bytes of one block of ``weights`` weights
    block_bytes: int
    weights: int


def _read_header() -> tuple[dict[str, GgmlType], int]:
    """The GGML types (``STOIC_GGML_TYPES``) and ``MAX_HEAD_DIM`` as ``stoic_kernels.h`` defines
    them, read from its text: they are needed at import (a GGUF file's tensors are sorted by
    type, a model's head dimension checked) before any library is built, and where none can
    be; the header is their one definition.

    :raises RuntimeError: if the header does not define them in the forms it states.
    """
    text = importlib.resources.files(__package__).joinpath("stoic_kernels.h").read_text("ascii")
    defines = {n: int(v) for n, v in re.findall(r"^#define (\w+) (\d+)\b", text, re.MULTILINE)}
    rows = re.findall(r"^\s*X\((\w+), (\d+), (\d+), (\w+), \w+\)", text, re.MULTILINE)
    try:
        types = {
            name: GgmlType(int(type_id), int(size), defines.get(weights) or int(weights))
            for name, type_id, size, weights in rows
        }
        max_head_dim = defines["MAX_HEAD_DIM"]
    except (KeyError, ValueError) as e:
        raise RuntimeError(f"stoic_kernels.h does not define {e}") from e
    if not types:
        raise RuntimeError("stoic_kernels.h lists no GGML types (STOIC_GGML_TYPES)")
    return types, max_head_dim


#: the GGML types the kernels compute on, by name (``STOIC_GGML_TYPES`` in ``stoic_kernels.h``);
#: and the largest head dimension the attention kernels take (``MAX_HEAD_DIM`` there)
GGML_TYPES, MAX_HEAD_DIM = _read_header()
#: the GGML types the G8 layouts are built from: every type the kernels compute on
#: (``_gemm8.c``'s stoic_g8_decode reads them all)
G8_TYPES = frozenset(GGML_TYPES)
#: the types whose values fit the nibbles of the G4 layout (``G8 + G8_NIBBLES``)
G4_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K"})
#: the types whose G8 layout (G4 for the 4-bit ones) takes about the bytes of their repacked
#: blocks (0.75, 1.125 and 1.25 bytes a weight, against K4/U4's 0.75, S8's 1.125 and K6's
#: 1.25; Q4_0's Z4 0.625, 1.2x): with int8 activations (``--dtype auto`` on a CPU with VNNI) that one layout
#: serves steps of every size, one row as fast as the one-row loops (bound by memory) and a
#: prefill chunk or a batch of decodes 2-5x faster than their tiles, so nothing else is held.
#: The 5-bit types' G8 would take 1.4-1.7x their blocks: they keep their blocks for small steps
#: and the G8 layout for big ones.
G8_ALONE_TYPES = G4_TYPES | {"Q6_K", "Q8_0"}
#: the KV cache types the C attention reads (``kv_bf16``: a bfloat16 pool, widened exactly)
C_POOL_DTYPES = (torch.float32, torch.bfloat16)


class Layouts(NamedTuple):
    """The layouts and flags the products take (``stoic_kernels.h``), read from the loaded
    library (:meth:`read`)."""

    #: the repacked layout the products read for each GGML type (``stoic_layout_of``)
    of: dict[str, int]
    #: a matrix stacked from parts of different layouts (``MIXED``)
    mixed: int
    #: the fixed order in bfloat16 (``BF16FIXED``, ``_bf16fixed.c``; ``--deterministic`` where
    #: the CPU has AVX512_BF16): the pointer is a descriptor of the repacked blocks and their
    #: bfloat16 copy
    bf16fixed: int
    #: int8 activations over the G8 layout (``G8``, ``_gemm8.c``): any number of rows, each row
    #: in one order (the default mode's batched steps; ``--deterministic``'s every step where the
    #: CPU has VNNI); its variants are ``g8`` + 1 to 3
    g8: int
    #: G8's values as nibbles (``G8 + G8_NIBBLES``): the 4-bit types' matrices, 0.75 bytes a
    #: weight
    g4: int
    #: G4 with Q4_K's super-block scales (``G8 + G8_NIBBLES + G8_SUPER``): 0.59 bytes a weight
    g4k: int
    #: Q6_K's 6-bit values with its scales (``G8 + G8_HALVES + G8_SYMMETRIC + G8_SUPER``):
    #: 0.8125 bytes a weight
    g6: int
    #: or'ed with a layout: the product sums every row in one order whatever the number of rows
    #: (``FIXED_ORDER``; ``--deterministic``)
    fixed_order: int
    #: or'ed with a layout: products of up to eight rows quantise the activations to int8 per
    #: block of 32 and multiply with integer dot products (``INT8_ROWS``; ``_int8rows.c``)
    int8_rows: int

    @classmethod
    def read(cls, lib: ctypes.CDLL) -> Layouts:
        """The library's (``_constants.c``).

        :raises AttributeError: if it lacks ``stoic_layout_of``; ``ValueError`` if it lacks a
            constant or has no layout for one of :data:`GGML_TYPES`.
        """
        layout_of = lib.stoic_layout_of
        layout_of.argtypes, layout_of.restype = [ctypes.c_int], ctypes.c_int
        of = {kind: int(layout_of(ggml.type_id)) for kind, ggml in GGML_TYPES.items()}
        if not all(of.values()):
            raise ValueError(f"no layout for {[k for k, v in of.items() if not v]}")
        return cls(
            of=of,
            mixed=const(lib, "stoic_layout_mixed"),
            bf16fixed=const(lib, "stoic_layout_bf16fixed"),
            g8=const(lib, "stoic_layout_g8"),
            g4=const(lib, "stoic_layout_g4"),
            g4k=const(lib, "stoic_layout_g4k"),
            g6=const(lib, "stoic_layout_g6"),
            fixed_order=const(lib, "stoic_flag_fixed_order"),
            int8_rows=const(lib, "stoic_flag_int8_rows"),
        )


def const(lib: ctypes.CDLL, name: str) -> int:
    """The library's ``const int`` ``name``. :raises ValueError: if it has none."""
    return int(ctypes.c_int.in_dll(lib, name).value)
