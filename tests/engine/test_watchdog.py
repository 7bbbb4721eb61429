"""The step watchdog tells slow from hung: a step that keeps progressing (a tick per decoder
layer) runs however long it takes; one that stops progressing for ``step_timeout`` is a hang
(the process executor replaces its worker, the thread executor's engine is failed)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from support import PROMPTS, collect, engine_config, wait_idle, wait_replaced

import stoic
from stoic.errors import EngineFailed, ExecutorFailed

pytestmark = [pytest.mark.model, pytest.mark.asyncio]

TIMEOUT = 1.0
PARAMS = stoic.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
LONG = stoic.SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
#: the default model's step ticks 32 times (its start, 30 layers, its end): at 0.125 s a tick
#: one step takes 4 s or more, four times the step timeout, and never 1 s without progress
SLOW_DEFAULT = stoic.FaultSpec(kind="slow", after_steps=1, seconds=0.125)
HANG = stoic.FaultSpec(kind="hang", after_steps=1, seconds=60.0)


async def _slowed(engine: stoic.Engine) -> tuple[list[tuple[str, Any]], float]:
    """Start every prompt, and once each generates, slow the next step (a decode step of every
    stream); return their outcomes and the seconds they took from the fault on."""
    streams = [await engine.submit(p, PARAMS) for p in PROMPTS[:2]]
    heads = [(await asyncio.wait_for(s.__anext__(), 60)).text for s in streams]
    started = time.monotonic()
    await engine.inject_fault(SLOW_DEFAULT)
    rests = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 120)
    outcomes = [(head + text, error) for head, (text, error) in zip(heads, rests, strict=True)]
    return outcomes, time.monotonic() - started


@pytest.mark.parametrize("executor", ["process", "thread"])
async def test_a_step_slowed_to_several_times_the_timeout_is_not_killed(
    default_model_dir: Path, executor: str
) -> None:
    """A throttled worker (the ``slow`` fault) makes one step take four times
    ``step_timeout``; it keeps progressing, so nothing is killed or failed: every stream ends
    with its fault-free text, on the same worker, with no restart."""
    config = engine_config(default_model_dir, executor=executor, step_timeout=TIMEOUT)
    async with stoic.Engine.start(config) as engine:
        reference = [(await engine.complete(p, PARAMS)).text for p in PROMPTS[:2]]
        pid = engine.stats().executor_pid
        outcomes, seconds = await _slowed(engine)
        assert seconds >= 4 * TIMEOUT  # the premise: the step really was that slow
        assert outcomes == [(text, None) for text in reference]
        stats = await wait_idle(engine)
        assert engine.health().state == "serving"
        assert (stats.restarts, stats.executor_pid, stats.faults_injected) == (0, pid, 1)


async def test_a_hung_worker_is_killed_within_about_the_timeout_and_replaced(
    tiny_model_dir: Path,
) -> None:
    """Process executor: a step spinning without progress (the ``hang`` fault, 60 s) has its
    worker killed after about ``step_timeout``; the stream fails with ``kind="hang"``, a new
    worker serves, and the next answer equals the fault-free one."""
    config = engine_config(tiny_model_dir, executor="process", step_timeout=TIMEOUT)
    async with stoic.Engine.start(config) as engine:
        expected = (await engine.complete(PROMPTS[1], PARAMS)).text
        pid = engine.stats().executor_pid
        stream = await engine.submit(PROMPTS[0], LONG)
        await asyncio.wait_for(stream.__anext__(), 60)
        armed = time.monotonic()
        await engine.inject_fault(HANG)
        _text, error = await asyncio.wait_for(collect(stream), 30)
        seconds = time.monotonic() - armed
        assert isinstance(error, ExecutorFailed) and error.kind == "hang", error
        assert "no progress" in error.message
        # killed at the timeout (a quarter of it later at most, plus the kill), not at 60 s
        assert TIMEOUT * 0.95 <= seconds < TIMEOUT + 4.0, seconds
        await wait_replaced(engine, pid)
        assert (await engine.complete(PROMPTS[1], PARAMS)).text == expected
        stats = await wait_idle(engine)
        assert dict(stats.restarts_by_kind) == {"hang": 1}


async def test_a_hung_thread_step_fails_the_engine_within_about_the_timeout(
    tiny_model_dir: Path,
) -> None:
    """Thread executor: a step spinning without progress fails the engine after about
    ``step_timeout`` (a thread cannot be killed); the stream ends with ``EngineFailed`` and the
    health's reason says the step made no progress."""
    config = engine_config(tiny_model_dir, step_timeout=TIMEOUT)
    async with stoic.Engine.start(config) as engine:
        stream = await engine.submit(PROMPTS[0], LONG)
        await asyncio.wait_for(stream.__anext__(), 60)
        armed = time.monotonic()
        await engine.inject_fault(stoic.FaultSpec(kind="hang", after_steps=1, seconds=3.0))
        _text, error = await asyncio.wait_for(collect(stream), 30)
        seconds = time.monotonic() - armed
        assert isinstance(error, EngineFailed), error
        assert TIMEOUT * 0.95 <= seconds < TIMEOUT + 1.5, seconds  # before the 3 s spin ends
        health = engine.health()
        assert health.state == "failed"
        assert "no progress" in (health.reason or "") and "hung" in (health.reason or "")
