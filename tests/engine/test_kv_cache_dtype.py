"""``kv_cache_dtype`` (``--kv-cache-dtype``): the default model under ``auto`` keeps its KV cache
in bfloat16, which holds twice the tokens in the same memory and changes its outputs by no more
than bfloat16 rounding of the keys and values does; ``float32`` keeps the exact cache. The
kernels' arithmetic over a bfloat16 pool is tested in tests/model (test_cdecode.py,
test_chunk_attention.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import stoic

PARAMS = stoic.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=True)
PROMPTS = (
    "The three primary colours are",
    "def fibonacci(n):\n    ",
    "Paris is the capital of France. Berlin is the capital of",
)


def _config(kv: str, **overrides: Any) -> stoic.EngineConfig:
    # a small cap, so that the cache is sized by its bytes (not the machine's RAM)
    base: dict[str, Any] = {
        "model": "default",
        "dtype": "auto",
        "kv_cache_dtype": kv,
        "kv_cache_memory_gib": 0.05,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 8,  # prompts in chunks: later ones read the cached prefix
    }
    return stoic.EngineConfig(**(base | overrides))


async def _run(engine: stoic.Engine) -> list[stoic.CompletionResult]:
    return [await engine.complete(p, PARAMS) for p in PROMPTS]


def _agreement(
    got: list[stoic.CompletionResult], want: list[stoic.CompletionResult]
) -> tuple[int, float]:
    """Tokens the two runs' greedy texts share from their starts (summed over the prompts), and
    the largest logprob difference of a token over those and each first differing one."""
    agreed, worst = 0, 0.0
    for a, b in zip(got, want, strict=True):
        assert a.logprobs is not None and b.logprobs is not None
        for x, y, lx, ly in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs, strict=True):
            worst = max(worst, abs(lx.logprob - ly.logprob))
            if x != y:
                break
            agreed += 1
    return agreed, worst


async def _serve(
    config: stoic.EngineConfig, cache: torch.dtype
) -> tuple[list[stoic.CompletionResult], int]:
    """The prompts' results on an engine of ``config``, and its KV blocks, checking that its
    cache holds ``cache`` (the model, and the compute card, say so)."""
    async with stoic.Engine.start(config) as engine:
        assert engine.loaded.cache_dtype == cache
        results = await _run(engine)
        stats = engine.stats()
        assert stats.compute is not None
        assert stats.compute.kv_cache_dtype == str(cache).removeprefix("torch.")
        return results, stats.kv_blocks_total


@pytest.mark.model
@pytest.mark.timeout(600)
async def test_auto_holds_the_default_models_cache_in_bfloat16_twice_the_tokens() -> None:
    """``auto`` on the default model (a GGUF file on the C layers, the fast dtype) gives a
    bfloat16 cache: twice the blocks of a float32 one in the same memory, said in the compute
    card. Its greedy text follows the float32 cache's: most tokens the same, each token's
    logprob within 0.5 nats (measured 0.12-0.29: the fast dtype's int8 row activations amplify
    any perturbation; prompt chunks of 8 tokens instead of 64 alone move them 0.12 with a
    float32 cache)."""
    half, half_blocks = await _serve(_config("auto"), torch.bfloat16)
    full, full_blocks = await _serve(_config("float32"), torch.float32)
    assert abs(half_blocks - 2 * full_blocks) <= 1, (half_blocks, full_blocks)
    agreed, worst = _agreement(half, full)
    assert agreed >= len(PROMPTS) * PARAMS.max_tokens // 2 and worst < 0.5, (agreed, worst)


@pytest.mark.model
@pytest.mark.timeout(600)
async def test_in_float32_a_bfloat16_cache_moves_logprobs_by_its_rounding_only() -> None:
    """``dtype="float32"`` (exact results) keeps the cache float32 under ``auto``. An explicit
    bfloat16 cache with it changes each token's logprob by under 0.05 nats (measured 0.017):
    the keys' and values' rounding, nothing else; a bad name is refused by the config."""
    exact, _ = await _serve(_config("auto", dtype="float32"), torch.float32)
    rounded, _ = await _serve(_config("bfloat16", dtype="float32"), torch.bfloat16)
    agreed, worst = _agreement(rounded, exact)
    assert agreed >= len(PROMPTS) * PARAMS.max_tokens // 2 and worst < 0.05, (agreed, worst)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        stoic.EngineConfig(kv_cache_dtype="int8")
