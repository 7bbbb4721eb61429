"""OTP-style supervisors: restart strategies, sliding-window intensity, escalation.

A supervisor is itself an actor (private ``_SupervisorActor``) whose mailbox
receives its children's exits, so supervision is event-driven and handled
one exit at a time.  Its ``on_start`` starts the children in order, its
``on_stop`` stops them in reverse order, and giving up is that actor failing
with :class:`SupervisorEscalation`: under a parent supervisor that is an
ordinary child failure; at the top level the system records it.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn, TypeVar

import anyio

from ._actor import Actor
from ._cell import ActorCell, _describe, expected_failure
from ._exceptions import ActorStopped, SupervisorEscalation
from ._intensity import RestartWindow
from ._ref import ActorRef
from ._reply import Reply
from ._spec import Backoff, ChildFailure, ChildSpec, Restart, Strategy

if TYPE_CHECKING:
    from ._system import ActorSystem

__all__ = ["Supervisor", "SupervisorStatistics"]

M = TypeVar("M")

#: margin on top of the children's shutdown timeouts for a supervisor's own stop
_SHUTDOWN_MARGIN = 5.0


class SupervisorStatistics(NamedTuple):
    """A snapshot of one supervisor."""

    #: children it has, stopped-for-good ones included
    children: int
    #: children whose current incarnation is running
    running: int
    #: restarts carried out since it was spawned (one per handled exit)
    restart_count: int
    #: restarts counted in the current sliding intensity window
    restarts_in_window: int
    #: times it gave up and escalated
    escalations: int
    #: failures a child's ``on_failure`` hook exempted from the intensity (restarted, not
    #: counted)
    exempted: int


@dataclass
class _Child:
    spec: ChildSpec[Any]
    cell: ActorCell
    #: added by start_child: forgotten once stopped for good (declared ones stay listed)
    dynamic: bool = False
    finished: bool = False


class _ChildExited(NamedTuple):
    cell: ActorCell
    incarnation: int
    reason: BaseException | None


class _StartChild(NamedTuple):
    child: _Child
    reply: Reply[None]


class _TerminateChild(NamedTuple):
    cell: ActorCell
    reply: Reply[None]


class _SupervisorActor(Actor[Any]):
    """The actor behind a :class:`Supervisor`; one instance per incarnation."""

    def __init__(self, supervisor: Supervisor) -> None:
        self._supervisor = supervisor

    async def on_start(self) -> None:
        await self._supervisor._start_all()

    async def receive(self, message: Any) -> None:
        supervisor = self._supervisor
        if isinstance(message, _ChildExited):
            await supervisor._on_child_exited(message)
        elif isinstance(message, _StartChild):
            try:
                await supervisor._start_child(message.child)
            except Exception as exc:
                message.reply.fail(exc)
            else:
                message.reply.send(None)
        elif isinstance(message, _TerminateChild):
            await supervisor._terminate_now(message.cell)
            message.reply.send(None)

    async def on_stop(self) -> None:
        await self._supervisor._stop_children()

    def failure_expected(self, error: BaseException) -> bool:
        """Giving up is this actor's way of failing (``supervisor.escalated`` reports it), and a
        child's start failure that the child expects is expected here too: it only passes on."""
        if isinstance(error, SupervisorEscalation):
            return True
        return any(expected_failure(c.cell.instance, error) for c in self._supervisor._children)


