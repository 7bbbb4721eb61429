"""Declarative supervision settings: restart types, strategies, backoff, child specs."""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

from ._actor import Actor

__all__ = ["Backoff", "ChildFailure", "ChildSpec", "Restart", "Strategy"]

M = TypeVar("M")


class Restart(enum.Enum):
    """When a supervisor restarts a child whose incarnation ended on its own."""

    #: always restarted, even after a normal stop
    PERMANENT = "permanent"
    #: restarted only if it failed with an exception
    TRANSIENT = "transient"
    #: never restarted; also not restarted when a sibling's failure stops it
    TEMPORARY = "temporary"

    def should_restart(self, reason: BaseException | None) -> bool:
        if self is Restart.PERMANENT:
            return True
        return self is Restart.TRANSIENT and reason is not None


class Strategy(enum.Enum):
    """Which children a supervisor restarts when one of them has to be restarted."""

    #: only the child that exited
    ONE_FOR_ONE = "one_for_one"
    #: every child: the others are stopped in reverse start order, then all started in order
    ONE_FOR_ALL = "one_for_all"
    #: the child that exited and every child started after it, stopped and started likewise
    REST_FOR_ONE = "rest_for_one"


@dataclass(frozen=True)
class Backoff:
    """Exponential delay between a child's death and its restart.

    The defaults mean no delay at all (``initial`` is 0).

    :raises ValueError: on a negative ``initial``/``maximum``, a ``factor``
        below 1, or a ``jitter`` outside ``[0, 1]``.
    """

    #: delay before the first restart in a window, in clock seconds
    initial: float = 0.0
    #: growth per restart already counted in the window
    factor: float = 2.0
    #: cap on the delay, jitter included
    maximum: float = 5.0
    #: random spread, as a fraction of the delay: ``delay * (1 ± jitter)``
    jitter: float = 0.1

    def __post_init__(self) -> None:
        if not (self.initial >= 0 and self.maximum >= 0):
            raise ValueError("Backoff.initial and Backoff.maximum must be >= 0")
        if not self.factor >= 1:
            raise ValueError("Backoff.factor must be >= 1")
        if not 0 <= self.jitter <= 1:
            raise ValueError("Backoff.jitter must be within [0, 1]")

    def delay(self, attempt: int, rng: random.Random) -> float:
        """Return the delay before a restart.

        ``attempt`` is the number of restarts already counted in the current
        intensity window (0 for the first).  The result is
        ``min(maximum, initial * factor**attempt)``, spread by ``± jitter``,
        then clamped to ``[0, maximum]``.
        """
        if self.initial <= 0:
            return 0.0
        try:
            base = min(self.maximum, self.initial * self.factor ** max(attempt, 0))
        except OverflowError:
            base = self.maximum
        if self.jitter:
            base *= 1.0 + rng.uniform(-self.jitter, self.jitter)
        return 0.0 if math.isnan(base) else min(max(base, 0.0), self.maximum)


class ChildFailure(NamedTuple):
    """What a supervisor tells a child's ``on_failure`` hook about one failure."""

    #: the exception the child failed with
    reason: BaseException
    #: the incarnation that failed
    incarnation: int
    #: counted, this failure exceeds the restart intensity: unless the hook exempts it, the
    #: supervisor gives up after the hook instead of restarting the child
    last: bool


@dataclass(frozen=True)
class ChildSpec(Generic[M]):
    """How a supervisor starts, restarts and stops one child.

    :raises ValueError: on an empty name, a mailbox size below 1, or a
        negative shutdown timeout.
    """

    #: unique among the supervisor's children; also the actor's name
    name: str
    #: builds a fresh actor instance for every incarnation
    factory: Callable[[], Actor[M]]
    #: which exits are restarted
    restart: Restart = Restart.PERMANENT
    #: seconds (real time) to finish the message in hand and run ``on_stop``
    shutdown_timeout: float = 5.0
    #: capacity of the child's mailbox
    mailbox_size: int = 64
    #: awaited by the supervisor after the child failed, before it is restarted,
    #: with a :class:`ChildFailure`; runs even if the restart intensity is then
    #: exceeded; raising escalates like an exceeded intensity. It returns whether
    #: the failure counts toward the restart intensity: ``False`` exempts it (it is
    #: not recorded, and the child is restarted even if it was ``last``); ``None``
    #: or ``True`` counts it. The supervisor cannot bound exempt failures: a hook
    #: that exempts some must bound them itself.
    on_failure: Callable[[ChildFailure], Awaitable[bool | None]] | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("ChildSpec.name must not be empty")
        if self.mailbox_size < 1:
            raise ValueError("ChildSpec.mailbox_size must be at least 1")
        if self.shutdown_timeout < 0:
            raise ValueError("ChildSpec.shutdown_timeout must be >= 0")
