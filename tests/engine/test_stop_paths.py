"""Leaving the engine and the edges of recovery: the drain, admission while stopping, cancelling
the stop, requests submitted and aborted while the executor recovers, failures spaced wider than
the restart window, and a hung step's late result fenced after the watchdog fired."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from support import PROMPTS, collect, engine_config, until, wait_idle

import stoic
from stoic.errors import EngineFailed, EngineStopped, ExecutorFailed

pytestmark = [pytest.mark.model, pytest.mark.asyncio]

#: cannot finish within a drain of a few seconds (prompt + 480 tokens fits the tiny model's 512)
LONG = stoic.SamplingParams(max_tokens=480, temperature=0, ignore_eos=True)
#: a few steps: finishes within any drain below
SHORT = stoic.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
#: every step takes at least 50 ms (a ``slow`` fault: the tiny model's 4 progress ticks a step, its
#: start, 2 layers and its end, wait 12.5 ms each): LONG needs 24 s or more, whatever the
#: machine's speed, so it cannot finish within a drain of a few seconds, and SHORT can
SLOW_STEPS = stoic.FaultSpec(kind="slow", probability=1.0, seed=0, seconds=0.0125)
DRAIN = 5.0


async def _first(stream: Any) -> str:
    """Read one delta (the request is generating) and return its text."""
    delta = await asyncio.wait_for(stream.__anext__(), 60)
    return str(delta.text)


async def _rest(stream: Any, head: str) -> tuple[str, BaseException | None]:
    text, error = await collect(stream)
    return head + text, error


class _Held:
    """An engine entered in a task of its own, left when :meth:`leave` is called, so that the
    test can act while the engine stops (its state ``"stopping"``)."""

    def __init__(self, config: stoic.EngineConfig) -> None:
        self._config = config
        self._ready = asyncio.Event()
        self._leave = asyncio.Event()
        self.engine: stoic.Engine | None = None
        self.task: asyncio.Task[None] = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async with stoic.Engine.start(self._config) as engine:
            self.engine = engine
            self._ready.set()
            await self._leave.wait()

    async def entered(self) -> stoic.Engine:
        await asyncio.wait_for(asyncio.shield(self._ready.wait()), 120)
        assert self.engine is not None
        return self.engine

    async def leave(self) -> None:
        """Start leaving the block; return once the engine reports ``"stopping"``."""
        engine = await self.entered()
        self._leave.set()
        await until(lambda: engine.health().state == "stopping", 30, "stopping")


async def test_leaving_the_engine_drains_finishable_streams_and_stops_the_rest_with_a_prefix(
    tiny_model_dir: Path,
) -> None:
    """Leaving ``Engine.start()`` with streams running: those that finish within
    ``drain_timeout`` end normally with their whole output; those that cannot end with
    ``EngineStopped`` whose ``partial`` is a prefix of their fault-free text; nothing is left
    running or waiting, and the stats stay readable after the block."""
    config = engine_config(tiny_model_dir, drain_timeout=DRAIN)
    async with stoic.Engine.start(config) as engine:
        await engine.inject_fault(SLOW_STEPS)
        longs = [await engine.submit(p, LONG) for p in PROMPTS[:2]]
        shorts = [await engine.submit(p, SHORT) for p in PROMPTS]
        heads = await asyncio.gather(*(_first(s) for s in [*longs, *shorts]))
        tasks = [
            asyncio.create_task(_rest(s, h)) for s, h in zip([*longs, *shorts], heads, strict=True)
        ]
        started = time.monotonic()
    drained = time.monotonic() - started
    outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 30)
    stats = engine.stats()
    assert stats.state == "stopping"
    assert stats.running == 0 and stats.waiting == 0
    assert stats.kv_blocks_used == 0, stats
    assert drained >= DRAIN * 0.9, f"the drain ended after {drained:.2f}s, before its deadline"

    partials = []
    for text, error in outcomes[:2]:
        assert isinstance(error, EngineStopped), error
        assert error.partial is not None and error.partial.completion_tokens >= 1
        assert error.partial.completion_tokens < 480  # LONG.max_tokens
        assert text == error.partial.text
        partials.append(error.partial)
    for text, error in outcomes[2:]:
        assert error is None, error
        assert text

    # the fault-free text of as many tokens, from a fresh engine (float32: exact greedy outputs)
    async with stoic.Engine.start(engine_config(tiny_model_dir)) as fresh:
        for prompt, partial in zip(PROMPTS[:2], partials, strict=True):
            n = partial.completion_tokens
            params = stoic.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
            full = (await fresh.complete(prompt, params)).text
            assert full.startswith(partial.text), (full, partial.text)
        for prompt, (text, _error) in zip(PROMPTS, outcomes[2:], strict=True):
            assert (await fresh.complete(prompt, SHORT)).text == text


async def test_submit_while_the_engine_is_stopping_raises_engine_stopped(
    tiny_model_dir: Path,
) -> None:
    """Once leaving ``Engine.start()`` has begun (state ``"stopping"``), ``submit`` and
    ``complete`` raise ``EngineStopped`` at once, while a stream admitted before keeps running
    until the drain deadline."""
    held = _Held(engine_config(tiny_model_dir, drain_timeout=DRAIN))
    engine = await held.entered()
    await engine.inject_fault(SLOW_STEPS)
    running = await engine.submit(PROMPTS[0], LONG)
    head = await _first(running)
    reader = asyncio.create_task(_rest(running, head))
    await held.leave()
    assert not engine.health().ok
    with pytest.raises(EngineStopped):
        await engine.submit(PROMPTS[1], SHORT)
    with pytest.raises(EngineStopped):
        await engine.complete(PROMPTS[1], SHORT)
    assert not reader.done()  # the admitted stream still generates during the drain
    await asyncio.wait_for(held.task, 60)
    _text, error = await asyncio.wait_for(reader, 30)
    assert isinstance(error, EngineStopped) and error.partial is not None


def _executor_threads() -> list[threading.Thread]:
    """The engine's executor thread (ends shortly after the block: it is told, not joined)."""
    return [t for t in threading.enumerate() if t.name.startswith("stoic-executor")]


