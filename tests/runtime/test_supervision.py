"""Supervisors: strategies, restart types, intensity, backoff, recovery hooks, escalation."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from stoic.runtime import (
    ActorSystem,
    Backoff,
    ChildFailure,
    ChildSpec,
    Restart,
    Strategy,
    SupervisorEscalation,
    Terminated,
)
from stoic.runtime.testing import MockClock, TestProbe

from .helpers import Boom, Ping, Worker, take, worker


async def test_one_for_one_restarts_only_the_failed_child() -> None:
    """ONE_FOR_ONE: a crash restarts that child alone; siblings keep their incarnation,
    and a message sent after the restart is handled by the new incarnation."""
    async with ActorSystem() as system:
        probe = await TestProbe.spawn(system)
        sup = await system.spawn_supervisor("sup", [worker(n, probe.ref) for n in "abc"])
        assert await take(probe, 3) == [("start", n, 0) for n in "abc"]

        await sup.child("b").tell("boom")
        assert await take(probe, 2) == [("stop", "b", 0), ("start", "b", 1)]
        await sup.child("b").tell("hello")
        assert await probe.expect_message() == ("got", "b", "hello")

        for name, incarnation in [("a", 0), ("b", 1), ("c", 0)]:
            assert await sup.child(name).ask(Ping, timeout=1) == (name, incarnation)
        await probe.expect_no_message(0.02)
        assert sup.restart_count == 1


async def test_one_for_all_restarts_every_child_in_order() -> None:
    """ONE_FOR_ALL: the siblings are stopped in reverse start order, then all children
    are started again in start order."""
    async with ActorSystem() as system:
        probe = await TestProbe.spawn(system)
        sup = await system.spawn_supervisor(
            "sup", [worker(n, probe.ref) for n in "abc"], strategy=Strategy.ONE_FOR_ALL
        )
        await take(probe, 3)
        await sup.child("b").tell("boom")
        assert await take(probe, 6) == [
            ("stop", "b", 0),
            ("stop", "c", 0),
            ("stop", "a", 0),
            ("start", "a", 1),
            ("start", "b", 1),
            ("start", "c", 1),
        ]
        await probe.expect_no_message(0.02)


async def test_rest_for_one_restarts_the_failed_child_and_later_ones() -> None:
    """REST_FOR_ONE: the failed child and those started after it are restarted (later
    ones stopped in reverse order, all started in order); earlier ones are untouched."""
    async with ActorSystem() as system:
        probe = await TestProbe.spawn(system)
        sup = await system.spawn_supervisor(
            "sup", [worker(n, probe.ref) for n in "abcd"], strategy=Strategy.REST_FOR_ONE
        )
        await take(probe, 4)
        await sup.child("b").tell("boom")
        assert await take(probe, 6) == [
            ("stop", "b", 0),
            ("stop", "d", 0),
            ("stop", "c", 0),
            ("start", "b", 1),
            ("start", "c", 1),
            ("start", "d", 1),
        ]
        assert await sup.child("a").ask(Ping, timeout=1) == ("a", 0)


async def test_queued_messages_survive_a_restart() -> None:
    """The mailbox belongs to the stable ref: messages queued behind the failing one are
    handled, in order, by the next incarnation."""
    async with ActorSystem() as system:
        probe = await TestProbe.spawn(system)
        sup = await system.spawn_supervisor("sup", [worker("w", probe.ref)])
        ref = sup.child("w")
        await take(probe, 1)
        for message in ["boom", 1, 2, 3]:
            ref.try_tell(message)
        assert await take(probe, 5) == [
            ("stop", "w", 0),
            ("start", "w", 1),
            ("got", "w", 1),
            ("got", "w", 2),
            ("got", "w", 3),
        ]
        assert sup.child("w") is ref


async def test_intensity_exceeded_within_the_window_escalates() -> None:
    """More than max_restarts restarts inside `within` seconds stops the children and
    escalates; at top level `async with ActorSystem()` re-raises the escalation."""
    clock = MockClock()
    escalations: list[SupervisorEscalation] = []

    async def on_escalate(error: SupervisorEscalation) -> None:
        escalations.append(error)

    async def scenario() -> None:
        async with ActorSystem(clock=clock) as system:
            probe = await TestProbe.spawn(system)
            sup = await system.spawn_supervisor(
                "sup", [worker("w", probe.ref)], max_restarts=3, within=5.0, on_escalate=on_escalate
            )
            child = sup.child("w")
            await take(probe, 1)
            for incarnation in range(1, 4):
                await child.tell("boom")
                expected = [("stop", "w", incarnation - 1), ("start", "w", incarnation)]
                assert await take(probe, 2) == expected
                clock.advance(1.0)
            await child.tell("boom")
            failure = await asyncio.wait_for(system.wait_failed(), 1)
            assert (await probe.expect_terminated(child)).reason.__class__ is Boom
            assert not sup.ref.is_alive and system.failure is failure

    with pytest.raises(SupervisorEscalation) as raised:
        await scenario()
    escalation = raised.value
    assert escalations == [escalation]
    assert (escalation.supervisor, escalation.child, escalation.restarts) == ("sup", "w", 4)
    assert isinstance(escalation.__cause__, Boom)


async def test_same_failures_spread_wider_than_the_window_do_not_escalate() -> None:
    """The window slides: restarts older than `within` no longer count."""
    clock = MockClock()
    async with ActorSystem(clock=clock) as system:
        probe = await TestProbe.spawn(system)
        sup = await system.spawn_supervisor(
            "sup", [worker("w", probe.ref)], max_restarts=3, within=5.0
        )
        await take(probe, 1)
        for incarnation in range(1, 7):
            await sup.child("w").tell("boom")
            assert await take(probe, 2) == [
                ("stop", "w", incarnation - 1),
                ("start", "w", incarnation),
            ]
            clock.advance(2.0)
        stats = sup.statistics()
        assert stats.restart_count == 6 and stats.restarts_in_window == 2
        assert system.failure is None


async def test_backoff_delays_grow_exponentially_on_the_clock() -> None:
    """Backoff delays are slept on the system clock between death and restart, grow by
    `factor` per restart in the window, and are capped at `maximum`."""
    clock = MockClock()
    backoff = Backoff(initial=1.0, factor=2.0, maximum=3.0, jitter=0.0)
    async with ActorSystem(clock=clock) as system:
        probe = await TestProbe.spawn(system)
        sup = await system.spawn_supervisor(
            "sup", [worker("w", probe.ref)], max_restarts=10, within=100.0, backoff=backoff
        )
        await take(probe, 1)
        for incarnation, delay in [(1, 1.0), (2, 2.0), (3, 3.0)]:
            await sup.child("w").tell("boom")
            assert await probe.expect_message() == ("stop", "w", incarnation - 1)
            await clock.wait_for_sleepers(1)
            assert clock.sleeps[-1] == delay
            clock.advance(delay - 0.25)
            await probe.expect_no_message(0.02)
            clock.advance(0.25)
            assert await probe.expect_message() == ("start", "w", incarnation)
        assert clock.sleeps == [1.0, 2.0, 3.0]


def test_backoff_delay_is_capped_jittered_and_seedable() -> None:
    """Backoff.delay: initial*factor**attempt, within ±jitter, never above maximum, and
    reproducible for a seeded RNG; initial=0 means no delay."""
    backoff = Backoff(initial=0.5, factor=3.0, maximum=4.0, jitter=0.2)
    delays = [backoff.delay(attempt, random.Random(7)) for attempt in range(5)]
    assert delays == [backoff.delay(attempt, random.Random(7)) for attempt in range(5)]
    for attempt, delay in enumerate(delays):
        base = min(4.0, 0.5 * 3.0**attempt)
        assert base * 0.8 <= delay <= min(base * 1.2, 4.0)
    assert Backoff().delay(10, random.Random()) == 0.0
    with pytest.raises(ValueError, match="jitter"):
        Backoff(jitter=2.0)


async def test_on_failure_hook_runs_before_the_restart() -> None:
    """ChildSpec.on_failure is awaited with the error and the failed incarnation after
    the child died and before its next incarnation starts."""
    async with ActorSystem() as system:
        probe = await TestProbe.spawn(system)

        async def recover(failure: ChildFailure) -> None:
            await probe.ref.tell(("hook", str(failure.reason), failure.incarnation))

        sup = await system.spawn_supervisor("sup", [worker("w", probe.ref, on_failure=recover)])
        await take(probe, 1)
        for incarnation in (0, 1):
            await sup.child("w").tell("boom")
            assert await take(probe, 3) == [
                ("stop", "w", incarnation),
                ("hook", "w exploded", incarnation),
                ("start", "w", incarnation + 1),
            ]


async def test_on_failure_hook_runs_even_when_the_intensity_is_exceeded() -> None:
    """The hook still runs for the failure that exceeds the intensity, then the
    supervisor escalates instead of restarting."""
    calls: list[ChildFailure] = []

    async def recover(failure: ChildFailure) -> None:
        calls.append(failure)

    async def scenario() -> None:
        async with ActorSystem() as system:
            probe = await TestProbe.spawn(system)
            sup = await system.spawn_supervisor(
                "sup", [worker("w", probe.ref, on_failure=recover)], max_restarts=0
            )
            await sup.child("w").tell("boom")
            await asyncio.wait_for(system.wait_failed(), 1)

    with pytest.raises(SupervisorEscalation):
        await scenario()
    assert [(f.incarnation, f.last) for f in calls] == [(0, True)]


async def test_a_raising_on_failure_hook_escalates() -> None:
    """If the recovery hook itself raises, the supervisor escalates with that error as
    the cause, whatever the remaining intensity."""

    async def recover(failure: ChildFailure) -> None:
        raise RuntimeError("cannot recover")

    async def scenario() -> None:
        async with ActorSystem() as system:
            probe = await TestProbe.spawn(system)
            sup = await system.spawn_supervisor(
                "sup", [worker("w", probe.ref, on_failure=recover)], max_restarts=100
            )
            await sup.child("w").tell("boom")
            await asyncio.wait_for(system.wait_failed(), 1)

    with pytest.raises(SupervisorEscalation) as raised:
        await scenario()
    assert isinstance(raised.value.__cause__, RuntimeError)


async def test_a_failure_the_hook_exempts_is_restarted_and_not_counted() -> None:
    """on_failure returning False exempts that failure from the restart intensity: the child is
    restarted even when the failure was ``last`` (counted, it would exceed the intensity), and
    the window does not hold it. Failures it counts (None) still make the supervisor give up."""
    seen: list[ChildFailure] = []
    verdicts = iter([None, None, False, False, None])

    async def recover(failure: ChildFailure) -> bool | None:
        seen.append(failure)
        return next(verdicts)

    async def scenario() -> None:
        async with ActorSystem(clock=MockClock()) as system:
            probe = await TestProbe.spawn(system)
            sup = await system.spawn_supervisor(
                "sup", [worker("w", probe.ref, on_failure=recover)], max_restarts=2, within=60.0
            )
            await take(probe, 1)
            for incarnation in range(1, 5):
                await sup.child("w").tell("boom")
                assert await take(probe, 2) == [
                    ("stop", "w", incarnation - 1),
                    ("start", "w", incarnation),
                ]
            stats = sup.statistics()
            assert (stats.restart_count, stats.restarts_in_window, stats.exempted) == (4, 2, 2)
            await sup.child("w").tell("boom")
            await asyncio.wait_for(system.wait_failed(), 1)

    with pytest.raises(SupervisorEscalation) as raised:
        await scenario()
    assert raised.value.restarts == 3
    assert [(f.incarnation, f.last) for f in seen] == [
        (0, False),
        (1, False),
        (2, True),
        (3, True),
        (4, True),
    ]


async def test_temporary_child_is_never_restarted() -> None:
    """TEMPORARY: a failed child stops for good (watchers get the error), and it is not
    restarted when a ONE_FOR_ALL sibling's failure stops it either."""
    async with ActorSystem() as system:
        probe = await TestProbe.spawn(system)
        sup = await system.spawn_supervisor(
            "sup",
            [worker("t", probe.ref, restart=Restart.TEMPORARY), worker("p", probe.ref)],
            strategy=Strategy.ONE_FOR_ALL,
        )
        await take(probe, 2)
        temporary = sup.child("t")
        await temporary.tell("boom")
        terminated = await probe.expect_terminated(temporary)
        assert isinstance(terminated.reason, Boom)
        assert await take(probe, 1) == [("stop", "t", 0)]
        await probe.expect_no_message(0.02)  # no sibling restart for a temporary exit
        assert not temporary.is_alive

        sup2 = await system.spawn_supervisor(
            "sup2",
            [worker("t2", probe.ref, restart=Restart.TEMPORARY), worker("p2", probe.ref)],
            strategy=Strategy.ONE_FOR_ALL,
        )
        await take(probe, 2)
        await sup2.child("p2").tell("boom")
        assert await take(probe, 3) == [("stop", "p2", 0), ("stop", "t2", 0), ("start", "p2", 1)]
        assert (await probe.expect_terminated(sup2.child("t2"))).reason is None


