"""Resume, poison isolation and the out-of-memory back-off, in the scheduler's core without a model.

The fabricated sampler (:func:`stoic.actors.testing.next_letter`) makes each token a function of
its position, so a fault-free run's text is known and a resumed one must equal it.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stoic.actors.testing import SchedulerHarness, create_scheduler, drain
from stoic.errors import EngineFailed, ExecutorFailed
from stoic.scheduler import CLEAN_STEPS_PER_DOUBLING

PROMPTS = ["hello there", "a longer prompt than that", "abcd", "XYZZY poison", "zz"]


def _fault_free(prompts: list[str], max_tokens: int) -> list[str]:
    h = create_scheduler(num_blocks=64, block_size=4)
    streams = [h.add(p, max_tokens=max_tokens) for p in prompts]
    h.run_until_idle()
    return [drain(s)[0] for s in streams]


def _fail_inflight(h: SchedulerHarness, kind: str = "error") -> None:
    batch = h.start_step()
    assert batch is not None
    h.executor_down(RuntimeError("injected"), kind)
    h.check()


def test_resumed_streams_continue_exactly_where_they_stopped() -> None:
    """Under ``"resume"``, executor failures mid-prefill and mid-decode end no stream: each
    continues with exactly its fault-free text, no token lost or repeated, and every block is
    free at the end."""
    prompts = PROMPTS[:3]
    expected = _fault_free(prompts, 12)
    h = create_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=64, recovery="resume")
    streams = [h.add(p, max_tokens=12) for p in prompts]
    _fail_inflight(h)  # during the first prefill
    for _ in range(4):
        h.step()
    _fail_inflight(h, "oom")  # mid-decode
    h.run_until_idle()
    h.check()
    assert [drain(s) for s in streams] == [(t, "length", None) for t in expected]
    stats = h.core.stats()
    assert stats.requests_resumed == 6 and stats.failed_sequences == 0
    assert h.allocator.used_blocks == 0


def test_a_spent_resume_budget_ends_the_request_with_its_partial() -> None:
    """A sequence resumed ``max_resumes`` times fails on the next executor failure with the
    error and the text it had, a prefix of its fault-free text."""
    (expected,) = _fault_free(["hello there"], 12)
    h = create_scheduler(recovery="resume", max_resumes=1)
    stream = h.add("hello there", max_tokens=12)
    h.step()
    _fail_inflight(h)
    h.step()
    _fail_inflight(h)
    h.check()
    _, _, error = drain(stream)
    assert isinstance(error, ExecutorFailed) and error.partial is not None
    assert error.partial.text == "lm" and expected.startswith("lm")
    assert h.core.stats().resumes_exhausted == 1
    assert h.allocator.used_blocks == 0 and h.core.idle


def _run_with_poison(
    h: SchedulerHarness, poison: str, limit: int = 500, *, keep_kv: bool = False
) -> int:
    """Step until idle, failing (``error``) every step whose batch holds a prompt with
    ``poison`` (the KV cache kept through each failure with ``keep_kv``); returns the
    failures."""
    failures = 0
    for _ in range(limit):
        if h.core.idle:
            return failures
        batch = h.start_step()
        assert batch is not None, "work remains but no step could start"
        if any(poison in prompt for prompt in h.core.inflight_prompts()):
            h.executor_down(RuntimeError("poisoned"), "error", keep_kv=keep_kv)
            failures += 1
        else:
            h.finish_step()
        h.check()
    raise AssertionError("not idle")


@pytest.mark.parametrize("keep_kv", [False, True])
@pytest.mark.parametrize("poison_last", [False, True])
def test_a_poison_request_is_isolated_and_every_other_completes(
    keep_kv: bool, poison_last: bool
) -> None:
    """A request that fails every step it is in ends alone, with the error and its partial;
    the others batched with it complete with their fault-free text, whether the KV cache is
    dropped or kept through the failures, and whether the poison is probed before others or
    last (its end ends the isolation, which releases what it held back). Isolation costs few
    failures (within the default restart intensity of 5)."""
    prompts = [*PROMPTS[:3], "XYZZY poison", *PROMPTS[4:], "more text here"]
    if poison_last:
        prompts.append(prompts.pop(3))
    expected = _fault_free(prompts, 10)
    h = create_scheduler(num_blocks=64, block_size=4, recovery="resume")
    streams = [h.add(p, max_tokens=10) for p in prompts]
    for _ in range(3):  # everyone decoding, the poison too (the fault arrives later)
        h.step()
    failures = _run_with_poison(h, "XYZZY", keep_kv=keep_kv)
    assert failures <= 4
    results = [drain(s) for s in streams]
    for prompt, (text, finish, error), want in zip(prompts, results, expected, strict=True):
        if "XYZZY" in prompt:
            assert isinstance(error, ExecutorFailed) and not error.retryable
            assert "isolated" in str(error) and want.startswith(text)
        else:
            assert (text, finish, error) == (want, "length", None)
    stats = h.core.stats()
    assert stats.requests_isolated == 1 and stats.failed_sequences == 1
    assert h.allocator.used_blocks == 0


def test_isolation_failures_are_charged_to_the_suspect_not_the_engine() -> None:
    """The failures that make the poison request a suspect (steps with everyone in them) count
    toward the engine's restart intensity; its two failures alone (isolation probes) are
    charged to it instead (``Recovered.charged`` is False), so isolating it costs the engine
    two failures whatever failed before."""
    prompts = [*PROMPTS[:3], "XYZZY poison", "more text here"]
    h = create_scheduler(num_blocks=64, block_size=4, recovery="resume")
    streams = [h.add(p, max_tokens=10) for p in prompts]
    h.step()
    charged: list[bool] = []
    while not h.core.idle:
        assert h.start_step() is not None
        if any("XYZZY" in prompt for prompt in h.core.inflight_prompts()):
            charged.append(h.executor_down(RuntimeError("poisoned"), "error").charged)
        else:
            h.finish_step()
        h.check()
    assert charged == [True, True, False, False]
    assert [drain(s)[2] is None for s in streams] == [True, True, True, False, True]
    stats = h.core.stats()
    assert stats.requests_isolated == 1 and stats.isolation_failures == 2


def test_a_step_failing_whatever_it_holds_is_charged_after_two_probe_failures() -> None:
    """A worker that fails every step (a crash loop, not a poison request) makes no clean step:
    after two failures charged to suspects every failure counts again, so the restart
    intensity still stops it. A failure with no step in flight counts too."""
    h = create_scheduler(
        num_blocks=64, block_size=4, max_num_batched_tokens=64, recovery="resume", max_resumes=10
    )
    for p in PROMPTS[:4]:
        h.add(p, max_tokens=10)
    charged: list[bool] = []
    while not h.core.idle:
        assert h.start_step() is not None
        charged.append(h.executor_down(RuntimeError("broken"), "error").charged)
    # the batch twice (everyone a suspect), the first probe twice (charged to it, isolated),
    # then each further probe twice, charged to the engine
    assert charged == [True, True, False, False, True, True, True, True, True, True]
    assert h.core.stats().isolation_failures == 2
    assert h.executor_down(RuntimeError("idle")).charged  # nothing in flight


def test_the_last_failure_fails_the_engine_only_if_charged_to_it() -> None:
    """``final_if_charged`` (counted, the failure exceeds the restart intensity) fails the
    engine only for a failure charged to it: an isolation probe's failure recovers and the
    poison request is isolated; the next failure without a clean step in between is charged
    and fails the engine, every sequence ending with ``EngineFailed``."""
    h = create_scheduler(num_blocks=64, block_size=4, recovery="resume")
    poison, other = h.add("XYZZY", max_tokens=6), h.add("hello", max_tokens=6)
    h.step()
    _fail_inflight(h)
    _fail_inflight(h)  # both suspects; the poison runs alone first
    for _ in range(2):
        assert h.start_step() is not None and h.core.inflight_prompts() == ["XYZZY"]
        outcome = h.executor_down(RuntimeError("poisoned"), final_if_charged="over")
        assert not outcome.charged and h.core.failed is None
    assert isinstance(drain(poison)[2], ExecutorFailed) and not other.done
    assert h.start_step() is not None and h.core.inflight_prompts() == ["hello"]
    outcome = h.executor_down(RuntimeError("again"), final_if_charged="over")
    assert outcome.charged and h.core.failed == "over"
    assert isinstance(drain(other)[2], EngineFailed)


def test_requests_arriving_during_an_isolation_wait_and_then_complete() -> None:
    """While a suspect runs alone, new requests are held back (a failing step must not be
    blamed on them) and run once it is over."""
    h = create_scheduler(num_blocks=64, block_size=4, recovery="resume")
    poison = h.add("XYZZY", max_tokens=6)
    other = h.add("hello", max_tokens=6)
    h.step()
    _fail_inflight(h)
    _fail_inflight(h)  # both failed twice in a row: suspects
    late = h.add("late one", max_tokens=6)
    batch = h.start_step()
    assert batch is not None and [c.seq_id for c in batch.chunks] == [0]  # the poison, alone
    h.executor_down(RuntimeError("poisoned"), "error")
    _run_with_poison(h, "XYZZY")
    assert isinstance(drain(poison)[2], ExecutorFailed)
    assert drain(other)[2] is None and drain(late)[2] is None


def test_an_aborted_suspect_ends_the_isolation_cleanly() -> None:
    """Aborting the suspect under test moves on to the next one (or ends the isolation): no
    sequence is stranded in the held-back queue."""
    h = create_scheduler(num_blocks=64, block_size=4, recovery="resume")
    a = h.add("first", max_tokens=6)
    b = h.add("second", max_tokens=6)
    h.step()
    _fail_inflight(h)
    _fail_inflight(h)
    h.core.abort(a.request_id)
    h.check()
    h.run_until_idle()
    h.check()
    assert drain(a)[1] == "abort" and drain(b)[2] is None and h.core.idle


def test_an_oom_halves_the_step_budget_and_clean_steps_restore_it() -> None:
    """After an out-of-memory failure the token budget and the running cap halve (floors: one
    block, one sequence); every CLEAN_STEPS_PER_DOUBLING clean steps they double back."""
    h = create_scheduler(max_num_seqs=8, max_num_batched_tokens=32, block_size=4)
    budget = h.core.budget
    for want in [(16, 4), (8, 2), (4, 1), (4, 1)]:
        h.add("hello", max_tokens=1)
        _fail_inflight(h, "oom")
        assert (budget.tokens, budget.seqs) == want
        assert h.core.stats().token_budget == want[0]
    h.add("x" * 30, max_tokens=500)
    while budget.tokens < 32:
        before = budget.tokens
        for _ in range(CLEAN_STEPS_PER_DOUBLING):
            assert h.step() is not None
            assert h.batches[-1].num_tokens <= before
        assert budget.tokens == min(32, before * 2)
    assert budget.seqs == 8


def test_other_failures_leave_the_budget_alone() -> None:
    """Only an out-of-memory failure backs the budget off."""
    h = create_scheduler()
    h.add("hello", max_tokens=4)
    _fail_inflight(h, "error")
    assert h.core.budget.tokens == 32


@given(
    failures=st.lists(st.integers(1, 8), max_size=6),
    kinds=st.lists(st.sampled_from(["error", "oom"]), min_size=6, max_size=6),
)
def test_random_failures_never_change_a_resumed_text(failures: list[int], kinds: list[str]) -> None:
    """Whatever steps fail (and however the budget backs off), with enough resumes every
    stream ends with exactly its fault-free text and no block is left. (At least one clean
    step between failures: a sequence that fails twice in a row alone is taken for a poison.)"""
    prompts = PROMPTS
    expected = _fault_free(prompts, 9)
    h = create_scheduler(
        num_blocks=24, block_size=4, max_num_batched_tokens=16, recovery="resume", max_resumes=10
    )
    streams = [h.add(p, max_tokens=9) for p in prompts]
    for gap, kind in zip(failures, kinds, strict=False):
        for _ in range(gap):
            if h.core.idle:
                break
            h.step()
        if not h.core.idle:
            _fail_inflight(h, kind)
    h.run_until_idle()
    h.check()
    assert [drain(s) for s in streams] == [(t, "length", None) for t in expected]
    assert h.allocator.used_blocks == 0