async def test_cancelling_the_task_leaving_the_engine_cuts_the_drain_short_but_stops_every_actor(
    tiny_model_dir: Path,
) -> None:
    """``task.cancel()`` of the task leaving ``Engine.start()`` during the drain: the anyio
    shield does not hold against asyncio cancellation, so the drain ends at once (well before
    ``drain_timeout``) and the running stream ends with ``EngineStopped`` and its partial; the
    stop itself still completes: no actor task and no executor thread is left, and the task ends
    cancelled."""
    before = asyncio.all_tasks()
    held = _Held(engine_config(tiny_model_dir, drain_timeout=60.0))
    engine = await held.entered()
    running = await engine.submit(PROMPTS[0], LONG)
    head = await _first(running)
    reader = asyncio.create_task(_rest(running, head))
    await held.leave()
    held.task.cancel()
    started = time.monotonic()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(held.task, 30)
    assert time.monotonic() - started < 30  # not the 60 s drain
    _text, error = await asyncio.wait_for(reader, 10)
    assert isinstance(error, EngineStopped), error
    assert error.partial is not None and error.partial.completion_tokens >= 1
    left = asyncio.all_tasks() - before - {asyncio.current_task()}
    assert not left, left
    await until(lambda: not _executor_threads(), 10, "the executor thread ended")
    with pytest.raises(EngineStopped):
        await engine.submit(PROMPTS[1], SHORT)


async def test_a_task_cancelled_inside_the_block_still_gets_the_whole_drain(
    tiny_model_dir: Path,
) -> None:
    """``task.cancel()`` while the task is still inside ``Engine.start()``: the block is left
    through the ``CancelledError`` and, that cancellation being spent, the drain runs to its
    deadline (a short stream finishes normally, a long one ends with ``EngineStopped``) before
    the task ends cancelled."""
    held = _Held(engine_config(tiny_model_dir, drain_timeout=DRAIN))
    engine = await held.entered()
    await engine.inject_fault(SLOW_STEPS)
    streams = [await engine.submit(PROMPTS[0], LONG), await engine.submit(PROMPTS[1], SHORT)]
    heads = await asyncio.gather(*(_first(s) for s in streams))
    tasks = [asyncio.create_task(_rest(s, h)) for s, h in zip(streams, heads, strict=True)]
    assert engine.health().state == "serving"
    held.task.cancel()
    started = time.monotonic()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(held.task, 60)
    elapsed = time.monotonic() - started
    assert elapsed >= DRAIN * 0.9, f"left after {elapsed:.2f}s: the drain was cut short"
    (_long, long_error), (short_text, short_error) = await asyncio.wait_for(
        asyncio.gather(*tasks), 10
    )
    assert isinstance(long_error, EngineStopped) and long_error.partial is not None
    assert short_error is None, short_error
    assert short_text


async def test_an_anyio_cancel_scope_around_the_engine_waits_for_the_whole_drain(
    tiny_model_dir: Path,
) -> None:
    """An anyio cancel scope cancelled around ``Engine.start()``: the stop is shielded, so the
    drain runs to its deadline (a short stream finishes normally, a long one ends with
    ``EngineStopped`` after ``drain_timeout``), every actor stops, then the scope's cancellation
    takes effect."""
    before = asyncio.all_tasks()
    tasks: list[asyncio.Task[tuple[str, BaseException | None]]] = []
    with anyio.CancelScope() as scope:
        async with stoic.Engine.start(engine_config(tiny_model_dir, drain_timeout=DRAIN)) as engine:
            await engine.inject_fault(SLOW_STEPS)
            streams = [
                await engine.submit(PROMPTS[0], LONG),
                await engine.submit(PROMPTS[1], SHORT),
            ]
            heads = await asyncio.gather(*(_first(s) for s in streams))
            tasks = [asyncio.create_task(_rest(s, h)) for s, h in zip(streams, heads, strict=True)]
            scope.cancel()
            started = time.monotonic()
            await anyio.sleep(60)
    elapsed = time.monotonic() - started
    assert scope.cancelled_caught
    assert elapsed >= DRAIN * 0.9, f"left after {elapsed:.2f}s: the drain was cut short"
    (_long, long_error), (short_text, short_error) = await asyncio.wait_for(
        asyncio.gather(*tasks), 10
    )
    assert isinstance(long_error, EngineStopped) and long_error.partial is not None
    assert short_error is None, (getattr(short_error, "partial", None), elapsed)
    assert short_text
    left = asyncio.all_tasks() - before - {asyncio.current_task()}
    assert not left, left
    await until(lambda: not _executor_threads(), 10, "the executor thread ended")


