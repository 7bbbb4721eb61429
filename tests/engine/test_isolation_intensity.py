"""Poison isolation against the restart intensity (``recovery="resume"``): the failures of an
isolation probe (a suspect run alone) are charged to the suspect, not to the engine, so a poison
request is isolated whatever failed in the last window; a worker that fails every step still
fails the engine.

float32 throughout: the healthy requests must end with exactly their fault-free text.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from support import collect, engine_config, wait_idle, wait_restarts

import stoic
from stoic.errors import EngineFailed, ExecutorFailed

pytestmark = [pytest.mark.model, pytest.mark.asyncio]

GREEDY = stoic.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
#: long enough to outlive three faults three steps apart (and their resumes)
LONG = stoic.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def _config(model_dir: Path, **overrides: Any) -> stoic.EngineConfig:
    return engine_config(model_dir, **{"recovery": "resume", **overrides})


async def test_a_poison_request_is_isolated_after_unrelated_failures_in_the_same_window(
    default_model_dir: Path,
) -> None:
    """An error, an out-of-memory error and a kill -9 of the worker (all resumed), then a poison
    request batched with eight healthy ones, all within one restart window: 3 + 2 failures of
    steps with healthy requests in them count (5, the default ``max_restarts``), the poison
    request's two failures alone do not. It ends alone with an isolated error, the eight
    complete with exactly their fault-free text, and the engine stays serving. (Counted as
    before, the 6th failure exceeded the intensity and all nine ended with ``EngineFailed``.)
    The window is long (600 s) so that a slow machine cannot let a failure age out of it."""
    config = _config(default_model_dir, executor="process", restart_window=600.0)
    first = [f"Describe a river (#{i})." for i in range(3)]
    healthy = [f"Name a fruit (#{i})." for i in range(8)]
    prompts = [*healthy[:4], "Name a fruit XYZZY.", *healthy[4:]]
    async with stoic.Engine.start(config) as engine:
        assert engine.stats().restarts == 0
        baseline = await asyncio.gather(
            *(engine.complete(p, LONG) for p in first),
            *(engine.complete(p, GREEDY) for p in prompts),
        )
        want_first, expected = [r.text for r in baseline[:3]], baseline[3:]

        # three unrelated failures, each resumed, three steps apart (clean steps between them)
        streams = [await engine.submit(p, LONG) for p in first]
        readers = [asyncio.ensure_future(collect(s)) for s in streams]
        for n, kind in enumerate(["error", "oom", "crash"], start=1):
            await engine.inject_fault(stoic.FaultSpec(kind=kind, after_steps=3))  # type: ignore[arg-type]
            await wait_restarts(engine, n, limit=60.0)
        outcomes = await asyncio.wait_for(asyncio.gather(*readers), 120)
        assert outcomes == [(text, None) for text in want_first]
        assert engine.stats().failed_sequences == 0

        # then, in the same window, a poison request batched with eight healthy ones
        await engine.inject_fault(stoic.FaultSpec(kind="error", match="XYZZY"))
        streams = [await engine.submit(p, GREEDY) for p in prompts]
        outcomes = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 120)
        for prompt, (text, error), want in zip(prompts, outcomes, expected, strict=True):
            if "XYZZY" in prompt:
                assert isinstance(error, ExecutorFailed) and not error.retryable
                assert "isolated" in str(error) and want.text.startswith(text)
            else:
                assert (text, error) == (want.text, None)
        stats = await wait_idle(engine, 10.0)
        assert engine.health().state == "serving"
        assert stats.requests_isolated == 1 and stats.failed_sequences == 1
        # every failure restarted the executor; the two charged to the suspect did not count
        assert stats.isolation_failures == 2
        assert stats.restarts == config.max_restarts + stats.isolation_failures
        await engine.clear_faults()
        again = await engine.complete(prompts[4], GREEDY)
        assert again.text == expected[4].text


async def test_a_worker_failing_every_step_still_fails_the_engine(tiny_model_dir: Path) -> None:
    """A crash loop (every step fails, whatever it holds) is not a poison request: once two
    failures were charged to suspects without a clean step, every failure counts again, so the
    engine is failed past the restart intensity instead of isolating request after request.
    Every stream ends with an error, nothing hangs, and new requests are refused at once."""
    config = _config(tiny_model_dir, max_restarts=5, restart_window=600.0, max_resumes=10)
    async with stoic.Engine.start(config) as engine:
        await engine.inject_fault(stoic.FaultSpec(kind="error", probability=1.0, seed=1))
        streams = [await engine.submit(f"hello (#{i})", GREEDY) for i in range(8)]
        outcomes = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 60)
        await asyncio.wait_for(engine.wait_failed(), 10)
        assert engine.health().state == "failed"
        for _text, error in outcomes:
            assert isinstance(error, EngineFailed) or (
                isinstance(error, ExecutorFailed) and "isolated" in str(error)
            )
        assert any(isinstance(error, EngineFailed) for _text, error in outcomes)
        stats = engine.stats()
        assert stats.isolation_failures == 2
        # the 6th failure charged to the engine escalated; the two charged to suspects restarted
        assert stats.restarts == config.max_restarts + 2
        with pytest.raises(EngineFailed):
            await engine.submit("hello", GREEDY)
