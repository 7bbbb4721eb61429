"""Continuous batching, aborts and preemption on the real default model."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from support import engine_config, until, wait_idle

import stoic

pytestmark = [pytest.mark.model, pytest.mark.asyncio(loop_scope="module")]


def _prompts(n: int, seed: int = 1) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    words = [
        "alpha",
        "beta",
        "gamma",
        "delta",
        "river",
        "mountain",
        "quiet",
        "storm",
        "lantern",
        "orbit",
        "maple",
        "copper",
    ]
    out = []
    for i in range(n):
        length = rng.choice([3, 10, 40, 120])
        text = f"Request {i}: " + " ".join(rng.choice(words) for _ in range(length))
        out.append((text, rng.choice([4, 12, 24, 40])))
    return out


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(default_model_dir: Path) -> Any:
    config = engine_config(default_model_dir, num_kv_blocks=512, enable_fault_injection=False)
    async with stoic.Engine.start(config) as eng:
        yield eng


async def test_32_concurrent_mixed_requests_share_the_batch(engine: Any) -> None:
    """32 concurrent requests of mixed lengths all complete, share steps, and free every block."""
    work = _prompts(32)
    results = await asyncio.gather(
        *(
            engine.complete(p, stoic.SamplingParams(max_tokens=m, temperature=0, ignore_eos=True))
            for p, m in work
        )
    )
    for (_, max_tokens), result in zip(work, results, strict=True):
        assert result.completion_tokens == max_tokens
        assert result.finish_reason == "length"
    stats = await wait_idle(engine)
    assert stats.max_batch_size >= 16, f"batch was not shared: max {stats.max_batch_size}"


async def _drain(stream: Any) -> tuple[int, str | None]:
    """Read a stream to its end: its completion tokens and the finish reason of its last delta."""
    n, reason = 0, None
    async for delta in stream:
        n, reason = delta.completion_tokens, delta.finish_reason
    return n, reason


@pytest.mark.timeout(900)  # 32 sequences of the real model: slow on a loaded 2-core machine
async def test_aborting_half_frees_their_blocks_at_once(engine: Any) -> None:
    """Aborting 16 of 32 streams mid-generation ends exactly those with ``"abort"`` and frees
    their blocks while the other 16 still run; those 16 then complete with ``"length"``."""
    max_tokens = 24
    params = stoic.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    streams = [await engine.submit(p, params) for p, _ in _prompts(32, seed=2)]
    firsts = await asyncio.gather(*(s.__anext__() for s in streams))
    assert all(d.completion_tokens >= 1 and d.finish_reason is None for d in firsts)
    aborted, survivors = streams[::2], streams[1::2]
    # the most blocks the survivors can ever hold: prompt + every token, whole blocks
    survivor_bound = sum(-(-(s.prompt_tokens + max_tokens) // 16) for s in survivors)
    assert engine.stats().kv_blocks_used > survivor_bound  # so the check below discriminates
    for s in aborted:
        await s.aclose()
    # each aborted stream ends with "abort", before reaching max_tokens
    ends = await asyncio.wait_for(asyncio.gather(*(_drain(s) for s in aborted)), 120)
    for n, reason in ends:
        assert reason == "abort"
        assert n < max_tokens
    # their sequences left the batch at once (running is updated with the abort) ...
    assert engine.stats().running == 16
    # ... and their blocks are back (one message hop later) while the survivors still run
    await until(lambda: engine.stats().kv_blocks_used <= survivor_bound, limit=60.0)
    assert engine.stats().running == 16
    assert not any(s.done for s in survivors), "a survivor ended before the aborted were freed"
    finished = await asyncio.wait_for(asyncio.gather(*(_drain(s) for s in survivors)), 600)
    assert finished == [(max_tokens, "length")] * 16
    await wait_idle(engine, 60.0)


async def test_breaking_out_of_chat_aborts(engine: Any) -> None:
    """Leaving the async iteration early aborts the request: it ends long before its 200 tokens
    and nothing keeps running."""
    generated = engine.stats().generated_tokens
    msgs = [{"role": "user", "content": "Count to one hundred."}]
    async for _delta in engine.chat(msgs, stoic.SamplingParams(max_tokens=200, ignore_eos=True)):
        break
    await until(
        lambda: engine.stats().running == 0 and engine.stats().kv_blocks_used == 0, limit=60.0
    )
    # by outcome: a no-op abort would let it run to 200 tokens
    assert engine.stats().generated_tokens - generated < 100


async def test_preemption_with_a_tiny_cache_keeps_outputs_exact(default_model_dir: Path) -> None:
    """With a cache too small for all sequences, preempted ones are recomputed: output unchanged."""
    work = _prompts(8, seed=3)
    params = [stoic.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True) for _ in work]
    big = engine_config(default_model_dir, num_kv_blocks=256, enable_fault_injection=False)
    async with stoic.Engine.start(big) as eng:
        alone = [
            (await eng.complete(p, sp)).token_ids for (p, _), sp in zip(work, params, strict=True)
        ]
    # 16 blocks x 16 tokens = 256 tokens: far fewer than the 8 sequences need together
    tiny = engine_config(default_model_dir, num_kv_blocks=16, enable_fault_injection=False)
    async with stoic.Engine.start(tiny) as eng:
        together = await asyncio.gather(
            *(eng.complete(p, sp) for (p, _), sp in zip(work, params, strict=True))
        )
        stats = await wait_idle(eng)
        assert stats.preemptions > 0, "the cache was not small enough to force preemption"
    assert [r.token_ids for r in together] == alone
