"""The scheduler's core without a model: planning, preemption, prefix skip, fencing, failures.

Every test drives a real :class:`~stoic.scheduler.SchedulerCore` (and the
:class:`~stoic.scheduler.BlockAllocator` it owns) through
:func:`stoic.actors.testing.create_scheduler`, with fabricated step outputs. They run in
seconds.
"""

from __future__ import annotations

import pytest

from stoic.actors.testing import EOS_ID, create_scheduler, drain
from stoic.errors import EngineFailed, EngineStopped, ExecutorFailed
from stoic.request import SamplingParams, StepOutput


def test_a_request_runs_to_max_tokens_and_frees_its_blocks() -> None:
    """A sequence prefills, decodes ``max_tokens`` tokens, finishes with ``length``, and every
    block is free once the core is idle."""
    h = create_scheduler(num_blocks=16, block_size=4)
    stream = h.add("hello", max_tokens=5)
    steps = h.run_until_idle()
    h.check()
    assert steps == 5  # one prefill step (which samples) and four decodes
    assert h.allocator.used_blocks == 0
    text, finish, error = drain(stream)
    assert (text, finish, error) == ("fghij", "length", None)


def test_the_step_budget_is_respected_and_long_prompts_are_chunked() -> None:
    """No step carries more tokens than the budget; a long prompt is prefilled in chunks and
    samples only after its last chunk."""
    h = create_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=8)
    h.add("x" * 21, max_tokens=2)
    h.add("y" * 5, max_tokens=2)
    h.run_until_idle()
    h.check()
    assert all(b.num_tokens <= 8 for b in h.batches)
    first = [c for b in h.batches for c in b.chunks if c.seq_id == 0]
    assert [len(c.token_ids) for c in first][:3] == [8, 8, 5]
    assert [c.sample for c in first][:3] == [False, False, True]


def test_the_youngest_running_sequence_is_preempted_first() -> None:
    """When blocks run out, the most recently admitted running sequence gives its blocks back
    and goes to the front of the waiting queue; the oldest keeps running."""
    h = create_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    old = h.add("a" * 7, max_tokens=9)
    young = h.add("b" * 7, max_tokens=9)
    h.step()  # both prefilled: 2 blocks each
    assert [s.request_id for s in h.core.running] == ["req-0", "req-1"]
    while not h.core.waiting:
        h.step()
        h.check()
    assert [s.request_id for s in h.core.running] == ["req-0"]
    assert [s.request_id for s in h.core.waiting] == ["req-1"]
    assert h.core.stats().preemptions == 1
    h.run_until_idle()
    h.check()
    assert drain(old)[1] == "length"
    # the preempted sequence was recomputed and still produced its whole output
    text, finish, _ = drain(young)
    assert (len(text), finish) == (9, "length")


def test_a_shared_prefix_is_served_from_the_cache() -> None:
    """A second request with the same prompt shares the first one's full blocks: its first
    chunk starts after them, and ``cached_tokens`` says how many prompt tokens were skipped."""
    h = create_scheduler(num_blocks=32, block_size=4)
    prompt = "the same prompt, twice"  # 22 tokens: 5 full blocks
    first = h.add(prompt, max_tokens=3)
    h.run_until_idle()
    second = h.add(prompt, max_tokens=3)
    h.step()
    chunk = h.batches[-1].chunks[0]
    assert chunk.start_pos == 20
    assert chunk.token_ids == tuple(prompt.encode()[20:])
    assert second.cached_tokens == 20
    h.run_until_idle()
    h.check()
    assert drain(first)[0] == drain(second)[0]


def test_the_last_prompt_token_is_always_computed() -> None:
    """A prompt that is whole blocks long still computes its last token (its logits give the
    first sample): its last block is not shared even though it is cached, so that block is
    computed again."""
    h = create_scheduler(num_blocks=32, block_size=4)
    h.add("abcdefgh", max_tokens=2)
    h.run_until_idle()
    h.add("abcdefgh", max_tokens=2)
    h.step()
    chunk = h.batches[-1].chunks[0]
    assert (chunk.start_pos, chunk.token_ids, chunk.sample) == (4, tuple(b"efgh"), True)


