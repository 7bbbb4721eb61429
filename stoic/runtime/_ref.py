"""The stable, typed handle through which everyone talks to an actor."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, TypeVar

import anyio

from ._exceptions import AskTimeout
from ._mailbox import MailboxStatistics
from ._reply import Reply

if TYPE_CHECKING:
    from ._cell import ActorCell

__all__ = ["ActorRef"]

M = TypeVar("M")
R = TypeVar("R")


class ActorRef(Generic[M]):
    """A stable handle to one actor: the same object across all its restarts.

    The mailbox belongs to the reference, not to an incarnation: messages
    queued while the actor restarts are handled by the new incarnation.
    Messages from one sender are handled in the order sent.  References are
    created by the runtime (``spawn``, ``Supervisor.child``), never directly.
    """

    __slots__ = ("_cell",)

    def __init__(self, cell: ActorCell) -> None:
        self._cell = cell

    @property
    def name(self) -> str:
        return self._cell.name

    @property
    def is_alive(self) -> bool:
        """False once the actor has stopped for good (restarting still counts as alive)."""
        return not self._cell.dead

    async def tell(self, message: M) -> None:
        """Queue ``message``, waiting while the mailbox is full (backpressure).

        :raises ActorStopped: if the actor has stopped for good, or stops while
            this call waits for space; the message counts as a dead letter.
        """
        await self._cell.deliver(message)

    def try_tell(self, message: M) -> None:
        """Queue ``message`` now or not at all.

        :raises MailboxFull: if the mailbox is full (nothing is queued).
        :raises ActorStopped: if the actor has stopped for good; the message
            counts as a dead letter.
        """
        self._cell.deliver_nowait(message)

    async def ask(self, make: Callable[[Reply[R]], M], *, timeout: float) -> R:  # noqa: ASYNC109
        """Send ``make(reply)`` and wait for what the actor sends back on ``reply``.

        ``timeout`` (seconds, real time) covers waiting for mailbox space and
        for the answer; it is enforced here, so it fires even if the callee
        hangs.  On timeout or cancellation the reply is abandoned: a late answer
        is a no-op.  No task is created.

        :raises AskTimeout: if no answer came within ``timeout``.
        :raises ActorStopped: if the actor has stopped for good (a dead letter),
            or its incarnation ended after taking the message and before
            answering (its failure, if any, is the ``__cause__``).
        :raises BaseException: whatever the callee passed to ``reply.fail``.
        """
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        reply = Reply(future, self._cell.name)
        message = make(reply)
        try:
            with anyio.move_on_after(timeout):
                await self._cell.deliver(message, reply)
                return await future
        finally:
            reply._abandon()
        raise AskTimeout(f"{self._cell.name!r} did not reply within {timeout} s")

    def statistics(self) -> MailboxStatistics:
        """Return a snapshot of this actor's mailbox."""
        return self._cell.mailbox.statistics()

    def __repr__(self) -> str:
        state = "alive" if self.is_alive else "stopped"
        return f"<ActorRef {self._cell.name!r} {state}>"
