"""The engine sizes its compute threads to its CPU budget and reports what each step ran on."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import structlog
from support import collect, engine_config

import stoic
from stoic.worker import cpu_budget


async def _one_request(engine: stoic.Engine) -> str:
    stream = engine.generate("The sky is", stoic.SamplingParams(max_tokens=4, temperature=0.0))
    text, error = await collect(stream)
    assert error is None
    return text


@pytest.mark.parametrize("executor", ["thread", "process"])
async def test_fixed_threads_are_what_every_step_runs_on(
    default_model_dir: Path, executor: str
) -> None:
    """``threads=1, adapt_threads=False``: the steps run on one thread, in the server's thread
    or in the worker process, and the stats (``stoic_compute_threads``) say so."""
    config = engine_config(default_model_dir, executor=executor, threads=1, adapt_threads=False)
    with structlog.testing.capture_logs() as logs:
        async with stoic.Engine.start(config) as engine:
            assert engine.stats().compute_threads == 0  # no step yet
            await _one_request(engine)
            assert engine.stats().compute_threads == 1
    budget = [e for e in logs if e["event"] == "engine.cpu_budget"]
    assert len(budget) == 1
    assert budget[0]["threads"] == 1 and budget[0]["adapt_threads"] is False
    assert budget[0]["cpus"] == len(os.sched_getaffinity(0))


async def test_by_default_the_threads_stay_within_the_cpu_budget(default_model_dir: Path) -> None:
    """Without ``threads`` the budget is the affinity capped by the cgroup quota; adapting may
    run fewer threads (a neighbour), never more."""
    config = engine_config(default_model_dir, executor="thread")
    async with stoic.Engine.start(config) as engine:
        await _one_request(engine)
        assert 1 <= engine.stats().compute_threads <= cpu_budget().threads


def test_threads_below_one_are_refused() -> None:
    with pytest.raises(ValueError, match="threads"):
        stoic.EngineConfig(threads=0)
