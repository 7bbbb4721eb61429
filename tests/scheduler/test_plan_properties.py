"""Property tests of the scheduler's core, without actors or a model: random sequences of add,
step, finish, abort, executor failure and stale results keep every invariant, and every step is
planned on the true cache state (checked against that state, taken just before the plan).

They drive :class:`~stoic.scheduler.SchedulerCore` through
:func:`stoic.actors.testing.create_scheduler` with fabricated outputs; each runs in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from stoic.actors.testing import SchedulerHarness, create_scheduler, drain
from stoic.scheduler import Seq, block_hashes, prefix_blocks


def _prefix_hashes(seq: Seq, block_size: int) -> tuple[bytes, ...]:
    return block_hashes(seq.all_ids, block_size, prefix_blocks(seq, block_size), [])


@dataclass
class _PlanChecks:
    """Starts a step and checks it against the state it was planned on.

    * it carries at most the token budget and ``max_num_seqs`` sequences in force;
    * a starting sequence shares whole blocks, never more than the cached blocks it would
      have found when the plan began, and what it shares is cached and held afterwards;
    * the prefix-hit counter grows by the tokens shared;
    * each chunk's table covers its tokens, and every block it reads was zeroed since the KV
      tensors were last (re)created; no block is zeroed twice between two drops (a block
      zeroed again could be a cached one: its keys and values would be wiped).
    """

    #: blocks zeroed since the last drop (cleared on an executor failure)
    zeroed: set[int] = field(default_factory=set)

    def start(self, h: SchedulerHarness) -> None:
        core, alloc = h.core, h.allocator
        size = core.cfg.block_size
        waiting = {seq.seq_id: seq for seq in core.waiting}
        found = {
            seq_id: alloc.lookup(_prefix_hashes(seq, size))[0] if core.cfg.prefix_caching else 0
            for seq_id, seq in waiting.items()
        }
        budget, seqs, hits = core.budget.tokens, core.budget.seqs, core.stats().prefix_cached_tokens
        batch = h.start_step()
        if batch is None:
            return
        assert batch.num_tokens <= budget and len(batch.chunks) <= seqs
        assert not self.zeroed & set(batch.zero_blocks), "a block was zeroed twice"
        self.zeroed |= set(batch.zero_blocks)
        shared = 0
        for chunk in batch.chunks:
            assert set(chunk.block_table) <= self.zeroed, "a block is read before it was zeroed"
            assert len(chunk.block_table) * size >= chunk.start_pos + len(chunk.token_ids)
            seq = waiting.get(chunk.seq_id)
            if seq is None:
                continue
            blocks, rest = divmod(chunk.start_pos, size)
            assert rest == 0 and blocks <= found[chunk.seq_id]
            assert alloc.lookup(_prefix_hashes(seq, size)[:blocks]) == (blocks, 0)
            assert seq.stream.cached_tokens <= seq.prompt_len
            shared += chunk.start_pos
        # a sequence preempted and readmitted by this same plan may share its own blocks too
        assert core.stats().prefix_cached_tokens - hits >= shared


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 12), st.integers(0, 3)),
        st.tuples(st.just("step")),
        st.tuples(st.just("start")),
        st.tuples(st.just("finish")),
        st.tuples(st.just("abort"), st.integers(0, 40)),
        st.tuples(st.just("executor_down"), st.sampled_from(["error", "oom"])),
        st.tuples(st.just("stale")),
    ),
    max_size=60,
)


def _apply(
    h: SchedulerHarness, op: tuple[object, ...], prompts: list[str], checks: _PlanChecks
) -> None:
    match op:
        case ("add", length, max_tokens, family):
            assert isinstance(length, int) and isinstance(family, int)
            assert isinstance(max_tokens, int)
            # a few prompt families, so prefixes are shared
            h.add((prompts[family] * 8)[:length], max_tokens=max_tokens)
        case ("step",):
            if h.inflight is None:
                checks.start(h)
                h.finish_step()
        case ("start",):
            if h.inflight is None:
                checks.start(h)
        case ("finish",):
            h.finish_step()
        case ("abort", index):
            assert isinstance(index, int)
            if index < len(h.streams):
                h.core.abort(h.streams[index].request_id)
        case ("executor_down", kind):
            h.executor_down(RuntimeError("injected"), kind)
            checks.zeroed.clear()  # the tensors were dropped: every block is to be zeroed again
        case ("stale",):
            if h.inflight is not None:
                step_id, incarnation, batch = h.inflight
                assert h.core.complete(step_id, incarnation + 1, h.output_for(batch)) is None


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=_OPS,
    # the longest request (30 + 12 tokens) needs 11 blocks; the intake refuses longer ones
    num_blocks=st.integers(11, 24),
    budget=st.integers(8, 24),
    prefix_caching=st.booleans(),
    resume=st.booleans(),
)
# found by a CI run: a preempted sequence readmitted sharing a finished one's cached blocks; the
# core counted those blocks free when the finished one let go (they were still held)
@example(
    ops=[("add", 16, 6, 0), ("add", 21, 5, 0), ("add", 21, 1, 1)],
    num_blocks=12,
    budget=22,
    prefix_caching=True,
    resume=False,
)
def test_random_operations_keep_every_invariant(
    ops: list[tuple[object, ...]], num_blocks: int, budget: int, prefix_caching: bool, resume: bool
) -> None:
    """Over any sequence of add / step / abort / executor failure / stale result, failing or
    resuming on executor failures: the allocator's invariant holds, blocks in use equal the
    blocks in the core's tables, every planned step keeps :class:`_PlanChecks`' rules (the
    budget and ``max_num_seqs``, prefix hits, zeroing), a stream is open exactly while its
    sequence is known, and once everything ran to completion every block is free and every
    stream has ended (under resume, with an error only if its resumes were spent or it was
    isolated)."""
    h = create_scheduler(
        num_blocks=num_blocks,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=budget,
        prefix_caching=prefix_caching,
        recovery="resume" if resume else "fail",
    )
    prompts = ["abcd", "abce", "zyxw", "the quick brown fox "]
    checks = _PlanChecks()
    for op in ops:
        _apply(h, op, prompts, checks)
        h.check()
        for batch in h.batches:
            assert batch.num_tokens <= budget
            assert len(batch.chunks) <= 4
            assert len({c.seq_id for c in batch.chunks}) == len(batch.chunks)
    h.finish_step()
    h.run_until_idle()
    h.check()
    assert h.allocator.used_blocks == 0
    assert all(s.done for s in h.streams)
    if resume:
        stats = h.core.stats()
        assert stats.failed_sequences == stats.resumes_exhausted + stats.requests_isolated


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(
    prompts=st.lists(st.sampled_from(["system: be brief. ", "system: be kind. ", "x"]), min_size=1),
    tails=st.lists(st.text("abc", min_size=1, max_size=9), min_size=1, max_size=6),
    num_blocks=st.integers(12, 40),
)
def test_a_starting_sequence_shares_exactly_the_cached_prefix_it_finds(
    prompts: list[str], tails: list[str], num_blocks: int
) -> None:
    """Requests one after another (nothing evicted between the lookup and the plan): each
    shares exactly the blocks the prefix cache holds for its prompt when it starts, is charged
    only for the rest, and produces the output it produces without prefix caching; once idle
    every block is free (cached ones are evictable, not held)."""

    def run(prefix_caching: bool) -> list[str]:
        h = create_scheduler(
            num_blocks=num_blocks,
            block_size=4,
            max_num_batched_tokens=64,
            prefix_caching=prefix_caching,
        )
        texts = []
        for i, tail in enumerate(tails):
            stream = h.add(prompts[i % len(prompts)] + tail, max_tokens=3)
            (seq,) = h.core.waiting
            prompt_len = seq.prompt_len
            expected = h.allocator.lookup(_prefix_hashes(seq, 4))[0] if prefix_caching else 0
            batch = h.step()
            assert batch is not None
            (chunk,) = batch.chunks
            assert chunk.start_pos == expected * 4 == stream.cached_tokens
            assert len(chunk.token_ids) == prompt_len - chunk.start_pos and chunk.sample
            h.run_until_idle()
            h.check()
            assert h.allocator.used_blocks == 0
            texts.append(drain(stream)[0])
        return texts

    assert run(prefix_caching=True) == run(prefix_caching=False)
