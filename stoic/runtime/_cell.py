"""The runtime's record of one actor: mailbox, current incarnation, task, watchers.

A cell outlives the incarnations of its actor.  Its life:

* **idle**: created, or between two incarnations (messages queue up);
* **running**: an incarnation's task runs ``on_start``, then the message
  loop, then ``on_stop``;
* **dead** (:meth:`ActorCell.finalize`): the mailbox is closed, what was in
  it becomes dead letters, watchers get :class:`Terminated`.

When an incarnation ends on its own (failure or self-stop) the cell reports
to its supervisor, or finalizes itself if it has none.  When someone stops
it (:meth:`ActorCell.stop`), that someone decides what comes next.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from structlog.stdlib import BoundLogger

from ._actor import Actor, ActorContext, Terminated
from ._exceptions import ActorStopped, SupervisorEscalation
from ._log import get_logger
from ._mailbox import Envelope, Mailbox
from ._ref import ActorRef
from ._reply import Reply

if TYPE_CHECKING:
    from ._supervisor import Supervisor
    from ._system import ActorSystem

__all__ = ["ActorCell"]

_logger = get_logger("stoic.runtime")


def _describe(reason: BaseException | None) -> str | None:
    return None if reason is None else f"{type(reason).__name__}: {reason}"


def expected_failure(instance: Actor[Any] | None, error: BaseException | None) -> bool:
    """:meth:`Actor.failure_expected`, for a failure (``error`` not None); False if it raises."""
    if instance is None or error is None:
        return False
    try:
        return bool(instance.failure_expected(error))
    except Exception:
        return False


def _log_failure(log: BoundLogger, event: str, instance: Actor[Any], error: Exception) -> None:
    """A bug at error level with its traceback; an expected failure at debug level (its
    traceback shows only there)."""
    if expected_failure(instance, error):
        log.debug(event, error=_describe(error), expected=True, exc_info=error)
    else:
        log.error(event, error=_describe(error), exc_info=error)


class ActorCell:
    """Internal: one actor's mailbox and lifecycle.  Users only see its :class:`ActorRef`."""

    def __init__(
        self,
        system: ActorSystem,
        name: str,
        factory: Callable[[], Actor[Any]],
        *,
        mailbox_size: float,
        shutdown_timeout: float,
        supervisor: Supervisor | None = None,
        owner: Supervisor | None = None,
    ) -> None:
        if shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {shutdown_timeout!r}")
        self.system = system
        self.name = name
        self.factory = factory
        self.shutdown_timeout = shutdown_timeout
        #: the supervisor this actor reports its exits to (None: top level)
        self.supervisor = supervisor
        #: set when this cell runs a supervisor
        self.owner = owner
        self.mailbox = Mailbox(name, mailbox_size)
        self.ref: ActorRef[Any] = ActorRef(self)
        self.incarnation = -1
        self.instance: Actor[Any] | None = None
        self.dead = False
        self.last_reason: BaseException | None = None
        self.log = _logger.bind(actor=name, incarnation=-1)
        self.stop_callbacks: list[Callable[[], None]] = []
        self.finalize_callbacks: list[Callable[[], None]] = []
        self._task: asyncio.Task[None] | None = None
        self._stop_requested = False
        self._self_stop = False
        self._in_flight: set[Reply[Any]] = set()
        self._watchers: dict[ActorCell, None] = {}
        self._watching: dict[ActorCell, None] = {}
        system._register(self)

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def is_current(self) -> bool:
        """True when called from this actor's own task."""
        return self._task is not None and self._task is asyncio.current_task()

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested

    # -- sending -----------------------------------------------------------------

    async def deliver(self, message: Any, reply: Reply[Any] | None = None) -> None:
        try:
            await self.mailbox.put(Envelope(message, reply))
        except ActorStopped:
            self.dead_letter(message)
            raise

    def deliver_nowait(self, message: Any) -> None:
        try:
            self.mailbox.put_nowait(Envelope(message))
        except ActorStopped:
            self.dead_letter(message)
            raise

    def deliver_system(self, message: Any) -> None:
        """Queue a runtime message past the bound; dropped silently once dead."""
        if not self.mailbox.closed:
            self.mailbox.put_nowait(Envelope(message, system=True))

    def dead_letter(self, message: Any) -> None:
        self.mailbox.dead_letters += 1
        self.system._count_dead_letter()
        self.log.warning("actor.dead_letter", message_type=type(message).__qualname__)

    # -- lifecycle ---------------------------------------------------------------

    async def start(self, restart_error: BaseException | None = None) -> None:
        """Start the next incarnation; return once its ``on_start`` completed.

        ``restart_error`` is passed to the previous instance's ``pre_restart``.

        :raises ActorStopped: if the cell is dead.
        :raises Exception: what the factory or ``on_start`` raised (the
            incarnation is then over, and nobody else is told).
        """
        if self.dead:
            raise ActorStopped(f"actor {self.name!r} has stopped")
        if self.running:
            raise RuntimeError(f"actor {self.name!r} is already running")
        previous = self.instance
        instance = self.factory()
        self.incarnation += 1
        self._stop_requested = self._self_stop = False
        self.log = _logger.bind(actor=self.name, incarnation=self.incarnation)
        instance._stoic_context = ActorContext(self, self.incarnation, self.log)
        self.instance = instance
        started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._task = self.system._create_task(
            self._run(instance, previous, restart_error, started),
            name=f"actor:{self.name}#{self.incarnation}",
        )
        await started

    async def _run(
        self,
        instance: Actor[Any],
        previous: Actor[Any] | None,
        restart_error: BaseException | None,
        started: asyncio.Future[None],
    ) -> None:
        log = self.log
        reason: BaseException | None = None
        started_ok = False
        try:
            if previous is not None and restart_error is not None:
                try:
                    await previous.pre_restart(restart_error)
                except Exception as exc:
                    log.error("actor.pre_restart_failed", error=_describe(exc), exc_info=exc)
            try:
                await instance.on_start()
            except Exception as exc:
                reason = exc
                _log_failure(log, "actor.start_failed", instance, exc)
                if not started.done():
                    started.set_exception(exc)
                return
            started_ok = True
            if not started.done():
                started.set_result(None)
            # the restart after an expected failure is part of the recovery its owner reports
            quiet = expected_failure(previous, restart_error)
            (log.debug if quiet else log.info)("actor.started")
            try:
                await self._serve(instance)
            except Exception as exc:
                reason = exc
                _log_failure(log, "actor.failed", instance, exc)
            try:
                await instance.on_stop()
            except Exception as exc:
                log.error("actor.on_stop_failed", error=_describe(exc), exc_info=exc)
        finally:
            if not started.done():
                started.set_exception(ActorStopped(f"actor {self.name!r} stopped while starting"))
            self._incarnation_ended(reason, started_ok)

    async def _serve(self, instance: Actor[Any]) -> None:
        mailbox = self.mailbox
        while not (self._stop_requested or self._self_stop or self.dead):
            envelope = mailbox.pop()
            if envelope is None:
                await mailbox.wait_readable()
                continue
            reply = envelope.reply
            if reply is not None and not reply.done:
                self._in_flight.add(reply)
                reply._on_done = self._in_flight.discard
            await instance.receive(envelope.message)
            mailbox.processed += 1

    def _incarnation_ended(self, reason: BaseException | None, started_ok: bool) -> None:
        in_flight, self._in_flight = self._in_flight, set()
        for reply in list(in_flight):
            error = ActorStopped(f"actor {self.name!r} stopped before replying")
            error.__cause__ = reason
            reply._abort(error)
        self.last_reason = reason
        if not started_ok:
            return  # whoever awaits start() handles it
        quiet = expected_failure(self.instance, reason)
        (self.log.debug if quiet else self.log.info)("actor.stopped", reason=_describe(reason))
        if self._stop_requested or self.dead:
            return  # whoever stopped it handles it
        if self.supervisor is not None:
            self.supervisor._child_exited(self, self.incarnation, reason)
            return
        self.finalize(reason)
        if isinstance(reason, SupervisorEscalation) and self.owner is not None:
            self.system._record_failure(reason)

    def request_self_stop(self) -> None:
        self._self_stop = True
        self.mailbox.wake()

    async def stop(self, grace: float | None = None) -> None:
        """Stop the running incarnation gracefully; the cell stays idle afterwards.

        The actor finishes the message in hand and runs ``on_stop``; after
        ``grace`` seconds (default: the cell's shutdown timeout) its task is cancelled.
        A no-op when not running.  From the actor's own task it only requests
        the stop (as :meth:`ActorContext.stop` does) and returns.
        """
        task = self._task
        if task is None or task.done():
            return
        if task is asyncio.current_task():
            self.request_self_stop()
            return
        self._stop_requested = True
        self.mailbox.wake()
        for callback in list(self.stop_callbacks):
            callback()
        if grace is None:
            grace = self.shutdown_timeout
        done, _ = await asyncio.wait({task}, timeout=None if math.isinf(grace) else grace)
        if not done:
            self.log.warning("actor.shutdown_timeout", timeout=grace)
            task.cancel()
            await asyncio.wait({task})

    def finalize(self, reason: BaseException | None) -> None:
        """Mark the actor stopped for good: dead letters, ``Terminated`` to watchers."""
        if self.dead:
            return
        self.dead = True
        self.last_reason = reason
        if self._task is not None and not self._task.done() and not self.is_current():
            self._task.cancel()  # only on paths that were cut short; normally it is done
        for envelope in self.mailbox.close():
            if envelope.reply is not None:
                envelope.reply._abort(ActorStopped(f"actor {self.name!r} has stopped"))
            if not envelope.system:
                self.dead_letter(envelope.message)
        for callback in self.finalize_callbacks:
            callback()
        for target in self._watching:
            target._watchers.pop(self, None)
        self._watching.clear()
        for watcher in self._watchers:
            watcher.deliver_system(Terminated(self.ref, reason))
        self._watchers.clear()
        self.system._cell_finalized(self)
        self.log.info("actor.terminated", reason=_describe(reason))

    # -- death watch -------------------------------------------------------------

    def watch(self, target: ActorCell) -> None:
        if target is self or self.dead:
            return
        if target.dead:
            self.deliver_system(Terminated(target.ref, target.last_reason))
            return
        target._watchers[self] = None
        self._watching[target] = None

    def unwatch(self, target: ActorCell) -> None:
        target._watchers.pop(self, None)
        self._watching.pop(target, None)

    def __repr__(self) -> str:
        state = "dead" if self.dead else "running" if self.running else "idle"
        return f"<ActorCell {self.name!r} #{self.incarnation} {state}>"
