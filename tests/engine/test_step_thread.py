"""The thread executor keeps torch's work on one thread (one OpenMP pool in the process)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from support import engine_config

import stoic
from stoic.engine import _engine
from stoic.executor import _backend
from stoic.worker import ModelRunner

pytestmark = [pytest.mark.model, pytest.mark.asyncio]


async def test_thread_executor_loads_builds_and_runs_the_model_on_its_step_thread(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loading the weights, building the runner (the blocks' checks and repacking) and every step
    run on the executor's one thread, none on the event loop's or a pool's: libgomp keeps an
    OpenMP pool per calling thread and stops spinning between parallel regions once the pools'
    threads outnumber the cores (a burst's steps measured 1.8x slower with the runner built on
    another thread)."""
    seen: dict[str, set[str]] = {"load": set(), "build": set(), "step": set()}

    def record(what: str) -> None:
        seen[what].add(threading.current_thread().name)

    real_load, real_init, real_execute = (
        _engine.load_model,
        ModelRunner.__init__,
        ModelRunner.execute,
    )

    def load(*args: Any, **kwargs: Any) -> Any:
        record("load")
        return real_load(*args, **kwargs)

    def init(self: ModelRunner, *args: Any, **kwargs: Any) -> None:
        record("build")
        real_init(self, *args, **kwargs)

    def execute(self: ModelRunner, *args: Any, **kwargs: Any) -> Any:
        record("step")
        return real_execute(self, *args, **kwargs)

    monkeypatch.setattr(_engine, "load_model", load)
    monkeypatch.setattr(ModelRunner, "__init__", init)
    monkeypatch.setattr(ModelRunner, "execute", execute)
    assert _backend.ModelRunner is ModelRunner
    config = engine_config(tiny_model_dir, executor="thread")
    async with stoic.Engine.start(config) as engine:
        params = stoic.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        result = await engine.complete("one thread", params)
        assert result.completion_tokens == 4
    assert seen == {
        "load": {"stoic-executor"},
        "build": {"stoic-executor"},
        "step": {"stoic-executor"},
    }


async def test_a_model_that_fails_to_load_stops_the_step_thread(tmp_path: Path) -> None:
    """A load that raises on the step thread reaches the caller of ``Engine.start`` as
    ModelUnavailable, and leaves no stoic-executor thread behind."""
    before = {t for t in threading.enumerate() if t.name == "stoic-executor"}
    with pytest.raises(stoic.errors.ModelUnavailable):
        async with stoic.Engine.start(stoic.EngineConfig(model=str(tmp_path / "missing"))):
            pass
    for thread in threading.enumerate():
        if thread.name == "stoic-executor" and thread not in before:
            thread.join(timeout=5)
            assert not thread.is_alive()


async def test_cancelling_start_during_the_load_waits_for_the_load(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start cancelled while the model loads propagates the cancellation only once the load
    ended: no load outlives the start that asked for it (a retry cannot overlap two)."""
    loading, finished = threading.Event(), threading.Event()
    real_load = _engine.load_model

    def slow_load(*args: Any, **kwargs: Any) -> Any:
        loading.set()
        time.sleep(0.5)
        try:
            return real_load(*args, **kwargs)
        finally:
            finished.set()

    monkeypatch.setattr(_engine, "load_model", slow_load)

    async def start() -> None:
        async with stoic.Engine.start(engine_config(tiny_model_dir, executor="thread")):
            pass

    task = asyncio.ensure_future(start())
    assert await asyncio.to_thread(loading.wait, 30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert finished.is_set()
