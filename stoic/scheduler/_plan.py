"""Step planning on the true cache state: which tokens of which sequences the next step
computes, under a token budget and the KV blocks the allocator has free.

One synchronous call looks each starting sequence's prefix up in the prefix cache, shares its
cached blocks, allocates the blocks every chunk needs and charges the budget for the tokens
it computes, as vLLM v1's ``schedule()`` does: nothing is estimated, so nothing is corrected
afterwards and no plan is refused. Pure functions over the scheduler core's queues and its
:class:`~stoic.scheduler.BlockAllocator`.
"""

from __future__ import annotations

import collections
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ..request import SeqChunk
from ._allocator import BlockAllocator
from ._sequence import Seq, SeqStatus
from ._speculate import MAX_STEP_ROWS
from ._tenants import TenantShares

__all__ = [
    "Planned",
    "StepPlan",
    "blocks_for",
    "chunks_of",
    "plan_step",
    "prefix_blocks",
]


@dataclass(frozen=True, slots=True)
class Planned:
    """One sequence's part of a planned step: ``n_tokens`` from ``seq.num_computed`` on."""

    seq: Seq
    n_tokens: int
    #: sample a token after the chunk (it reaches the end of what the sequence has)
    sample: bool
    #: proposed tokens after the sequence's own (counted in ``n_tokens``), to verify
    drafts: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class StepPlan:
    """A planned step, its blocks allocated."""

    planned: tuple[Planned, ...]
    #: blocks handed out for the first time since the KV tensors were (re)created: the step
    #: zeroes them before use (:attr:`stoic.request.StepBatch.zero_blocks`)
    fresh_blocks: tuple[int, ...]
    #: prompt tokens the starting sequences shared from the prefix cache (not computed)
    cached_tokens: int


def blocks_for(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size)


def prefix_blocks(seq: Seq, block_size: int) -> int:
    """Full blocks of ``seq`` that may be shared from the prefix cache when it starts: every full
    block but the one holding the last token (its logits give the first sample)."""
    return (len(seq.all_ids) - 1) // block_size


