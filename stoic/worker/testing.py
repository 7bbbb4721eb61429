"""Test helpers of the step worker (public, like :mod:`stoic.model.testing`)."""

from __future__ import annotations

import torch

from ..model import PagedKVCache
from ..request import StepBatch
from ._runner import ModelRunner

__all__ = ["final_hidden_states"]


def final_hidden_states(
    runner: ModelRunner, steps: list[StepBatch], num_blocks: int, block_size: int
) -> tuple[list[torch.Tensor], PagedKVCache]:
    """Run ``steps`` in order on a fresh, zeroed cache of ``num_blocks`` blocks; return the
    final hidden states of the sampled rows of every step that samples (what the LM head is
    given), and the cache: what two forward paths are compared on."""
    cache = PagedKVCache(runner.kv_spec(num_blocks=num_blocks, block_size=block_size))
    cache.zero_blocks(tuple(range(num_blocks)))
    captured: list[torch.Tensor] = []
    head = runner._head

    def spy(x: torch.Tensor) -> torch.Tensor:
        captured.append(x.clone())
        return head(x)

    runner._head = spy  # type: ignore[assignment]
    try:
        for batch in steps:
            runner.execute(batch, cache)
    finally:
        runner._head = head
    return captured, cache
