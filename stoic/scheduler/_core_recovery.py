"""The executor's lifecycle and failures, one part of :class:`~stoic.scheduler.SchedulerCore`:
fencing a failed executor, dropping the KV cache's bookkeeping with it, ending or resuming its
sequences, isolating a poison request and failing the engine for good. Split from
:mod:`stoic.scheduler._core` (module and class size); it is a mixin over the core's state,
which :class:`~stoic.scheduler.SchedulerCore` initialises, and is never used on its own.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import EngineFailed, EngineStopped, FailureKind, StoicError
from ._allocator import BlockAllocator
from ._outcomes import exhausted_error, failed_error, isolated_error
from ._records import Recovered
from ._sequence import SeqStatus, Sequence

if TYPE_CHECKING:
    from ._budget import StepBudget
    from ._core import _Inflight
    from ._records import SchedulerConfig

__all__ = ["CoreRecovery"]

#: failures alone that end a suspect as the cause; also the most failures charged to suspects
#: between two clean steps (beyond that the isolation makes no progress: they count)
_SOLO_FAILURES = 2


class CoreRecovery:
    """The failure half of the scheduler's core (see :class:`~stoic.actors._core.SchedulerCore`
    for the invariants, which hold across both halves)."""

    # the core's state this half reads and writes (initialised by SchedulerCore.__init__)
    cfg: SchedulerConfig
    failed: str | None
    admitting: bool
    budget: StepBudget
    _waiting: deque[Sequence]
    _running: list[Sequence]
    _held: list[Sequence]
    _probe: Sequence | None
    _incarnation: int | None
    _inflight: _Inflight | None
    allocator: BlockAllocator
    _suspect_charges: int
    _failed_sequences: int
    _resumed: int
    _exhausted: int
    _isolated: int
    _isolation_failures: int

    if TYPE_CHECKING:

        def _remove(self, seq: Sequence) -> None: ...

        def _release(self, seq: Sequence) -> None: ...

    # -- the executor's lifecycle and failures --------------------------------------------------
    def executor_ready(self, incarnation: int) -> None:
        """Executor ``incarnation`` is ready: steps go to it."""
        if self.failed is None:
            self._incarnation = incarnation

    def fail_all(self, error: Callable[[Sequence], StoicError]) -> int:
        """The one exit path for errors: end every waiting and running sequence with
        ``error(seq)`` and give its blocks back. Returns how many ended."""
        ended = [*self._running, *self._waiting, *self._held]
        for seq in ended:
            self._fail(seq, error(seq))
        return len(ended)

    def _fail(self, seq: Sequence, error: StoicError) -> None:
        seq.stream.fail(error)
        self._remove(seq)
        self._failed_sequences += 1

    def executor_down(
        self,
        error: BaseException,
        kind: FailureKind,
        *,
        final: str | None = None,
        final_if_charged: str | None = None,
    ) -> Recovered:
        """The executor failed: fence it (its late results are dropped), back the step budget
        off after an out-of-memory failure, and settle every sequence that had started.

        Under ``"fail"`` they end with an :class:`~stoic.errors.ExecutorFailed` carrying their
        partial output; under ``"resume"`` they are re-admitted (see :meth:`_resume`).
        Sequences still waiting for their first step lost nothing: they stay queued and run
        once the executor is back. With ``final`` (the executor will not be restarted), or
        ``final_if_charged`` and a failure charged to the engine (see :meth:`_charged`), the
        engine fails instead (:meth:`fail_engine`): every sequence ends with ``EngineFailed``.

        The KV tensors are dropped with the executor (the recovery's ``DropAll`` to the cache
        manager): every block is forgotten here, the prefix cache with them, and every block is
        zeroed again before its next use.
        """
        freed = self.allocator.free_all()
        return self._settle(error, kind, final, final_if_charged)._replace(blocks_freed=freed)

    def _settle(
        self,
        error: BaseException,
        kind: FailureKind,
        final: str | None,
        final_if_charged: str | None,
    ) -> Recovered:
        """:meth:`executor_down` past the blocks' drop: what becomes of each sequence."""
        planned = self._inflight.planned if self._inflight is not None else ()
        batch = [p.seq for p in planned if p.seq.status is SeqStatus.RUNNING]
        charged = self._charged(batch)
        final = final or (final_if_charged if charged else None)
        if final is not None:
            return Recovered(self.fail_engine(final), 0, 0, 0, charged)
        prefilling = {p.seq.seq_id for p in planned if p.n_tokens > 1}
        self._incarnation = None
        self._inflight = None
        if kind == "oom":
            self.budget.out_of_memory()
        if self.cfg.recovery == "resume":
            return self._resume(batch, error, kind)._replace(charged=charged)
        queued = [seq for seq in self._waiting if seq.num_new == 0]
        for seq in queued:
            self._waiting.remove(seq)
        count = self.fail_all(lambda seq: failed_error(seq, error, kind, seq.seq_id in prefilling))
        for seq in queued:  # their cached prefix blocks (if any) were dropped with the cache
            self._release(seq)
            seq.num_computed = 0
        self._waiting.extend(queued)
        return Recovered(count, 0, 0, 0, charged)

    def _charged(self, batch: list[Sequence]) -> bool:
        """Whether the failure of the step that ran ``batch`` counts toward the engine's restart
        intensity.

        A step that ran only suspects (an isolation probe: one suspect alone) is charged to the
        suspect instead, so isolating a poison request does not fail the engine whatever
        failed in the last window. That stays bounded: a suspect is ended after two failures
        alone, and at most two failures are charged to suspects between two clean steps. A
        worker that fails every step whatever it holds makes no clean step, so from the third
        probe failure on its failures count and the engine fails as without isolation. A
        step with nothing in it, or with any non-suspect, is charged to the engine.
        """
        if (
            batch
            and all(seq.strikes >= 2 for seq in batch)
            and self._suspect_charges < _SOLO_FAILURES
        ):
            self._suspect_charges += 1
            self._isolation_failures += 1
            return False
        return True

    def _resume(self, batch: list[Sequence], error: BaseException, kind: FailureKind) -> Recovered:
        """Re-admit every running sequence with its prompt and generated tokens as context (its
        detokeniser, stop-string and sampling state are its own and carry on), unless it was
        resumed ``max_resumes`` times already or is found to cause the failures.

        **Isolation.** Each sequence counts the failed steps it was in since its last clean step.
        One that failed twice in a row is a suspect: while suspects exist, they run one at a time,
        alone, everything else held back. A suspect whose step completes is cleared; one that
        fails alone twice in a row is the cause and ends with the error. (Twice, so that a
        random failure while an innocent suspect runs alone does not end it.)
        """
        previous, self._probe = self._probe, None
        for seq in batch:
            seq.strikes += 1
        if len(batch) == 1 and batch[0].strikes >= 2:
            batch[0].solo_failures += 1
        resumed: list[Sequence] = []
        exhausted = isolated = 0
        for seq in list(self._running):
            if seq.solo_failures >= _SOLO_FAILURES:
                isolated += 1
                self._fail(seq, isolated_error(seq, error, kind))
            elif seq.resumes >= self.cfg.max_resumes:
                exhausted += 1
                self._fail(seq, exhausted_error(seq, error, kind))
            else:
                self._running.remove(seq)
                seq.resumes += 1
                resumed.append(seq)
        everyone = sorted([*resumed, *self._waiting, *self._held], key=lambda q: q.seq_id)
        for seq in everyone:  # their blocks were dropped with the cache
            self._release(seq)
            seq.num_computed = 0
            seq.status = SeqStatus.WAITING
        self._resumed += len(resumed)
        self._isolated += isolated
        self._exhausted += exhausted
        self._waiting, self._held = deque(everyone), []
        suspects = [seq for seq in everyone if seq.strikes >= 2]
        if suspects:
            self._hold_all_but(previous if previous in suspects else suspects[0])
        return Recovered(isolated + exhausted, len(resumed), exhausted, isolated)

    def _hold_all_but(self, probe: Sequence) -> None:
        """Run ``probe`` alone (it waits): hold back every other waiting sequence."""
        self._probe = probe
        self._held = sorted([*self._held, *self._waiting], key=lambda q: q.seq_id)
        self._held.remove(probe)
        self._waiting = deque([probe])

    def _next_probe(self) -> None:
        """The probe was cleared (or ended): test the next suspect, or end the isolation."""
        probe, self._probe = self._probe, None
        suspects = [seq for seq in self._held if seq.strikes >= 2]
        if not suspects:  # the isolation is over: the held sequences queue again, in order
            self._waiting.extend(self._held)
            self._held = []
            return
        if probe is not None and probe.status is SeqStatus.RUNNING:
            # cleared: it steps aside (its full blocks stay in the prefix cache for its return)
            self._running.remove(probe)
            self._release(probe)
            probe.num_computed = 0
            probe.status = SeqStatus.WAITING
            self._waiting.append(probe)
        self._hold_all_but(suspects[0])

    def fail_engine(self, reason: str) -> int:
        """The engine is failed for good: fence, end every sequence, refuse new ones."""
        if self.failed is not None:
            return 0
        self.failed = reason
        self._incarnation = None
        self._inflight = None
        return self.fail_all(
            lambda seq: EngineFailed(f"engine failed: {reason}", partial=seq.partial())
        )

    def stop(self) -> int:
        """End every sequence with :class:`~stoic.errors.EngineStopped` (a drain's deadline, or
        the scheduler stopping) and admit nothing more."""
        self.admitting = False
        return self.fail_all(
            lambda seq: EngineStopped(
                "engine stopped before the request finished", partial=seq.partial()
            )
        )
