"""Step planning on the true cache state: which tokens of which sequences the next step
computes, under a token budget and the KV blocks the allocator has free.

One synchronous call looks each starting sequence's prefix up in the prefix cache, shares its
cached blocks, allocates the blocks every chunk needs and charges the budget for the tokens
it computes, as vLLM v1's ``schedule()`` does: nothing is estimated, so nothing is corrected
afterwards and no plan is refused. Pure functions over the scheduler core's queues and its
:class:`~stoic.scheduler.BlockAllocator`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ..request import SeqChunk
from ._allocator import BlockAllocator
from ._sequence import Seq, SeqStatus

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
) -> StepPlan:
    """Choose the next step's chunks and allocate their blocks.

    Running sequences come first, oldest first; when the free blocks run out, the youngest
    running sequences are handed to ``preempt`` (which moves them from ``running`` to the front
    of ``waiting`` and gives their blocks back to ``allocator``). Then waiting sequences are
    moved to ``running`` in order while blocks, ``budget`` and ``max_num_seqs`` allow. With
    prefix caching (``prefix_hashes``: a starting sequence's full prefix blocks' hashes), one
    that starts first shares the cached blocks of its longest cached prefix and its chunk
    begins after them: the budget is charged only for the tokens computed, and the blocks it
    takes are exactly those the allocator will give (a shared block a running sequence holds
    costs nothing; an evictable one leaves the free pool). Each chunk samples when it reaches
    the end of its sequence's tokens.
    """
    planned: list[Planned] = []
    fresh: list[int] = []
    cached_tokens = 0

    def grow(seq: Seq, tokens: int) -> None:
        fresh.extend(allocator.grow(seq.seq_id, blocks_for(tokens, block_size)))
        seq.block_table = allocator.table(seq.seq_id)

    i = 0
    while i < len(running) and budget > 0:
        seq = running[i]
        n = min(seq.remaining, budget)
        need = blocks_for(seq.num_computed + n, block_size) - len(seq.block_table)
        while need > allocator.free_blocks and running[-1] is not seq:
            preempt(running[-1])
        if need > allocator.free_blocks:
            preempt(seq)
            continue
        grow(seq, seq.num_computed + n)
        budget -= n
        planned.append(Planned(seq, n, sample=n == seq.remaining))
        i += 1
    while waiting and budget > 0 and len(running) < max_num_seqs:
        seq = waiting[0]
        hashes = prefix_hashes(seq) if prefix_hashes is not None else ()
        shared, unused = allocator.lookup(hashes)
        start = shared * block_size
        n = min(len(seq.all_ids) - start, budget)
        if unused + blocks_for(start + n, block_size) - shared > allocator.free_blocks:
            break
        waiting.popleft()
        seq.status = SeqStatus.RUNNING
        running.append(seq)
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
        budget -= n
        planned.append(Planned(seq, n, sample=n == seq.remaining))
    return StepPlan(tuple(planned), tuple(fresh), cached_tokens)


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
        token_ids=tuple(seq.all_ids[seq.num_computed : seq.num_computed + p.n_tokens]),
        start_pos=seq.num_computed,
        block_table=seq.block_table,
        sample=p.sample,
        params=params,
        num_generated=seq.num_generated,
        output_ids=tuple(seq.all_ids[seq.prompt_len :]) if counts else (),
        prompt_ids=tuple(seq.all_ids[: seq.prompt_len]) if counts and params.counts_prompt else (),
    )