async def test_transient_child_is_restarted_only_after_a_failure() -> None:
    """TRANSIENT: restarted after an exception, but a normal stop ends it for good."""
    async with ActorSystem() as system:
        probe = await TestProbe.spawn(system)
        sup = await system.spawn_supervisor(
            "sup", [worker("w", probe.ref, restart=Restart.TRANSIENT)]
        )
        ref = sup.child("w")
        await take(probe, 1)
        await ref.tell("boom")
        assert await take(probe, 2) == [("stop", "w", 0), ("start", "w", 1)]
        await ref.tell("stop")
        assert await take(probe, 1) == [("stop", "w", 1)]
        assert (await probe.expect_terminated(ref)).reason is None
        assert sup.restart_count == 1


async def test_permanent_child_is_restarted_after_a_normal_stop() -> None:
    """PERMANENT: even a normal self-stop is followed by a restart."""
    async with ActorSystem() as system:
        probe = await TestProbe.spawn(system)
        sup = await system.spawn_supervisor("sup", [worker("w", probe.ref)])
        await take(probe, 1)
        await sup.child("w").tell("stop")
        assert await take(probe, 2) == [("stop", "w", 0), ("start", "w", 1)]


async def test_restart_does_not_notify_watchers() -> None:
    """A restarted child has not terminated: its watchers hear nothing, and its ref
    stays alive."""
    async with ActorSystem() as system:
        probe = await TestProbe.spawn(system)
        watcher = await TestProbe.spawn(system, "watcher")
        sup = await system.spawn_supervisor("sup", [worker("w", probe.ref)])
        ref = sup.child("w")
        watcher.watch(ref)
        await ref.tell("boom")
        await take(probe, 3)
        await watcher.expect_no_message(0.02)
        assert ref.is_alive


