"""The scheduler: waiting and running queues, the step loop, preemption, stops, deltas.

One step is in flight at a time. When its result arrives the scheduler (1) appends the sampled
tokens and applies token-level stops, (2) frees finished sequences' blocks, (3) plans and sends the
next step, and only then (4) detokenises and pushes deltas, so that text work overlaps the next
forward pass. A sequence ended by a stop string in (4) simply has its in-flight token discarded.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, assert_never

from ...errors import EngineFailed, EngineStopped, ExecutorFailed
from ...model import SeqChunk, StepBatch
from .. import Actor, ActorRef, Reply
from ._cache import OutOfBlocks
from ._messages import (
    Abort,
    AddSequence,
    AllocateBlocks,
    Allocation,
    CacheMsg,
    CacheStats,
    CommitBlocks,
    Drain,
    EngineFailedNotice,
    ExecutorDown,
    ExecutorMsg,
    ExecutorReady,
    FreeBlocks,
    GetCacheStats,
    RunStep,
    SchedulerMsg,
    SchedulerStats,
    StepResult,
    StepTimeout,
)
from ._sequence import SeqStatus, Sequence, block_hashes

__all__ = ["Scheduler", "SchedulerConfig"]

_ASK_TIMEOUT = 30.0
_PROGRESS_EVERY = 10.0


@dataclass(frozen=True)
class SchedulerConfig:
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    step_timeout: float
    eos_token_ids: frozenset[int]
    #: share the KV blocks of equal prompt prefixes between sequences
    prefix_caching: bool = True


@dataclass
class _Planned:
    seq: Sequence
    n_tokens: int
    sample: bool


class Scheduler(Actor[SchedulerMsg]):
    """Forms one batch per step and routes results to each sequence's :class:`ResultStream`.

    Invariants: every admitted sequence ends with exactly one terminal outcome on its stream;
    finished and aborted sequences' blocks are freed at once; results from a fenced executor
    incarnation are discarded (and counted).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        tokenizer: Any,
        cache: ActorRef[CacheMsg],
        executor: Callable[[], ActorRef[ExecutorMsg]],
        on_fatal: Callable[[str], None],
    ) -> None:
        self.cfg = config
        self._tokenizer = tokenizer
        self._cache = cache
        self._executor = executor
        self._on_fatal = on_fatal
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._by_request: dict[str, Sequence] = {}
        self._next_seq_id = 0
        self._free_blocks = config.num_blocks
        self._incarnation: int | None = None
        self._step_id = 0
        self._inflight: tuple[int, list[_Planned]] | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._failed: str | None = None
        self._draining: tuple[Reply[int], asyncio.TimerHandle] | None = None
        self._drain_requested = False
        # statistics
        self._steps = 0
        self._preemptions = 0
        self._fenced = 0
        self._failed_sequences = 0
        self._last_batch = 0
        self._max_batch = 0
        self._prompt_tokens = 0
        self._generated = 0
        self._last_progress = time.monotonic()
        #: sequences whose blocks are to be returned (sent before the next allocation)
        self._to_free: list[int] = []
        #: full blocks to put in the prefix cache (sent before the frees)
        self._to_commit: list[tuple[int, int, tuple[bytes, ...]]] = []
        self._prefix_cached_tokens = 0

    # -- message handling -----------------------------------------------------------------------
    async def receive(self, message: SchedulerMsg) -> None:
        try:
            await self._handle(message)
        finally:
            await self._flush_cache_updates()

    async def _flush_cache_updates(self) -> None:
        """Send pending commits, then frees: a finished sequence's full blocks stay cached."""
        if self._to_commit:
            entries, self._to_commit = tuple(self._to_commit), []
            await self._cache.tell(CommitBlocks(entries))
        if self._to_free:
            seq_ids, self._to_free = tuple(self._to_free), []
            await self._cache.tell(FreeBlocks(seq_ids))

    async def _handle(self, message: SchedulerMsg) -> None:
        match message:
            case AddSequence():
                self._add(message)
                await self._maybe_step()
            case Abort(request_id=request_id):
                seq = self._by_request.get(request_id)
                if seq is not None:
                    seq.stream.finish("abort")
                    self._remove(seq)
                    self.context.log.info(
                        "sequence.aborted", request_id=request_id, generated=seq.num_generated
                    )
            case StepResult():
                await self._on_step_result(message)
            case StepTimeout(step_id=step_id):
                if self._inflight is not None and self._inflight[0] == step_id:
                    reason = f"step {step_id} exceeded the step timeout of {self.cfg.step_timeout}s (hung executor)"
                    self.context.log.error(
                        "scheduler.watchdog_fired", step=step_id, timeout=self.cfg.step_timeout
                    )
                    self._fail_engine(reason)
            case ExecutorDown(error=error, kind=kind, incarnation=incarnation, reply=reply):
                reply.send(self._executor_down(error, kind, incarnation))
            case ExecutorReady(incarnation=incarnation):
                if self._failed is None:
                    self._incarnation = incarnation
                    stats: CacheStats = await self._cache.ask(
                        lambda r: GetCacheStats(r), timeout=_ASK_TIMEOUT
                    )
                    self._free_blocks = stats.blocks_total - stats.blocks_used
                    self.context.log.info(
                        "scheduler.executor_ready", executor_incarnation=incarnation
                    )
                    await self._maybe_step()
            case EngineFailedNotice(reason=reason):
                self._fail_engine(reason)
            case Drain(timeout=timeout, reply=reply):
                self._start_drain(timeout, reply)
            case _:
                assert_never(message)

    async def on_stop(self) -> None:
        self._cancel_watchdog()
        if self._draining is not None:
            self._draining[1].cancel()
        for seq in [*self._running, *self._waiting]:
            seq.stream.fail(EngineStopped(partial=seq.partial()))
        self._running.clear()
        self._waiting.clear()
        self._by_request.clear()

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            running=len(self._running),
            waiting=len(self._waiting),
            steps=self._steps,
            preemptions=self._preemptions,
            fenced_results=self._fenced,
            failed_sequences=self._failed_sequences,
            last_batch_size=self._last_batch,
            max_batch_size=self._max_batch,
            prompt_tokens=self._prompt_tokens,
            generated_tokens=self._generated,
            prefix_cached_tokens=self._prefix_cached_tokens,
        )

    # -- admission and removal ------------------------------------------------------------------
    def _add(self, msg: AddSequence) -> None:
        if self._failed is not None:
            msg.stream.fail(EngineFailed(f"engine failed: {self._failed}"))
            return
        if self._drain_requested:
            msg.stream.fail(EngineStopped())
            return
        seq = Sequence(
            self._next_seq_id,
            msg.request_id,
            msg.prompt_ids,
            msg.params,
            msg.max_tokens,
            msg.stream,
            self._tokenizer,
            time.monotonic(),
        )
        self._next_seq_id += 1
        self._by_request[msg.request_id] = seq
        self._waiting.append(seq)
        self._prompt_tokens += seq.prompt_len

    def _remove(self, seq: Sequence) -> None:
        """Forget a sequence and free its blocks at once."""
        seq.status = SeqStatus.FINISHED
        self._by_request.pop(seq.request_id, None)
        if seq in self._running:
            self._running.remove(seq)
        elif seq in self._waiting:
            self._waiting.remove(seq)
        self._return_blocks(seq)
        self._check_drained()

    def _return_blocks(self, seq: Sequence) -> None:
        """Forget ``seq``'s block table; its blocks go back to the cache with the next flush."""
        if seq.block_table:
            self._free_blocks += len(seq.block_table)
            seq.block_table = ()
            seq.committed_blocks = 0
            self._to_free.append(seq.seq_id)

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks; it is recomputed when readmitted (front of the queue)."""
        self._running.remove(seq)
        self._return_blocks(seq)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        self._waiting.appendleft(seq)
        self._preemptions += 1
        self.context.log.info(
            "sequence.preempted", request_id=seq.request_id, generated=seq.num_generated
        )

    # -- the step loop --------------------------------------------------------------------------
    def _can_step(self) -> bool:
        return self._incarnation is not None and self._failed is None

    async def _maybe_step(self, *, retry: bool = True) -> None:
        if self._inflight is not None or not self._can_step():
            return
        plan = self._plan()
        if not plan:
            return
        grants = []
        prefixes = []
        for p in plan:
            total = self._blocks_for(p.seq.num_computed + p.n_tokens)
            if total > len(p.seq.block_table):
                grants.append((p.seq.seq_id, total))
            if self.cfg.prefix_caching and p.seq.num_computed == 0 and not p.seq.block_table:
                # leave at least the last token to compute: its logits give the first sample
                count = (len(p.seq.all_ids) - 1) // self.cfg.block_size
                if count:
                    prefixes.append((p.seq.seq_id, self._hashes(p.seq, count)))
        await self._flush_cache_updates()
        fresh: tuple[int, ...] = ()
        if grants:
            try:
                allocation: Allocation = await self._cache.ask(
                    lambda r: AllocateBlocks(tuple(grants), r, tuple(prefixes)),
                    timeout=_ASK_TIMEOUT,
                )
            except OutOfBlocks:
                # our free-block estimate drifted: refresh it and plan again on the next event
                stats: CacheStats = await self._cache.ask(
                    lambda r: GetCacheStats(r), timeout=_ASK_TIMEOUT
                )
                self._free_blocks = stats.blocks_total - stats.blocks_used
                self.context.log.warning(
                    "scheduler.allocation_refused", free_blocks=self._free_blocks
                )
                if retry:
                    # sequences _plan() moved to running still lack blocks: plan again now with
                    # the corrected estimate rather than wait for the next message
                    await self._maybe_step(retry=False)
                return
            self._free_blocks = allocation.free_blocks
            fresh = allocation.fresh_blocks
            for p in plan:
                table = allocation.tables.get(p.seq.seq_id)
                if table is not None:
                    p.seq.block_table = table
            if allocation.cached_blocks:
                plan = self._skip_cached(plan, allocation.cached_blocks)
        if not self._can_step():
            return  # the executor went down while we were allocating
        if not plan:
            # every planned token was found in the prefix cache: plan the rest now
            await self._maybe_step(retry=retry)
            return
        chunks = tuple(
            SeqChunk(
                seq_id=p.seq.seq_id,
                token_ids=tuple(
                    p.seq.all_ids[p.seq.num_computed : p.seq.num_computed + p.n_tokens]
                ),
                start_pos=p.seq.num_computed,
                block_table=p.seq.block_table,
                sample=p.sample,
                params=p.seq.params,
                num_generated=p.seq.num_generated,
            )
            for p in plan
        )
        self._step_id += 1
        step_id = self._step_id
        self._inflight = (step_id, plan)
        self._last_batch = len(plan)
        self._max_batch = max(self._max_batch, len(plan))
        self._arm_watchdog(step_id)
        incarnation = self._incarnation
        assert incarnation is not None
        await self._executor().tell(RunStep(step_id, incarnation, StepBatch(chunks, fresh)))

    def _plan(self) -> list[_Planned]:
        budget = self.cfg.max_num_batched_tokens
        free = self._free_blocks
        plan: list[_Planned] = []
        # running sequences first, oldest first; the youngest are preempted when blocks run out
        i = 0
        while i < len(self._running) and budget > 0:
            seq = self._running[i]
            n = min(seq.remaining, budget)
            need = self._blocks_for(seq.num_computed + n) - len(seq.block_table)
            while need > free and self._running[-1] is not seq:
                victim = self._running[-1]
                free += len(victim.block_table)
                self._preempt(victim)
            if need > free:
                free += len(seq.block_table)
                self._preempt(seq)
                continue
            free -= max(need, 0)
            budget -= n
            plan.append(_Planned(seq, n, sample=n == seq.remaining))
            i += 1
        # then admit waiting sequences in arrival order while blocks, budget and slots allow
        while self._waiting and budget > 0 and len(self._running) < self.cfg.max_num_seqs:
            seq = self._waiting[0]
            n = min(seq.remaining, budget)
            need = self._blocks_for(seq.num_computed + n) - len(seq.block_table)
            if need > free:
                break
            self._waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self._running.append(seq)
            free -= need
            budget -= n
            plan.append(_Planned(seq, n, sample=n == seq.remaining))
        return plan

    def _hashes(self, seq: Sequence, count: int) -> tuple[bytes, ...]:
        return block_hashes(seq.all_ids, self.cfg.block_size, count, seq.hashes)

    def _skip_cached(self, plan: list[_Planned], cached: dict[int, int]) -> list[_Planned]:
        """Start the sequences that share cached blocks after them; drop emptied chunks."""
        kept = []
        for p in plan:
            blocks = cached.get(p.seq.seq_id, 0)
            if blocks:
                seq = p.seq
                skipped = blocks * self.cfg.block_size
                end = seq.num_computed + p.n_tokens
                seq.num_computed = skipped
                seq.committed_blocks = blocks
                self._prefix_cached_tokens += skipped
                if seq.num_generated == 0 and not seq.stream.cached_tokens:
                    # what the client is told (usage.prompt_tokens_details.cached_tokens): the
                    # first admission's hit; a readmission after preemption is stoic's business
                    seq.stream.cached_tokens = min(skipped, seq.prompt_len)
                p.n_tokens = max(0, end - skipped)
                p.sample = p.n_tokens == seq.remaining
                self.context.log.debug(
                    "sequence.prefix_cached", request_id=seq.request_id, tokens=skipped
                )
            if p.n_tokens:
                kept.append(p)
        return kept

    def _blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.cfg.block_size)

    async def _on_step_result(self, msg: StepResult) -> None:
        if (
            self._inflight is None
            or msg.step_id != self._inflight[0]
            or msg.incarnation != self._incarnation
        ):
            self._fenced += 1
            self.context.log.info(
                "scheduler.result_fenced", step=msg.step_id, executor_incarnation=msg.incarnation
            )
            return
        _, plan = self._inflight
        self._inflight = None
        self._cancel_watchdog()
        self._steps += 1
        touched: list[Sequence] = []
        for p in plan:
            seq = p.seq
            if seq.status is not SeqStatus.RUNNING:
                continue  # aborted, preempted or stopped while the step ran
            seq.num_computed += p.n_tokens
            if self.cfg.prefix_caching:
                self._commit_full_blocks(seq)
            token = msg.output.sampled.get(seq.seq_id)
            if p.sample and token is not None:
                seq.append(token, self.cfg.eos_token_ids)
                self._generated += 1
                touched.append(seq)
        # free token-level finishes at once, then keep the executor busy before text work
        for seq in touched:
            if seq.finish_reason is not None:
                self._release_blocks(seq)
        await self._maybe_step()
        for seq in touched:
            seq.detokenize()
            if seq.finish_reason is not None:
                seq.stream.finish(seq.finish_reason, seq.stop_reason)
                self._remove(seq)
        self._progress()

    def _commit_full_blocks(self, seq: Sequence) -> None:
        """Queue the blocks this step filled for the prefix cache."""
        full = min(seq.num_computed // self.cfg.block_size, len(seq.block_table))
        if full > seq.committed_blocks:
            hashes = self._hashes(seq, full)[seq.committed_blocks :]
            self._to_commit.append((seq.seq_id, seq.committed_blocks, hashes))
            seq.committed_blocks = full

    def _release_blocks(self, seq: Sequence) -> None:
        if seq in self._running:
            self._running.remove(seq)
        seq.status = SeqStatus.FINISHED
        self._return_blocks(seq)

    # -- failures -------------------------------------------------------------------------------
    def _executor_down(self, error: BaseException, kind: str, incarnation: int) -> int:
        """Fence the failed incarnation and end every sequence with the error."""
        self._incarnation = None
        prefilling: set[int] = set()
        if self._inflight is not None:
            prefilling = {p.seq.seq_id for p in self._inflight[1] if p.n_tokens > 1}
            self._inflight = None
        self._cancel_watchdog()
        count = 0
        for seq in [*self._running, *self._waiting]:
            # an OOM while this very sequence was prefilling will likely recur: do not ask for a retry
            retryable = not (kind == "oom" and seq.seq_id in prefilling)
            seq.stream.fail(
                ExecutorFailed(
                    f"the model executor failed ({kind}): {error}; the engine recovered",
                    partial=seq.partial(),
                    kind=kind,
                    retryable=retryable,
                )
            )
            seq.status = SeqStatus.FINISHED
            count += 1
        self._running.clear()
        self._waiting.clear()
        self._by_request.clear()
        self._free_blocks = self.cfg.num_blocks  # the cache manager drops everything next
        self._to_free.clear()
        self._to_commit.clear()
        self._failed_sequences += count
        self.context.log.warning(
            "scheduler.sequences_failed", count=count, kind=kind, executor_incarnation=incarnation
        )
        self._check_drained()
        return count

    def _fail_engine(self, reason: str) -> None:
        if self._failed is not None:
            return
        self._failed = reason
        self._incarnation = None
        self._inflight = None
        self._cancel_watchdog()
        count = 0
        for seq in [*self._running, *self._waiting]:
            seq.stream.fail(EngineFailed(f"engine failed: {reason}", partial=seq.partial()))
            seq.status = SeqStatus.FINISHED
            self._return_blocks(seq)
            count += 1
        self._running.clear()
        self._waiting.clear()
        self._by_request.clear()
        self._failed_sequences += count
        self.context.log.error("scheduler.engine_failed", reason=reason, sequences_failed=count)
        self._on_fatal(reason)
        self._check_drained()

    # -- watchdog, drain, progress --------------------------------------------------------------
    def _arm_watchdog(self, step_id: int) -> None:
        self._cancel_watchdog()
        loop = asyncio.get_running_loop()
        ref = self.context.ref

        def fire() -> None:
            try:
                ref.try_tell(StepTimeout(step_id))
            except Exception:  # mailbox full or stopped: try again shortly
                if ref.is_alive:
                    self._watchdog = loop.call_later(0.05, fire)

        self._watchdog = loop.call_later(self.cfg.step_timeout, fire)

    def _cancel_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def _start_drain(self, timeout: float, reply: Reply[int]) -> None:
        self._drain_requested = True
        pending = len(self._running) + len(self._waiting)
        if pending == 0:
            reply.send(0)
            return
        self.context.log.info("scheduler.draining", sequences=pending, timeout=timeout)

        def deadline() -> None:
            for seq in [*self._running, *self._waiting]:
                seq.stream.fail(
                    EngineStopped(
                        "engine stopped before the request finished", partial=seq.partial()
                    )
                )
                self._remove(seq)
            self._check_drained()

        self._draining = (reply, asyncio.get_running_loop().call_later(timeout, deadline))

    def _check_drained(self) -> None:
        if self._draining is not None and not self._running and not self._waiting:
            reply, timer = self._draining
            self._draining = None
            timer.cancel()
            if not reply.done:
                reply.send(0)

    def _progress(self) -> None:
        now = time.monotonic()
        if now - self._last_progress >= _PROGRESS_EVERY:
            self._last_progress = now
            self.context.log.info(
                "scheduler.progress",
                running=len(self._running),
                waiting=len(self._waiting),
                steps=self._steps,
                generated_tokens=self._generated,
                free_blocks=self._free_blocks,
            )
