"""What an operator watches besides the counters: the sequences in the engine now, and the last
executor failures with how long each took to recover and what became of the streams.

:class:`IncidentLog` is a bounded ring of :class:`Incident` records, fed by the recovery
procedure (:class:`~stoic.engine._recovery.Recovery`: opened, streams settled, engine failed)
and by the health state machine (:class:`RecordingHealth`: the next executor ready closes the
incident with its time to recover). :func:`sequence_views` reads the scheduler's queues. Both
reach applications as one :class:`Activity` record (:meth:`stoic.Engine.activity`).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

from ..actors import EngineHealth, Recovered
from ..errors import FailureKind
from ..model import ComputePath
from ..scheduler import SchedulerCore, Seq

__all__ = [
    "Activity",
    "Incident",
    "IncidentLog",
    "RecordingHealth",
    "SequenceView",
    "sequence_views",
]

#: how many incidents the log keeps (the oldest leave first)
INCIDENTS_KEPT = 50
#: how many admission times are kept for requests not seen finishing (the oldest leave first)
_ADMISSIONS_KEPT = 4096
#: seconds an admitted request may take to appear in the scheduler's queues
_IN_TRANSIT = 10.0


@dataclass(frozen=True, slots=True)
class SequenceView:
    """One sequence in the scheduler, as an operator sees it."""

    #: the request's id (``x-request-id``, or the engine's own)
    request_id: str
    #: ``running`` (scheduled into steps) or ``waiting`` (admitted, queued)
    status: Literal["running", "waiting"]
    #: tokens generated so far
    generated: int
    #: the most it may generate
    max_tokens: int
    #: the prompt's length in tokens
    prompt_tokens: int
    #: seconds since the engine admitted it
    age: float


@dataclass(frozen=True, slots=True)
class Incident:
    """One executor failure and its recovery."""

    #: the kind of failure (``oom``, ``error``, ``fatal``, ``hang``, ``crash``)
    kind: FailureKind
    #: when it happened (``time.time()``, seconds since the epoch)
    at: float
    #: the executor incarnation that failed
    incarnation: int
    #: the failed process, when known
    pid: int | None
    #: the error, as one line
    error: str
    #: seconds until a new executor served; None while recovering (or the engine failed)
    recovered_after: float | None = None
    #: streams re-admitted to continue where they stopped (``--recovery resume``)
    resumed: int = 0
    #: streams ended with the error and their partial output
    failed: int = 0
    #: of ``failed``: their resumes were spent
    exhausted: int = 0
    #: of ``failed``: found to cause the failures, ended alone
    isolated: int = 0
    #: the failure counted toward the restart intensity (False: charged to a suspect)
    charged: bool = True
    #: the KV cache outlived the failure (``--kv-outlives-worker``; a failure that leaves the
    #: pools intact): resumed streams went on from their kept keys and values
    kv_kept: bool = False
    #: resumed streams' tokens whose keys and values were kept, and those to compute again
    reused_tokens: int = 0
    recompute_tokens: int = 0
    #: the engine failed for good after it (restart intensity, an unrecoverable device)
    engine_failed: str | None = None
    _started: float = 0.0  # time.monotonic() when it happened

    @property
    def recovering(self) -> bool:
        """No executor serves yet since this failure, and the engine has not failed."""
        return self.recovered_after is None and self.engine_failed is None


@dataclass(frozen=True, slots=True)
class Activity:
    """What :meth:`stoic.Engine.activity` answers: the sequences now and the last incidents."""

    running: tuple[SequenceView, ...]
    waiting: tuple[SequenceView, ...]
    #: the last incidents, oldest first (at most :data:`INCIDENTS_KEPT`)
    incidents: tuple[Incident, ...]
    #: the configured tokens per step (``EngineStats.token_budget`` below it: backed off)
    token_budget_configured: int
    #: warm spare workers configured (``--executor-spares``)
    spares: int


class IncidentLog:
    """The last :data:`INCIDENTS_KEPT` executor failures, and when requests were admitted.

    Every method runs on the event loop and does not block.
    """

    def __init__(self, kept: int = INCIDENTS_KEPT) -> None:
        self._incidents: deque[Incident] = deque(maxlen=kept)
        self._admitted: OrderedDict[str, float] = OrderedDict()

    # -- fed by the recovery procedure and the health state machine ------------------------------
    def opened(self, kind: FailureKind, incarnation: int, pid: int | None, error: str) -> None:
        """An executor failure of ``kind`` began to be recovered from."""
        self._incidents.append(
            Incident(kind, time.time(), incarnation, pid, error, _started=time.monotonic())
        )

    def settled(self, outcome: Recovered) -> None:
        """The scheduler settled the streams of the latest failure (``outcome``)."""
        self._update(
            lambda i: replace(
                i,
                resumed=outcome.resumed,
                failed=outcome.failed,
                exhausted=outcome.exhausted,
                isolated=outcome.isolated,
                charged=outcome.charged,
                kv_kept=outcome.kv_kept,
                reused_tokens=outcome.reused_tokens,
                recompute_tokens=outcome.recompute_tokens,
            )
        )

    def ready(self) -> None:
        """A new executor serves: the latest incident still recovering is over."""
        now = time.monotonic()
        self._update(lambda i: replace(i, recovered_after=now - i._started), only_recovering=True)

    def engine_failed(self, reason: str) -> None:
        """The engine failed for good: the latest incident still recovering never will."""
        self._update(lambda i: replace(i, engine_failed=reason), only_recovering=True)

    def _update(
        self, change: Callable[[Incident], Incident], *, only_recovering: bool = False
    ) -> None:
        if self._incidents and (not only_recovering or self._incidents[-1].recovering):
            self._incidents[-1] = change(self._incidents[-1])

    # -- admissions (for the sequences' ages) ---------------------------------------------------
    def admitted(self, request_id: str) -> None:
        self._admitted[request_id] = time.monotonic()
        self._admitted.move_to_end(request_id)
        while len(self._admitted) > _ADMISSIONS_KEPT:
            self._admitted.popitem(last=False)

    # -- reading --------------------------------------------------------------------------------
    @property
    def incidents(self) -> tuple[Incident, ...]:
        return tuple(self._incidents)

    def views(self, core: SchedulerCore) -> tuple[tuple[SequenceView, ...], ...]:
        """The running and the waiting sequences of ``core``; admission times of requests that
        left it are forgotten."""
        now = time.monotonic()
        running, waiting = sequence_views(core, self._admitted, now)
        # a request admitted a moment ago may not have reached the scheduler's queues yet
        present = {v.request_id for v in (*running, *waiting)}
        gone = [r for r, t in self._admitted.items() if r not in present and now - t > _IN_TRANSIT]
        for rid in gone:
            del self._admitted[rid]
        return running, waiting


def sequence_views(
    core: SchedulerCore, admitted: dict[str, float], now: float
) -> tuple[tuple[SequenceView, ...], tuple[SequenceView, ...]]:
    """The running and waiting sequences of ``core`` (ages from ``admitted``: request id to
    ``time.monotonic()`` at admission; 0 for one not there)."""

    def view(seq: Seq, status: Literal["running", "waiting"]) -> SequenceView:
        rid = seq.request_id
        age = round(now - admitted.get(rid, now), 3)
        return SequenceView(rid, status, seq.num_generated, seq.max_tokens, seq.prompt_len, age)

    return (
        tuple(view(s, "running") for s in core.running),
        tuple(view(s, "waiting") for s in core.waiting),
    )


class RecordingHealth(EngineHealth):
    """The engine's health state machine, telling ``incidents`` when an executor is ready
    again after a failure (the end of an incident) and when the engine fails."""

    def __init__(self, incidents: IncidentLog) -> None:
        super().__init__()
        self._incidents = incidents

    def executor_ready(
        self, incarnation: int, *, pid: int | None = None, compute: ComputePath | None = None
    ) -> None:
        super().executor_ready(incarnation, pid=pid, compute=compute)
        if self.state == "serving":
            self._incidents.ready()

    def fail(self, reason: str) -> bool:
        failed = super().fail(reason)
        if failed:
            self._incidents.engine_failed(reason)
        return failed
