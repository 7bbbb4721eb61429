"""Mailboxes, tell/try_tell/ask, replies and dead letters."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import pytest
from structlog.testing import capture_logs

from stoic.runtime import (
    Actor,
    ActorStopped,
    ActorSystem,
    AskTimeout,
    ChildSpec,
    MailboxFull,
    Reply,
    Strategy,
)
from stoic.runtime._mailbox import Envelope, Mailbox
from stoic.runtime.testing import TestProbe

from .helpers import Boom, Hang, Ping, Seen, Worker, take, worker


class Collector(Actor[Any]):
    """Appends every message to ``seen``; blocks on a Hang first if told so."""

    def __init__(self, seen: list[Any]) -> None:
        self.seen = seen

    async def receive(self, message: Any) -> None:
        if isinstance(message, Hang):
            await message.gate.wait()
        else:
            self.seen.append(message)


@dataclass(frozen=True)
class Never:
    """A request its callee keeps without answering."""

    reply: Reply[int]


class Callee(Actor[Any]):
    """Keeps Never replies unanswered; fails on Boom-requests; echoes others."""

    def __init__(self) -> None:
        self.kept: list[Reply[Any]] = []

    async def receive(self, message: Any) -> None:
        match message:
            case Never(reply=reply):
                self.kept.append(reply)
            case ("boom", _):
                raise Boom("died while handling the ask")
            case ("hang", _):
                await asyncio.Event().wait()
            case ("fail", reply):
                reply.fail(ValueError("bad request"))
            case (value, reply):
                reply.send(value)


async def test_full_mailbox_makes_tell_wait_and_try_tell_raise() -> None:
    """With the mailbox full, try_tell raises MailboxFull at once and tell waits until a
    slot frees up; nothing is dropped and order is kept."""
    seen = Seen()
    gate = asyncio.Event()
    async with ActorSystem() as system:
        ref = await system.spawn(Collector(seen), name="c", mailbox_size=2)
        await ref.tell(Hang(gate))
        await asyncio.sleep(0)  # the actor takes the Hang and blocks on it
        await ref.tell(1)
        await ref.tell(2)
        with pytest.raises(MailboxFull):
            ref.try_tell(99)
        blocked = asyncio.create_task(ref.tell(3))
        await asyncio.sleep(0.01)
        assert not blocked.done()
        assert ref.statistics().current_buffer_used == 2
        assert ref.statistics().tasks_waiting_send == 1
        gate.set()
        await asyncio.wait_for(blocked, 1)
        await ref.tell(4)
        await seen.until(4)
        assert seen == [1, 2, 3, 4]
        assert ref.statistics().max_buffer_size == 2


async def test_messages_from_one_sender_arrive_in_order() -> None:
    """Per-sender FIFO, even when backpressure makes concurrent senders wait."""
    seen = Seen()
    async with ActorSystem() as system:
        ref = await system.spawn(Collector(seen), name="c", mailbox_size=3)

        async def send(tag: str) -> None:
            for i in range(200):
                await ref.tell((tag, i))

        await asyncio.gather(send("x"), send("y"))
        await seen.until(400)
    for tag in "xy":
        assert [i for t, i in seen if t == tag] == list(range(200))


async def test_no_message_lost_or_duplicated_when_a_receiver_is_cancelled() -> None:
    """A receiver cancelled mid-receive (its shutdown timeout elapsed during a
    restart) loses only the message in hand -- whose ask fails with ActorStopped --
    while every queued message is handled exactly once, in order, by the next
    incarnation."""
    seen = Seen()
    gate = asyncio.Event()
    async with ActorSystem() as system:
        probe = await TestProbe.spawn(system)
        sup = await system.spawn_supervisor(
            "sup",
            [
                ChildSpec("rx", lambda: Collector(seen), shutdown_timeout=0.0, mailbox_size=32),
                worker("crasher", probe.ref),
            ],
            strategy=Strategy.ONE_FOR_ALL,
        )
        rx = sup.child("rx")
        await rx.tell(Hang(gate))
        await asyncio.sleep(0)
        for i in range(20):
            await rx.tell(i)
        asking: asyncio.Task[Any] = asyncio.create_task(rx.ask(lambda r: Hang(gate), timeout=5))
        await asyncio.sleep(0.01)
        await sup.child("crasher").tell("boom")  # ONE_FOR_ALL: cancels rx in its Hang
        await seen.until(20)
        # the queued ask's Hang is now in hand; cancel rx once more while it hangs
        await sup.child("crasher").tell("boom")
        with pytest.raises(ActorStopped):
            await asyncio.wait_for(asking, 1)
        await rx.tell("after")
        await seen.until(21)
        assert seen == [*range(20), "after"]
        stats = rx.statistics()
        assert stats.messages_received == 23 and stats.messages_processed == 21


def test_mailbox_keeps_a_message_whose_reader_was_cancelled_while_waking() -> None:
    """The exact race: a message arrives for a waiting reader, which is cancelled
    before it runs; the message stays queued for the next reader, exactly once."""

    async def main() -> None:
        mailbox = Mailbox("m", 4)
        reader = asyncio.create_task(mailbox.wait_readable())
        await asyncio.sleep(0)
        mailbox.put_nowait(Envelope("hello"))
        reader.cancel()  # woken and cancelled in the same loop iteration
        with pytest.raises(asyncio.CancelledError):
            await reader
        envelope = mailbox.pop()
        assert envelope is not None and envelope.message == "hello"
        assert mailbox.pop() is None

    asyncio.run(main())


async def test_ask_times_out_against_a_silent_callee_without_leaking_tasks() -> None:
    """ask raises AskTimeout when the callee never answers or hangs forever; it creates
    no task, and a late answer is a harmless no-op."""
    async with ActorSystem() as system:
        callee = Callee()
        ref = await system.spawn(callee, name="callee", shutdown_timeout=0.05)
        before = asyncio.all_tasks()
        started = time.monotonic()
        with pytest.raises(AskTimeout):
            await ref.ask(Never, timeout=0.05)
        with pytest.raises(TimeoutError):  # AskTimeout is a TimeoutError
            await ref.ask(lambda r: ("hang", r), timeout=0.05)
        assert time.monotonic() - started < 1.0
        assert asyncio.all_tasks() == before
        late = callee.kept[0]
        assert late.done
        late.send(1)  # the asker gave up: no-op
        with pytest.raises(RuntimeError):
            late.send(2)


async def test_ask_to_an_actor_that_dies_before_replying_raises_actor_stopped_fast() -> None:
    """If the callee fails while handling the ask, the asker gets ActorStopped (caused
    by the failure) at once rather than waiting for its timeout -- whether the callee
    stops for good or is restarted."""
    async with ActorSystem() as system:
        unsupervised = await system.spawn(Callee, name="callee")
        sup = await system.spawn_supervisor("sup", [ChildSpec("callee", Callee)])
        for ref in (unsupervised, sup.child("callee")):
            started = time.monotonic()
            with pytest.raises(ActorStopped) as raised:
                await ref.ask(lambda r: ("boom", r), timeout=30)
            assert time.monotonic() - started < 1.0
            assert isinstance(raised.value.__cause__, Boom)
        assert not unsupervised.is_alive
        assert await sup.child("callee").ask(lambda r: ("ok", r), timeout=1) == "ok"


async def test_ask_raises_what_the_callee_failed_the_reply_with() -> None:
    """reply.fail(error) makes ask raise error; reply.send(value) makes it return value."""
    async with ActorSystem() as system:
        ref = await system.spawn(Callee, name="callee")
        assert await ref.ask(lambda r: (42, r), timeout=1) == 42
        with pytest.raises(ValueError, match="bad request"):
            await ref.ask(lambda r: ("fail", r), timeout=1)


async def test_reply_is_one_shot() -> None:
    """A reply can be answered once; a second answer raises RuntimeError."""
    async with ActorSystem() as system:
        replies: list[Reply[Any]] = []

        class Twice(Actor[Any]):
            async def receive(self, message: Any) -> None:
                message.send(1)
                replies.append(message)
                assert message.done

        ref = await system.spawn(Twice, name="twice")
        assert await ref.ask(lambda r: r, timeout=1) == 1
        with pytest.raises(RuntimeError, match="already sent"):
            replies[0].send(2)
        with pytest.raises(RuntimeError):
            replies[0].fail(ValueError())


async def test_message_to_a_stopped_actor_is_a_dead_letter() -> None:
    """tell, try_tell and ask to a stopped actor raise ActorStopped at once, and each
    counts (and logs) a dead letter with the message type."""
    async with ActorSystem() as system:
        probe = await TestProbe.spawn(system)
        ref = await system.spawn(Worker("w", probe.ref), name="w")
        await system.stop(ref)
        assert not ref.is_alive
        with capture_logs() as logs:
            with pytest.raises(ActorStopped):
                await ref.tell("hello")
            with pytest.raises(ActorStopped):
                ref.try_tell(3)
            with pytest.raises(ActorStopped):
                await ref.ask(Ping, timeout=5)
        assert system.dead_letters == 3 and ref.statistics().dead_letters == 3
        letters = [entry for entry in logs if entry["event"] == "actor.dead_letter"]
        assert [entry["message_type"] for entry in letters] == ["str", "int", "Ping"]
        assert all(entry["actor"] == "w" for entry in letters)


async def test_messages_left_in_the_mailbox_become_dead_letters() -> None:
    """Stopping for good counts every message still queued as a dead letter, fails any
    queued ask with ActorStopped, and wakes senders blocked on the full mailbox."""
    gate = asyncio.Event()
    async with ActorSystem() as system:
        ref = await system.spawn(Collector([]), name="c", mailbox_size=2, shutdown_timeout=0.05)
        await ref.tell(Hang(gate))
        await asyncio.sleep(0)
        await ref.tell(1)
        asking = asyncio.create_task(ref.ask(lambda r: ("q", r), timeout=5))
        blocked = asyncio.create_task(ref.tell(2))
        await asyncio.sleep(0.01)
        await system.stop(ref)  # cancelled in its Hang after 0.05 s
        with pytest.raises(ActorStopped):
            await asking
        with pytest.raises(ActorStopped):
            await blocked
        assert system.dead_letters == 3


async def test_statistics_report_the_mailbox() -> None:
    """MailboxStatistics counts what was received and processed."""
    async with ActorSystem() as system:
        probe = await TestProbe.spawn(system)
        ref = await system.spawn(Worker("w", probe.ref), name="w", mailbox_size=8)
        for i in range(3):
            await ref.tell(i)
        await take(probe, 4)
        stats = ref.statistics()
        assert stats.messages_received == 3 and stats.messages_processed == 3
        assert stats.current_buffer_used == 0 and stats.max_buffer_size == 8
