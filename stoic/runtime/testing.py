"""Test kit for code built on :mod:`stoic.runtime`.

* :class:`MockClock` -- a :class:`~stoic.runtime.Clock` whose time moves only
  when the test says so, to drive restart windows and backoff deterministically;
* :class:`TestProbe` -- an actor that records what it receives and offers
  ``expect_*`` assertions with (real-time) timeouts.
"""

# The expect_* timeouts are part of the assertion, not cancellation plumbing.
# ruff: noqa: ASYNC109

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections import deque
from typing import Any, Generic, TypeVar, overload

from ._actor import Actor, Terminated
from ._ref import ActorRef
from ._system import ActorSystem

__all__ = ["MockClock", "TestProbe"]

M = TypeVar("M")
T = TypeVar("T")


class MockClock:
    """A manual clock: ``now()`` changes only through :meth:`advance`.

    ``sleep(seconds)`` parks the caller until the clock is advanced past its
    deadline; ``sleep(0)`` (or less) only yields to the event loop.  There is
    no autojump: a test advances time itself, typically after
    :meth:`wait_for_sleepers` has shown that the code under test is parked.
    Every requested duration is appended to :attr:`sleeps`.
    """

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()
        self._watchers: list[asyncio.Future[None]] = []
        #: every duration passed to :meth:`sleep`, in call order
        self.sleeps: list[float] = []

    def now(self) -> float:
        return self._now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._now + seconds, next(self._seq), future))
        for watcher in self._watchers:
            if not watcher.done():
                watcher.set_result(None)
        self._watchers.clear()
        await future  # a cancelled future is skipped (and dropped) by advance()

    def advance(self, seconds: float) -> None:
        """Move time forward by ``seconds`` and wake every sleeper now due.

        The woken tasks run at the caller's next ``await``.

        :raises ValueError: if ``seconds`` is negative.
        """
        if seconds < 0:
            raise ValueError("time cannot go backwards")
        self._now += seconds
        while self._sleepers and self._sleepers[0][0] <= self._now:
            _, _, future = heapq.heappop(self._sleepers)
            if not future.done():
                future.set_result(None)

    @property
    def sleepers(self) -> int:
        """Number of tasks currently parked in :meth:`sleep`."""
        return sum(1 for _, _, future in self._sleepers if not future.done())

    @property
    def next_deadline(self) -> float:
        """The earliest deadline of a parked sleeper (``math.inf`` when none)."""
        pending = [deadline for deadline, _, future in self._sleepers if not future.done()]
        return min(pending, default=math.inf)

    async def wait_for_sleepers(self, count: int = 1, *, within: float = 1.0) -> None:
        """Wait (real time) until at least ``count`` tasks are parked in :meth:`sleep`.

        :raises AssertionError: if that does not happen within ``within`` seconds.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while self.sleepers < count:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise AssertionError(
                    f"expected {count} sleeper(s) on the mock clock, found {self.sleepers}"
                )
            watcher: asyncio.Future[None] = loop.create_future()
            self._watchers.append(watcher)
            try:
                await asyncio.wait({watcher}, timeout=remaining)
            finally:
                watcher.cancel()

    def __repr__(self) -> str:
        return f"MockClock(now={self._now}, sleepers={self.sleepers})"


class _ProbeActor(Actor[Any]):
    def __init__(self, probe: TestProbe[Any]) -> None:
        self._probe = probe

    async def receive(self, message: Any) -> None:
        self._probe._record(message)


class TestProbe(Generic[M]):
    """An actor that records every message it receives, for assertions.

    Create with :meth:`spawn`; hand :attr:`ref` to the code under test.  The
    ``expect_*`` methods consume recorded messages in arrival order; their
    timeouts are real time.  :attr:`received` keeps everything ever received.
    """

    __test__ = False  # not a pytest test class

    def __init__(self) -> None:
        self._ref: ActorRef[M] | None = None
        self._pending: deque[Any] = deque()
        self._waiter: asyncio.Future[None] | None = None
        #: every message received, in order (consumed or not)
        self.received: list[Any] = []

    @classmethod
    async def spawn(
        cls, system: ActorSystem, name: str = "probe", *, mailbox_size: int = 1024
    ) -> TestProbe[Any]:
        """Spawn a probe as a top-level actor of ``system``."""
        probe: TestProbe[Any] = cls()
        probe._ref = await system.spawn(_ProbeActor(probe), name=name, mailbox_size=mailbox_size)
        return probe

    @property
    def ref(self) -> ActorRef[M]:
        if self._ref is None:
            raise RuntimeError("create probes with `await TestProbe.spawn(system)`")
        return self._ref

    def watch(self, ref: ActorRef[Any]) -> None:
        """Have this probe receive ``Terminated`` once ``ref`` stops for good."""
        self.ref._cell.watch(ref._cell)

    def _record(self, message: Any) -> None:
        self.received.append(message)
        self._pending.append(message)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _wait(self, deadline: float) -> bool:
        loop = asyncio.get_running_loop()
        remaining = deadline - loop.time()
        if remaining <= 0:
            return False
        self._waiter = loop.create_future()
        try:
            await asyncio.wait({self._waiter}, timeout=remaining)
        finally:
            self._waiter.cancel()
            self._waiter = None
        return True

    @overload
    async def expect_message(self, timeout: float = ..., *, of_type: None = None) -> Any: ...

    @overload
    async def expect_message(self, timeout: float = ..., *, of_type: type[T]) -> T: ...

    async def expect_message(
        self, timeout: float = 1.0, *, of_type: type[Any] | None = None
    ) -> Any:
        """Return the next message, waiting up to ``timeout`` seconds.

        :raises AssertionError: if none arrives in time, or it is not an
            instance of ``of_type``.
        """
        deadline = asyncio.get_running_loop().time() + timeout
        while not self._pending:
            if not await self._wait(deadline):
                kind = "" if of_type is None else f" of type {of_type.__name__}"
                raise AssertionError(f"probe got no message{kind} within {timeout} s")
        message = self._pending.popleft()
        if of_type is not None and not isinstance(message, of_type):
            raise AssertionError(
                f"probe expected a message of type {of_type.__name__}, got {message!r}"
            )
        return message

    async def expect_no_message(self, within: float = 0.1) -> None:
        """Assert that no message arrives (or is already waiting) for ``within`` seconds.

        :raises AssertionError: naming the message that did arrive.
        """
        deadline = asyncio.get_running_loop().time() + within
        while not self._pending:
            if not await self._wait(deadline):
                return
        raise AssertionError(f"probe expected no message, got {self._pending[0]!r}")

    async def expect_terminated(self, ref: ActorRef[Any], timeout: float = 1.0) -> Terminated:
        """Watch ``ref`` and return its :class:`Terminated` notice.

        Other messages received meanwhile stay queued, in order, for later
        ``expect_message`` calls.

        :raises AssertionError: if ``ref`` does not terminate within ``timeout``.
        """
        self.watch(ref)
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            for message in self._pending:
                if isinstance(message, Terminated) and message.ref is ref:
                    self._pending.remove(message)
                    return message
            if not await self._wait(deadline):
                raise AssertionError(f"{ref!r} did not terminate within {timeout} s")
