"""Penalties and logit bias through the whole engine on the tiny model: the same greedy output
with the thread executor, across the process boundary, and when preemption recomputes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from support import engine_config, wait_idle

import stoic

pytestmark = [pytest.mark.model, pytest.mark.asyncio]

PROMPTS = [f"Write about the number {i} and the number {i} again." for i in range(6)]
PLAIN = stoic.SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
PENALISED = stoic.SamplingParams(
    max_tokens=32,
    temperature=0,
    ignore_eos=True,
    frequency_penalty=0.7,
    presence_penalty=0.4,
    repetition_penalty=1.3,
    logit_bias=((5, -100.0), (7, 3.0)),
)


async def test_penalised_outputs_are_the_same_across_executors_and_preemption(
    tiny_model_dir: Path,
) -> None:
    """Greedy outputs with every penalty and a logit bias: one by one with the thread executor
    they differ from the plain ones (the penalties reach the sampler); batched in a worker
    process, and batched in a cache so small that sequences are preempted and recomputed, they
    are the same tokens."""
    async with stoic.Engine.start(engine_config(tiny_model_dir, executor="thread")) as engine:
        plain = [(await engine.complete(p, PLAIN)).token_ids for p in PROMPTS]
        alone = [(await engine.complete(p, PENALISED)).token_ids for p in PROMPTS]
    assert all(a != p for a, p in zip(alone, plain, strict=True))
    assert all(5 not in ids for ids in alone)
    async with stoic.Engine.start(engine_config(tiny_model_dir, executor="process")) as engine:
        results = await asyncio.gather(*(engine.complete(p, PENALISED) for p in PROMPTS))
        assert [r.token_ids for r in results] == alone
    tiny = engine_config(tiny_model_dir, executor="thread", num_kv_blocks=8, block_size=16)
    async with stoic.Engine.start(tiny) as engine:
        results = await asyncio.gather(*(engine.complete(p, PENALISED) for p in PROMPTS))
        stats = await wait_idle(engine)
        assert stats.preemptions > 0, "the cache was not small enough to force preemption"
        assert [r.token_ids for r in results] == alone
