"""Actors and helpers shared by the actor runtime tests."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from stoic.runtime import Actor, ActorRef, ChildSpec, Reply, Restart
from stoic.runtime.testing import TestProbe


class Boom(Exception):
    """The failure the test actors raise on purpose."""


@dataclass(frozen=True)
class Ping:
    """Ask a :class:`Worker` for its ``(name, incarnation)``."""

    reply: Reply[tuple[str, int]]


@dataclass(frozen=True)
class Hang:
    """Make a :class:`Worker` block in ``receive`` until ``gate`` is set (forever if never)."""

    gate: asyncio.Event


class Worker(Actor[Any]):
    """Reports its life to ``events``: ``("start"|"stop", name, incarnation)`` and
    ``("got", name, message)``; raises :class:`Boom` on ``"boom"``; stops itself on
    ``"stop"``; answers :class:`Ping`; blocks on :class:`Hang`."""

    def __init__(self, name: str, events: ActorRef[Any], *, log: list[Any] | None = None):
        self.name = name
        self.events = events
        self.log = log

    def _note(self, event: tuple[Any, ...]) -> None:
        if self.log is not None:
            self.log.append(event)
        self.events.try_tell(event)

    async def on_start(self) -> None:
        self._note(("start", self.name, self.context.incarnation))

    async def receive(self, message: Any) -> None:
        match message:
            case "boom":
                raise Boom(f"{self.name} exploded")
            case "stop":
                self.context.stop()
            case Ping(reply=reply):
                reply.send((self.name, self.context.incarnation))
            case Hang(gate=gate):
                await gate.wait()
            case _:
                self._note(("got", self.name, message))

    async def on_stop(self) -> None:
        self._note(("stop", self.name, self.context.incarnation))


def worker(
    name: str,
    events: ActorRef[Any],
    *,
    restart: Restart = Restart.PERMANENT,
    log: list[Any] | None = None,
    **kwargs: Any,
) -> ChildSpec[Any]:
    """A :class:`ChildSpec` for a :class:`Worker`."""
    return ChildSpec(name, lambda: Worker(name, events, log=log), restart=restart, **kwargs)


async def take(probe: TestProbe[Any], count: int, within: float = 1.0) -> list[Any]:
    """The next ``count`` messages of ``probe``."""
    return [await probe.expect_message(within) for _ in range(count)]


class Seen(list[Any]):
    """A list that tests can wait on until it holds enough items."""

    def __init__(self) -> None:
        super().__init__()
        self._grown = asyncio.Event()

    def append(self, item: Any) -> None:
        super().append(item)
        self._grown.set()

    async def until(self, count: int, within: float = 1.0) -> None:
        """Wait until at least ``count`` items were appended."""
        async with asyncio.timeout(within):
            while len(self) < count:
                self._grown.clear()
                await self._grown.wait()