def test_a_result_from_a_fenced_incarnation_changes_nothing() -> None:
    """After the executor went down, its late result is dropped and counted; the sequences it
    would have advanced were already failed with their partial output."""
    h = create_scheduler()
    stream = h.add("hello", max_tokens=8)
    h.step()
    batch = h.start_step()
    assert batch is not None and h.inflight is not None
    step_id, incarnation, _ = h.inflight
    assert h.executor_down(RuntimeError("boom")).failed == 1
    before = h.core.stats()
    assert h.core.complete(step_id, incarnation, h.output_for(batch)) is None
    after = h.core.stats()
    assert after.fenced_results == before.fenced_results + 1
    assert after._replace(fenced_results=0) == before._replace(fenced_results=0)
    _, _, error = drain(stream)
    assert isinstance(error, ExecutorFailed)
    assert error.partial is not None and error.partial.token_ids == (ord("f"),)
    h.check()


def test_a_continued_sequence_counts_its_generated_tokens_but_streams_only_new_ones() -> None:
    """A request continued after ``generated`` tokens: its context is prefilled with them, its
    chunks count them (``num_generated``, the seed's position; ``output_ids``, the penalties'),
    they count toward ``max_tokens``, and its stream and an executor failure's partial output
    carry only the tokens generated after them; a continuation not yet stepped stays queued
    through an executor failure, as a fresh request does."""
    h = create_scheduler(max_num_seqs=1)
    penalised = SamplingParams(max_tokens=5, presence_penalty=0.5)
    stream = h.add("hello", 5, penalised, generated=tuple(b"fg"))
    queued = h.add("world", 5, generated=tuple(b"fg"))
    h.step()
    chunk = h.batches[-1].chunks[0]
    assert chunk.token_ids == tuple(b"hellofg") and chunk.sample
    assert (chunk.num_generated, chunk.output_ids) == (2, tuple(b"fg"))
    h.step()
    assert h.batches[-1].chunks[0].num_generated == 3
    h.executor_down(RuntimeError("boom"))
    error = drain(stream)[2]
    assert isinstance(error, ExecutorFailed) and error.partial is not None
    assert (error.partial.token_ids, error.partial.text) == (tuple(b"hi"), "hi")
    assert not queued.done
    h.run_until_idle()
    h.check()
    assert drain(queued) == ("hij", "length", None)
    assert queued.prompt_tokens == 5


def test_a_result_for_another_step_is_fenced() -> None:
    """A result whose step id is not the one in flight is dropped."""
    h = create_scheduler()
    h.add("hello", max_tokens=8)
    batch = h.start_step()
    assert batch is not None and h.inflight is not None
    step_id, incarnation, _ = h.inflight
    assert h.core.complete(step_id + 1, incarnation, StepOutput({})) is None
    assert h.core.stats().fenced_results == 1
    assert h.core.inflight_step == step_id


def test_an_oom_while_prefilling_is_not_retryable_for_that_request() -> None:
    """An out-of-memory failure marks the sequences that were prefilling in the failed step not
    retryable (the same request would fail again); the decoding ones stay retryable."""
    h = create_scheduler(max_num_batched_tokens=64)
    decoding = h.add("short", max_tokens=8)
    h.step()
    prefilling = h.add("a much longer prompt", max_tokens=8)
    h.start_step()
    h.executor_down(RuntimeError("CUDA out of memory"), "oom")
    errors = [drain(s)[2] for s in (decoding, prefilling)]
    assert all(isinstance(e, ExecutorFailed) for e in errors)
    assert [e.retryable for e in errors if isinstance(e, ExecutorFailed)] == [True, False]


def test_an_executor_failure_keeps_requests_that_had_not_started() -> None:
    """Sequences that had started fail with their partial; those still waiting for their first
    step lost nothing: they stay queued and run to completion once the executor is back."""
    h = create_scheduler(max_num_seqs=1)
    started = h.add("hello", max_tokens=4)
    queued = h.add("world", max_tokens=4)
    h.step()
    assert [s.request_id for s in h.core.waiting] == ["req-1"]
    assert h.executor_down(RuntimeError("boom")).failed == 1
    h.check()
    assert isinstance(drain(started)[2], ExecutorFailed)
    assert not queued.done
    h.run_until_idle()
    h.check()
    assert drain(queued) == ("fghi", "length", None)


