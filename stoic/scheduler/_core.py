"""The scheduler's core: queues, step planning under a token budget on the true KV cache state,
step completion and every way a sequence ends. Pure and synchronous: no actors, no awaits, no
model.

The actor shell (:mod:`stoic.actors._scheduler`) drives it, in the spirit of vLLM v1's
``schedule()`` / ``update_from_output()``:

1. :meth:`SchedulerCore.schedule` picks the step's chunks under the token budget, looks each
   starting sequence's prefix up in the prefix cache, allocates the blocks (preempting the
   youngest running sequences when they run out) and returns the
   :class:`~stoic.request.StepBatch` to run, all in one call against the
   :class:`~stoic.scheduler.BlockAllocator` it owns: there is no estimate to correct, no plan
   the cache could refuse, nothing to retry;
2. :meth:`SchedulerCore.complete` applies a step's sampled tokens and commits the blocks it
   filled to the prefix cache (a result from a fenced step or incarnation is dropped), and
   after the next step is on its way :meth:`SchedulerCore.emit` detokenises and finishes the
   sequences it touched.

**Why the block bookkeeping lives here.** The cache manager actor owned it once, and the core
planned before the cache manager answered the prefix lookup: it kept a guess of what was
cached, charged the budget by the guess, corrected it afterwards and re-planned refused
allocations. The block tables, free list, prefix hash index and reference counts are plain
bookkeeping (no I/O, no tensors) that only the scheduler changes, so they live beside the
planner, which consults them synchronously. The cache manager keeps the physical side: the KV
tensors' lifetime and their drop after a failure (``DropAll``); the core forgets every block
at the same moment (:meth:`SchedulerCore.executor_down`).

Two collaborators hold the rest, each with its own state: the queues with the block tables and
the prefix cache's hashes (:class:`~stoic.scheduler._queues.SeqQueues`: blocks go back one way,
``release``), and what an executor failure does to the sequences, poison isolation included
(:class:`~stoic.scheduler._recovery.Recovery`). Sequences end with an error one way
(:meth:`SchedulerCore.fail_all`, :meth:`SchedulerCore._fail`).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..errors import EngineFailed, EngineStopped, FailureKind, StoicError
from ..request import SamplingParams, StepBatch, StepOutput
from ._admission import Expected, LoadMeter, prompt_budget, queue_wait
from ._allocator import BlockAllocator
from ._budget import StepBudget
from ._plan import Planned, chunks_of, plan_step
from ._queues import SeqQueues
from ._records import Recovered, SchedulerConfig, SchedulerStats
from ._recovery import Recovery
from ._sequence import Seq, SeqSink, SeqStatus
from ._speculate import DraftPolicy
from ._tenants import TenantShares, TenantStats

__all__ = ["SchedulerConfig", "SchedulerCore", "SchedulerStats", "Step"]


class Step(NamedTuple):
    """A step to run: send ``batch`` to executor ``incarnation`` as step ``step_id``."""

    step_id: int
    incarnation: int
    batch: StepBatch


@dataclass(frozen=True, slots=True)
class _Inflight:
    step_id: int
    incarnation: int
    planned: tuple[Planned, ...]
    #: when it was planned (the core's clock): its duration feeds the load meter
    started: float
    #: the blocks it zeroes before use (:attr:`StepBatch.zero_blocks`)
    fresh: tuple[int, ...] = ()


class SchedulerCore:
    """Waiting and running queues, the step plan and every sequence's fate.

    Invariants (checked by ``tests/scheduler/``): every admitted sequence ends with exactly one
    terminal outcome on its stream; the blocks of a finished, aborted or failed sequence are
    free at once, and the allocator's blocks in use are exactly those in the sequences' tables;
    at most one step is in flight; the tokens of a step never exceed the token budget; a
    result whose step or incarnation is not the one in flight changes nothing.

    The queues and block tables are a :class:`~stoic.scheduler._queues.SeqQueues`; what an
    executor failure does to the sequences (fail or resume, poison isolation) is decided by a
    :class:`~stoic.scheduler._recovery.Recovery`; the core fences the executor and ends
    sequences.
    """

    def __init__(
        self, config: SchedulerConfig, tokenizer: Any, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.cfg = config
        self._tokenizer = tokenizer
        #: the time deadlines and step durations are read on (injected by tests)
        self.clock = clock
        #: the tenants' fair shares and counters
        self.shares = TenantShares(config.tenants)
        #: recent steps' durations and sequences' ends: the admission estimate's rates
        self.meter = LoadMeter()
        #: who gets drafts (``--speculative``), and the counters of those verified and kept
        self.drafting = DraftPolicy(config.speculative, config.num_speculative_tokens)
        #: ``(deadline, seq_id, seq)`` of the sequences with a deadline (a heap; ended ones
        #: are skipped when they come up)
        self._deadlines: list[tuple[float, int, Seq]] = []
        #: requests the intake admitted, their sequences on their way (:meth:`expect`)
        self._expected: dict[str, Expected] = {}
        self._next_seq_id = 0
        self._next_step_id = 0
        #: the KV cache's logical side: block tables, free list, prefix cache (see the module)
        self.allocator = BlockAllocator(config.num_blocks)
        self.queues = SeqQueues(self.allocator, config.block_size, self.shares)
        self.recovery = Recovery(
            self.queues, policy=config.recovery, max_resumes=config.max_resumes, fail=self._fail
        )
        self._incarnation: int | None = None
        self._inflight: _Inflight | None = None
        #: set once the engine is failed for good: nothing is admitted or stepped again
        self.failed: str | None = None
        #: blocks a failed step was to zero, kept with the cache through the failure: the next
        #: step zeroes them (they hold no position a completed step committed)
        self._rezero: tuple[int, ...] = ()
        #: set by a drain: nothing new is admitted
        self.admitting = True
        #: the step limits in force (backed off after an out-of-memory failure)
        self.budget = StepBudget(
            config.max_num_batched_tokens, config.max_num_seqs, config.block_size
        )
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

    # -- reading --------------------------------------------------------------------------------
    @property
    def idle(self) -> bool:
        """No sequence is waiting or running."""
        q = self.queues
        return not q.running and not q.waiting and not q.held

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
    def running(self) -> tuple[Seq, ...]:
        return tuple(self.queues.running)

    @property
    def waiting(self) -> tuple[Seq, ...]:
        """Sequences admitted and not running (those held back by an isolation included)."""
        return (*self.queues.waiting, *self.queues.held)

    def inflight_prompts(self) -> list[str]:
        """The prompts of the step in flight's sequences, as text (fault rehearsals match on
        them)."""
        if self._inflight is None:
            return []
        return [p.seq.prompt_text for p in self._inflight.planned]

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            running=len(self.queues.running),
            waiting=len(self.queues.waiting) + len(self.queues.held),
            steps=self._steps,
            preemptions=self._preemptions,
            fenced_results=self._fenced,
            failed_sequences=self._failed_sequences,
            last_batch_size=self._last_batch,
            max_batch_size=self._max_batch,
            prompt_tokens=self._prompt_tokens,
            generated_tokens=self._generated,
            prefix_cached_tokens=self._prefix_cached_tokens,
            kv_blocks_used=self.allocator.used_blocks,
            kv_blocks_total=self.allocator.num_blocks,
            kv_blocks_cached=self.allocator.cached_blocks,
            requests_resumed=self.recovery.resumed,
            resumes_exhausted=self.recovery.exhausted,
            requests_isolated=self.recovery.isolated,
            isolation_failures=self.recovery.isolation_failures,
            token_budget=self.budget.tokens,
            seq_budget=self.budget.seqs,
            timed_out=self.shares.timed_out(),
            resume_reused_tokens=self.recovery.reused_tokens,
            resume_recomputed_tokens=self.recovery.recomputed_tokens,
            spec_draft_tokens=self.drafting.proposed,
            spec_accepted_tokens=self.drafting.accepted,
        )

    def tenant_stats(self) -> dict[str, TenantStats]:
        """Every tenant's counters, and its running and waiting sequences now."""
        q = self.queues
        return self.shares.snapshot(
            (s.tenant for s in q.running), (s.tenant for s in (*q.waiting, *q.held))
        )

    def queue_wait(self, tenant: str, priority: int, prompt_tokens: int) -> float:
        """Seconds a new request would wait for its first token (the admission estimate:
        :func:`~stoic.scheduler._admission.queue_wait`)."""
        q = self.queues
        return queue_wait(
            tenant=tenant,
            priority=priority,
            prompt_tokens=prompt_tokens,
            running=q.running,
            waiting=(*q.waiting, *q.held, *self._expected.values()),
            step_tokens=self.budget.tokens,
            max_seqs=self.budget.seqs,
            policy=self.shares.policy,
            meter=self.meter,
            now=self.clock(),
            stretch=self.cfg.decode_stretch,
            floor=self.cfg.block_size,
        )

    def expect(self, request_id: str, tenant: str, priority: int, prompt_tokens: int) -> None:
        """The intake admitted ``request_id``; its sequence is on its way (:meth:`add`, or
        :meth:`abort` if its caller gave up first): the wait estimate counts it meanwhile."""
        self._expected[request_id] = Expected(tenant, priority, prompt_tokens)

    # -- admission and removal ------------------------------------------------------------------
    def add(
        self,
        request_id: str,
        prompt_ids: tuple[int, ...],
        params: SamplingParams,
        max_tokens: int,
        stream: SeqSink,
        generated: tuple[int, ...] = (),
        *,
        tenant: str = "",
        priority: int = 0,
        timeout: float | None = None,
    ) -> Seq | None:
        """Queue a new sequence (continuing after ``generated``, the tokens its request generated
        before: see :class:`Seq`) for ``tenant`` with ``priority``, to end with ``"timeout"``
        ``timeout`` seconds from now if not done by then; if the engine is failed or draining,
        end its stream instead."""
        self._expected.pop(request_id, None)
        if self.failed is not None:
            stream.fail(EngineFailed(f"engine failed: {self.failed}"))
            return None
        if not self.admitting:
            stream.fail(EngineStopped())
            return None
        seq = Seq(
            self._next_seq_id,
            request_id,
            prompt_ids,
            params,
            max_tokens,
            stream,
            self._tokenizer,
            generated,
            tenant=tenant,
            priority=priority,
            deadline=None if timeout is None else self.clock() + timeout,
        )
        if seq.deadline is not None:
            heapq.heappush(self._deadlines, (seq.deadline, seq.seq_id, seq))
        self._next_seq_id += 1
        self.queues.admit(seq, hold=self.recovery.probe is not None)
        self._prompt_tokens += seq.prompt_len
        return seq

    def abort(self, request_id: str) -> Seq | None:
        """End the request's stream with ``"abort"`` and free its blocks (None if unknown)."""
        self._expected.pop(request_id, None)
        seq = self.queues.by_request.get(request_id)
        if seq is not None:
            seq.stream.finish("abort")
            self._remove(seq)
        return seq

    def _remove(self, seq: Seq) -> None:
        """Forget a sequence (whatever its state) and give its blocks back."""
        self.queues.unlink(seq)
        if seq is self.recovery.probe:
            self.recovery.next_probe()

    def _preempt(self, seq: Seq) -> None:
        """Give a running sequence's blocks back; it is recomputed when readmitted (queue front;
        its full blocks stay in the prefix cache, so it may share them again)."""
        self.queues.running.remove(seq)
        self.queues.restart(seq)
        self.queues.waiting.appendleft(seq)
        self._preemptions += 1

    # -- planning -------------------------------------------------------------------------------
    def schedule(self) -> Step | None:
        """Plan the next step on the allocator's true state, allocate its blocks and start it.

        See :func:`~stoic.scheduler._plan.plan_step` for the order (running first, the youngest
        preempted when blocks run out, then waiting ones admitted, each sharing its cached
        prefix). Returns the step to send, or None if no step can or need run (one in flight,
        no executor, the engine failed, or nothing fits).
        """
        if self._deadlines:
            self.expire()
        if not self.can_step:
            return None
        cfg = self.cfg
        plan = plan_step(
            self.queues.running,
            self.queues.waiting,
            budget=self.budget.tokens,
            max_num_seqs=self.budget.seqs,
            allocator=self.allocator,
            block_size=cfg.block_size,
            preempt=self._preempt,
            prefix_hashes=self.queues.prefix_hashes if cfg.prefix_caching else None,
            shares=self.shares,
            prompt_budget=self._prompt_budget if cfg.decode_stretch else None,
            draft=self._draft if cfg.speculative != "off" else None,
        )
        if not plan.planned:
            return None
        self._prefix_cached_tokens += plan.cached_tokens
        for p in plan.planned:
            if p.seq.resume_debt:
                self.recovery.readmitted(p.seq)
        self._next_step_id += 1
        incarnation = self._incarnation
        assert incarnation is not None
        fresh, self._rezero = (*self._rezero, *plan.fresh_blocks), ()
        self._inflight = _Inflight(
            self._next_step_id, incarnation, plan.planned, self.clock(), fresh
        )
        self._last_batch = len(plan.planned)
        self._max_batch = max(self._max_batch, len(plan.planned))
        batch = StepBatch(chunks_of(plan.planned), fresh)
        return Step(self._next_step_id, incarnation, batch)

    def _draft(self, seq: Seq, budget: int) -> tuple[int, ...]:
        return self.drafting.drafts(seq, len(self.queues.running), budget)

    def _prompt_budget(self, decodes: int) -> int | None:
        return prompt_budget(self.meter, decodes, self.cfg.decode_stretch, self.cfg.block_size)

    def complete(self, step_id: int, incarnation: int, output: StepOutput) -> list[Seq] | None:
        """Apply a step's sampled tokens and the token-level stops (EOS, stop ids, max_tokens).

        Returns the sequences that got a token (pass them to :meth:`emit` once the next step is
        planned); those that finished have given their blocks back already (their full blocks
        stay in the prefix cache). Returns None,
        changing nothing but a counter, when the result is not the step in flight (fenced).
        """
        inflight = self._inflight
        if inflight is None or (inflight.step_id, inflight.incarnation) != (step_id, incarnation):
            self._fenced += 1
            return None
        self._inflight = None
        self._steps += 1
        now = self.clock()
        # (a 1-token prompt too; a decode's drafts count as prompt tokens: rows of a chunk)
        decodes = sum(1 for p in inflight.planned if p.n_tokens - len(p.drafts) == 1)
        prompt = sum(p.n_tokens for p in inflight.planned) - decodes
        self.meter.step(decodes, prompt, now - inflight.started)
        touched: list[Seq] = []
        for p in inflight.planned:
            seq = p.seq
            if seq.status is not SeqStatus.RUNNING:
                continue  # aborted, preempted or stopped while the step ran
            token = output.sampled.get(seq.seq_id)
            computed = p.n_tokens - len(p.drafts)
            seq.strikes = seq.solo_failures = 0  # a clean step: not a suspect
            if p.sample and token is not None:
                kept = output.accepted.get(seq.seq_id, ()) if p.drafts else ()
                # with stop strings, kept drafts are detokenised one token at a time, as the
                # steps they stand for would emit them: the token completing a stop string ends
                # the sequence and the drafts after it are dropped (token ids and usage as
                # without drafts)
                one_by_one = bool(kept) and bool(seq.params.stop)
                appended = 0
                for sampled in (token, *kept):
                    seq.append(sampled, self.cfg.eos_token_ids)
                    appended += 1
                    if one_by_one:
                        seq.detokenize()
                    if seq.finish_reason is not None:
                        break
                self._generated += appended
                # each token appended after the first confirmed a draft: its keys and values
                # are the sequence's; the refused drafts' lie past num_computed, overwritten by
                # the next step
                computed += appended - 1
                if p.drafts:
                    self.drafting.settle(seq, len(p.drafts), len(kept))
                touched.append(seq)
            seq.num_computed += computed
            if self.cfg.prefix_caching:
                self.queues.commit_full_blocks(seq)
        for seq in touched:
            if seq.finish_reason is not None:
                # out of the running queue and its blocks back now, so the next plan can use them;
                # it is forgotten (and its stream finished) by emit()
                self.queues.running.remove(seq)
                seq.status = SeqStatus.FINISHED
                self.queues.release(seq)
        self.budget.clean_step()
        self.recovery.clean_step()
        return touched

    def emit(self, touched: list[Seq]) -> list[Seq]:
        """Detokenise ``touched`` (from :meth:`complete`), push their deltas, and end those that
        finished (a stop string can end one here). Returns the sequences that ended."""
        ended = []
        for seq in touched:
            seq.detokenize()
            if seq.finish_reason is not None:
                seq.stream.finish(seq.finish_reason, seq.stop_reason)
                self._remove(seq)
                ended.append(seq)
        if ended:
            self.meter.ended(self.clock(), len(ended))
        return ended

    def expire(self) -> int:
        """End the sequences whose deadline has passed with ``"timeout"`` and their output so
        far (the text of tokens not yet emitted included). Returns how many ended."""
        now, heap, ended = self.clock(), self._deadlines, 0
        while heap and heap[0][0] <= now:
            seq = heapq.heappop(heap)[2]
            if (
                seq.finish_reason is not None
                or self.queues.by_request.get(seq.request_id) is not seq
            ):
                continue  # ended, or ending (emit() finishes it)
            seq.finish_reason = "timeout"
            seq.detokenize()  # a stop string it completes ends it with "stop" instead
            seq.stream.finish(seq.finish_reason, seq.stop_reason)
            self._remove(seq)
            self.shares.stats_of(seq.tenant).timed_out += 1
            ended += 1
        return ended

    # -- the executor's lifecycle and the ways sequences end with an error -----------------------
    def executor_ready(self, incarnation: int) -> None:
        """Executor ``incarnation`` is ready: steps go to it."""
        if self.failed is None:
            self._incarnation = incarnation

    def executor_down(
        self,
        error: BaseException,
        kind: FailureKind,
        *,
        final: str | None = None,
        final_if_charged: str | None = None,
        keep_kv: bool = False,
    ) -> Recovered:
        """The executor failed: fence it (its late results are dropped), forget every block (the
        KV tensors and the prefix cache go with it: the cache manager's ``DropAll``), back the
        budget off after an out-of-memory failure, and let :class:`~._recovery.Recovery` settle
        the sequences that had started (fail or resume; waiting ones stay queued). With
        ``final``, or ``final_if_charged`` and a failure charged to the engine
        (:meth:`~._recovery.Recovery.charged`), the engine fails instead (:meth:`fail_engine`).

        With ``keep_kv`` the KV cache outlived the failure: no block is forgotten (the block
        tables and the prefix cache stand: what completed steps wrote is intact), and the
        failed step's freshly handed-out blocks are zeroed by the next step instead.
        """
        inflight = self._inflight
        if keep_kv:
            freed = 0
            self._rezero = inflight.fresh if inflight is not None else self._rezero
        else:
            freed = self.allocator.free_all()
            self._rezero = ()
        planned = inflight.planned if inflight is not None else ()
        batch = [p.seq for p in planned if p.seq.status is SeqStatus.RUNNING]
        charged = self.recovery.charged(batch)
        final = final or (final_if_charged if charged else None)
        if final is not None:
            return Recovered(self.fail_engine(final), 0, 0, 0, charged, freed)
        # the sequences' own tokens: drafts were proposals, never part of one's computed work
        step_tokens = {p.seq.seq_id: p.n_tokens - len(p.drafts) for p in planned}
        self._incarnation = None
        self._inflight = None
        if kind == "oom":
            self.budget.out_of_memory()
        settled = self.recovery.settle(batch, step_tokens, error, kind, keep=keep_kv)
        return settled._replace(charged=charged, blocks_freed=freed, kv_kept=keep_kv)

    def fail_all(self, error: Callable[[Seq], StoicError]) -> int:
        """The one exit path for errors: end every waiting and running sequence with
        ``error(seq)`` and give its blocks back. Returns how many ended."""
        ended = self.queues.everyone()
        for seq in ended:
            self._fail(seq, error(seq))
        return len(ended)

    def _fail(self, seq: Seq, error: StoicError) -> None:
        seq.stream.fail(error)
        self._remove(seq)
        self._failed_sequences += 1

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