async def test_escalation_stops_children_in_reverse_order_before_on_escalate() -> None:
    """On escalation every child is stopped in reverse start order before on_escalate
    is called, and the escalation is catchable around the system."""
    log: list[Any] = []

    async def on_escalate(error: SupervisorEscalation) -> None:
        log.append(("escalate", error.child))

    async def scenario() -> None:
        async with ActorSystem() as system:
            probe = await TestProbe.spawn(system)
            sup = await system.spawn_supervisor(
                "sup",
                [worker(n, probe.ref, log=log) for n in "abc"],
                max_restarts=0,
                on_escalate=on_escalate,
            )
            await sup.child("a").tell("boom")
            await asyncio.wait_for(system.wait_failed(), 1)

    with pytest.raises(SupervisorEscalation):
        await scenario()
    assert log[3:] == [("stop", "a", 0), ("stop", "c", 0), ("stop", "b", 0), ("escalate", "a")]


async def test_nested_supervisor_escalation_is_a_child_failure_of_its_parent() -> None:
    """A supervisor spawned with parent= escalates into its parent, which restarts it
    (and so its children, whose refs stay valid); no system failure results."""
    async with ActorSystem() as system:
        probe = await TestProbe.spawn(system)
        root = await system.spawn_supervisor("root", [worker("r", probe.ref)], max_restarts=5)
        sub = await system.spawn_supervisor(
            "sub", [worker("x", probe.ref)], max_restarts=0, parent=root
        )
        await take(probe, 2)
        assert root.child("sub") is sub.ref
        child = sub.child("x")
        await child.tell("boom")
        assert await take(probe, 2) == [("stop", "x", 0), ("start", "x", 1)]
        assert await child.ask(Ping, timeout=1) == ("x", 1)
        assert root.restart_count == 1 and sub.statistics().escalations == 1
        assert system.failure is None and sub.ref.is_alive


