"""The engine's health: one state machine with named transitions, shared by the facade and the
actors (instead of a callback per event)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Literal, get_args

from .._logging import get_logger
from ..errors import EngineFailed, EngineStopped, FailureKind
from ..model import ComputePath

__all__ = ["STATES", "EngineHealth", "Health", "State"]

State = Literal["starting", "serving", "recovering", "failed", "stopping"]
#: every state, in the order they are documented (and exported as metrics)
STATES: tuple[State, ...] = get_args(State)

_log = get_logger("stoic.engine")


@dataclass(frozen=True)
class Health:
    """What the engine can do right now (a snapshot)."""

    state: State
    reason: str | None = None
    #: the executor's incarnation (0 at start, +1 per restart)
    incarnation: int = 0
    #: executor restarts so far (counted when the new executor is ready)
    restarts: int = 0
    #: the process the model runs in (this one with the thread executor)
    executor_pid: int | None = None
    #: restarts by the kind of failure that caused them
    restarts_by_kind: tuple[tuple[FailureKind, int], ...] = ()
    #: how the executor's model computes (None until an executor was ready)
    compute: ComputePath | None = None
    #: the compute threads of the last step (0 before the first step)
    threads: int = 0

    @property
    def ok(self) -> bool:
        return self.state == "serving"


class EngineHealth:
    """The health state machine. Transitions, each a method:

    * ``starting`` -> ``serving``: :meth:`executor_ready` (the first executor took its KV cache);
    * ``serving`` -> ``recovering``: :meth:`recovering` (an executor failure is being handled);
    * ``recovering`` -> ``serving``: :meth:`executor_ready` (a restarted executor is ready);
    * any state but ``failed`` -> ``stopping``: :meth:`stopping` (a graceful stop began);
    * any state -> ``failed``: :meth:`fail` (terminal: restart intensity exceeded, an
      unrecoverable device error, a hung step, or a crashed engine actor).

    Every method is called on the event loop; none blocks.
    """

    def __init__(self) -> None:
        self._state: State = "starting"
        self._reason: str | None = "loading the model"
        self._incarnation = 0
        self._restarts = 0
        self._by_kind: dict[FailureKind, int] = {}
        self._last_kind: FailureKind = "error"
        self._pid: int | None = None
        self._compute: ComputePath | None = None
        self._threads = 0
        self._failure: EngineFailed | None = None
        self._failed = asyncio.Event()

    @property
    def state(self) -> State:
        return self._state

    @property
    def failure(self) -> EngineFailed | None:
        """The engine's failure, once it is failed."""
        return self._failure

    def snapshot(self) -> Health:
        return Health(
            self._state,
            self._reason,
            self._incarnation,
            self._restarts,
            self._pid,
            tuple(sorted(self._by_kind.items())),
            self._compute,
            self._threads,
        )

    def check_accepting(self) -> None:
        """Raise unless new requests may be admitted (queued during recovery is fine).

        :raises EngineFailed: if the engine is failed.
        :raises EngineStopped: if the engine is stopping.
        """
        if self._failure is not None:
            raise EngineFailed(self._failure.message)
        if self._state == "stopping":
            raise EngineStopped()

    # -- transitions ----------------------------------------------------------------------------
    def executor_ready(
        self, incarnation: int, *, pid: int | None = None, compute: ComputePath | None = None
    ) -> None:
        """An executor incarnation (running the model in process ``pid``, computing as
        ``compute`` says) took its KV cache and serves steps."""
        if compute is not None:
            self._compute = compute
        if incarnation > self._incarnation:
            # counted when the restart happened, not when it was decided
            self._restarts += 1
            self._by_kind[self._last_kind] = self._by_kind.get(self._last_kind, 0) + 1
        self._incarnation = incarnation
        self._pid = pid
        if self._state in ("starting", "recovering"):
            self._state, self._reason = "serving", None

    def compute_threads(self, threads: int) -> None:
        """A step ran on ``threads`` compute threads (the executor's ``ThreadGovernor``: fewer
        while other processes take CPUs); a change is logged as ``executor.threads``."""
        if threads and threads != self._threads:
            _log.info("executor.threads", threads=threads, before=self._threads)
            self._threads = threads

    def recovering(self, kind: FailureKind) -> None:
        """An executor failure of ``kind`` is being recovered from."""
        self._last_kind = kind
        if self._state == "serving":
            self._state, self._reason = "recovering", f"executor failed ({kind}); recovering"

    def stopping(self) -> None:
        """A graceful stop began: no new requests; running ones may finish."""
        if self._failure is None:
            self._state, self._reason = "stopping", "engine is shutting down"

    def fail(self, reason: str) -> bool:
        """Mark the engine failed for good. Returns False if it already was (first reason wins)."""
        if self._failure is not None:
            return False
        self._state, self._reason = "failed", reason
        self._failure = EngineFailed(f"engine failed: {reason}")
        self._failed.set()
        _log.error("engine.failed", reason=reason)
        return True

    async def wait_failed(self) -> EngineFailed:
        """Return the engine's failure once it happens."""
        await self._failed.wait()
        assert self._failure is not None
        return self._failure