def plan_step(
    running: list[Seq],
    waiting: deque[Seq],
    *,
    budget: int,
    max_num_seqs: int,
    allocator: BlockAllocator,
    block_size: int,
    preempt: Callable[[Seq], None],
    prefix_hashes: Callable[[Seq], tuple[bytes, ...]] | None,
    shares: TenantShares,
    prompt_budget: Callable[[int], int | None] | None = None,
    draft: Callable[[Seq, int], tuple[int, ...]] | None = None,
) -> StepPlan:
    """Choose the next step's chunks and allocate their blocks.

    The order, each under ``budget`` tokens and the free blocks:

    1. **Room for priorities**: a waiting sequence whose priority is better (lower) than a
       running sequence's of its tenant, with too few blocks free for its first chunk, has
       those running sequences preempted, worst priority first (vLLM's priority preemption,
       kept within a tenant: a priority never outranks another tenant's share).
    2. **Decodes first**: every running sequence with one token to feed, oldest first: a burst
       of prompts never stalls the running streams.
    3. **Fair shares**: prompt chunks of running sequences, then waiting sequences admitted,
       taken from the tenant whose virtual time is least (:class:`TenantShares`; within a
       tenant: running chunks first, then waiting by priority and admission order), while
       ``max_num_seqs``, the tenant's running limit and the blocks allow. A waiting sequence
       that does not fit the free blocks stops admission for this step (first come, first
       served within what the shares allow: a short one never jumps the queue for blocks).
       With ``prompt_budget`` (the decodes planned -> prompt tokens, or None), a step that
       decodes carries at most that many prompt tokens (a bound on how long the decodes wait).

    With ``draft`` (a running sequence and the budget left -> proposed tokens), a decode carries
    its drafts after its own token, to verify in the same step (speculative decoding); they
    count against the budget and get their blocks like any token, and the step's decodes and
    drafts stay within :data:`~stoic.scheduler._speculate.MAX_STEP_ROWS` tokens.

    When the free blocks run out for a running sequence's chunk, ``preempt`` takes back the
    blocks of the worst-priority, youngest running sequence not yet in the plan (the sequence
    itself when that is it): it moves from ``running`` to the front of ``waiting``. With
    prefix caching (``prefix_hashes``: a starting sequence's full prefix blocks' hashes), one
    that starts shares the cached blocks of its longest cached prefix and its chunk begins
    after them: the budget is charged only for the tokens computed, and the blocks it takes
    are exactly those the allocator will give (a shared block a running sequence holds costs
    nothing; an evictable one leaves the free pool). Each chunk samples when it reaches the end
    of its sequence's tokens, and charges its tokens to its tenant's share.
    """
    planned: list[Planned] = []
    in_plan: set[int] = set()
    fresh: list[int] = []
    cached_tokens = 0

    def grow(seq: Seq, tokens: int) -> None:
        fresh.extend(allocator.grow(seq.seq_id, blocks_for(tokens, block_size)))
        seq.block_table = allocator.table(seq.seq_id)

    def add(seq: Seq, n: int, drafts: tuple[int, ...] = ()) -> None:
        nonlocal budget
        budget -= n
        in_plan.add(seq.seq_id)
        planned.append(Planned(seq, n, n - len(drafts) == seq.remaining, drafts))
        shares.charge(seq.tenant, n)

    def place(seq: Seq, n: int, drafts: tuple[int, ...] = ()) -> bool:
        """Plan ``n`` tokens of running ``seq``, preempting for its blocks; False if it was
        preempted itself."""
        need = blocks_for(seq.num_computed + n, block_size) - len(seq.block_table)
        while need > allocator.free_blocks:
            victim = max(
                (s.priority, i, s)
                for i, s in enumerate(running)
                if s.seq_id not in in_plan  # seq itself among them
            )[2]
            preempt(victim)
            if victim is seq:
                return False
        grow(seq, seq.num_computed + n)
        add(seq, n, drafts)
        return True

    _room_for_priorities(running, waiting, budget, allocator, block_size, preempt)
    decodes = 0
    decoding = [s for s in running if s.remaining == 1]
    draft_rows = MAX_STEP_ROWS - len(decoding)  # drafts left to this step's decodes
    for seq in decoding:
        if budget <= 0:
            break
        if seq.status is SeqStatus.RUNNING:  # not preempted for an earlier one
            drafts = draft(seq, min(budget, 1 + draft_rows)) if draft is not None else ()
            if drafts:  # only into blocks no decode of this step may need: never a preemption
                spare = allocator.free_blocks - len(running)
                held = len(seq.block_table) + max(0, spare)
                drafts = drafts[: max(0, held * block_size - seq.num_computed - 1)]
                draft_rows -= len(drafts)
            decodes += place(seq, 1 + len(drafts), drafts)
    cap = prompt_budget(decodes) if prompt_budget is not None and decodes else None
    if cap is not None:
        budget = min(budget, cap)
    queues = _by_tenant(running, waiting, in_plan)
    active = collections.Counter(s.tenant for s in running)
    admitting = True
    max_running = shares.policy.max_running
    while queues and budget > 0:
        tenant = min(queues, key=shares.vtime)
        queue = queues[tenant]
        seq = queue[0]
        if seq.status is SeqStatus.RUNNING:
            queue.popleft()
            place(seq, min(seq.remaining, budget))
        elif seq.status is not SeqStatus.WAITING or seq not in waiting:
            queue.popleft()  # preempted or readmitted meanwhile: the next plan sees it
        elif (
            not admitting
            or len(running) >= max_num_seqs
            or (max_running is not None and active[tenant] >= max_running)
        ):
            queue.clear()  # the rest of this tenant's queue is waiting sequences too
        else:
            hashes = prefix_hashes(seq) if prefix_hashes is not None else ()
            shared, unused = allocator.lookup(hashes)
            start = shared * block_size
            n = min(len(seq.all_ids) - start, budget)
            if unused + blocks_for(start + n, block_size) - shared > allocator.free_blocks:
                admitting = False
                continue
            queue.popleft()
            waiting.remove(seq)
            seq.status = SeqStatus.RUNNING
            running.append(seq)
            active[tenant] += 1
            if shared:
                allocator.match(seq.seq_id, hashes[:shared])
                seq.num_computed = start
                seq.committed_blocks = shared
                cached_tokens += start
                if seq.num_new == 0 and not seq.stream.cached_tokens:
                    # what the client is told (usage.prompt_tokens_details.cached_tokens): the
                    # first admission's hit; a readmission after preemption is stoic's business
                    seq.stream.cached_tokens = min(start, seq.prompt_len)
            grow(seq, start + n)
            add(seq, n)
        if not queue:
            del queues[tenant]
    return StepPlan(tuple(planned), tuple(fresh), cached_tokens)