async def test_escalation_propagates_up_to_the_top_level() -> None:
    """When the parent's intensity is exceeded too, the top-level escalation is the
    parent's, caused by the child supervisor's escalation."""

    async def scenario() -> None:
        async with ActorSystem() as system:
            probe = await TestProbe.spawn(system)
            root = await system.spawn_supervisor("root", [], max_restarts=0)
            sub = await system.spawn_supervisor(
                "sub", [worker("x", probe.ref)], max_restarts=0, parent=root
            )
            await sub.child("x").tell("boom")
            await asyncio.wait_for(system.wait_failed(), 1)
            assert not sub.child("x").is_alive

    with pytest.raises(SupervisorEscalation) as raised:
        await scenario()
    assert raised.value.supervisor == "root" and raised.value.child == "sub"
    cause = raised.value.__cause__
    assert isinstance(cause, SupervisorEscalation) and cause.supervisor == "sub"


async def test_child_failing_to_start_fails_spawn_supervisor() -> None:
    """If a child's on_start raises while the supervisor starts, spawn_supervisor raises
    it after stopping the children already started, in reverse order."""

    class BadStart(Worker):
        async def on_start(self) -> None:
            raise Boom("cannot start")

    async with ActorSystem() as system:
        probe = await TestProbe.spawn(system)
        specs = [worker("a", probe.ref), worker("b", probe.ref)]
        specs.append(ChildSpec("bad", lambda: BadStart("bad", probe.ref)))
        with pytest.raises(Boom):
            await system.spawn_supervisor("sup", specs)
        assert await take(probe, 4) == [
            ("start", "a", 0),
            ("start", "b", 0),
            ("stop", "b", 0),
            ("stop", "a", 0),
        ]
        assert system.statistics().supervisors == 0


