"""Overload in the pure scheduler core: fair shares between tenants, priorities, deadlines and
the admission estimate (issue 47), as properties over random workloads (hypothesis) and as
examples.

Each test drives a real :class:`~stoic.scheduler.SchedulerCore` through
:func:`stoic.actors.testing.create_scheduler` with fabricated step outputs and, where time
matters, a clock of its own.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stoic.actors.testing import SchedulerHarness, create_scheduler, drain
from stoic.scheduler import MIN_STEPS, LoadMeter, TenantPolicy, TenantShares


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _tenant_tokens(h: SchedulerHarness, tenant_of: dict[int, str], since: int) -> Counter[str]:
    tokens: Counter[str] = Counter()
    for batch in h.batches[since:]:
        for chunk in batch.chunks:
            tokens[tenant_of[chunk.seq_id]] += len(chunk.token_ids)
    return tokens


def _seq_ids(h: SchedulerHarness) -> dict[int, str]:
    return {s.seq_id: s.tenant for s in (*h.core.running, *h.core.waiting)}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    weights=st.tuples(st.integers(1, 4), st.integers(1, 4)),
    prompt=st.integers(20, 50),
)
def test_shares_converge_to_the_weights(weights: tuple[int, int], prompt: int) -> None:
    """Two tenants that always have work the budget can take get step tokens in the ratio of
    their weights (within 10% over 250 steps), whatever their prompts: neither's backlog
    decides. (Where one cannot use its share, say all the slots are taken, the other gets the
    rest: the shares are work-conserving.)"""
    policy = TenantPolicy(weights={"a": weights[0], "b": weights[1]})
    h = create_scheduler(
        num_blocks=1024,
        block_size=4,
        max_num_seqs=32,
        max_num_batched_tokens=32,
        tenants=policy,
        prefix_caching=False,  # equal prompts: every token computed
    )
    tenant_of: dict[int, str] = {}
    lengths = {"a": prompt, "b": 70 - prompt}  # different prompt lengths per tenant
    for step in range(300):
        live = Counter(s.tenant for s in (*h.core.running, *h.core.waiting))
        for tenant in ("a", "b"):
            for _ in range(10 - live[tenant]):
                h.add("x" * lengths[tenant], max_tokens=3, tenant=tenant)
        tenant_of.update(_seq_ids(h))
        if step == 50:
            since = len(h.batches)
        h.step()
    tokens = _tenant_tokens(h, tenant_of, since)
    want = weights[0] / weights[1]
    assert tokens["a"] / tokens["b"] == pytest.approx(want, rel=0.1)
    h.check()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arrival=st.integers(0, 80), flood_prompt=st.integers(20, 90), light_prompt=st.integers(1, 40)
)
def test_no_tenant_starves_behind_a_flood(
    arrival: int, flood_prompt: int, light_prompt: int
) -> None:
    """A tenant's one request starts within a few steps however deep another tenant's queue is
    (first come, first served would make it wait for the whole flood: 40 requests)."""
    h = create_scheduler(num_blocks=1024, block_size=4, max_num_seqs=8, max_num_batched_tokens=32)
    for _ in range(40):
        h.add("f" * flood_prompt, max_tokens=4, tenant="flood")
    light = None
    for step in range(200):
        if step == arrival:
            light = h.add("l" * light_prompt, max_tokens=2, tenant="light")
            seq_id = next(s.seq_id for s in h.core.waiting if s.tenant == "light")
        batch = h.step()
        if (
            light is not None
            and batch is not None
            and any(c.seq_id == seq_id for c in batch.chunks)
        ):
            # slots free every few steps (4 tokens each); then it goes first
            assert step - arrival <= 8, f"started {step - arrival} steps after it arrived"
            break
    else:
        pytest.fail("the light tenant's request never started")
    h.check()


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(-3, 3), st.integers(1, 20), st.sampled_from("ab")),
        st.tuples(st.just("step")),
    ),
    max_size=60,
)


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_OPS, num_blocks=st.integers(6, 40), max_num_seqs=st.integers(1, 4))
def test_priorities_order_admission_within_a_tenant(
    ops: list[tuple[object, ...]], num_blocks: int, max_num_seqs: int
) -> None:
    """A sequence starts only when no waiting sequence of its tenant has a better (lower)
    priority, whatever the arrivals, blocks and slots; every sequence still ends."""
    h = create_scheduler(
        num_blocks=num_blocks, block_size=4, max_num_seqs=max_num_seqs, max_num_batched_tokens=16
    )
    for op in [*ops, *[("step",)] * 400]:
        if op[0] == "add":
            _, priority, length, tenant = op
            assert isinstance(priority, int) and isinstance(length, int)
            h.add("p" * length, max_tokens=3, priority=priority, tenant=str(tenant))
            continue
        before = {s.seq_id for s in h.core.running}
        h.start_step()
        started = [s for s in h.core.running if s.seq_id not in before]
        for seq in started:
            left = [w.priority for w in h.core.waiting if w.tenant == seq.tenant]
            assert seq.priority <= min(left, default=seq.priority)
        h.finish_step()
        h.check()
    assert h.core.idle
    assert all(drain(s)[1] == "length" for s in h.streams)


def test_a_better_priority_preempts_a_worse_one_of_its_tenant_only() -> None:
    """With the blocks taken, a waiting request preempts a running one of its own tenant with
    a worse priority, never another tenant's, nor one of a better or equal priority."""
    h = create_scheduler(num_blocks=10, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    other = h.add("o" * 15, max_tokens=5, tenant="other", priority=9)  # 4 blocks, then 5
    low = h.add("l" * 15, max_tokens=5, tenant="t", priority=5)
    h.step()
    h.add("h" * 10, max_tokens=2, tenant="t", priority=5)  # 3 blocks: 2 free; equal: waits
    h.step()
    assert [s.request_id for s in h.core.waiting] == ["req-2"]
    assert h.core.stats().preemptions == 0
    h.add("u" * 10, max_tokens=2, tenant="t", priority=0)  # better: preempts `low`
    h.step()
    running = {s.request_id for s in h.core.running}
    assert "req-3" in running and "req-1" not in running and "req-0" in running
    assert h.core.stats().preemptions == 1
    h.run_until_idle()
    h.check()
    assert [drain(s)[1] for s in (other, low)] == ["length", "length"]


def test_a_tenant_runs_no_more_than_its_running_limit() -> None:
    """``max_running`` caps one tenant's running sequences; another tenant still gets slots."""
    policy = TenantPolicy(max_running=2)
    h = create_scheduler(num_blocks=256, max_num_seqs=8, max_num_batched_tokens=64, tenants=policy)
    for _ in range(6):
        h.add("a" * 5, max_tokens=6, tenant="a")
    h.add("b" * 5, max_tokens=6, tenant="b")
    most = 0
    while not h.core.idle:
        h.step()
        counts = Counter(s.tenant for s in h.core.running)
        most = max(most, counts["a"])
        assert counts["a"] <= 2
    assert most == 2
    assert all(drain(s)[1] == "length" for s in h.streams)


def test_a_deadline_ends_a_running_request_with_its_output_so_far() -> None:
    """A running request whose deadline passes ends with ``timeout`` and the text it had,
    the last step's token included; its blocks are free; the others go on."""
    clock = Clock()
    h = create_scheduler(num_blocks=32, clock=clock)
    late = h.add("hello", max_tokens=50, timeout=5.0)
    other = h.add("world", max_tokens=6)
    for _ in range(3):
        h.step()
    clock.now += 5.0
    h.step()  # the planning of this step ends it (before it is planned)
    text, finish, error = drain(late)
    assert (finish, error) == ("timeout", None)
    assert len(text) == 3  # three steps' tokens: the prefill's sample and two decodes
    assert h.core.stats().timed_out == 1
    assert h.core.tenant_stats()[""].timed_out == 1
    h.run_until_idle()
    h.check()
    assert drain(other)[1] == "length" and h.allocator.used_blocks == 0


def test_a_deadline_ends_a_waiting_request_with_no_output() -> None:
    """A request still queued when its deadline passes ends with ``timeout`` and no text."""
    clock = Clock()
    h = create_scheduler(num_blocks=32, max_num_seqs=1, clock=clock)
    h.add("first", max_tokens=10)
    queued = h.add("second", max_tokens=10, timeout=1.0)
    h.step()
    clock.now += 2.0
    h.step()
    assert drain(queued) == ("", "timeout", None)
    h.run_until_idle()
    h.check()


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(
                st.just("add"),
                st.integers(1, 20),
                st.one_of(st.none(), st.floats(0.5, 20.0)),
                st.sampled_from("ab"),
            ),
            st.tuples(st.just("step")),
            st.tuples(st.just("tick"), st.floats(0.1, 5.0)),
            st.tuples(st.just("abort"), st.integers(0, 30)),
        ),
        max_size=80,
    )
)
def test_an_admitted_request_ends_once_and_never_with_a_refusal(
    ops: list[tuple[object, ...]],
) -> None:
    """Whatever the arrivals, deadlines and clock: every admitted request ends exactly once
    with stop, length, abort, or timeout only once its deadline has passed; never with an
    error (a refusal follows no admission)."""
    clock = Clock()
    h = create_scheduler(num_blocks=24, max_num_seqs=3, max_num_batched_tokens=16, clock=clock)
    deadlines: list[float | None] = []
    for op in [*ops, *[("step",)] * 300]:
        match op:
            case ("add", length, timeout, tenant):
                assert isinstance(length, int)
                h.add("q" * length, max_tokens=4, timeout=timeout, tenant=str(tenant))  # type: ignore[arg-type]
                deadlines.append(None if timeout is None else clock.now + timeout)  # type: ignore[operator]
            case ("step",):
                h.step()
            case ("tick", seconds):
                clock.now += seconds  # type: ignore[operator]
            case ("abort", index):
                if isinstance(index, int) and index < len(h.streams):
                    h.core.abort(h.streams[index].request_id)
        h.check()
    assert h.core.idle
    for stream, deadline in zip(h.streams, deadlines, strict=True):
        _, finish, error = drain(stream)
        assert error is None and finish in ("stop", "length", "abort", "timeout")
        if finish == "timeout":
            assert deadline is not None and clock.now >= deadline


