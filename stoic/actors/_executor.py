"""The executor: owns the model on its device and runs one batched forward per step in a
dedicated worker thread, so the event loop never runs torch work.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar, assert_never

from ..model import ModelRunner, PagedKVCache, StepOutput
from ..runtime import Actor, ActorContext, ActorRef
from ._failures import classify_failure
from ._faults import FaultInjector, InjectedFault
from ._health import EngineHealth
from ._messages import (
    ASK_TIMEOUT,
    AcquireKV,
    CacheMsg,
    ExecutorMsg,
    ExecutorReady,
    RunStep,
    SchedulerMsg,
    StepResult,
    WorkerExited,
)

__all__ = ["Executor", "StepWorker", "classify_failure", "is_stale"]

T = TypeVar("T")

#: how long leaving a StepWorker waits for its thread to end. In an orderly stop its callables
#: are done and it ends at once; the wait matters because a thread that ran torch and is still
#: ending while the interpreter exits aborted the process ("terminate called without an active
#: exception": a server stopped while its model loaded). One still running (a hung step) is
#: left to the daemon thread.
_JOIN_TIMEOUT = 2.0


def is_stale(context: ActorContext[ExecutorMsg], step: RunStep) -> bool:
    """Whether ``step`` was meant for an earlier incarnation (it is dropped, and logged)."""
    if step.incarnation == context.incarnation:
        return False
    context.log.info(
        "executor.stale_step_dropped", step=step.step_id, for_incarnation=step.incarnation
    )
    return True


class StepWorker:
    """One dedicated daemon thread that runs callables in order.

    A daemon thread, so a step that hangs forever cannot keep the process from exiting.
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[
            tuple[Callable[[], Any], concurrent.futures.Future[Any]] | None
        ] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

    async def run(self, fn: Callable[[], T]) -> T:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._queue.put((fn, future))
        return await asyncio.wrap_future(future)

    def close(self) -> None:
        """Let the thread exit once the callables queued before this one have run."""
        self._queue.put(None)

    def __enter__(self) -> StepWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        self._thread.join(timeout=_JOIN_TIMEOUT)


class Executor(Actor[ExecutorMsg]):
    """Runs :class:`RunStep` messages; a step that raises fails the actor (its supervisor recovers).

    On start (every incarnation) it takes the KV tensors from the cache manager (re-created after
    a drop) and tells the scheduler it is ready. Each result carries the incarnation number.
    """

    def __init__(
        self,
        runner: ModelRunner,
        cache: ActorRef[CacheMsg],
        scheduler: ActorRef[SchedulerMsg],
        faults: FaultInjector,
        health: EngineHealth,
        worker: StepWorker,
    ) -> None:
        self._runner = runner
        self._cache = cache
        self._scheduler = scheduler
        self._faults = faults
        self._health = health
        self._kv: PagedKVCache | None = None
        # one worker thread for every incarnation: torch's OpenMP pool is per calling thread, so a
        # new thread per restart would leave idle pools competing for the cores
        self._worker = worker

    async def on_start(self) -> None:
        incarnation = self.context.incarnation
        kv: PagedKVCache | None = await self._cache.ask(AcquireKV, timeout=ASK_TIMEOUT)
        assert kv is not None, "the thread executor needs the KV tensors in this process"
        self._kv = kv
        self._health.executor_ready(incarnation, pid=os.getpid(), compute=self._runner.compute_path)
        await self._scheduler.tell(ExecutorReady(incarnation, self.context.ref))
        self.context.log.info("executor.ready")

    def failure_expected(self, error: BaseException) -> bool:
        """Out of memory, a poisoned device (``oom``, ``fatal``) and injected faults are expected:
        the recovery logs them as one event. Anything else a step raises here may be a bug in
        the model code, and keeps its traceback (which shows the model's frames)."""
        return classify_failure(error) != "error" or isinstance(error, InjectedFault)

    async def on_stop(self) -> None:
        self._kv = None

    async def receive(self, message: ExecutorMsg) -> None:
        match message:
            case RunStep(step_id=step_id, incarnation=incarnation, batch=batch, fault=fault):
                if is_stale(self.context, message):
                    return
                assert self._kv is not None
                kv, runner = self._kv, self._runner
                fault = fault or self._faults.decide()

                def step() -> StepOutput:
                    FaultInjector.in_thread(fault, runner.progress)
                    return runner.execute(batch, kv)

                output = await self._worker.run(step)
                await self._scheduler.tell(StepResult(step_id, incarnation, output))
            case WorkerExited():
                pass  # the process executor's; this one runs in a thread
            case _:
                assert_never(message)
