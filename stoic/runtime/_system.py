"""The actor system: owns every actor task, spawns, stops and shuts down in order."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from types import TracebackType
from typing import Any, NamedTuple, TypeVar

import anyio

from ._actor import Actor
from ._cell import ActorCell
from ._clock import Clock, MonotonicClock
from ._exceptions import SupervisorEscalation
from ._log import get_logger
from ._ref import ActorRef
from ._spec import Backoff, ChildSpec, Strategy
from ._supervisor import Supervisor

__all__ = ["ActorSystem", "SystemStatistics"]

M = TypeVar("M")

_logger = get_logger("stoic.runtime")
_NO_BACKOFF = Backoff()


class SystemStatistics(NamedTuple):
    """A snapshot of an actor system."""

    #: actors not stopped for good (restarting ones and supervisors included)
    actors: int
    #: supervisors not stopped for good
    supervisors: int
    #: messages that could not be delivered, see :attr:`ActorSystem.dead_letters`
    dead_letters: int
    #: restarts carried out by all supervisors together
    restarts: int
    #: whether a top-level supervisor escalated (see :attr:`ActorSystem.failure`)
    failed: bool


class ActorSystem:
    """Home of a tree of actors; use as ``async with ActorSystem() as system:``.

    Leaving the block stops every top-level actor and supervisor in reverse
    start order (supervisors stop their children in reverse start order
    first), each gracefully within its shutdown timeout and cancelled after
    it, so no task is left behind.  If a top-level supervisor escalated and
    the block itself raised nothing, leaving it raises that
    :class:`SupervisorEscalation`.

    Runs on asyncio (plain, or anyio's asyncio backend); all calls must come
    from the event loop it was entered on.
    """

    def __init__(self, name: str = "stoic", *, clock: Clock | None = None) -> None:
        self.name = name
        self._clock: Clock = clock if clock is not None else MonotonicClock()
        self._state = "new"
        self._top: dict[str, ActorCell] = {}
        self._cells: dict[ActorCell, None] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._dead_letters = 0
        self._restarts = 0
        self._failure: SupervisorEscalation | None = None
        self._failed = asyncio.Event()
        self._log = _logger.bind(system=name)

    # -- context manager -----------------------------------------------------------

    async def __aenter__(self) -> ActorSystem:
        if self._state != "new":
            raise RuntimeError(f"actor system {self.name!r} cannot be entered twice")
        self._state = "running"
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with anyio.CancelScope(shield=True):
            await self._shutdown()
        if exc is None and self._failure is not None:
            raise self._failure

    async def _shutdown(self) -> None:
        if self._state != "running":
            return
        self._state = "closing"
        for cell in reversed(list(self._top.values())):
            await cell.stop()
            cell.finalize(cell.last_reason)
        # Whatever is left was cut short (a supervisor cancelled mid-stop, say).
        leftover = [task for task in self._tasks if not task.done()]
        for task in leftover:
            task.cancel()
        if leftover:
            await asyncio.wait(leftover)
        for cell in reversed(list(self._cells)):
            cell.finalize(cell.last_reason)
        self._state = "closed"

    # -- public --------------------------------------------------------------------

    @property
    def clock(self) -> Clock:
        """The clock supervisors measure restart windows and backoff delays on."""
        return self._clock

    @property
    def dead_letters(self) -> int:
        """Messages never delivered: sent to stopped actors, or left in their
        mailboxes when they stopped for good."""
        return self._dead_letters

    @property
    def failure(self) -> SupervisorEscalation | None:
        """The escalation of a top-level supervisor, or None."""
        return self._failure

    async def wait_failed(self) -> SupervisorEscalation:
        """Wait until a top-level supervisor escalates; return its escalation."""
        await self._failed.wait()
        assert self._failure is not None
        return self._failure

    def statistics(self) -> SystemStatistics:
        return SystemStatistics(
            actors=len(self._cells),
            supervisors=sum(1 for cell in self._cells if cell.owner is not None),
            dead_letters=self._dead_letters,
            restarts=self._restarts,
            failed=self._failure is not None,
        )

    async def spawn(
        self,
        actor: Actor[M] | Callable[[], Actor[M]],
        *,
        name: str,
        mailbox_size: int = 64,
        shutdown_timeout: float = 5.0,
    ) -> ActorRef[M]:
        """Start an unsupervised top-level actor; return once its ``on_start`` completed.

        ``actor`` is an instance or a factory called once.  If it fails later it
        stops for good (its watchers get ``Terminated(ref, error)``).

        :raises RuntimeError: if the system is not running (not entered, or shutting down).
        :raises ValueError: if a top-level actor of that name is alive, or the sizes are invalid.
        :raises Exception: what the factory or ``on_start`` raised.
        """
        self._check_name(name)
        factory: Callable[[], Actor[Any]]
        if isinstance(actor, Actor):
            instance: Actor[Any] = actor
            factory = lambda: instance  # noqa: E731
        else:
            factory = actor
        cell = ActorCell(
            self, name, factory, mailbox_size=mailbox_size, shutdown_timeout=shutdown_timeout
        )
        await self._start_top_level(cell)
        return cell.ref

    async def spawn_supervisor(
        self,
        name: str,
        children: Sequence[ChildSpec[Any]],
        *,
        strategy: Strategy = Strategy.ONE_FOR_ONE,
        max_restarts: int = 3,
        within: float = 5.0,
        backoff: Backoff = _NO_BACKOFF,
        on_escalate: Callable[[SupervisorEscalation], Awaitable[None]] | None = None,
        seed: int | None = None,
        parent: Supervisor | None = None,
    ) -> Supervisor:
        """Start a supervisor and its children in order; return once all started.

        With ``parent``, the new supervisor is added as the last (PERMANENT)
        child of ``parent``: its escalation is then a child failure that
        ``parent`` handles by its own strategy and intensity.  Otherwise it is
        top level and its escalation becomes :attr:`failure`.

        :raises RuntimeError: if the system is not running.
        :raises ValueError: on a duplicate name or invalid settings.
        :raises ActorStopped: if ``parent`` has stopped for good.
        :raises Exception: what a child's factory or ``on_start`` raised (the
            children already started are stopped again in reverse order).
        """
        if parent is None:
            self._check_name(name)
        else:
            self._check_running()
        supervisor = Supervisor(
            self,
            name,
            children,
            strategy=strategy,
            max_restarts=max_restarts,
            within=within,
            backoff=backoff,
            on_escalate=on_escalate,
            seed=seed,
            parent=parent,
        )
        if parent is None:
            await self._start_top_level(supervisor._cell)
        else:
            await parent._adopt(supervisor._as_child())
        return supervisor

    async def stop(self, ref: ActorRef[Any]) -> None:
        """Stop an actor for good: it finishes the message in hand and runs
        ``on_stop``; it is cancelled if it outlives its shutdown timeout.

        A supervised actor is removed from its supervisor (never restarted);
        a supervisor stops its children first.  A no-op if already stopped.

        :raises RuntimeError: if called from the actor's own task (use
            ``context.stop()`` there).
        """
        cell = ref._cell
        if cell.dead:
            return
        if cell.is_current():
            raise RuntimeError(f"actor {cell.name!r} cannot await its own stop")
        if cell.supervisor is not None:
            await cell.supervisor._terminate(cell)
            return
        await cell.stop()
        cell.finalize(cell.last_reason)

    def __repr__(self) -> str:
        return f"<ActorSystem {self.name!r} {self._state} actors={len(self._cells)}>"

    # -- runtime internals ---------------------------------------------------------

    def _check_running(self) -> None:
        if self._state != "running":
            raise RuntimeError(f"actor system {self.name!r} is not running ({self._state})")

    def _check_name(self, name: str) -> None:
        self._check_running()
        if not name:
            raise ValueError("actor names must not be empty")
        if name in self._top:
            raise ValueError(f"a top-level actor named {name!r} is already alive")

    async def _start_top_level(self, cell: ActorCell) -> None:
        self._top[cell.name] = cell
        try:
            await cell.start()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await cell.stop()
            cell.finalize(cell.last_reason)
            raise

    def _register(self, cell: ActorCell) -> None:
        self._cells[cell] = None

    def _cell_finalized(self, cell: ActorCell) -> None:
        self._cells.pop(cell, None)
        if self._top.get(cell.name) is cell:
            del self._top[cell.name]

    def _create_task(self, coro: Coroutine[Any, Any, None], *, name: str) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _count_dead_letter(self) -> None:
        self._dead_letters += 1

    def _count_restart(self) -> None:
        self._restarts += 1

    def _record_failure(self, escalation: SupervisorEscalation) -> None:
        if self._failure is None:
            self._failure = escalation
            self._log.error(
                "system.failed", supervisor=escalation.supervisor, child=escalation.child
            )
            self._failed.set()