class Supervisor:
    """Starts children, restarts them per :class:`Strategy`, and gives up when
    they fail too often.

    Create with :meth:`ActorSystem.spawn_supervisor`.  More than
    ``max_restarts`` restarts within ``within`` seconds (a sliding window on
    the system clock) makes it stop all children in reverse start order and
    escalate.  A failure the child's ``on_failure`` hook exempts (it returns
    ``False``) is restarted without being counted.  The handle and every child
    reference stay valid across restarts, including restarts of this
    supervisor by its parent.
    """

    def __init__(
        self,
        system: ActorSystem,
        name: str,
        children: Sequence[ChildSpec[Any]],
        *,
        strategy: Strategy,
        max_restarts: int,
        within: float,
        backoff: Backoff,
        on_escalate: Callable[[SupervisorEscalation], Awaitable[None]] | None,
        seed: int | None,
        parent: Supervisor | None,
    ) -> None:
        names = [spec.name for spec in children]
        if len(set(names)) != len(names):
            raise ValueError(f"child names of supervisor {name!r} are not unique: {names}")
        self._system = system
        self.name = name
        self.strategy = strategy
        #: the restart intensity (:class:`RestartWindow`: ``max_restarts`` within ``within`` s)
        self.intensity = RestartWindow(max_restarts, within)
        self.backoff = backoff
        self._on_escalate = on_escalate
        self._rng = random.Random(seed)
        self._parent = parent
        self._escalations = 0
        #: restarts carried out since spawned (one per handled exit)
        self.restart_count = 0
        self._cell = ActorCell(
            system,
            name,
            lambda: _SupervisorActor(self),
            mailbox_size=math.inf,
            shutdown_timeout=_SHUTDOWN_MARGIN,
            supervisor=parent,
            owner=self,
        )
        self._cell.finalize_callbacks.append(self._finalize_children)
        self._children = [_Child(spec, self._new_cell(spec)) for spec in children]
        self._update_shutdown_timeout()

    def _new_cell(self, spec: ChildSpec[Any]) -> ActorCell:
        return ActorCell(
            self._system,
            spec.name,
            spec.factory,
            mailbox_size=spec.mailbox_size,
            shutdown_timeout=spec.shutdown_timeout,
            supervisor=self,
        )

    def _update_shutdown_timeout(self) -> None:
        budget = sum(child.cell.shutdown_timeout for child in self._children)
        self._cell.shutdown_timeout = budget + _SHUTDOWN_MARGIN
        if self._parent is not None:
            self._parent._update_shutdown_timeout()

    # -- public ------------------------------------------------------------------

    @property
    def ref(self) -> ActorRef[Any]:
        """The reference of the supervisor itself (to watch it, for instance)."""
        return self._cell.ref

    def child(self, name: str) -> ActorRef[Any]:
        """Return the stable reference of the child called ``name``.

        :raises KeyError: if there is no such child.
        """
        for child in self._children:
            if child.spec.name == name:
                return child.cell.ref
        raise KeyError(f"supervisor {self.name!r} has no child {name!r}")

    async def start_child(self, spec: ChildSpec[M]) -> ActorRef[M]:
        """Add a child after the existing ones and start it; return once started.

        :raises ValueError: if a child of that name exists.
        :raises ActorStopped: if this supervisor has stopped for good.
        :raises Exception: what the child's factory or ``on_start`` raised.
        """
        child = _Child(spec, self._new_cell(spec), dynamic=True)
        await self._adopt(child)
        return child.cell.ref

    async def stop(self) -> None:
        """Stop all children in reverse start order, then the supervisor, for good."""
        await self._system.stop(self.ref)

    def statistics(self) -> SupervisorStatistics:
        return SupervisorStatistics(
            children=len(self._children),
            running=sum(1 for child in self._children if child.cell.running),
            restart_count=self.restart_count,
            restarts_in_window=self.intensity.count(self._system.clock.now()),
            escalations=self._escalations,
            exempted=self.intensity.exempted,
        )

    def __repr__(self) -> str:
        return f"<Supervisor {self.name!r} {self.strategy.name} children={len(self._children)}>"

    # -- called from outside the supervisor's task ---------------------------------

    async def _adopt(self, child: _Child) -> None:
        try:
            await self._cell.ref.ask(lambda reply: _StartChild(child, reply), timeout=math.inf)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await child.cell.stop()
            child.cell.finalize(child.cell.last_reason)
            raise

    async def _terminate(self, cell: ActorCell) -> None:
        with contextlib.suppress(ActorStopped):  # if the supervisor is gone, so is the child
            await self._cell.ref.ask(lambda reply: _TerminateChild(cell, reply), timeout=math.inf)

    def _as_child(self) -> _Child:
        """This supervisor as a PERMANENT child of its parent."""
        return _Child(ChildSpec(self.name, self._cell.factory), self._cell, dynamic=True)

    def _child_exited(
        self, cell: ActorCell, incarnation: int, reason: BaseException | None
    ) -> None:
        if self._cell.dead:
            cell.finalize(reason)
        else:
            self._cell.deliver_system(_ChildExited(cell, incarnation, reason))

    def _finalize_children(self) -> None:
        for child in reversed(self._children):
            child.finished = True
            child.cell.finalize(child.cell.last_reason)

    def _finish(self, child: _Child, reason: BaseException | None) -> None:
        """Stop ``child`` for good; it is never restarted again."""
        child.finished = True
        if child.dynamic:
            self._children.remove(child)
            self._update_shutdown_timeout()
        child.cell.finalize(reason)

    # -- called from the supervisor's own task ------------------------------------

    async def _start_all(self) -> None:
        self.intensity.clear()
        started: list[_Child] = []
        for child in self._children:
            if child.finished or child.cell.running:
                continue
            try:
                await child.cell.start()
            except BaseException:
                for done in reversed(started):
                    await done.cell.stop()
                raise
            started.append(child)

    async def _stop_children(self, children: Sequence[_Child] | None = None) -> None:
        for child in reversed(self._children if children is None else children):
            await child.cell.stop()

    async def _start_child(self, child: _Child) -> None:
        if any(other.spec.name == child.spec.name for other in self._children):
            raise ValueError(f"supervisor {self.name!r} already has a child {child.spec.name!r}")
        await child.cell.start()
        self._children.append(child)
        self._update_shutdown_timeout()

    async def _terminate_now(self, cell: ActorCell) -> None:
        for child in self._children:
            if child.cell is cell:
                await cell.stop()
                self._finish(child, cell.last_reason)
                return

    async def _on_child_exited(self, exit: _ChildExited) -> None:
        for child in self._children:
            if child.cell is exit.cell:
                cell = child.cell
                stale = cell.incarnation != exit.incarnation or cell.running
                if not (child.finished or cell.dead or stale):
                    await self._recover(child, exit.reason)
                return

    def _affected(self, child: _Child) -> list[_Child]:
        live = [c for c in self._children if not c.finished]
        if self.strategy is Strategy.ONE_FOR_ONE:
            return [child]
        if self.strategy is Strategy.ONE_FOR_ALL:
            return live
        return live[live.index(child) :]

    async def _recover(self, child: _Child, reason: BaseException | None) -> None:
        while True:
            log = child.cell.log
            if not child.spec.restart.should_restart(reason):
                self._finish(child, reason)
                return
            now = self._system.clock.now()
            window = self.intensity
            attempt = window.count(now)
            counted = True
            if reason is not None and child.spec.on_failure is not None:
                last = attempt + 1 > window.max_restarts
                try:
                    verdict = await child.spec.on_failure(
                        ChildFailure(reason, child.cell.incarnation, last)
                    )
                except Exception as exc:
                    window.add(now)
                    await self._escalate(child, exc, "its on_failure hook raised")
                counted = verdict is not False
            if counted:
                window.add(now)
            else:
                window.exempted += 1
            if window.exceeded:
                await self._escalate(child, reason, f"it exited {window.counted} times")
            affected = self._affected(child)
            await self._stop_children([c for c in affected if c is not child])
            restart: list[_Child] = []
            for sibling in affected:
                if sibling is child or sibling.spec.restart is not Restart.TEMPORARY:
                    restart.append(sibling)
                else:
                    self._finish(sibling, sibling.cell.last_reason)
            delay = self.backoff.delay(attempt, self._rng)
            # an expected failure's restart is reported by whoever recovers from it
            quiet = expected_failure(child.cell.instance, reason)
            (log.debug if quiet else log.warning)(
                "actor.restarting",
                supervisor=self.name,
                reason=_describe(reason),
                delay=delay,
                restarts=[c.spec.name for c in restart],
                counted=counted,
            )
            if delay > 0 and not await self._sleep(delay):
                return  # we are being stopped; the children stay down
            self.restart_count += 1
            self._system._count_restart()
            failure = await self._start_some(restart, child, reason)
            if failure is None:
                return
            child, reason = failure

    async def _start_some(
        self, children: list[_Child], failed: _Child, reason: BaseException | None
    ) -> tuple[_Child, BaseException] | None:
        for child in children:
            try:
                await child.cell.start(reason if child is failed else None)
            except Exception as exc:
                return child, exc
        return None

    async def _sleep(self, delay: float) -> bool:
        """Sleep on the system clock; False if a stop request cut it short."""
        cell = self._cell
        if cell.stop_requested:
            return False
        with anyio.CancelScope() as scope:
            cell.stop_callbacks.append(scope.cancel)
            try:
                await self._system.clock.sleep(delay)
            finally:
                cell.stop_callbacks.remove(scope.cancel)
        return not scope.cancel_called

    async def _escalate(self, child: _Child, error: BaseException | None, why: str) -> NoReturn:
        window = self.intensity
        restarts = window.counted
        self._escalations += 1
        await self._stop_children()
        escalation = SupervisorEscalation(
            f"supervisor {self.name!r} gave up on child {child.spec.name!r}: {why} "
            f"(at most {window.max_restarts} restarts within {window.within} s)",
            supervisor=self.name,
            child=child.spec.name,
            restarts=restarts,
        )
        escalation.__cause__ = error  # the hook below sees it, as the supervisor's parent does
        self._cell.log.error(
            "supervisor.escalated",
            child=child.spec.name,
            restarts=restarts,
            error=_describe(error),
        )
        if self._on_escalate is not None:
            try:
                await self._on_escalate(escalation)
            except Exception as exc:
                self._cell.log.error(
                    "supervisor.on_escalate_failed", error=_describe(exc), exc_info=exc
                )
        raise escalation from error
