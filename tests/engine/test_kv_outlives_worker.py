"""The KV cache outlives the worker (``kv_outlives_worker``, on by default with the process
executor on a CPU): after a ``kill -9`` of the worker every stream resumes from its kept keys and
values, exactly; the prefix cache still hits; a segfault drops the pools; a kill in the very
first step, two kills in a row and a kill while a spare takes over all end every stream exactly.

float32 throughout: resumed text must equal the fault-free text token for token.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from support import collect, engine_config, wait_idle, wait_restarts

import stoic

pytestmark = [pytest.mark.model, pytest.mark.asyncio]

TOKENS = 24
STREAMS = 16
GREEDY = stoic.SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
TOPICS = ["the sea", "a cat", "winter", "bread", "a robot", "the moon", "tea", "trains"]


def _prompts(tag: str) -> list[str]:
    """16 prompts of some 60-90 tokens each, distinct from the first token on (``tag``)."""
    return [
        f"{tag} {i}: Write a careful paragraph about {TOPICS[i % 8]}, in the style of an old "
        f"travel guide, mentioning {TOPICS[(i + 3) % 8]} and {TOPICS[(i + 5) % 8]} once each, "
        "with no lists and no headings, and end it with a question to the reader." * (1 + i % 2)
        for i in range(STREAMS)
    ]


def _config(model_dir: Path, **overrides: Any) -> stoic.EngineConfig:
    return engine_config(
        model_dir, **{"executor": "process", "recovery": "resume", "max_resumes": 10, **overrides}
    )


async def _fault_free(engine: stoic.Engine, prompts: list[str]) -> list[str]:
    results = await asyncio.gather(*(engine.complete(p, GREEDY) for p in prompts))
    return [r.text for r in results]


async def _generated_at_least(engine: stoic.Engine, tokens: int, limit: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while engine.stats().generated_tokens < tokens:
        assert loop.time() < deadline, f"fewer than {tokens} tokens: {engine.stats()}"
        await asyncio.sleep(0.005)


async def _hits(engine: stoic.Engine, prompt: str) -> int:
    """Prompt tokens of ``prompt`` the prefix cache gives a new request now."""
    before = engine.stats().prefix_cached_tokens
    await engine.complete(prompt, stoic.SamplingParams(max_tokens=1, temperature=0))
    return engine.stats().prefix_cached_tokens - before


async def test_a_kill_9_mid_decode_resumes_16_streams_from_their_kept_cache(
    default_model_dir: Path,
) -> None:
    """16 streams decoding, the worker killed with SIGKILL: each ends with exactly its
    fault-free text, the tokens computed again are at most the failed step's (one decode token
    a stream), everything else is reused; a request finished before the kill still finds its
    prompt in the prefix cache afterwards; every block is free at the end."""
    prompts, earlier = _prompts("A"), "Before the kill: " + _prompts("B")[0]
    async with stoic.Engine.start(_config(default_model_dir)) as engine:
        expected = await _fault_free(engine, prompts)
        await engine.complete(earlier, GREEDY)
        base = engine.stats()
        readers = [asyncio.ensure_future(collect(await engine.submit(p, GREEDY))) for p in prompts]
        await _generated_at_least(engine, base.generated_tokens + STREAMS * 6)
        victim = engine.stats().executor_pid
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        outcomes = await asyncio.wait_for(asyncio.gather(*readers), 120)
        assert outcomes == [(text, None) for text in expected]
        stats = await wait_idle(engine, 10.0)
        assert stats.restarts == 1 and stats.executor_pid != victim
        assert stats.requests_resumed == STREAMS and stats.failed_sequences == 0
        assert 0 < stats.resume_recomputed_tokens <= STREAMS
        assert stats.resume_reused_tokens >= STREAMS * 60
        assert await _hits(engine, earlier) > 0
        assert (await wait_idle(engine, 5.0)).kv_blocks_used == 0
        (incident,) = engine.activity().incidents
        assert incident.kv_kept and incident.reused_tokens == stats.resume_reused_tokens


async def test_a_segfault_drops_the_pools_and_streams_recompute_exactly(
    default_model_dir: Path,
) -> None:
    """A worker that segfaults may have corrupted its memory: the pools are dropped, every
    stream is recomputed from its prompt and generated tokens and still ends exactly; nothing
    is reused and the prefix cache is empty afterwards."""
    prompts, earlier = _prompts("C")[:8], "Before the segfault: " + _prompts("D")[0]
    async with stoic.Engine.start(_config(default_model_dir)) as engine:
        expected = await _fault_free(engine, prompts)
        await engine.complete(earlier, GREEDY)
        base = engine.stats()
        readers = [asyncio.ensure_future(collect(await engine.submit(p, GREEDY))) for p in prompts]
        await _generated_at_least(engine, base.generated_tokens + 8 * 4)
        await engine.inject_fault(stoic.FaultSpec(kind="segfault", after_steps=1))
        outcomes = await asyncio.wait_for(asyncio.gather(*readers), 120)
        assert outcomes == [(text, None) for text in expected]
        stats = await wait_idle(engine, 10.0)
        assert dict(stats.restarts_by_kind) == {"crash": 1}
        assert stats.resume_reused_tokens == 0 and stats.resume_recomputed_tokens >= 8 * 60
        assert await _hits(engine, earlier) == 0
        (incident,) = engine.activity().incidents
        assert not incident.kv_kept


async def test_kills_in_the_first_step_twice_in_a_row_and_onto_a_spare_end_every_stream_exactly(
    default_model_dir: Path,
) -> None:
    """With a warm spare: a kill in the very first step of new requests (nothing committed
    yet), then, once they decode, two kills in a row (the spare takes over from the first, a
    cold worker from the second, both on the kept pools): every stream ends with exactly its
    fault-free text and its keys and values were reused, not all recomputed."""
    prompts = _prompts("E")[:8]
    async with stoic.Engine.start(_config(default_model_dir, executor_spares=1)) as engine:
        expected = await _fault_free(engine, prompts)
        fresh = _prompts("F")[:4]
        expected_fresh = await _fault_free(engine, fresh)
        base = engine.stats()
        await engine.inject_fault(stoic.FaultSpec(kind="crash", after_steps=1))
        first = [asyncio.ensure_future(collect(await engine.submit(p, GREEDY))) for p in fresh]
        await wait_restarts(engine, 1, limit=60.0)
        assert await asyncio.wait_for(asyncio.gather(*first), 120) == [
            (text, None) for text in expected_fresh
        ]
        readers = [asyncio.ensure_future(collect(await engine.submit(p, GREEDY))) for p in prompts]
        await _generated_at_least(engine, engine.stats().generated_tokens + 8 * 6)
        for n in (2, 3):
            await engine.inject_fault(stoic.FaultSpec(kind="crash", after_steps=1))
            await wait_restarts(engine, n, limit=120.0)
        outcomes = await asyncio.wait_for(asyncio.gather(*readers), 180)
        assert outcomes == [(text, None) for text in expected]
        stats = await wait_idle(engine, 10.0)
        assert stats.failed_sequences == 0 and stats.restarts == 3
        assert stats.resume_reused_tokens - base.resume_reused_tokens >= 8 * 60
        assert all(i.kv_kept for i in engine.activity().incidents)