async def test_requests_submitted_during_recovery_wait_and_an_abort_there_frees_them(
    tiny_model_dir: Path,
) -> None:
    """A hung step in the process executor: the worker is killed and replaced (state
    ``"recovering"`` for seconds). A request submitted then is queued and completes, with its
    fault-free text, once the new worker serves; one aborted while still queued leaves the queue
    at once, is not counted as failed, and no sequence or KV block is left afterwards."""
    config = engine_config(tiny_model_dir, executor="process", step_timeout=2.0)
    async with stoic.Engine.start(config) as engine:
        expected = (await engine.complete(PROMPTS[1], SHORT)).text
        victim = await engine.submit(PROMPTS[0], LONG)
        head = await _first(victim)
        victim_task = asyncio.create_task(_rest(victim, head))
        await engine.inject_fault(stoic.FaultSpec(kind="hang", after_steps=1, seconds=60))
        await until(lambda: engine.health().state == "recovering", 60, "recovering")
        _text, error = await asyncio.wait_for(victim_task, 10)
        assert isinstance(error, ExecutorFailed) and error.kind == "hang", error
        failed = engine.stats().failed_sequences

        queued = await engine.submit(PROMPTS[1], SHORT)
        aborted = await engine.submit(PROMPTS[2], LONG)
        await until(lambda: engine.stats().waiting == 2, 10, "both queued")
        assert engine.health().state == "recovering"  # the premise: the worker is not back yet
        await aborted.aclose()
        await until(lambda: engine.stats().waiting == 1, 10, "the aborted request dequeued")
        assert engine.health().state == "recovering"

        text, error = await asyncio.wait_for(collect(queued), 60)
        assert error is None, error
        assert text == expected
        assert engine.health().state == "serving"
        stats = await wait_idle(engine, 10)
        assert stats.failed_sequences == failed  # the abort is not a failure
        assert stats.restarts == 1 and dict(stats.restarts_by_kind) == {"hang": 1}


async def test_failures_spaced_wider_than_the_restart_window_never_fail_the_engine(
    tiny_model_dir: Path,
) -> None:
    """``max_restarts=1`` within ``restart_window=0.5`` s: three executor errors, each injected
    after the previous recovery and more than the window later, are each recovered from; the
    engine keeps serving with ``restarts == 3``."""
    config = engine_config(tiny_model_dir, max_restarts=1, restart_window=0.5)
    params = stoic.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    async with stoic.Engine.start(config) as engine:
        for n in range(1, 4):
            await asyncio.sleep(0.8)  # wider than the window since the previous restart
            await engine.inject_fault(stoic.FaultSpec(kind="error", after_steps=1))
            _text, error = await asyncio.wait_for(collect(await engine.submit("hi", params)), 30)
            assert isinstance(error, ExecutorFailed) and error.kind == "error", error
            await until(
                lambda n=n: engine.health().ok and engine.stats().restarts == n,  # type: ignore[misc]
                30,
                f"recovery {n}",
            )
        assert engine.health().state == "serving"
        assert engine.stats().restarts == 3
        assert (await engine.complete("hi", params)).completion_tokens == 16


async def test_a_hung_steps_late_result_is_fenced_after_the_watchdog_fired(
    tiny_model_dir: Path,
) -> None:
    """Thread executor, a step hanging past ``step_timeout``: the watchdog fails the engine
    (streams end with ``EngineFailed``), and when the hung step returns, its result is dropped
    and counted: ``fenced_results`` goes up by exactly one."""
    config = engine_config(tiny_model_dir, step_timeout=1.0)
    async with stoic.Engine.start(config) as engine:
        stream = await engine.submit(PROMPTS[0], LONG)
        head = await _first(stream)
        fenced = engine.stats().fenced_results
        await engine.inject_fault(stoic.FaultSpec(kind="hang", after_steps=1, seconds=4.0))
        _text, error = await asyncio.wait_for(_rest(stream, head), 30)
        assert isinstance(error, EngineFailed), error
        health = engine.health()
        assert health.state == "failed" and "hung" in (health.reason or "")
        assert engine.stats().fenced_results == fenced  # the step has not returned yet
        await until(lambda: engine.stats().fenced_results > fenced, 30, "the late result")
        await asyncio.sleep(0.5)
        assert engine.stats().fenced_results == fenced + 1
        assert engine.stats().running == 0
