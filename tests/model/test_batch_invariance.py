"""Batch invariance of every kernel ``--deterministic`` computes with: one row computed alone is
bitwise the row computed inside batches of 2..64 rows (the fixed-order quantised products of
every block type, a stacked projection of mixed types, the C attention over the paged cache,
the C layers, and the torch operators the step keeps: RMSNorm, softmax, the rotary table)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf_blocks import random_blocks

from stoic.model._qkernels import GGML_TYPES, Kernels

#: batch sizes, on and off the kernels' 4- and 8-row tiles and the 16-lane routine's limit
SIZES = (2, 3, 4, 5, 8, 9, 15, 16, 17, 31, 32, 33, 48, 64)


def _rows(n: int, cols: int, seed: int) -> torch.Tensor:
    return torch.randn(n, cols, generator=torch.Generator().manual_seed(seed))


def _alone_equals_batched(product: object, cols: int) -> list[int]:
    """Batch sizes at which the first row's result differs from its result alone."""
    x = _rows(max(SIZES), cols, seed=cols)
    alone = product(x[:1].contiguous())  # type: ignore[operator]
    return [n for n in SIZES if not torch.equal(product(x[:n].contiguous())[:1], alone)]  # type: ignore[operator]


@pytest.mark.parametrize("kind", sorted(GGML_TYPES))
def test_fixed_order_product_of_a_row_is_bitwise_the_same_in_any_batch(
    kernels: Kernels, kind: str
) -> None:
    """A row multiplied alone equals that row multiplied in batches of 2..64 (every block type,
    with a bias), and every row of a batch equals its product alone."""
    cols = 512
    blocks = random_blocks(kind, 40, cols, seed=3)
    bias = torch.randn(40)
    fixed = kernels.bind(kind, blocks, bias, fixed=True)
    assert _alone_equals_batched(fixed, cols) == []
    x = _rows(33, cols, seed=5)
    batched = fixed(x)
    for i in (0, 7, 16, 32):
        assert torch.equal(batched[i], fixed(x[i : i + 1].contiguous())[0])


def test_default_order_product_is_not_batch_invariant(kernels: Kernels) -> None:
    """The default products are not: one row takes the factored routine (and, past 16 rows, the
    8-lane tiles), which sum in another order (what the fixed order exists for)."""
    blocks = random_blocks("Q4_1", 40, 512, seed=3)
    assert _alone_equals_batched(kernels.bind("Q4_1", blocks, None), 512) != []


def test_fixed_order_stacked_product_of_mixed_types_is_batch_invariant(kernels: Kernels) -> None:
    """A fused projection of parts of different types (Q4_K over Q6_K, as in Q4_K_M)."""
    parts = [("Q4_K", random_blocks("Q4_K", 24, 512, 1)), ("Q6_K", random_blocks("Q6_K", 8, 512, 2))]
    assert _alone_equals_batched(kernels.bind_stack(parts, None, fixed=True), 512) == []