def test_a_tenant_back_from_idle_brings_no_credit() -> None:
    """A tenant that had no work joins at the least virtual time of those that have some: its
    idle time is not a credit to spend in a burst."""
    shares = TenantShares()
    shares.joined("busy")
    shares.charge("busy", 1000)
    shares.joined("back")
    assert shares.vtime("back") == shares.vtime("busy") == 1000
    shares.charge("back", 10)
    shares.left("back")
    shares.joined("back")  # its own (greater) time stays
    assert shares.vtime("back") == 1010


def test_weights_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        TenantPolicy(weights={"a": 0.0})
    with pytest.raises(ValueError, match="at least 1"):
        TenantPolicy(max_running=0)


def test_the_meter_fits_step_durations_to_decodes_and_prompt_tokens() -> None:
    """Step durations ``fixed + per_decode * decodes + per_prompt * prompt`` are recovered from
    the recent steps, whatever their mix; a window of decode-only steps prices a prompt token
    as a decode row; before any step the meter knows nothing."""
    meter = LoadMeter()
    assert meter.cost() is None and meter.seconds(4, 32) is None
    steps = ((32, 0), (8, 0), (31, 225), (2, 254), (16, 100), (0, 256), (20, 0)) * 3
    for n, (decodes, prompt) in enumerate(steps, 1):
        meter.step(decodes, prompt, 0.01 + 0.006 * decodes + 0.0025 * prompt)
        # a few steps are no evidence (a cold first one would be extrapolated many times over)
        assert (meter.cost() is None) == (n < MIN_STEPS)
    cost = meter.cost()
    assert cost is not None
    assert (cost.fixed, cost.per_decode, cost.per_prompt) == pytest.approx((0.01, 0.006, 0.0025))
    assert meter.seconds(32, 224) == pytest.approx(0.01 + 0.192 + 0.56)
    decode_only = LoadMeter()
    for decodes in (32, 30, 31, 32) * 4:
        decode_only.step(decodes, 0, 0.02 + 0.006 * decodes)
    assert decode_only.seconds(0, 10) == pytest.approx(0.02 + 0.06)


