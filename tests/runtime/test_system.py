"""The actor system: spawning, stopping, shutdown order, death watch, logging, anyio."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import anyio
import pytest
from structlog.testing import capture_logs

from stoic.runtime import (
    Actor,
    ActorStopped,
    ActorSystem,
    AskTimeout,
    ChildSpec,
    SupervisorEscalation,
    Terminated,
)
from stoic.runtime.testing import MockClock, TestProbe

from .helpers import Boom, Ping, Worker, take, worker


class Echo(Actor[Any]):
    async def receive(self, message: Any) -> None:
        value, reply = message
        reply.send(value)


class HangingStop(Actor[Any]):
    """Its on_stop never returns on its own; records whether it was cancelled."""

    def __init__(self, log: list[Any]) -> None:
        self.log = log

    async def receive(self, message: Any) -> None:
        pass

    async def on_stop(self) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.log.append("cancelled")
            raise


async def test_system_exit_stops_everything_in_reverse_start_order() -> None:
    """Leaving `async with` runs on_stop of every actor in reverse start order (a
    supervisor's children in reverse order at its place) and leaves no task behind."""
    log: list[Any] = []
    before = asyncio.all_tasks()
    async with ActorSystem() as system:
        sink = await TestProbe.spawn(system, "sink")
        for name in "ab":
            await system.spawn(Worker(name, sink.ref, log=log), name=name)
        await system.spawn_supervisor("sup", [worker(n, sink.ref, log=log) for n in "cd"])
        await system.spawn(Worker("e", sink.ref, log=log), name="e")
        assert system.statistics().actors == 7  # sink, a, b, sup, c, d, e
    assert [event for event in log if event[0] == "stop"] == [("stop", name, 0) for name in "edcba"]
    assert asyncio.all_tasks() == before
    assert system.statistics().actors == 0


async def test_on_stop_that_hangs_is_cancelled_after_the_shutdown_timeout() -> None:
    """An actor outliving its shutdown timeout is cancelled, and shutdown goes on to
    stop the actors started before it."""
    log: list[Any] = []
    async with ActorSystem() as system:
        sink = await TestProbe.spawn(system, "sink")
        await system.spawn(Worker("first", sink.ref, log=log), name="first")
        await system.spawn(HangingStop(log), name="hanging", shutdown_timeout=0.05)
        started = time.monotonic()
    assert time.monotonic() - started < 1.0
    assert log[-2:] == ["cancelled", ("stop", "first", 0)]


async def test_stop_is_graceful() -> None:
    """system.stop lets the actor finish the message in hand, runs on_stop, and then
    the ref is dead; stopping again is a no-op."""
    async with ActorSystem() as system:
        probe = await TestProbe.spawn(system)

        class Slow(Worker):
            async def receive(self, message: Any) -> None:
                await asyncio.sleep(0.02)
                await super().receive(message)

        ref = await system.spawn(Slow("slow", probe.ref), name="slow")
        await ref.tell("work")
        await asyncio.sleep(0)
        await system.stop(ref)
        assert await take(probe, 3) == [
            ("start", "slow", 0),
            ("got", "slow", "work"),
            ("stop", "slow", 0),
        ]
        assert not ref.is_alive
        await system.stop(ref)


async def test_spawn_raises_what_on_start_raised() -> None:
    """spawn returns after on_start; if on_start raises, spawn raises it and the actor
    (whose on_stop does not run) is dead; its name is free again."""
    async with ActorSystem() as system:
        probe = await TestProbe.spawn(system)

        class BadStart(Worker):
            async def on_start(self) -> None:
                raise Boom("no")

        with pytest.raises(Boom):
            await system.spawn(BadStart("w", probe.ref), name="w")
        ref = await system.spawn(Worker("w", probe.ref), name="w")
        assert await take(probe, 1) == [("start", "w", 0)]
        with pytest.raises(ValueError, match="already alive"):
            await system.spawn(Worker("w", probe.ref), name="w")
        assert ref.is_alive


async def test_unsupervised_failure_stops_the_actor_and_notifies_watchers() -> None:
    """An unsupervised actor whose receive raises stops for good (on_stop runs) and its
    watchers get Terminated(ref, error); the system does not fail."""
    async with ActorSystem() as system:
        probe = await TestProbe.spawn(system)
        ref = await system.spawn(Worker("w", probe.ref), name="w")
        await ref.tell("boom")
        terminated = await probe.expect_terminated(ref)
        assert terminated.ref is ref and isinstance(terminated.reason, Boom)
        assert await take(probe, 2) == [("start", "w", 0), ("stop", "w", 0)]
        assert not ref.is_alive and system.failure is None


async def test_death_watch_reports_a_normal_stop_and_an_already_dead_ref() -> None:
    """Terminated carries None after a normal stop; watching a dead ref delivers it at
    once; unwatch stops further notices."""
    async with ActorSystem() as system:
        probe = await TestProbe.spawn(system)
        first = await system.spawn(Worker("first", probe.ref), name="first")
        second = await system.spawn(Worker("second", probe.ref), name="second")
        await take(probe, 2)
        await first.tell("stop")
        assert await probe.expect_terminated(first) == Terminated(first, None)
        assert await probe.expect_terminated(first) == Terminated(first, None)  # already dead

        class Watcher(Actor[Any]):
            async def on_start(self) -> None:
                self.context.watch(second)
                self.context.unwatch(second)

            async def receive(self, message: Any) -> None:
                await probe.ref.tell(("watcher got", message))

        await system.spawn(Watcher, name="watcher")
        await system.stop(second)
        await take(probe, 2)  # "stop" of first and second
        await probe.expect_no_message(0.02)


async def test_top_level_escalation_is_reraised_and_catchable() -> None:
    """A top-level supervisor's escalation is recorded on the system (failure,
    wait_failed, statistics) and re-raised when the `async with` block exits."""
    caught: SupervisorEscalation | None = None
    try:
        async with ActorSystem() as system:
            probe = await TestProbe.spawn(system)
            sup = await system.spawn_supervisor("sup", [worker("w", probe.ref)], max_restarts=0)
            await sup.child("w").tell("boom")
            failure = await asyncio.wait_for(system.wait_failed(), 1)
            assert system.failure is failure and system.statistics().failed
    except SupervisorEscalation as error:
        caught = error
    assert caught is failure


async def test_body_exception_wins_over_the_escalation() -> None:
    """If the block raises, that exception propagates (after a clean shutdown)."""

    async def scenario() -> None:
        async with ActorSystem() as system:
            probe = await TestProbe.spawn(system)
            sup = await system.spawn_supervisor("sup", [worker("w", probe.ref)], max_restarts=0)
            await sup.child("w").tell("boom")
            await system.wait_failed()
            raise KeyError("mine")

    with pytest.raises(KeyError):
        await scenario()


async def test_structlog_events_are_bound_to_actor_and_incarnation() -> None:
    """start, failure, stop, restart and escalation are logged as single events bound
    with actor=<name> and incarnation=<n>."""

    async def scenario() -> None:
        async with ActorSystem() as system:
            probe = await TestProbe.spawn(system)
            sup = await system.spawn_supervisor("sup", [worker("w", probe.ref)], max_restarts=1)
            for _ in range(2):
                await sup.child("w").tell("boom")
            await asyncio.wait_for(system.wait_failed(), 1)

    with capture_logs() as logs, pytest.raises(SupervisorEscalation):
        await scenario()
    events = [(e["event"], e.get("actor"), e.get("incarnation")) for e in logs]
    for expected in [
        ("actor.started", "w", 0),
        ("actor.failed", "w", 0),
        ("actor.stopped", "w", 0),
        ("actor.restarting", "w", 0),
        ("actor.started", "w", 1),
        ("supervisor.escalated", "sup", 0),
        ("actor.terminated", "w", 1),
    ]:
        assert expected in events


async def test_mock_clock_and_probe_behave_as_documented() -> None:
    """MockClock wakes sleepers only once advanced past their deadline; the probe's
    expectations fail with AssertionError on timeout or a wrong type."""
    clock = MockClock(10.0)
    sleeper = asyncio.create_task(clock.sleep(2.0))
    await clock.wait_for_sleepers(1)
    assert clock.next_deadline == 12.0
    clock.advance(1.5)
    await asyncio.sleep(0)
    assert not sleeper.done()
    clock.advance(0.5)
    await asyncio.wait_for(sleeper, 1)
    assert clock.now() == 12.0 and clock.sleepers == 0
    async with ActorSystem(clock=clock) as system:
        assert system.clock is clock
        probe = await TestProbe.spawn(system)
        with pytest.raises(AssertionError, match="no message"):
            await probe.expect_message(0.01)
        probe.ref.try_tell("text")
        with pytest.raises(AssertionError, match="type int"):
            await probe.expect_message(of_type=int)
        assert probe.received == ["text"]


def test_runtime_works_from_anyio_code() -> None:
    """Under anyio.run (asyncio backend), actors work from a task group: concurrent
    asks, an ask cut short by a cancel scope, a supervised restart -- and nothing is
    left running afterwards."""

    async def main() -> None:
        async with ActorSystem() as system:
            echo = await system.spawn(Echo, name="echo")
            results: list[int] = []

            async def ask(value: int) -> None:
                results.append(await echo.ask(lambda r: (value, r), timeout=1))

            async with anyio.create_task_group() as tg:
                for value in range(10):
                    tg.start_soon(ask, value)
            assert sorted(results) == list(range(10))

            probe = await TestProbe.spawn(system)
            sup = await system.spawn_supervisor(
                "sup", [ChildSpec("w", lambda: Worker("w", probe.ref))]
            )
            with anyio.move_on_after(0.05) as scope:
                await sup.child("w").ask(lambda r: ("ignored", r), timeout=10)
            assert scope.cancelled_caught
            await sup.child("w").tell("boom")
            events = await take(probe, 4)  # start, got ("ignored", reply), stop, start
            assert events[2:] == [("stop", "w", 0), ("start", "w", 1)]
            assert await sup.child("w").ask(Ping, timeout=1) == ("w", 1)
            with pytest.raises(AskTimeout):
                await sup.child("w").ask(lambda r: ("ignored", r), timeout=0.01)
        assert {t for t in asyncio.all_tasks() if t is not asyncio.current_task()} == set()
        with pytest.raises(ActorStopped):
            await echo.tell((1, None))

    anyio.run(main, backend="asyncio")
