"""The executor actor: runs one batched forward per step on its :class:`StepBackend` (a worker
thread or a worker process), so the event loop never runs torch work."""

from __future__ import annotations

import contextlib
from typing import assert_never

from ..actors import (
    ASK_TIMEOUT,
    AcquireKV,
    CacheMsg,
    EngineHealth,
    ExecutorMsg,
    ExecutorReady,
    FaultInjector,
    KVLease,
    RunStep,
    SchedulerMsg,
    StepResult,
    WorkerExited,
)
from ..runtime import Actor, ActorContext, ActorRef
from ._backend import StepBackend

__all__ = ["Executor", "is_stale"]


def is_stale(context: ActorContext[ExecutorMsg], step: RunStep) -> bool:
    """Whether ``step`` was meant for an earlier incarnation (it is dropped, and logged)."""
    if step.incarnation == context.incarnation:
        return False
    context.log.info(
        "executor.stale_step_dropped", step=step.step_id, for_incarnation=step.incarnation
    )
    return True


class Executor(Actor[ExecutorMsg]):
    """Runs :class:`RunStep` messages on ``backend``; a failed step, a dead worker or a hung one
    fails the actor (its supervisor recovers).

    On start (every incarnation) it takes the KV cache's lease from the cache manager (the
    tensors, re-created after a drop; with a worker process: whether its pools were dropped),
    attaches to the backend (a worker process: the same one when it survived the failure, else
    a spare or a new process) and tells the scheduler it is ready. Each result carries the
    incarnation number.
    """

    def __init__(
        self,
        backend: StepBackend,
        cache: ActorRef[CacheMsg],
        scheduler: ActorRef[SchedulerMsg],
        faults: FaultInjector,
        health: EngineHealth,
        *,
        step_timeout: float,
    ) -> None:
        self._backend = backend
        self._cache = cache
        self._scheduler = scheduler
        self._faults = faults
        self._health = health
        self._step_timeout = step_timeout

    async def on_start(self) -> None:
        incarnation = self.context.incarnation
        lease: KVLease = await self._cache.ask(AcquireKV, timeout=ASK_TIMEOUT)
        ref = self.context.ref

        def exited(pid: int) -> None:
            # stopped or full: a step in flight sees the exit anyway
            with contextlib.suppress(Exception):
                ref.try_tell(WorkerExited(pid))

        attached = await self._backend.attach(lease, exited, incarnation)
        self._health.executor_ready(incarnation, pid=attached.pid, compute=attached.compute)
        await self._scheduler.tell(ExecutorReady(incarnation, ref))
        self.context.log.info("executor.ready", **attached.log)

    def failure_expected(self, error: BaseException) -> bool:
        """What the backend anticipates (out of memory, a poisoned device, an injected fault; a
        worker process's every failure): the recovery logs it as one event. Anything else keeps
        its traceback."""
        return self._backend.failure_expected(error)

    async def on_stop(self) -> None:
        self._backend.detach()

    async def receive(self, message: ExecutorMsg) -> None:
        match message:
            case RunStep(step_id=step_id, incarnation=incarnation, batch=batch, fault=fault):
                if is_stale(self.context, message):
                    return
                output = await self._backend.run_step(
                    step_id, batch, fault or self._faults.decide(), self._step_timeout
                )
                await self._scheduler.tell(StepResult(step_id, incarnation, output))
            case WorkerExited(pid=pid):
                self._backend.check_exited(pid)
            case _:
                assert_never(message)
