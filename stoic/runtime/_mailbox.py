"""The bounded FIFO mailbox every actor reads its messages from.

A purpose-built queue rather than an anyio memory object stream because the
runtime needs three things the stream does not give directly: closing wakes
blocked senders with :class:`ActorStopped` and hands back what was still
queued (to count dead letters); the single reader pops synchronously after
waking, so cancelling a reader that waits never loses a message; and the
runtime can queue system messages (``Terminated``, supervisor notices) past
the bound, so they are never blocked or dropped.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from typing import Any, NamedTuple

from ._exceptions import ActorStopped, MailboxFull
from ._reply import Reply

__all__ = ["Envelope", "Mailbox", "MailboxStatistics"]


class Envelope:
    """One queued message, with the reply channel of the ``ask`` that sent it."""

    __slots__ = ("message", "reply", "system")

    def __init__(self, message: Any, reply: Reply[Any] | None = None, *, system: bool = False):
        self.message = message
        self.reply = reply
        #: queued by the runtime itself: bypasses the bound, never a dead letter
        self.system = system


class MailboxStatistics(NamedTuple):
    """A snapshot of one actor's mailbox."""

    #: messages queued and not yet taken by the actor
    current_buffer_used: int
    #: capacity for ordinary messages (``math.inf`` when unbounded)
    max_buffer_size: float
    #: senders blocked in ``tell``/``ask`` waiting for space
    tasks_waiting_send: int
    #: messages ever accepted into the mailbox
    messages_received: int
    #: messages whose ``receive`` returned normally, all incarnations together
    messages_processed: int
    #: messages to this actor that were never delivered (see ``ActorSystem.dead_letters``)
    dead_letters: int


class Mailbox:
    """Bounded FIFO of :class:`Envelope` with one reader and any number of writers."""

    def __init__(self, owner: str, size: float) -> None:
        if not (size >= 1):
            raise ValueError(f"mailbox size must be at least 1, got {size!r}")
        self._owner = owner
        self._size = size if math.isinf(size) else int(size)
        self._items: deque[Envelope] = deque()
        self._putters: deque[asyncio.Future[None]] = deque()
        self._getter: asyncio.Future[None] | None = None
        self.closed = False
        self.received = 0
        self.processed = 0
        self.dead_letters = 0

    def __len__(self) -> int:
        return len(self._items)

    def full(self) -> bool:
        return len(self._items) >= self._size

    def _stopped(self) -> ActorStopped:
        return ActorStopped(f"actor {self._owner!r} has stopped")

    def put_nowait(self, envelope: Envelope) -> None:
        """Queue ``envelope`` now; system envelopes ignore the bound.

        :raises ActorStopped: if the mailbox is closed.
        :raises MailboxFull: if an ordinary envelope finds it full.
        """
        if self.closed:
            raise self._stopped()
        if not envelope.system and (self.full() or self._waiting_putters()):
            raise MailboxFull(f"the mailbox of {self._owner!r} is full ({self._size} messages)")
        self._append(envelope)

    async def put(self, envelope: Envelope) -> None:
        """Queue ``envelope``, waiting (in FIFO order with other senders) for space.

        :raises ActorStopped: if the mailbox is or gets closed first.
        """
        if self.closed:
            raise self._stopped()
        if self.full() or self._waiting_putters():
            retry = False
            while True:
                future = asyncio.get_running_loop().create_future()
                if retry:  # woken, but another sender took the slot: stay first in line
                    self._putters.appendleft(future)
                else:
                    self._putters.append(future)
                try:
                    await future
                except BaseException:
                    if not future.done():
                        future.cancel()
                    if future in self._putters:
                        self._putters.remove(future)
                    elif not future.cancelled():
                        self._wake_putter()  # hand the slot we were given to the next sender
                    raise
                if self.closed:
                    raise self._stopped()
                if not self.full():
                    break
                retry = True
        self._append(envelope)

    def _append(self, envelope: Envelope) -> None:
        self._items.append(envelope)
        self.received += 1
        getter, self._getter = self._getter, None
        if getter is not None and not getter.done():
            getter.set_result(None)

    def _waiting_putters(self) -> bool:
        return bool(self._putters)

    def _wake_putter(self) -> None:
        while self._putters and not self.full():
            future = self._putters.popleft()
            if not future.done():
                future.set_result(None)
                return

    def pop(self) -> Envelope | None:
        """Take the oldest envelope, or None when empty; frees a slot for a blocked sender."""
        if not self._items:
            return None
        envelope = self._items.popleft()
        self._wake_putter()
        return envelope

    async def wait_readable(self) -> None:
        """Return once a message is queued, :meth:`wake` is called, or it gets closed."""
        if self._items or self.closed:
            return
        future = asyncio.get_running_loop().create_future()
        self._getter = future
        try:
            await future
        finally:
            if self._getter is future:
                self._getter = None

    def wake(self) -> None:
        """Make a pending :meth:`wait_readable` return (used to deliver stop requests)."""
        getter, self._getter = self._getter, None
        if getter is not None and not getter.done():
            getter.set_result(None)

    def close(self) -> list[Envelope]:
        """Refuse every further message, wake blocked senders, return what was queued."""
        self.closed = True
        left = list(self._items)
        self._items.clear()
        while self._putters:
            future = self._putters.popleft()
            if not future.done():
                future.set_result(None)
        self.wake()
        return left

    def statistics(self) -> MailboxStatistics:
        return MailboxStatistics(
            current_buffer_used=len(self._items),
            max_buffer_size=self._size,
            tasks_waiting_send=len(self._putters),
            messages_received=self.received,
            messages_processed=self.processed,
            dead_letters=self.dead_letters,
        )
