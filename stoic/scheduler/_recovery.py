"""What becomes of the sequences when the executor fails: under ``"fail"`` the started ones end
with the error, under ``"resume"`` they continue, and a poison request is isolated (suspects run
alone, one at a time) and ended. A resumed sequence is re-admitted from nothing computed when
the KV cache was dropped; when it was kept (pools that outlive the worker) it stays running on
its block table from the last position a completed step committed, and only the failed step's
tokens are computed again. A collaborator of
:class:`~stoic.scheduler.SchedulerCore` with its own state (the isolation's probe, the
failures charged to suspects, its counters); it moves sequences only through the core's
:class:`~stoic.scheduler._queues.SeqQueues` and ends them only through the core's ``fail``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from ..errors import FailureKind, StoicError
from ._outcomes import exhausted_error, failed_error, isolated_error
from ._queues import SeqQueues
from ._records import Recovered
from ._sequence import Seq, SeqStatus

__all__ = ["Recovery"]

#: failures alone that end a suspect as the cause; also the most failures charged to suspects
#: between two clean steps (beyond that the isolation makes no progress: they count)
_SOLO_FAILURES = 2


def _seq_id(seq: Seq) -> int:
    return seq.seq_id


class Recovery:
    """The fail/resume policy and the poison isolation, over the core's queues.

    ``fail(seq, error)`` is the core's one way to end a sequence with an error (it unlinks it
    from the queues and, if it was the probe, calls :meth:`next_probe`).
    """

    def __init__(
        self,
        queues: SeqQueues,
        *,
        policy: str,
        max_resumes: int,
        fail: Callable[[Seq, StoicError], None],
    ) -> None:
        self._queues = queues
        self._policy = policy
        self._max_resumes = max_resumes
        self._fail = fail
        #: the suspect under test, running alone while every other sequence is held back
        self.probe: Seq | None = None
        #: failures charged to suspects (not to the engine) since the last clean step
        self._suspect_charges = 0
        #: counters (the scheduler's statistics)
        self.resumed = 0
        self.exhausted = 0
        self.isolated = 0
        self.isolation_failures = 0
        #: resumed sequences' tokens kept across failures, and computed again (see
        #: :class:`~stoic.scheduler.SchedulerStats`)
        self.reused_tokens = 0
        self.recomputed_tokens = 0

    def clean_step(self) -> None:
        """A step completed: suspects' charges start again; a cleared or ended probe makes way
        for the next suspect."""
        self._suspect_charges = 0
        probe = self.probe
        if probe is not None and (probe.strikes == 0 or probe.status is SeqStatus.FINISHED):
            self.next_probe()

    def charged(self, batch: list[Seq]) -> bool:
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
            self.isolation_failures += 1
            return False
        return True

    def settle(
        self,
        batch: list[Seq],
        step_tokens: dict[int, int],
        error: BaseException,
        kind: FailureKind,
        *,
        keep: bool = False,
    ) -> Recovered:
        """The executor failed while ``batch`` ran (``step_tokens``: each one's tokens in the
        failed step, more than one for a prompt chunk): under ``"resume"`` see :meth:`_resume`
        (``keep``: the KV cache outlived the failure); under ``"fail"`` every sequence that had
        started ends with an :class:`~stoic.errors.ExecutorFailed` carrying its partial output,
        and those still waiting for their first step stay queued (they lost nothing)."""
        if self._policy == "resume":
            return self._resume(batch, step_tokens, error, kind, keep)
        prefilling = {seq_id for seq_id, n in step_tokens.items() if n > 1}
        queues = self._queues
        queued = [seq for seq in queues.waiting if seq.num_new == 0]
        for seq in queued:
            queues.waiting.remove(seq)
        ended = queues.everyone()
        for seq in ended:
            self._fail(seq, failed_error(seq, error, kind, seq.seq_id in prefilling))
        for seq in queued:  # their cached prefix blocks (if any) were dropped with the cache
            queues.restart(seq)
        queues.waiting.extend(queued)
        return Recovered(len(ended), 0, 0, 0)

    def _resume(
        self,
        batch: list[Seq],
        step_tokens: dict[int, int],
        error: BaseException,
        kind: FailureKind,
        keep: bool,
    ) -> Recovered:
        """Resume every running sequence (its detokeniser, stop-string and sampling state are its
        own and carry on), unless it was resumed ``max_resumes`` times already or is found to
        cause the failures. With ``keep`` (the KV cache outlived the failure) and no suspect,
        each stays running on its block table: its ``num_computed`` is what completed steps
        committed, so its next chunk is the failed step's again. Otherwise each is re-admitted
        with its prompt and generated tokens as context, recomputed from the prefix cache on
        (empty unless kept).

        **Isolation.** Each sequence counts the failed steps it was in since its last clean step.
        One that failed twice in a row is a suspect: while suspects exist, they run one at a time,
        alone, everything else held back. A suspect whose step completes is cleared; one that
        fails alone twice in a row is the cause and ends with the error. (Twice, so that a
        random failure while an innocent suspect runs alone does not end it.)
        """
        queues = self._queues
        previous, self.probe = self.probe, None
        for seq in batch:
            seq.strikes += 1
        if len(batch) == 1 and batch[0].strikes >= 2:
            batch[0].solo_failures += 1
        resumed: list[Seq] = []
        exhausted = isolated = 0
        for seq in list(queues.running):
            if seq.solo_failures >= _SOLO_FAILURES:
                isolated += 1
                self._fail(seq, isolated_error(seq, error, kind))
            elif seq.resumes >= self._max_resumes:
                exhausted += 1
                self._fail(seq, exhausted_error(seq, error, kind))
            else:
                seq.resumes += 1
                resumed.append(seq)
        self.resumed += len(resumed)
        self.isolated += isolated
        self.exhausted += exhausted
        suspects = any(seq.strikes >= 2 for seq in (*resumed, *queues.waiting, *queues.held))
        failed = Recovered(isolated + exhausted, len(resumed), exhausted, isolated)
        redo = sum(step_tokens.get(seq.seq_id, 0) for seq in resumed)
        if keep and not suspects:  # they run on where they were: only the failed step again
            kept = sum(seq.num_computed for seq in resumed)
            self.reused_tokens += kept
            self.recomputed_tokens += redo
            if queues.held:  # the isolation ended with this failure (its last probe failed
                # alone): what it held back queues again, in order (none holds blocks)
                queues.waiting = deque(sorted([*queues.waiting, *queues.held], key=_seq_id))
                queues.held = []
            return failed._replace(reused_tokens=kept, recompute_tokens=redo)
        for seq in resumed:
            queues.running.remove(seq)
            seq.resume_debt += seq.num_computed + step_tokens.get(seq.seq_id, 0)
        debt = sum(seq.resume_debt for seq in resumed)
        everyone = sorted([*resumed, *queues.waiting, *queues.held], key=_seq_id)
        for seq in everyone:  # their blocks go back (the prefix cache keeps full ones if kept)
            queues.restart(seq)
        queues.waiting, queues.held = deque(everyone), []
        if suspects:
            candidates = [seq for seq in everyone if seq.strikes >= 2]
            self._hold_all_but(previous if previous in candidates else candidates[0])
        return failed._replace(recompute_tokens=debt)

    def readmitted(self, seq: Seq) -> None:
        """``seq``, restarted by a failure (``resume_debt``), is admitted again: what of its
        computed tokens the prefix cache gave back (its ``num_computed`` at admission) counts
        as reused, the rest as recomputed."""
        reused = min(seq.resume_debt, seq.num_computed)
        self.reused_tokens += reused
        self.recomputed_tokens += seq.resume_debt - reused
        seq.resume_debt = 0

    def _hold_all_but(self, probe: Seq) -> None:
        """Run ``probe`` alone (it waits): hold back every other waiting sequence."""
        queues = self._queues
        self.probe = probe
        queues.held = sorted([*queues.held, *queues.waiting], key=lambda q: q.seq_id)
        queues.held.remove(probe)
        queues.waiting = deque([probe])

    def next_probe(self) -> None:
        """The probe was cleared (or ended): test the next suspect, or end the isolation."""
        queues = self._queues
        probe, self.probe = self.probe, None
        suspects = [seq for seq in queues.held if seq.strikes >= 2]
        if not suspects:  # the isolation is over: the held sequences queue again, in order
            queues.waiting.extend(queues.held)
            queues.held = []
            return
        if probe is not None and probe.status is SeqStatus.RUNNING:
            # cleared: it steps aside (its full blocks stay in the prefix cache for its return)
            queues.running.remove(probe)
            queues.restart(probe)
            queues.waiting.append(probe)
        self._hold_all_but(suspects[0])
