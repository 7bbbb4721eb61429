"""The public surface other packages are written against."""

from __future__ import annotations

import stoic.runtime
from stoic.runtime import AskTimeout, SupervisorEscalation


def test_public_names_are_exported() -> None:
    """Every name the engine imports is exported from stoic.runtime."""
    expected = {
        "Actor",
        "ActorRef",
        "ActorContext",
        "Reply",
        "ActorSystem",
        "Supervisor",
        "ChildSpec",
        "Restart",
        "Strategy",
        "Backoff",
        "Terminated",
        "Clock",
        "MonotonicClock",
        "ActorError",
        "ActorStopped",
        "MailboxFull",
        "AskTimeout",
        "SupervisorEscalation",
        "MailboxStatistics",
        "SystemStatistics",
    }
    assert expected <= set(stoic.runtime.__all__)
    assert all(hasattr(stoic.runtime, name) for name in stoic.runtime.__all__)


def test_exception_hierarchy() -> None:
    """All runtime errors share ActorError; AskTimeout is also a TimeoutError; an
    escalation carries who gave up on whom and how often."""
    assert issubclass(AskTimeout, TimeoutError)
    for name in ("ActorStopped", "MailboxFull", "AskTimeout", "SupervisorEscalation"):
        assert issubclass(getattr(stoic.runtime, name), stoic.runtime.ActorError)
    error = SupervisorEscalation("gave up", supervisor="sup", child="w", restarts=4)
    assert (error.supervisor, error.child, error.restarts, str(error)) == ("sup", "w", 4, "gave up")


def test_monotonic_clock_is_a_clock() -> None:
    """MonotonicClock satisfies the Clock protocol and never goes backwards."""
    clock = stoic.runtime.MonotonicClock()
    assert isinstance(clock, stoic.runtime.Clock)
    assert clock.now() <= clock.now()
