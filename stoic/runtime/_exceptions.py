"""Every exception the actor runtime raises, in one flat module."""

from __future__ import annotations

__all__ = [
    "ActorError",
    "ActorStopped",
    "AskTimeout",
    "MailboxFull",
    "SupervisorEscalation",
]


class ActorError(Exception):
    """Base class of the errors raised by the actor runtime itself."""


class ActorStopped(ActorError):
    """The target actor has stopped for good, or died while handling an ``ask``.

    Raised by ``tell``/``try_tell``/``ask`` on a stopped actor (the message is
    counted as a dead letter), by a sender blocked on a full mailbox when its
    target stops, and by ``ask`` when the callee's incarnation ended before it
    replied (the failure, if any, is chained as ``__cause__``).
    """


class MailboxFull(ActorError):
    """``try_tell`` found the target's bounded mailbox full; nothing was queued."""


class AskTimeout(ActorError, TimeoutError):
    """``ask`` got no reply within its timeout.

    Also a :class:`TimeoutError`, so code that handles timeouts generically
    catches it too.
    """


class SupervisorEscalation(ActorError):
    """A supervisor exceeded its restart intensity and gave up.

    The last error of the failing child is chained as ``__cause__``.
    """

    #: name of the supervisor that gave up
    supervisor: str
    #: name of the child whose failure exceeded the intensity
    child: str
    #: restarts counted in the sliding window, the one that overflowed included
    restarts: int

    def __init__(self, message: str, *, supervisor: str, child: str, restarts: int) -> None:
        super().__init__(message)
        self.supervisor = supervisor
        self.child = child
        self.restarts = restarts
