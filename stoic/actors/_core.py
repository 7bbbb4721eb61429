"""The scheduler's core: queues, step planning under a token budget, step completion and every
way a sequence ends. Pure and synchronous: no actors, no awaits, no model.

The actor shell (:mod:`stoic.actors._scheduler`) drives it, in the spirit of vLLM v1's
``schedule()`` / ``update_from_output()``:

1. :meth:`SchedulerCore.plan` picks the step's chunks under the token budget, preempting the
   youngest running sequences when the (estimated) free blocks run out, and says which block
   tables must grow and which new sequences may share a cached prefix;
2. the shell asks the cache manager for those blocks, then :meth:`SchedulerCore.allocated` applies
   the answer (or :meth:`SchedulerCore.allocation_refused` corrects the estimate) and returns the
   :class:`~stoic.model.StepBatch` to run;
3. :meth:`SchedulerCore.complete` applies a step's sampled tokens (a result from a fenced step or
   incarnation is dropped), and after the next step is on its way :meth:`SchedulerCore.emit`
   detokenises and finishes the sequences it touched.

Blocks go back one way (``_release``); sequences end with an error one way (:meth:`fail_all`).
Block frees and prefix-cache commits are queued and taken by the shell
(:meth:`take_cache_updates`), which sends them to the cache manager before its next allocation.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

from ..errors import EngineFailed, EngineStopped
from ..model import SamplingParams, StepBatch, StepOutput
from ._budget import StepBudget
from ._core_blocks import CoreBlocks
from ._core_recovery import CoreRecovery
from ._messages import Allocation, BlockCommit, BlockGrant, PrefixQuery
from ._plan import (
    Planned,
    StepPlan,
    blocks_for,
    chunks_of,
    plan_step,
    prefix_blocks,
    skip_cached,
    within_charge,
)
from ._prefix_view import PrefixView
from ._records import SchedulerConfig, SchedulerStats
from ._sequence import SeqStatus, Sequence
from ._stream import ResultStream

__all__ = ["SchedulerConfig", "SchedulerCore", "SchedulerStats"]


@dataclass(frozen=True, slots=True)
class _Inflight:
    step_id: int
    incarnation: int
    planned: tuple[Planned, ...]


class SchedulerCore(CoreBlocks, CoreRecovery):
    """Waiting and running queues, the step plan and every sequence's fate.

    Invariants (checked by ``tests/actors/test_scheduler_core.py``): every admitted sequence ends with
    exactly one terminal outcome on its stream; the blocks of a finished, aborted or failed
    sequence are queued for release at once; at most one step is in flight; the tokens of a
    step never exceed the token budget; a result whose step or incarnation is not the one in
    flight changes nothing.

    Two mixins over the same state hold the rest: the block tables and the prefix cache's
    bookkeeping (:class:`~stoic.actors._core_blocks.CoreBlocks`), and the executor's lifecycle and
    failures, i.e. fencing, fail/resume, poison isolation and the engine's end
    (:class:`~stoic.actors._core_recovery.CoreRecovery`).
    """

    def __init__(self, config: SchedulerConfig, tokenizer: Any) -> None:
        self.cfg = config
        self._tokenizer = tokenizer
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._by_request: dict[str, Sequence] = {}
        self._next_seq_id = 0
        self._next_step_id = 0
        self._free_blocks = config.num_blocks
        self._incarnation: int | None = None
        self._inflight: _Inflight | None = None
        #: set once the engine is failed for good: nothing is admitted or stepped again
        self.failed: str | None = None
        #: set by a drain: nothing new is admitted
        self.admitting = True
        self._to_free: list[int] = []
        # how many of this core's sequences hold each block: a block shared from the prefix
        # cache is free again only when its last holder lets go (keeps ``_free_blocks`` exact)
        self._holders: Counter[int] = Counter()
        self._to_commit: list[BlockCommit] = []
        #: what this core believes the prefix cache holds (charges a starting sequence's step
        #: budget for its uncached tokens only)
        self._prefix_view = PrefixView(config.num_blocks)
        #: the step limits in force (backed off after an out-of-memory failure)
        self.budget = StepBudget(
            config.max_num_batched_tokens, config.max_num_seqs, config.block_size
        )
        # poison isolation (``"resume"``): while a suspect exists, the one under test runs alone
        # and every other sequence is held back here, in admission order
        self._held: list[Sequence] = []
        self._probe: Sequence | None = None
        #: failures charged to suspects (not to the engine) since the last clean step
        self._suspect_charges = 0
        # statistics
        self._steps = 0
        self._preemptions = 0
        self._fenced = 0
        self._failed_sequences = 0
        self._last_batch = 0
        self._max_batch = 0
        self._prompt_tokens = 0
        self._generated = 0
        self._prefix_cached_tokens = 0
        self._prefix_missed_tokens = 0
        self._resumed = 0
        self._exhausted = 0
        self._isolated = 0
        self._isolation_failures = 0

    # -- reading --------------------------------------------------------------------------------
    @property
    def idle(self) -> bool:
        """No sequence is waiting or running."""
        return not self._running and not self._waiting and not self._held

    @property
    def can_step(self) -> bool:
        """An executor is ready, the engine is not failed and no step is in flight."""
        return self._incarnation is not None and self.failed is None and self._inflight is None

    @property
    def inflight_step(self) -> int | None:
        return self._inflight.step_id if self._inflight is not None else None

    @property
    def incarnation(self) -> int | None:
        """The executor incarnation steps go to (None while it is down)."""
        return self._incarnation

    @property
    def running(self) -> tuple[Sequence, ...]:
        return tuple(self._running)

    @property
    def waiting(self) -> tuple[Sequence, ...]:
        """Sequences admitted and not running (those held back by an isolation included)."""
        return (*self._waiting, *self._held)

    def inflight_prompts(self) -> list[str]:
        """The prompts of the step in flight's sequences, as text (fault rehearsals match on
        them)."""
        if self._inflight is None:
            return []
        return [p.seq.prompt_text for p in self._inflight.planned]

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            running=len(self._running),
            waiting=len(self._waiting) + len(self._held),
            steps=self._steps,
            preemptions=self._preemptions,
            fenced_results=self._fenced,
            failed_sequences=self._failed_sequences,
            last_batch_size=self._last_batch,
            max_batch_size=self._max_batch,
            prompt_tokens=self._prompt_tokens,
            generated_tokens=self._generated,
            prefix_cached_tokens=self._prefix_cached_tokens,
            prefix_guess_missed_tokens=self._prefix_missed_tokens,
            free_blocks=self._free_blocks,
            requests_resumed=self._resumed,
            resumes_exhausted=self._exhausted,
            requests_isolated=self._isolated,
            isolation_failures=self._isolation_failures,
            token_budget=self.budget.tokens,
            seq_budget=self.budget.seqs,
        )

    # -- admission and removal ------------------------------------------------------------------
    def add(
        self,
        request_id: str,
        prompt_ids: tuple[int, ...],
        params: SamplingParams,
        max_tokens: int,
        stream: ResultStream,
    ) -> Sequence | None:
        """Queue a new sequence; if the engine is failed or draining, end its stream instead."""
        if self.failed is not None:
            stream.fail(EngineFailed(f"engine failed: {self.failed}"))
            return None
        if not self.admitting:
            stream.fail(EngineStopped())
            return None
        seq = Sequence(
            self._next_seq_id, request_id, prompt_ids, params, max_tokens, stream, self._tokenizer
        )
        self._next_seq_id += 1
        self._by_request[request_id] = seq
        (self._held if self._probe is not None else self._waiting).append(seq)
        self._prompt_tokens += seq.prompt_len
        return seq

    def abort(self, request_id: str) -> Sequence | None:
        """End the request's stream with ``"abort"`` and free its blocks (None if unknown)."""
        seq = self._by_request.get(request_id)
        if seq is not None:
            seq.stream.finish("abort")
            self._remove(seq)
        return seq

    def _remove(self, seq: Sequence) -> None:
        """Forget a sequence (whatever its state) and give its blocks back."""
        if seq.status is SeqStatus.RUNNING:
            self._running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            (self._held if seq in self._held else self._waiting).remove(seq)
        seq.status = SeqStatus.FINISHED
        self._by_request.pop(seq.request_id, None)
        self._release(seq)
        if seq is self._probe:
            self._next_probe()

    def _preempt(self, seq: Sequence) -> int:
        """Give a running sequence's blocks back; it is recomputed when readmitted (queue front).
        Returns how many blocks became free."""
        self._running.remove(seq)
        freed = self._release(seq)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        self._waiting.appendleft(seq)
        self._preemptions += 1
        return freed

    # -- planning -------------------------------------------------------------------------------
    def plan(self) -> StepPlan | None:
        """Plan the next step under the token budget and the free-block estimate.

        See :func:`~stoic.actors._plan.plan_step` for the order (running first, the youngest
        preempted when blocks run out, then waiting ones admitted). Returns None if no step can
        or need run.
        """
        if not self.can_step:
            return None
        cfg = self.cfg
        planned = plan_step(
            self._running,
            self._waiting,
            budget=self.budget.tokens,
            free_blocks=self._free_blocks,
            max_num_seqs=self.budget.seqs,
            block_size=cfg.block_size,
            prefix_caching=cfg.prefix_caching,
            preempt=self._preempt,
            cached_tokens=self._believed_cached,
        )
        if not planned:
            return None
        grants: list[BlockGrant] = []
        prefixes: list[PrefixQuery] = []
        for p in planned:
            total = blocks_for(p.seq.num_computed + p.n_tokens, cfg.block_size)
            if total > len(p.seq.block_table):
                grants.append(BlockGrant(p.seq.seq_id, total))
            if cfg.prefix_caching and p.seq.num_computed == 0 and not p.seq.block_table:
                count = prefix_blocks(p.seq, cfg.block_size)
                if count:
                    prefixes.append(PrefixQuery(p.seq.seq_id, self._hashes(p.seq, count)))
        return StepPlan(tuple(planned), tuple(grants), tuple(prefixes))

    def allocation_refused(self, free_blocks: int) -> None:
        """The cache manager refused a plan's blocks (the estimate drifted): correct the estimate.

        The planned sequences stay where :meth:`plan` put them; the next plan takes them up.
        """
        self._free_blocks = free_blocks

    def allocated(
        self, plan: StepPlan, allocation: Allocation | None
    ) -> tuple[int, int, StepBatch] | None:
        """Apply the cache manager's answer to ``plan`` (None if it needed no blocks) and start the
        step: returns ``(step_id, incarnation, batch)``, or None when every planned token was
        found in the prefix cache (plan again for the rest).
        """
        planned = list(plan.planned)
        fresh: tuple[int, ...] = ()
        if allocation is not None:
            fresh = allocation.fresh_blocks
            for p in planned:
                table = allocation.tables.get(p.seq.seq_id)
                if table is not None:
                    self._set_table(p.seq, table)
            self._free_blocks = allocation.free_blocks
            self._learn_prefixes(planned, allocation.cached_blocks)
            if allocation.cached_blocks:
                planned, skipped = skip_cached(
                    planned, allocation.cached_blocks, self.cfg.block_size
                )
                self._prefix_cached_tokens += skipped
        planned = within_charge(planned, self.budget.tokens)
        if not planned or not self.can_step:
            return None
        chunks = chunks_of(planned)
        self._next_step_id += 1
        incarnation = self._incarnation
        assert incarnation is not None
        self._inflight = _Inflight(self._next_step_id, incarnation, tuple(planned))
        self._last_batch = len(planned)
        self._max_batch = max(self._max_batch, len(planned))
        return self._next_step_id, incarnation, StepBatch(chunks, fresh)

    def complete(self, step_id: int, incarnation: int, output: StepOutput) -> list[Sequence] | None:
        """Apply a step's sampled tokens and the token-level stops (EOS, stop ids, max_tokens).

        Returns the sequences that got a token (pass them to :meth:`emit` once the next step is
        planned); those that finished have their blocks queued for release already. Returns None,
        changing nothing but a counter, when the result is not the step in flight (fenced).
        """
        inflight = self._inflight
        if inflight is None or (inflight.step_id, inflight.incarnation) != (step_id, incarnation):
            self._fenced += 1
            return None
        self._inflight = None
        self._steps += 1
        self._suspect_charges = 0
        touched: list[Sequence] = []
        for p in inflight.planned:
            seq = p.seq
            if seq.status is not SeqStatus.RUNNING:
                continue  # aborted, preempted or stopped while the step ran
            seq.num_computed += p.n_tokens
            seq.strikes = seq.solo_failures = 0  # a clean step: not a suspect
            if self.cfg.prefix_caching:
                self._commit_full_blocks(seq)
            token = output.sampled.get(seq.seq_id)
            if p.sample and token is not None:
                seq.append(token, self.cfg.eos_token_ids)
                self._generated += 1
                touched.append(seq)
        for seq in touched:
            if seq.finish_reason is not None:
                # out of the running queue and its blocks back now, so the next plan can use them;
                # it is forgotten (and its stream finished) by emit()
                self._running.remove(seq)
                seq.status = SeqStatus.FINISHED
                self._release(seq)
        self.budget.clean_step()
        probe = self._probe
        if probe is not None and (probe.strikes == 0 or probe.status is SeqStatus.FINISHED):
            self._next_probe()
        return touched

    def emit(self, touched: list[Sequence]) -> list[Sequence]:
        """Detokenise ``touched`` (from :meth:`complete`), push their deltas, and end those that
        finished (a stop string can end one here). Returns the sequences that ended."""
        ended = []
        for seq in touched:
            seq.detokenize()
            if seq.finish_reason is not None:
                seq.stream.finish(seq.finish_reason, seq.stop_reason)
                self._remove(seq)
                ended.append(seq)
        return ended
