"""Step planning: which tokens of which sequences the next step computes, under a token budget
and the free KV blocks. Pure functions over the scheduler core's queues."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ..model import SeqChunk
from ._messages import BlockGrant, PrefixQuery
from ._sequence import SeqStatus, Sequence

__all__ = [
    "Planned",
    "StepPlan",
    "blocks_for",
    "chunks_of",
    "plan_step",
    "prefix_blocks",
    "skip_cached",
    "within_charge",
]


@dataclass(slots=True)
class Planned:
    """One sequence's part of a planned step: ``n_tokens`` from ``seq.num_computed`` on."""

    seq: Sequence
    n_tokens: int
    #: sample a token after the chunk (it reaches the end of what the sequence has)
    sample: bool
    #: the tokens charged to the step's budget, when fewer than ``n_tokens`` (a starting
    #: sequence whose prefix is believed cached): at most this many are computed
    charge: int | None = None


@dataclass(frozen=True, slots=True)
class StepPlan:
    """A planned step waiting for its blocks (see :meth:`SchedulerCore.allocated`)."""

    planned: tuple[Planned, ...]
    #: block tables that must grow
    grants: tuple[BlockGrant, ...]
    #: new sequences that may share cached prefix blocks
    prefixes: tuple[PrefixQuery, ...]


def blocks_for(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size)


def prefix_blocks(seq: Sequence, block_size: int) -> int:
    """Full blocks of ``seq`` that may be shared from the prefix cache when it starts: every full
    block but the one holding the last token (its logits give the first sample)."""
    return (len(seq.all_ids) - 1) // block_size


def _blocks_needed(seq: Sequence, n: int, block_size: int, prefix_caching: bool) -> int:
    """New blocks ``seq`` may take from the free ones to compute ``n`` more tokens.

    A sequence that starts (no blocks yet) with prefix caching may be given every cached block
    of its prefix, more than its chunk needs when the chunk is short: a shared block that nobody
    else holds comes out of the same pool of free (evictable) blocks, so count those too, or the
    cache manager would refuse the plan.
    """
    need = blocks_for(seq.num_computed + n, block_size) - len(seq.block_table)
    if prefix_caching and seq.num_computed == 0 and not seq.block_table:
        need = max(need, prefix_blocks(seq, block_size))
    return need


def plan_step(
    running: list[Sequence],
    waiting: deque[Sequence],
    *,
    budget: int,
    free_blocks: int,
    max_num_seqs: int,
    block_size: int,
    prefix_caching: bool,
    preempt: Callable[[Sequence], int],
    cached_tokens: Callable[[Sequence], int] = lambda seq: 0,
) -> list[Planned]:
    """Choose the next step's chunks.

    Running sequences come first, oldest first; when the free blocks run out, the youngest
    running sequences are handed to ``preempt`` (which moves them from ``running`` to the front
    of ``waiting`` and returns how many blocks that freed: a block another sequence shares
    stays in use). Then waiting sequences are moved to ``running`` in order while blocks,
    ``budget`` and ``max_num_seqs`` allow; one that starts is charged only for the tokens past
    ``cached_tokens(seq)`` (its prefix believed cached; fewer than its tokens), and its chunk
    covers that prefix too. Each chunk samples when it reaches the end of its sequence's
    tokens.
    """
    free = free_blocks
    planned: list[Planned] = []
    i = 0
    while i < len(running) and budget > 0:
        seq = running[i]
        n = min(seq.remaining, budget)
        need = _blocks_needed(seq, n, block_size, prefix_caching)
        while need > free and running[-1] is not seq:
            free += preempt(running[-1])
        if need > free:
            free += preempt(seq)
            continue
        free -= max(need, 0)
        budget -= n
        planned.append(Planned(seq, n, sample=n == seq.remaining))
        i += 1
    while waiting and budget > 0 and len(running) < max_num_seqs:
        seq = waiting[0]
        starting = prefix_caching and seq.num_computed == 0 and not seq.block_table
        cached = cached_tokens(seq) if starting else 0
        n = min(seq.remaining, budget + cached)
        need = _blocks_needed(seq, n, block_size, prefix_caching)
        if need > free and cached:
            # the blocks for the whole believed prefix do not fit (counted as taken, though
            # running sequences may hold them): plan it as if nothing were cached, as before
            cached = 0
            n = min(seq.remaining, budget)
            need = _blocks_needed(seq, n, block_size, prefix_caching)
        if need > free:
            break
        waiting.popleft()
        seq.status = SeqStatus.RUNNING
        running.append(seq)
        free -= need
        charge = n - cached
        budget -= charge
        planned.append(
            Planned(seq, n, sample=n == seq.remaining, charge=charge if cached else None)
        )
    return planned


def skip_cached(
    planned: list[Planned], cached: dict[int, int], block_size: int
) -> tuple[list[Planned], int]:
    """Start the sequences that share ``cached[seq_id]`` prefix blocks after them and drop the
    chunks that emptied. Returns the chunks kept and the prompt tokens skipped."""
    kept = []
    skipped_total = 0
    for p in planned:
        blocks = cached.get(p.seq.seq_id, 0)
        if blocks:
            seq = p.seq
            skipped = blocks * block_size
            end = seq.num_computed + p.n_tokens
            seq.num_computed = skipped
            seq.committed_blocks = blocks
            skipped_total += skipped
            if seq.num_generated == 0 and not seq.stream.cached_tokens:
                # what the client is told (usage.prompt_tokens_details.cached_tokens): the
                # first admission's hit; a readmission after preemption is stoic's business
                seq.stream.cached_tokens = min(skipped, seq.prompt_len)
            p.n_tokens = max(0, end - skipped)
            p.sample = p.n_tokens == seq.remaining
        if p.n_tokens:
            kept.append(p)
    return kept, skipped_total


def within_charge(planned: list[Planned], budget: int) -> list[Planned]:
    """Keep the step within ``budget`` once the cache manager has said what it shares
    (:func:`skip_cached`): a chunk whose prefix was believed cached but was not (evicted since)
    computes what its charge paid for and what the others left of ``budget``, in plan order;
    the rest of it comes in the next steps."""
    spare = budget - sum(
        p.n_tokens if p.charge is None else min(p.n_tokens, p.charge) for p in planned
    )
    for p in planned:
        if p.charge is not None and p.n_tokens > p.charge:
            p.n_tokens = p.charge + min(p.n_tokens - p.charge, max(spare, 0))
            spare -= p.n_tokens - p.charge
            p.sample = p.n_tokens == p.seq.remaining
    return planned


def chunks_of(planned: list[Planned]) -> tuple[SeqChunk, ...]:
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