def test_the_wait_estimate_counts_the_queue_ahead_by_share() -> None:
    """The estimate (the wait for the first token) counts a tenant's own queue ahead of it
    (priority as good or better) in full, another tenant's only up to that tenant's share of
    the same stretch, and its own prompt; with no step measured it is 0 (no refusal without
    evidence)."""
    clock = Clock()
    h = create_scheduler(
        num_blocks=1024, block_size=4, max_num_seqs=64, max_num_batched_tokens=32, clock=clock
    )
    core = h.core
    for _ in range(10):
        h.add("a" * 64, max_tokens=4, tenant="a")
    assert core.queue_wait("a", 0, 10) == 0.0
    for _ in range(MIN_STEPS):
        core.meter.step(0, 32, 0.1)
    # steps of 0.1 s per 32 tokens (one size: the duration scales with the tokens); the wait
    # is whole steps of the work ahead and of its own prompt (nothing runs: no step in flight)
    # tenant a: 640 tokens ahead and its 10, 32 a step: 21 steps
    assert core.queue_wait("a", 0, 10) == pytest.approx(2.1)
    # a better priority jumps its own tenant's queue: nothing ahead, nothing running: an idle
    # engine takes anything (refused on old measurements, nothing would renew them)
    assert core.queue_wait("a", -1, 10_000) == 0.0
    # tenant b: a's queue counts up to b's share, as many tokens as b's own 10: one step
    assert core.queue_wait("b", 0, 10) == pytest.approx(0.1)
    weighted = create_scheduler(
        num_blocks=1024,
        max_num_batched_tokens=32,
        tenants=TenantPolicy(weights={"a": 5.0}),
    )
    for _ in range(10):
        weighted.add("a" * 64, max_tokens=4, tenant="a")
    for _ in range(MIN_STEPS):
        weighted.core.meter.step(0, 32, 0.1)
    # a weighs five times b: 50 of a's tokens go ahead of b's 10: two steps
    assert weighted.core.queue_wait("b", 0, 10) == pytest.approx(0.2)


