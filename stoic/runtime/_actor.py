"""The actor base class, its per-incarnation context, and the death-watch notice."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from structlog.stdlib import BoundLogger

if TYPE_CHECKING:
    from ._cell import ActorCell
    from ._ref import ActorRef
    from ._system import ActorSystem

__all__ = ["Actor", "ActorContext", "Terminated"]

M = TypeVar("M")


@dataclass(frozen=True)
class Terminated:
    """Delivered to every watcher once ``ref`` has stopped for good.

    ``reason`` is the exception the actor last failed with, or None when it
    stopped normally.  A supervised actor that is restarted has not
    terminated; it terminates when its supervisor gives up on it or stops.
    """

    ref: ActorRef[Any]
    reason: BaseException | None


class ActorContext(Generic[M]):
    """What an actor knows about itself during one incarnation.

    Created by the runtime; reach it through :attr:`Actor.context`.
    """

    __slots__ = ("_cell", "incarnation", "log")

    def __init__(self, cell: ActorCell, incarnation: int, log: BoundLogger) -> None:
        self._cell = cell
        #: 0 for the first start, +1 for each restart
        self.incarnation = incarnation
        #: structlog logger bound with ``actor=<name>`` and ``incarnation=<n>``
        self.log = log

    @property
    def ref(self) -> ActorRef[M]:
        """This actor's own stable reference."""
        return self._cell.ref

    @property
    def name(self) -> str:
        return self._cell.name

    @property
    def system(self) -> ActorSystem:
        return self._cell.system

    def watch(self, ref: ActorRef[Any]) -> None:
        """Receive ``Terminated(ref, reason)`` once ``ref`` stops for good.

        At once (well, queued at once) if it already has.  Watching twice is
        the same as once; the watch outlives restarts of this actor.  The
        notice bypasses the mailbox bound, so it is never blocked or dropped.
        """
        self._cell.watch(ref._cell)

    def unwatch(self, ref: ActorRef[Any]) -> None:
        """Stop watching ``ref``; a notice already queued is still delivered."""
        self._cell.unwatch(ref._cell)

    def stop(self) -> None:
        """Stop this actor normally once the message in hand is handled.

        An unsupervised actor then stops for good; a supervised one exits
        normally, which its :class:`Restart` type decides about.
        """
        self._cell.request_self_stop()


class Actor(abc.ABC, Generic[M]):
    """Base class of actors: subclass and implement :meth:`receive`.

    The runtime calls the hooks from the actor's own task, one at a time,
    never concurrently with each other: ``on_start``, then ``receive`` once
    per message, then ``on_stop``.  If ``on_start`` or ``receive`` raises,
    the actor has failed and its supervisor (if any) decides what happens.
    """

    _stoic_context: ActorContext[M] | None = None

    @property
    def context(self) -> ActorContext[M]:
        """The context of the current incarnation.

        :raises RuntimeError: before the actor was started (e.g. in ``__init__``).
        """
        context = self._stoic_context
        if context is None:
            raise RuntimeError(f"{type(self).__name__} has no context before it is started")
        return context

    async def on_start(self) -> None:
        """Run before the first message of each incarnation; ``spawn`` waits for it."""

    @abc.abstractmethod
    async def receive(self, message: M) -> None:
        """Handle one message; raising fails the actor."""

    async def on_stop(self) -> None:
        """Run on every stop after a successful ``on_start``: normal, failed, before a
        restart, on system shutdown.  Exceptions are logged and ignored.  Cancelled if
        the actor outlives its shutdown timeout."""

    async def pre_restart(self, error: BaseException) -> None:
        """Run on the failed instance, after its ``on_stop`` and just before the new
        instance starts.  Exceptions are logged and ignored."""

    def failure_expected(self, error: BaseException) -> bool:
        """Whether ``error``, which ``on_start`` or ``receive`` raised, is a failure this actor
        anticipates (a worker process died, a device ran out of memory) rather than a bug.

        The runtime logs a failure's own events (``actor.failed`` or ``actor.start_failed``,
        ``actor.stopped``, ``actor.restarting``, the next ``actor.started``) at error, warning
        and info level with the traceback of a bug; an expected failure's at debug level, the
        traceback only there: whoever recovers from it (a supervisor's ``on_failure`` hook)
        reports it, as one event. The default: no failure is expected. Must not raise (an
        exception counts as False).
        """
        return False