def _by_tenant(running: list[Seq], waiting: deque[Seq], in_plan: set[int]) -> dict[str, deque[Seq]]:
    """Each tenant's candidates for the rest of a step, in its own order: its running sequences
    not yet planned (oldest first), then its waiting ones by priority (stable: admission order,
    preempted ones first, within a priority)."""
    queues: dict[str, deque[Seq]] = {}
    for seq in running:
        if seq.seq_id not in in_plan:
            queues.setdefault(seq.tenant, deque()).append(seq)
    for seq in sorted(waiting, key=_priority):
        queues.setdefault(seq.tenant, deque()).append(seq)
    return queues


def _priority(seq: Seq) -> int:
    return seq.priority


def _room_for_priorities(
    running: list[Seq],
    waiting: deque[Seq],
    budget: int,
    allocator: BlockAllocator,
    block_size: int,
    preempt: Callable[[Seq], None],
) -> None:
    """Preempt, for each tenant's best waiting sequence short of blocks, the running
    sequences of that tenant with a worse priority (worst, then youngest, first) until its
    first chunk fits (counted without the prefix cache: at worst one preemption too many)."""
    if not waiting or not running:
        return
    best: dict[str, Seq] = {}
    for seq in waiting:
        if seq.tenant not in best or seq.priority < best[seq.tenant].priority:
            best[seq.tenant] = seq
    for tenant, seq in best.items():
        victims = sorted(
            (s for s in running if s.tenant == tenant and s.priority > seq.priority),
            key=lambda s: (s.priority, s.seq_id),
        )
        need = blocks_for(min(len(seq.all_ids), budget), block_size)
        while victims and need > allocator.free_blocks:
            preempt(victims.pop())


def chunks_of(planned: tuple[Planned, ...]) -> tuple[SeqChunk, ...]:
    """The model's view of the planned chunks.

    A sampling chunk whose params use a penalty or a constraint carries the sequence's generated
    tokens (and its prompt's, for ``repetition_penalty``), read from the sequence itself so that
    they are right after a preemption or an executor restart; every other chunk carries neither.
    """
    return tuple(_chunk(p) for p in planned)


def _chunk(p: Planned) -> SeqChunk:
    seq = p.seq
    params = seq.params
    counts = p.sample and (params.counts_output or params.constraint is not None)
    return SeqChunk(
        seq_id=seq.seq_id,
        token_ids=(
            *seq.all_ids[seq.num_computed : seq.num_computed + p.n_tokens - len(p.drafts)],
            *p.drafts,
        ),
        start_pos=seq.num_computed,
        block_table=seq.block_table,
        sample=p.sample,
        params=params,
        num_generated=seq.num_generated,
        output_ids=tuple(seq.all_ids[seq.prompt_len :]) if counts else (),
        prompt_ids=tuple(seq.all_ids[: seq.prompt_len]) if counts and params.counts_prompt else (),
        drafts=len(p.drafts),
    )