def test_a_failed_engine_ends_everything_and_admits_nothing() -> None:
    """``fail_engine`` ends every sequence with EngineFailed and its partial, frees its blocks,
    refuses new sequences at once and stops stepping."""
    h = create_scheduler()
    running = h.add("hello", max_tokens=8)
    h.step()
    assert h.core.fail_engine("hung step") == 1
    h.check()
    assert h.allocator.used_blocks == 0
    late = h.add("late", max_tokens=2)
    assert h.core.schedule() is None
    for stream in (running, late):
        assert isinstance(drain(stream)[2], EngineFailed)


def test_stop_ends_everything_with_engine_stopped() -> None:
    """A drain deadline (``stop``) ends every sequence with EngineStopped and refuses new ones."""
    h = create_scheduler()
    stream = h.add("hello", max_tokens=8)
    h.step()
    assert h.core.stop() == 1
    h.check()
    assert isinstance(drain(stream)[2], EngineStopped)
    assert isinstance(drain(h.add("x"))[2], EngineStopped)


def test_abort_while_a_step_runs_discards_its_token() -> None:
    """An abort while the sequence's step is in flight finishes the stream with ``abort`` and
    frees its blocks at once; the step's token for it is discarded."""
    h = create_scheduler()
    stream = h.add("hello", max_tokens=8)
    other = h.add("world", max_tokens=3)
    h.start_step()
    assert h.core.abort("req-0") is not None
    assert h.held_blocks() == set(h.core.running[0].block_table)
    h.finish_step()
    h.run_until_idle()
    h.check()
    assert drain(stream) == ("", "abort", None)
    assert drain(other)[1] == "length"


def test_eos_and_stop_strings_end_a_sequence() -> None:
    """EOS ends a sequence with ``stop`` (not in the text); a stop string is cut from the text."""
    h = create_scheduler()
    eos = h.add("hi", max_tokens=8)
    h.run_until_idle(sample=lambda c: EOS_ID)
    assert drain(eos) == ("", "stop", None)
    stopped = h.add("hi", params=SamplingParams(max_tokens=8, stop=("de",)), max_tokens=8)
    h.run_until_idle()  # samples c, d, e, ...: "cde" -> cut at "de"
    assert drain(stopped) == ("c", "stop", None)
    h.check()


def test_a_readmitted_sequence_sharing_its_own_cached_prefix_does_not_stall() -> None:
    """A preempted sequence's committed blocks stay cached; when it is readmitted it shares all
    of them and its chunk starts after them; both sequences finish (found by the property test
    below, when the core planned on an estimate of the free blocks: it once counted those
    blocks as free for another sequence, and no step could start)."""
    h = create_scheduler(num_blocks=11, block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    long = h.add("abce" * 5 + "ab", max_tokens=12)
    short = h.add("ab", max_tokens=12)
    h.run_until_idle()
    h.check()
    assert h.core.stats().preemptions >= 1
    assert [drain(s)[1] for s in (long, short)] == ["length", "length"]


def test_a_cached_prefix_is_not_charged_to_the_step_budget() -> None:
    """A request whose 20-token prefix is cached is charged for its 3 new tokens only: it
    prefills and samples in its first step, next to a decoding sequence and a third request
    that gets the rest of the budget (charged for all 23, it used to compute nothing in that
    step: its chunk was all cached)."""
    h = create_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=8)
    prompt = "the same prompt, twice"  # 22 tokens: 5 full blocks
    first = h.add(prompt, max_tokens=3)
    h.run_until_idle()
    h.add("decoding", max_tokens=20)
    h.step()  # its prompt: it decodes from now on
    second = h.add(prompt + "!", max_tokens=3)
    third = h.add("x" * 30, max_tokens=2)
    batch = h.step()
    assert batch is not None
    by_seq = {c.seq_id: c for c in batch.chunks}
    assert len(by_seq) == 3 and batch.num_tokens == 8
    shared = by_seq[2]
    assert (shared.start_pos, len(shared.token_ids), shared.sample) == (20, 3, True)
    assert len(by_seq[3].token_ids) == 8 - 1 - 3
    assert second.cached_tokens == 20
    h.run_until_idle()
    h.check()
    assert drain(first)[1] == "length"
    text, finish, _ = drain(second)
    assert (len(text), finish) == (3, "length")
    assert drain(third)[1] == "length"


