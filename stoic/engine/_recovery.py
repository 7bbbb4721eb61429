"""The executor's recovery procedure, run by its supervisor before each restart, and what
happens when the supervisor gives up."""

from __future__ import annotations

import time
from collections.abc import Callable

from .._logging import get_logger
from ..actors import (
    ASK_TIMEOUT,
    CacheMsg,
    DropAll,
    EngineFailedNotice,
    EngineHealth,
    ExecutorDown,
    Recovered,
    SchedulerMsg,
    classify_failure,
)
from ..errors import EngineFailed
from ..runtime import ActorRef, SupervisorEscalation

__all__ = ["Recovery"]

_log = get_logger("stoic.engine")


class Recovery:
    """Recovers from executor failures (the supervisor's ``on_failure`` hook) and fails the engine
    when the supervisor escalates (its ``on_escalate`` hook).

    The procedure: mark the engine recovering; fence the failed incarnation and end every
    sequence with the error and its partial output (the scheduler); drop every KV block and the
    KV tensors (the cache manager). The supervisor then restarts the executor, which marks the
    engine serving again once it holds a fresh KV cache.
    """

    def __init__(
        self,
        health: EngineHealth,
        scheduler: ActorRef[SchedulerMsg],
        cache: ActorRef[CacheMsg],
        *,
        replaces_worker: bool,
        max_restarts: int,
        restart_window: float,
    ) -> None:
        self._health = health
        self._scheduler = scheduler
        self._cache = cache
        #: the executor runs the model in a worker process it replaces when the device is
        #: poisoned; otherwise a poisoned device is the server's own and cannot be recovered
        self._replaces_worker = replaces_worker
        self._max_restarts = max_restarts
        self._restart_window = restart_window
        #: failures in the supervisor's window, this one included (set once it is spawned)
        self.failures_in_window: Callable[[], int] = lambda: 0

    async def on_failure(self, error: BaseException, incarnation: int) -> None:
        """Run the recovery procedure for executor ``incarnation``, which failed with ``error``.

        :raises EngineFailed: if the device is poisoned (``fatal``) and the model runs in this
            process (the thread executor): restarting cannot help, so the supervisor escalates.
        """
        started = time.monotonic()
        kind = classify_failure(error)
        log = _log.bind(kind=kind, executor_incarnation=incarnation)
        log.error("recovery.executor_failed", error=f"{type(error).__name__}: {error}")
        self._health.recovering(kind)
        final: str | None = None
        if kind == "fatal" and not self._replaces_worker:
            final = f"unrecoverable device error: {error}"
        elif self.failures_in_window() > self._max_restarts:
            # the supervisor escalates after this hook: the streams must not hear "recovered"
            final = (
                f"the executor failed more than {self._max_restarts} times within "
                f"{self._restart_window:g} s (last: {kind}: {error})"
            )
        outcome: Recovered = await self._scheduler.ask(
            lambda r: ExecutorDown(error, kind, incarnation, r, final), timeout=ASK_TIMEOUT
        )
        log.info(
            "recovery.fenced",
            sequences_failed=outcome.failed,
            sequences_resumed=outcome.resumed,
            resumes_exhausted=outcome.exhausted,
            isolated=outcome.isolated,
        )
        freed: int = await self._cache.ask(DropAll, timeout=ASK_TIMEOUT)
        log.info(
            "recovery.cache_dropped",
            blocks_freed=freed,
            seconds=round(time.monotonic() - started, 4),
        )
        if kind == "fatal" and not self._replaces_worker:
            raise EngineFailed(f"unrecoverable device error: {error}")

    async def on_escalate(self, escalation: SupervisorEscalation) -> None:
        """The supervisor gave up (restart intensity exceeded): the engine is failed."""
        cause = escalation.__cause__
        reason = (
            f"executor failed {escalation} (last error: {type(cause).__name__}: {cause})"
            if cause
            else str(escalation)
        )
        self._health.fail(reason)
        if self._scheduler.is_alive:
            await self._scheduler.tell(EngineFailedNotice(reason))
