"""The step thread's idle work (StepWorker.set_idle, the KV cache's pages): it runs only while no
step is queued, a queued step runs before the next idle call, and it stops when it says done."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest

from stoic.executor import StepWorker

pytestmark = pytest.mark.asyncio


async def _until(condition: Callable[[], bool]) -> None:
    for _ in range(5000):  # 5 s at most
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("the step thread did not get there in 5 s")


async def test_idle_work_runs_between_steps_until_done_and_a_queued_step_waits_one_call() -> None:
    calls: list[str] = []
    permits = threading.Semaphore(0)  # the test lets the idle work make one call at a time

    def idle() -> bool:
        assert permits.acquire(timeout=5)
        calls.append("idle")
        return calls.count("idle") < 6

    async def idle_calls(n: int) -> None:
        await _until(lambda: calls.count("idle") >= n)

    with StepWorker("test-idle") as worker:
        assert await worker.run(lambda: calls.append("step") or 1) == 1
        worker.set_idle(idle)
        for _ in range(3):
            permits.release()
        await idle_calls(3)  # the thread now waits inside the 4th call
        step = asyncio.ensure_future(worker.run(lambda: calls.append("step") or 2))
        await asyncio.sleep(0.02)
        assert not step.done()
        permits.release()  # the 4th call ends: the queued step runs before a 5th
        assert await step == 2
        assert calls == ["step", "idle", "idle", "idle", "idle", "step"]
        permits.release()
        permits.release()
        await idle_calls(6)  # the 6th call said done
        permits.release()
        await asyncio.sleep(0.05)
        assert calls.count("idle") == 6  # not called again
        assert await worker.run(lambda: calls.append("step") or 3) == 3


async def test_idle_work_replaced_by_none_stops_at_once() -> None:
    runs = 0

    def idle() -> bool:
        nonlocal runs
        runs += 1
        return True  # never done

    with StepWorker("test-idle-stop") as worker:
        worker.set_idle(idle)
        await _until(lambda: runs >= 10)
        worker.set_idle(None)
        await worker.run(lambda: None)  # the thread has seen it
        stopped_at = runs
        await asyncio.sleep(0.05)
        assert runs == stopped_at


async def test_idle_work_that_raises_is_dropped_and_the_thread_runs_steps_on() -> None:
    def idle() -> bool:
        raise RuntimeError("broken idle work")

    with StepWorker("test-idle-raises") as worker:
        worker.set_idle(idle)
        # a thread the exception ended would never answer: the wait would time out
        assert await asyncio.wait_for(worker.run(lambda: 7), 5) == 7
        assert await asyncio.wait_for(worker.run(lambda: 8), 5) == 8
