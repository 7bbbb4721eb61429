"""Surviving executor failures: drop the cache, fail every stream with its partial output,
restart, keep serving (the first seed's lesson)."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

import pytest
from support import collect, engine_config, wait_idle

import stoic
from stoic.errors import EngineFailed, ExecutorFailed

pytestmark = [pytest.mark.model, pytest.mark.asyncio]

GREEDY = stoic.SamplingParams(max_tokens=24, temperature=0)


def _config(model_dir: Path, **overrides: Any) -> stoic.EngineConfig:
    return engine_config(model_dir, **overrides)


def _prompts(n: int) -> list[str]:
    topics = ["the sea", "a cat", "winter", "bread", "a robot", "the moon", "tea", "trains"]
    return [f"Write one sentence about {topics[i % len(topics)]} (#{i})." for i in range(n)]


async def _baseline(engine: Any, prompts: list[str], params: stoic.SamplingParams) -> list[str]:
    results = await asyncio.gather(*(engine.complete(p, params) for p in prompts))
    return [r.text for r in results]


async def _wait_healthy(engine: Any, limit: float) -> float:
    start = time.monotonic()
    while not engine.health().ok:
        assert time.monotonic() - start < limit, f"not healthy after {limit}s: {engine.health()}"
        await asyncio.sleep(0.005)
    return time.monotonic() - start


async def test_one_oom_fails_every_stream_with_its_prefix_and_the_engine_recovers(
    default_model_dir: Path,
) -> None:
    """16 streams, one injected OOM: all end with ExecutorFailed (at once, not after a timeout),
    each partial is a prefix of the fault-free output, no block stays used, health returns, the
    next answer is right.
    """
    prompts = _prompts(16)
    params = stoic.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    async with stoic.Engine.start(_config(default_model_dir)) as engine:
        expected = await _baseline(engine, prompts, params)
        streams = [await engine.submit(p, params) for p in prompts]
        await asyncio.gather(*(s.__anext__() for s in streams))  # all are generating
        await engine.inject_fault(stoic.FaultSpec(kind="oom", after_steps=2))
        started = time.monotonic()
        outcomes = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 10)
        elapsed = time.monotonic() - started
        # the contract is "at once", not a number: the bound only tells an end from a hang on a
        # busy 2-core machine (the recovery benchmark measures the real time: tens of ms)
        assert elapsed < 5.0, f"streams took {elapsed:.2f}s to end"
        for (_text, error), want in zip(outcomes, expected, strict=True):
            assert isinstance(error, ExecutorFailed), error
            assert error.kind == "oom"
            assert error.partial.completion_tokens >= 1
            assert want.startswith(error.partial.text)
        assert await _wait_healthy(engine, 5.0) < 5.0
        await wait_idle(engine, 1.0)  # the cache was dropped: every block is free
        stats = engine.stats()
        assert stats.restarts == 1
        assert stats.incarnation == 1
        again = await engine.complete(prompts[0], params)
        assert again.text == expected[0]


async def test_chaos_every_request_has_exactly_one_outcome(default_model_dir: Path) -> None:
    """200 requests at concurrency 16 with a seeded 5% per-step failure: successes equal their
    fault-free output, failures carry a prefix of it, and the books balance afterwards."""
    rng = random.Random(5)
    prompts = [rng.choice(_prompts(8)) for _ in range(200)]
    params = stoic.SamplingParams(max_tokens=8, temperature=0)
    config = _config(default_model_dir, max_restarts=1000, restart_window=1.0)
    async with stoic.Engine.start(config) as engine:
        distinct = sorted(set(prompts))
        expected = dict(zip(distinct, await _baseline(engine, distinct, params), strict=True))
        await engine.inject_fault(stoic.FaultSpec(kind="error", probability=0.05, seed=7))
        semaphore = asyncio.Semaphore(16)
        outcomes: list[tuple[str, str, BaseException | None]] = []

        async def one(prompt: str) -> None:
            async with semaphore:
                try:
                    stream = await engine.submit(prompt, params)
                except stoic.errors.StoicError as exc:  # pragma: no cover - not expected
                    outcomes.append((prompt, "", exc))
                    return
                text, error = await collect(stream)
                outcomes.append((prompt, text, error))

        await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), 300)
        await engine.clear_faults()
        assert len(outcomes) == 200
        failures = 0
        for prompt, text, error in outcomes:
            if error is None:
                assert text == expected[prompt]
            else:
                assert isinstance(error, ExecutorFailed), error
                assert expected[prompt].startswith(error.partial.text)
                failures += 1
        assert failures > 0, "the chaos run injected no failure"
        await _wait_healthy(engine, 5.0)
        stats = await wait_idle(engine)
        assert stats.restarts == stats.faults_injected
        assert stats.failed_sequences >= failures


async def test_persistent_failure_marks_the_engine_failed(default_model_dir: Path) -> None:
    """Every step failing: past the restart intensity the engine is failed, new requests are
    refused at once with EngineFailed, and nothing hangs."""
    config = _config(default_model_dir, max_restarts=3, restart_window=30.0)
    async with stoic.Engine.start(config) as engine:
        await engine.inject_fault(stoic.FaultSpec(kind="error", probability=1.0, seed=1))
        for _ in range(10):
            if engine.health().state == "failed":
                break
            try:
                stream = await engine.submit("hello", GREEDY)
            except EngineFailed:
                break
            _text, error = await asyncio.wait_for(collect(stream), 10)
            assert isinstance(error, ExecutorFailed | EngineFailed)
        failure = await asyncio.wait_for(engine.wait_failed(), 5)
        assert "executor" in str(failure)
        health = engine.health()
        assert health.state == "failed"
        assert not health.ok
        started = time.monotonic()
        with pytest.raises(EngineFailed):
            await engine.submit("hello", GREEDY)
        assert time.monotonic() - started < 1.0  # refused at once, not after a timeout
        assert engine.stats().restarts == 3  # the 4th failure escalated instead


async def test_a_hung_step_fires_the_watchdog_and_fails_the_engine(default_model_dir: Path) -> None:
    """A step that hangs past the step timeout: every stream gets an error, the engine is failed."""
    config = _config(default_model_dir, step_timeout=1.0)
    async with stoic.Engine.start(config) as engine:
        long = stoic.SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        streams = [await engine.submit(p, long) for p in _prompts(4)]
        await asyncio.gather(*(s.__anext__() for s in streams))
        await engine.inject_fault(stoic.FaultSpec(kind="hang", after_steps=1, seconds=3.0))
        outcomes = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 10)
        for _text, error in outcomes:
            assert isinstance(error, EngineFailed)
            assert error.partial is not None
        assert engine.health().state == "failed"
        assert "hung" in (engine.health().reason or "")
        with pytest.raises(EngineFailed):
            await engine.submit("hello", GREEDY)


async def test_fault_injection_is_refused_when_disabled(tiny_model_dir: Path) -> None:
    """Without the switch, inject_fault raises InvalidRequest and nothing is armed."""
    config = stoic.EngineConfig(model=str(tiny_model_dir), dtype="float32")
    async with stoic.Engine.start(config) as engine:
        with pytest.raises(stoic.errors.InvalidRequest):
            await engine.inject_fault(stoic.FaultSpec(kind="oom", after_steps=1))
        result = await engine.complete("hi", stoic.SamplingParams(max_tokens=3, ignore_eos=True))
        assert result.completion_tokens == 3


async def test_a_crashed_scheduler_fails_the_engine_and_ends_every_stream(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug that crashes the scheduler leaves no caller waiting: every stream ends with an error,
    the engine reports failed, and new requests are refused at once."""
    from stoic.scheduler import SchedulerCore

    config = stoic.EngineConfig(model=str(tiny_model_dir), dtype="float32")
    async with stoic.Engine.start(config) as engine:
        params = stoic.SamplingParams(max_tokens=50, ignore_eos=True)
        stream = await engine.submit("hello", params)
        await stream.__anext__()

        def boom(self: SchedulerCore, *args: object) -> None:
            raise RuntimeError("bug in the scheduler")

        monkeypatch.setattr(SchedulerCore, "complete", boom)
        _text, error = await asyncio.wait_for(collect(stream), 5)
        assert isinstance(error, stoic.errors.StoicError)
        failure = await asyncio.wait_for(engine.wait_failed(), 5)
        assert "scheduler" in str(failure)
        with pytest.raises(EngineFailed):
            await engine.submit("hello", params)