def test_the_decode_stretch_bounds_the_prompt_tokens_beside_decodes() -> None:
    """With a decode stretch, a step that decodes carries only the prompt tokens that keep it
    within the stretch of a decode-only step (the meter's line; never below a block); a step
    with no decode takes the whole budget; before any step is measured, the budget alone."""
    from stoic.scheduler import SchedulerConfig, SchedulerCore, prompt_budget

    meter = LoadMeter()
    assert prompt_budget(meter, 4, 2.0, 16) is None  # nothing measured
    for decodes, prompt in ((1, 0), (4, 0), (2, 64), (0, 128)) * 4:
        meter.step(decodes, prompt, 0.02 + 0.001 * (decodes + prompt))  # 20 ms, 1 ms a row
    # a decode-only step of 4: 24 ms; twice that allows 24 ms more: 24 prompt tokens
    assert prompt_budget(meter, 4, 2.0, 16) == 24
    assert prompt_budget(meter, 4, 2.0, 32) == 32  # the floor
    assert prompt_budget(meter, 0, 2.0, 16) is None  # no decode: nobody to stall
    assert prompt_budget(meter, 4, None, 16) is None
    h = create_scheduler(
        num_blocks=512, block_size=4, max_num_seqs=8, max_num_batched_tokens=128, clock=Clock()
    )
    h.core = SchedulerCore(
        dataclasses.replace(h.core.cfg, decode_stretch=2.0), h.tokenizer, h.core.clock
    )
    h.core.executor_ready(0)
    h.add("d" * 10, max_tokens=30)
    h.step()  # prefilled: decoding from now on
    h.core.meter = meter  # the steps above, not the harness's (the frozen clock times at 0 s)
    h.add("p" * 100, max_tokens=2)
    batch = h.step()
    assert batch is not None
    prompt = sum(len(c.token_ids) for c in batch.chunks if len(c.token_ids) > 1)
    # one decode: 21 ms; twice that: 21 prompt tokens (a whole chunk, as planned)
    assert prompt == 21
    assert isinstance(h.core.cfg, SchedulerConfig)
    h.run_until_idle()
    h.check()


def test_a_request_on_its_way_counts_in_the_estimate_once() -> None:
    """A request the intake admitted whose sequence has not reached the core yet counts as
    waiting work (a burst is not admitted on a view that misses itself); once added, or
    aborted on its way, it counts once or not at all."""
    h = create_scheduler(num_blocks=1024, block_size=4, max_num_batched_tokens=32)
    core = h.core
    h.add("r" * 20, max_tokens=4)
    for _ in range(MIN_STEPS):
        core.meter.step(0, 32, 0.1)
    alone = core.queue_wait("", 0, 10)  # 20 ahead and its 10: one step
    core.expect("req-x", "", 0, 64)
    assert core.queue_wait("", 0, 10) == pytest.approx(alone + 0.2)  # 64 more: two steps
    h.add("x" * 64, max_tokens=4, request_id="req-x")
    assert core.queue_wait("", 0, 10) == pytest.approx(alone + 0.2)
    core.expect("req-y", "", 0, 64)
    core.abort("req-y")
    assert core.queue_wait("", 0, 10) == pytest.approx(alone + 0.2)


def test_no_refusal_on_a_cost_extrapolated_from_small_chunks() -> None:
    """Steps that carried only small prompt chunks (a slow cold one among them) do not price a
    full step: the estimate is 0 until a step carried a quarter of the room."""
    h = create_scheduler(num_blocks=1024, block_size=4, max_num_batched_tokens=256)
    core = h.core
    for _ in range(4):
        h.add("w" * 300, max_tokens=4)
    core.meter.step(0, 8, 0.3)  # cold
    for _ in range(MIN_STEPS):
        core.meter.step(1, 0, 0.02)
    assert core.queue_wait("", 0, 300) == 0.0
    core.meter.step(0, 256, 0.5)
    assert core.queue_wait("", 0, 300) > 1.0
