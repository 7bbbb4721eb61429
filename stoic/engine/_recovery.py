"""The executor's recovery procedure, run by its supervisor before each restart, and what
happens when the supervisor gives up."""

from __future__ import annotations

import time

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
)
from ..errors import EngineFailed
from ..executor import ExecutorFault, classify_failure, kv_survives
from ..runtime import ActorRef, ChildFailure, SupervisorEscalation
from ._incidents import IncidentLog

__all__ = ["Recovery"]

_log = get_logger("stoic.engine")


class Recovery:
    """Recovers from executor failures (the supervisor's ``on_failure`` hook) and fails the engine
    when the supervisor escalates (its ``on_escalate`` hook).

    The procedure: mark the engine recovering; fence the failed incarnation and end every
    sequence with the error and its partial output (the scheduler); drop every KV block and the
    KV tensors (the cache manager). The supervisor then restarts the executor, which marks the
    engine serving again once it holds a fresh KV cache.

    When the KV pools outlive the worker (``kv_outlives_worker``) and the failure cannot have
    corrupted them (:func:`~stoic.executor.kv_survives`: a kill from outside, a hang, a step that
    raised), the cache is kept instead: the scheduler keeps its block tables and prefix cache,
    resumed sequences go on from what completed steps committed, and no ``DropAll`` is sent
    (the next worker serves on from the same pools).

    A failure of an isolation probe (a step that ran only a suspect) is charged to the suspect,
    not to the engine: the hook exempts it from the supervisor's restart intensity (the
    scheduler core bounds those, ``SchedulerCore._charged``).
    """

    def __init__(
        self,
        health: EngineHealth,
        scheduler: ActorRef[SchedulerMsg],
        cache: ActorRef[CacheMsg],
        *,
        replaces_worker: bool,
        kv_outlives_worker: bool = False,
        max_restarts: int,
        restart_window: float,
        incidents: IncidentLog | None = None,
    ) -> None:
        self._health = health
        #: where each failure, its streams' fate and its recovery are recorded for operators
        self._incidents = incidents or IncidentLog()
        self._scheduler = scheduler
        self._cache = cache
        #: the executor runs the model in a worker process it replaces when the device is
        #: poisoned; otherwise a poisoned device is the server's own and cannot be recovered
        self._replaces_worker = replaces_worker
        #: the KV pools outlive the worker: a failure that leaves them intact keeps the cache
        self._kv_outlives_worker = kv_outlives_worker
        self._max_restarts = max_restarts
        self._restart_window = restart_window

    async def on_failure(self, failure: ChildFailure) -> bool:
        """Run the recovery procedure for the executor incarnation that failed.

        Returns whether the failure counts toward the restart intensity (False: it was charged
        to a suspect). When it is the supervisor's ``last`` and counts, every sequence ends with
        :class:`~stoic.errors.EngineFailed` (the supervisor escalates after this hook), never
        with an error that says the engine recovered.

        :raises EngineFailed: if the device is poisoned (``fatal``) and the model runs in this
            process (the thread executor): restarting cannot help, so the supervisor escalates.
        """
        error, incarnation = failure.reason, failure.incarnation
        started = time.monotonic()
        kind = classify_failure(error)
        log = _log.bind(
            kind=kind, executor_incarnation=incarnation, **self._origin(error, incarnation)
        )
        described = f"{type(error).__name__}: {error}"
        self._health.recovering(kind)
        pid = self._origin(error, incarnation).get("pid")
        self._incidents.opened(kind, incarnation, pid if isinstance(pid, int) else None, described)
        final: str | None = None
        if kind == "fatal" and not self._replaces_worker:
            final = f"unrecoverable device error: {error}"
        keep = self._kv_outlives_worker and kv_survives(error, kind)
        # if it counts, the supervisor escalates after this hook: streams must not hear "recovered"
        over = (
            f"the executor failed more than {self._max_restarts} times within "
            f"{self._restart_window:g} s (last: {kind}: {error})"
            if failure.last
            else None
        )
        try:
            outcome: Recovered = await self._scheduler.ask(
                lambda r: ExecutorDown(error, kind, incarnation, r, final, over, keep),
                timeout=ASK_TIMEOUT,
            )
        except BaseException:
            log.error("recovery.executor_failed", error=described, fenced=False)
            raise
        self._incidents.settled(outcome)
        streams = {
            "sequences_failed": outcome.failed,
            "sequences_resumed": outcome.resumed,
            "resumes_exhausted": outcome.exhausted,
            "isolated": outcome.isolated,
            "charged": outcome.charged,
            "kv_kept": outcome.kv_kept,
            "reused_tokens": outcome.reused_tokens,
            "recompute_tokens": outcome.recompute_tokens,
        }
        # the one event an operator needs: what failed, how, and what became of the streams (no
        # traceback: the executor's failure_expected keeps it for bugs); the rest is at debug
        last = final or (over if outcome.charged else None)  # the supervisor gives up after this
        (log.error if last else log.warning)("recovery.executor_failed", error=described, **streams)
        log.debug("recovery.fenced", **streams)
        if outcome.kv_kept:
            log.debug("recovery.cache_kept", seconds=round(time.monotonic() - started, 4))
        else:
            released: bool = await self._cache.ask(DropAll, timeout=ASK_TIMEOUT)
            log.debug(
                "recovery.cache_dropped",
                blocks_freed=outcome.blocks_freed,
                tensors_released=released,
                seconds=round(time.monotonic() - started, 4),
            )
        if kind == "fatal" and not self._replaces_worker:
            raise EngineFailed(f"unrecoverable device error: {error}")
        return outcome.charged

    def _origin(self, error: BaseException, incarnation: int) -> dict[str, object]:
        """The failed process's ``pid`` and, if it ended, its ``signal`` or ``exit_code``."""
        fields = error.exit_fields() if isinstance(error, ExecutorFault) else {}
        health = self._health.snapshot()
        if "pid" not in fields and health.incarnation == incarnation and health.executor_pid:
            fields["pid"] = health.executor_pid  # the process that ran the failed incarnation
        return fields

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
