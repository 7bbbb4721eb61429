"""A KV cache kept through an executor failure (pools that outlive the worker), in the scheduler's
core without a model.

A simulated cache (:class:`SlotCache`) records which token's key and value each block slot holds;
every chunk checks, before it runs, that its context's slots hold exactly its sequence's tokens,
and a failed step writes an arbitrary part of what it was to write (a worker killed mid-step).
Kept or dropped, every stream must end with its fault-free text.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from stoic.actors.testing import SchedulerHarness, create_scheduler, drain
from stoic.request import StepBatch

PROMPTS = ["hello there", "a longer prompt than that", "abcd", "one two three four five", "zz"]
BLOCK = 4


class SlotCache:
    """What each ``(block, offset)`` slot holds: the token whose key and value were written
    there (a zeroed or never-written slot holds nothing)."""

    def __init__(self) -> None:
        self.slots: dict[tuple[int, int], int] = {}

    def _writes(self, h: SchedulerHarness, batch: StepBatch) -> list[tuple[tuple[int, int], int]]:
        """Check every chunk's context, then list the slots the step writes."""
        seqs = {seq.seq_id: seq for seq in h.core.running}
        writes = []
        for chunk in batch.chunks:
            ids = seqs[chunk.seq_id].all_ids
            for pos in range(chunk.start_pos):
                slot = (chunk.block_table[pos // BLOCK], pos % BLOCK)
                assert self.slots.get(slot) == ids[pos], (
                    f"sequence {chunk.seq_id} position {pos}: slot {slot} holds "
                    f"{self.slots.get(slot)}, not {ids[pos]}"
                )
            for i, token in enumerate(chunk.token_ids):
                pos = chunk.start_pos + i
                writes.append(((chunk.block_table[pos // BLOCK], pos % BLOCK), token))
        return writes

    def run(self, h: SchedulerHarness, batch: StepBatch, rng: random.Random | None = None) -> None:
        """Run ``batch``: zero its fresh blocks, check, write. With ``rng`` the step fails: it
        zeroes and writes a random part of what it would have."""
        zero = [(b, o) for b in batch.zero_blocks for o in range(BLOCK)]
        writes = self._writes(h, batch)
        if rng is not None:
            zero = [slot for slot in zero if rng.random() < 0.5]
            writes = [w for w in writes if rng.random() < 0.5]
        for slot in zero:
            self.slots.pop(slot, None)
        self.slots.update(writes)


def _fault_free(prompts: list[str], max_tokens: int) -> list[str]:
    h = create_scheduler(num_blocks=64, block_size=BLOCK)
    streams = [h.add(p, max_tokens=max_tokens) for p in prompts]
    h.run_until_idle()
    return [drain(s)[0] for s in streams]


def _step(h: SchedulerHarness, cache: SlotCache) -> bool:
    batch = h.start_step()
    if batch is None:
        return False
    cache.run(h, batch)
    h.finish_step()
    return True


def _fail(h: SchedulerHarness, cache: SlotCache, keep: bool, rng: random.Random) -> int:
    """Fail the next step after it wrote part of its work; returns its tokens."""
    batch = h.start_step()
    assert batch is not None
    cache.run(h, batch, rng)
    h.executor_down(RuntimeError("killed"), "crash", keep_kv=keep)
    if not keep:
        cache.slots.clear()  # the pools were dropped
    h.check()
    return batch.num_tokens


def test_a_kept_cache_resumes_each_sequence_from_its_committed_position() -> None:
    """A failure mid-decode with the cache kept: every sequence stays running on its block
    table, the next step is the failed one again (same chunks, same blocks), only its tokens
    count as recomputed, and every stream ends with its fault-free text."""
    prompts = PROMPTS[:3]
    expected = _fault_free(prompts, 12)
    h = create_scheduler(num_blocks=64, block_size=BLOCK, recovery="resume")
    cache = SlotCache()
    streams = [h.add(p, max_tokens=12) for p in prompts]
    for _ in range(4):
        _step(h, cache)
    tables = {seq.seq_id: (seq.block_table, seq.num_computed) for seq in h.core.running}
    failed = h.start_step()
    assert failed is not None
    outcome = h.executor_down(RuntimeError("killed"), "crash", keep_kv=True)
    assert outcome.kv_kept and outcome.resumed == 3 and outcome.blocks_freed == 0
    assert {seq.seq_id: (seq.block_table, seq.num_computed) for seq in h.core.running} == tables
    again = h.start_step()
    assert again is not None and again.chunks == failed.chunks
    cache.run(h, again)
    h.finish_step()
    while _step(h, cache):
        pass
    assert [drain(s) for s in streams] == [(t, "length", None) for t in expected]
    stats = h.core.stats()
    assert stats.resume_recomputed_tokens == failed.num_tokens == outcome.recompute_tokens
    assert stats.resume_reused_tokens == sum(n for _, n in tables.values())
    assert h.allocator.used_blocks == 0


def test_the_failed_steps_fresh_blocks_are_zeroed_by_the_next_step() -> None:
    """Blocks a failed step was handed out for the first time (to be zeroed in it) are zeroed
    by the step after the failure when the cache is kept: the dead worker may never have."""
    h = create_scheduler(num_blocks=64, block_size=BLOCK, recovery="resume")
    h.add("a longer prompt than that", max_tokens=4)
    failed = h.start_step()
    assert failed is not None and failed.zero_blocks
    h.executor_down(RuntimeError("killed"), "crash", keep_kv=True)
    again = h.start_step()
    assert again is not None and set(failed.zero_blocks) <= set(again.zero_blocks)


def test_the_prefix_cache_outlives_a_kept_failure_and_not_a_dropped_one() -> None:
    """A finished request's blocks stay in the prefix cache through a kept failure: the same
    prompt afterwards shares them; after a dropped one it computes them again."""
    for keep, hit in ((True, True), (False, False)):
        h = create_scheduler(num_blocks=64, block_size=BLOCK, recovery="resume")
        h.add(PROMPTS[1], max_tokens=2)
        h.run_until_idle()
        h.add("zz", max_tokens=8)
        h.step()
        h.start_step()
        h.executor_down(RuntimeError("killed"), "crash", keep_kv=keep)
        before = h.core.stats().prefix_cached_tokens
        h.add(PROMPTS[1], max_tokens=2)
        h.run_until_idle()
        assert (h.core.stats().prefix_cached_tokens > before) is hit
        h.check()


def test_two_failures_in_a_row_restart_the_suspects_and_reuse_the_prefix_cache() -> None:
    """The same sequences in two failed steps in a row are suspects: they restart (isolation
    runs them alone) even with the cache kept, and their full blocks come back from the prefix
    cache: reused, not recomputed."""
    (expected,) = _fault_free([PROMPTS[1]], 12)
    h = create_scheduler(num_blocks=64, block_size=BLOCK, recovery="resume")
    cache, rng = SlotCache(), random.Random(0)
    stream = h.add(PROMPTS[1], max_tokens=12)
    for _ in range(4):
        _step(h, cache)
    _fail(h, cache, True, rng)
    _fail(h, cache, True, rng)
    assert not h.core.running  # restarted: it waits to be readmitted alone
    while _step(h, cache):
        pass
    assert drain(stream) == (expected, "length", None)
    stats = h.core.stats()
    assert stats.resume_reused_tokens >= 6 * BLOCK  # its full blocks, from the prefix cache


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.sampled_from(PROMPTS), min_size=1, max_size=5),
    max_tokens=st.integers(1, 14),
    failures=st.lists(
        st.tuples(st.integers(0, 6), st.booleans(), st.integers(0, 2**16)), max_size=4
    ),
    budget=st.sampled_from([8, 16, 64]),
    blocks=st.sampled_from([24, 64]),
)
def test_kept_or_dropped_every_context_is_intact_and_every_text_exact(
    prompts: list[str],
    max_tokens: int,
    failures: list[tuple[int, bool, int]],
    budget: int,
    blocks: int,
) -> None:
    """Whatever the prompts, the token budget, the blocks (preemption included), and failures
    at any step that keep or drop the cache after writing an arbitrary part of their work:
    every chunk's context holds exactly its sequence's tokens, every stream ends with its
    fault-free text, the invariants hold and every block is free at the end. With only kept
    failures (each after a clean step), the tokens recomputed are exactly the failed steps'
    tokens."""
    expected = _fault_free(prompts, max_tokens)
    h = create_scheduler(
        num_blocks=blocks,
        block_size=BLOCK,
        max_num_batched_tokens=budget,
        recovery="resume",
        max_resumes=100,
    )
    cache = SlotCache()
    streams = [h.add(p, max_tokens=max_tokens) for p in prompts]
    all_kept, redo = True, 0
    for clean, keep, seed in failures:
        for _ in range(clean):
            _step(h, cache)
        if not _step(h, cache):  # at least one clean step between failures: no suspects
            break
        if h.core.idle:
            break
        batch = h.start_step()
        assert batch is not None
        redo += batch.num_tokens  # its sequences all resume (none is a suspect)
        cache.run(h, batch, random.Random(seed))
        h.executor_down(RuntimeError("killed"), "crash", keep_kv=keep)
        if not keep:
            cache.slots.clear()
        all_kept &= keep
        h.check()
    while _step(h, cache):
        h.check()
    assert [drain(s) for s in streams] == [(t, "length", None) for t in expected]
    assert h.allocator.used_blocks == 0 and h.core.idle
    if all_kept:
        assert h.core.stats().resume_recomputed_tokens == redo
