"""The paged forward pass on a tiny random model: equal to the model's own forward, and safe
against uninitialised cache memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stoic.model import ModelRunner, PagedKVCache, SamplingParams, SeqChunk, StepBatch, load_model

GREEDY = SamplingParams(max_tokens=8, temperature=0)


@pytest.fixture(scope="module")
def runner(tiny_model_dir: Path) -> ModelRunner:
    return ModelRunner(load_model(str(tiny_model_dir), dtype="float32", device="cpu"))


def _greedy_reference(tiny_model_dir: Path, prompt: list[int], steps: int) -> list[int]:
    ref = load_model(str(tiny_model_dir), dtype="float32", device="cpu").model
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(steps):
            ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def _decode(
    runner: ModelRunner, cache: PagedKVCache, prompt: list[int], steps: int, zero: bool
) -> list[int]:
    table = (5, 2, 7)  # deliberately scattered blocks
    fresh = table if zero else ()
    out = runner.execute(
        StepBatch((SeqChunk(0, tuple(prompt), 0, table, True, GREEDY),), fresh), cache
    )
    tokens = [out.sampled[0].token_id]
    for i in range(steps - 1):
        pos = len(prompt) + i
        chunk = SeqChunk(0, (tokens[-1],), pos, table, True, GREEDY, num_generated=i + 1)
        tokens.append(runner.execute(StepBatch((chunk,)), cache).sampled[0].token_id)
    return tokens


def test_paged_decode_equals_the_models_own_forward(
    runner: ModelRunner, tiny_model_dir: Path
) -> None:
    """Greedy tokens through the paged cache equal argmax of full re-computation each step."""
    prompt = [17, 404, 9, 1200, 33, 5, 870]
    cache = PagedKVCache(runner.kv_spec(num_blocks=8, block_size=4))
    got = _decode(runner, cache, prompt, 6, zero=True)
    assert got == _greedy_reference(tiny_model_dir, prompt, 6)


def test_uninitialised_cache_memory_never_leaks_into_attention(runner: ModelRunner) -> None:
    """Pools full of NaN give the same tokens as clean ones once fresh blocks are zeroed."""
    prompt = [17, 404, 9, 1200, 33]
    clean = PagedKVCache(runner.kv_spec(num_blocks=8, block_size=4))
    for pool in (*clean.keys, *clean.values):
        pool.zero_()
    want = _decode(runner, clean, prompt, 5, zero=False)
    dirty = PagedKVCache(runner.kv_spec(num_blocks=8, block_size=4))
    for pool in (*dirty.keys, *dirty.values):
        pool.fill_(float("nan"))
    assert _decode(runner, dirty, prompt, 5, zero=True) == want


def test_a_released_cache_refuses_to_run(runner: ModelRunner) -> None:
    """After release (a drop), executing against the old cache raises instead of computing."""
    cache = PagedKVCache(runner.kv_spec(num_blocks=4, block_size=4))
    cache.release()
    assert cache.released
    with pytest.raises(RuntimeError, match="released"):
        runner.execute(StepBatch((SeqChunk(0, (1, 2), 0, (0,), True, GREEDY),)), cache)