def test_a_prefix_evicted_since_it_was_cached_is_computed_within_the_budget() -> None:
    """A prefix whose blocks were evicted since it was cached is looked up on the true state:
    nothing is shared, the request is charged for its whole prompt, every step carries at most
    the budget, and the output is unchanged."""
    h = create_scheduler(num_blocks=9, block_size=4, max_num_batched_tokens=8, max_num_seqs=2)
    prompt = "the same prompt, twice"
    first = h.add(prompt, max_tokens=3)
    h.run_until_idle()
    h.add("y" * 33, max_tokens=2)  # 9 blocks: every cached block is evicted for it
    h.run_until_idle()
    h.add("decoding", max_tokens=12)
    h.step()
    second = h.add(prompt, max_tokens=3)
    before = len(h.batches)
    h.run_until_idle()
    h.check()
    assert second.cached_tokens == 0  # nothing was shared: the blocks were evicted
    assert all(b.num_tokens <= 8 for b in h.batches[before:])
    first_chunk = next(c for b in h.batches[before:] for c in b.chunks if c.seq_id == 3)
    assert first_chunk.start_pos == 0 and not first_chunk.sample
    assert drain(second)[0] == drain(first)[0]


def test_a_shared_prefix_held_by_running_sequences_is_admitted_as_before() -> None:
    """A request whose prefix blocks running sequences hold is admitted as soon as its own
    blocks fit: the shared blocks cost nothing from the free pool (found in review, when the
    core planned on an estimate: it waited 23 steps, until a holder finished)."""

    def decoding(k: int) -> bool:
        return len(h.core.running) == k and all(s.num_generated >= 1 for s in h.core.running)

    h = create_scheduler(num_blocks=17, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    prefix = "p" * 24
    h.add(prefix + "XYZXY", max_tokens=20)
    while not decoding(1):
        h.step()
    h.add(prefix + "ZZZZZ", max_tokens=20)
    while not decoding(2):
        h.step()
    assert h.allocator.free_blocks == 7
    h.add(prefix + "YYYYY", max_tokens=2)
    h.step()
    h.step()
    assert any(c.seq_id == 2 for b in h.batches[-2:] for c in b.chunks)
    h.run_until_idle()
    h.check()


def test_blocks_committed_by_the_last_step_are_shared_by_the_next_plan() -> None:
    """The prefix lookup reads the allocator the step's completion committed to: a request
    arriving while another with the same prompt still decodes shares its blocks in the very
    next step, and the step carries only its uncached tokens."""
    h = create_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=32)
    prompt = "s" * 20 + "tail"  # 24 tokens: 5 blocks may be shared
    first = h.add(prompt, max_tokens=6)
    h.step()  # prefill: its six full blocks are committed on completion
    assert h.allocator.cached_blocks == 6
    second = h.add(prompt, max_tokens=6)
    batch = h.step()
    assert batch is not None
    by_seq = {c.seq_id: c for c in batch.chunks}
    assert (by_seq[1].start_pos, len(by_seq[1].token_ids)) == (20, 4)
    assert set(h.core.running[1].block_table[:5]) == set(h.core.running[0].block_table[:5])
    assert second.cached_tokens == 20 and h.core.stats().prefix_cached_tokens == 20
    h.run_until_idle()
    h.check()
    assert drain(first)[0] == drain(second)[0]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_outputs_do_not_depend_on_the_token_budget(prefix_caching: bool) -> None:
    """With deterministic samples, each request's output is the same whether it ran alone with a
    big budget or with others under a tiny budget and tight KV (chunking, preemption)."""

    def run(budget: int, num_blocks: int) -> list[str]:
        h = create_scheduler(
            num_blocks=num_blocks,
            block_size=4,
            max_num_seqs=4,
            max_num_batched_tokens=budget,
            prefix_caching=prefix_caching,
        )
        streams = [h.add(f"prompt number {i}!" * (i + 1), max_tokens=6 + i) for i in range(6)]
        h.run_until_idle()
        h.check()
        return [drain(s)[0] for s in streams]

    # the longest request needs 29 blocks: 32 leave room for little else
    assert run(budget=8, num_blocks=32) == run(budget=512, num_blocks=256)