async def test_start_child_adds_a_supervised_child_and_stop_removes_it() -> None:
    """start_child appends a running child; system.stop on a supervised ref stops it for
    good (not restarted, watchers get Terminated(ref, None))."""
    async with ActorSystem() as system:
        probe = await TestProbe.spawn(system)
        sup = await system.spawn_supervisor("sup", [])
        ref = await sup.start_child(worker("late", probe.ref))
        assert ref is sup.child("late")
        assert await take(probe, 1) == [("start", "late", 0)]
        with pytest.raises(ValueError, match="already has"):
            await sup.start_child(worker("late", probe.ref))
        await system.stop(ref)
        assert await take(probe, 1) == [("stop", "late", 0)]
        assert await probe.expect_terminated(ref) == Terminated(ref, None)
        assert sup.restart_count == 0
        with pytest.raises(KeyError):
            sup.child("late")  # forgotten, so the name can be used again


async def test_a_child_that_keeps_failing_to_restart_escalates() -> None:
    """An on_start failure during a restart counts as another exit: with a frozen
    clock the intensity runs out and the supervisor escalates."""
    starts: list[int] = []

    class Fragile(Worker):
        async def on_start(self) -> None:
            starts.append(self.context.incarnation)
            if self.context.incarnation > 0:
                raise Boom("cannot restart")

    async def scenario() -> None:
        async with ActorSystem(clock=MockClock()) as system:
            probe = await TestProbe.spawn(system)
            sup = await system.spawn_supervisor(
                "sup", [ChildSpec("w", lambda: Fragile("w", probe.ref))], max_restarts=3
            )
            await sup.child("w").tell("boom")
            await asyncio.wait_for(system.wait_failed(), 1)

    with pytest.raises(SupervisorEscalation) as raised:
        await scenario()
    assert starts == [0, 1, 2, 3]  # the first start, then max_restarts restarts
    assert str(raised.value.__cause__) == "cannot restart"


async def test_stopping_interrupts_a_backoff_sleep() -> None:
    """A supervisor waiting out a backoff delay stops promptly when asked to; the child
    it was about to restart is not restarted and terminates with its last error."""
    clock = MockClock()
    async with ActorSystem(clock=clock) as system:
        probe = await TestProbe.spawn(system)
        sup = await system.spawn_supervisor(
            "sup", [worker("w", probe.ref)], backoff=Backoff(initial=60.0, maximum=60.0)
        )
        await take(probe, 1)
        await sup.child("w").tell("boom")
        await clock.wait_for_sleepers(1)
        await asyncio.wait_for(sup.stop(), 1)
        terminated = await probe.expect_terminated(sup.child("w"))
        assert isinstance(terminated.reason, Boom)
        assert await take(probe, 1) == [("stop", "w", 0)]
        await probe.expect_no_message(0.02)
        assert clock.sleepers == 0 and not sup.ref.is_alive
