"""The executor actor of the process mode: drives a worker process (see :mod:`._process`)."""

from __future__ import annotations

import contextlib
from typing import assert_never

from ..runtime import Actor, ActorRef
from ._executor import is_stale
from ._failures import ExecutorFault
from ._faults import FaultInjector
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
from ._process import WorkerPool, WorkerProcess

__all__ = ["ProcessExecutor"]


def _exited(worker: WorkerProcess) -> ExecutorFault:
    return ExecutorFault(
        f"executor process {worker.exited}", "crash", pid=worker.pid, exitcode=worker.exitcode
    )


class ProcessExecutor(Actor[ExecutorMsg]):
    """Runs :class:`RunStep` messages in a worker process; a failed step, a dead worker or a hung
    one fails the actor (its supervisor recovers).

    On start (every incarnation) it resets the cache manager's view of the KV pools and takes a
    ready worker from the pool: the same process with fresh KV pools when it survived the
    failure, else a spare or a new process. A worker whose device may be poisoned (``fatal``) is
    killed before the actor fails, so it is never reused. A step whose progress counter (shared
    with the worker) does not move for ``step_timeout`` gets its worker killed (SIGTERM, then
    SIGKILL) and fails as ``hang``; a slow step that keeps progressing runs to its end.
    """

    def __init__(
        self,
        pool: WorkerPool,
        cache: ActorRef[CacheMsg],
        scheduler: ActorRef[SchedulerMsg],
        faults: FaultInjector,
        health: EngineHealth,
        *,
        step_timeout: float,
    ) -> None:
        self._pool = pool
        self._cache = cache
        self._scheduler = scheduler
        self._faults = faults
        self._health = health
        self._step_timeout = step_timeout
        self._worker: WorkerProcess | None = None

    async def on_start(self) -> None:
        incarnation = self.context.incarnation
        await self._cache.ask(AcquireKV, timeout=ASK_TIMEOUT)  # the pools are new from here on
        worker, replaced = await self._pool.acquire()
        ref = self.context.ref

        def exited(gone: WorkerProcess) -> None:
            # stopped or full: a step in flight sees the exit anyway
            with contextlib.suppress(Exception):
                ref.try_tell(WorkerExited(gone.pid))

        worker.on_exit = exited
        self._worker = worker
        if not worker.alive:  # it died between being handed out and now
            raise _exited(worker)
        worker.set_role("serving", incarnation)  # its process title says so
        self._health.executor_ready(incarnation, pid=worker.pid, compute=worker.compute)
        await self._scheduler.tell(ExecutorReady(incarnation, ref))
        self.context.log.info("executor.ready", pid=worker.pid, new_process=replaced)

    def failure_expected(self, error: BaseException) -> bool:
        """Every :class:`ExecutorFault` (the worker's step raised, it died, hung or could not
        start) is expected: the recovery logs it as one event (``recovery.executor_failed``),
        without a traceback, which would only show this process's side of the pipe."""
        return isinstance(error, ExecutorFault)

    async def on_stop(self) -> None:
        if self._worker is not None:
            self._worker.on_exit = None
            self._worker = None

    async def receive(self, message: ExecutorMsg) -> None:
        worker = self._worker
        assert worker is not None
        match message:
            case RunStep(step_id=step_id, incarnation=incarnation, batch=batch, fault=fault):
                if is_stale(self.context, message):
                    return
                try:
                    output = await worker.step(
                        step_id, batch, fault or self._faults.decide(), self._step_timeout
                    )
                except ExecutorFault as exc:
                    if exc.kind == "fatal":
                        await worker.terminate()  # a poisoned device context is never used again
                    raise
                await self._scheduler.tell(StepResult(step_id, incarnation, output))
            case WorkerExited(pid=pid):
                if pid == worker.pid:
                    raise _exited(worker)
            case _:
                assert_never(message)
