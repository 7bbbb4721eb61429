"""How the runtime logs a failure: a bug at error level with its traceback, a failure the actor
expects (``Actor.failure_expected``) only at debug level, for its owner to report once."""

from __future__ import annotations

import asyncio
from collections.abc import MutableMapping
from typing import Any

from structlog.testing import capture_logs

from stoic.runtime import ActorRef, ActorSystem, ChildSpec
from stoic.runtime.testing import TestProbe

from .helpers import Boom, Worker, take


class Expecting(Worker):
    """A :class:`Worker` that expects its :class:`Boom` (and nothing else)."""

    def failure_expected(self, error: BaseException) -> bool:
        return isinstance(error, Boom)


class Raising(Worker):
    """A :class:`Worker` whose ``failure_expected`` itself fails: the failure counts as a bug."""

    def failure_expected(self, error: BaseException) -> bool:
        raise RuntimeError("no opinion")


async def _fail_once(factory: type[Worker]) -> list[MutableMapping[str, Any]]:
    """Spawn ``factory`` under a supervisor, make it fail once, let it restart: its events."""
    with capture_logs() as logs:
        await _run(factory)
    return [e for e in logs if e.get("actor") == "w"]


async def _run(factory: type[Worker]) -> None:
    async with ActorSystem() as system:
        probe = await TestProbe.spawn(system)
        events: ActorRef[Any] = probe.ref
        spec = ChildSpec("w", lambda: factory("w", events))
        sup = await system.spawn_supervisor("sup", [spec], max_restarts=3)
        await take(probe, 1)  # started
        await sup.child("w").tell("boom")
        await take(probe, 2)  # stopped, started again
        await asyncio.sleep(0)


#: the events of the failure and the restart (the shutdown's come after)
_FAILURE = [
    ("actor.started", 0),
    ("actor.failed", 0),
    ("actor.stopped", 0),
    ("actor.restarting", 0),
    ("actor.started", 1),
]


def _levels(events: list[MutableMapping[str, Any]]) -> dict[tuple[str, int], str]:
    """The level of each event of :data:`_FAILURE`."""
    levels = {(e["event"], e["incarnation"]): e["log_level"] for e in events}
    return {key: levels[key] for key in _FAILURE}


async def test_a_bug_is_an_error_with_its_traceback() -> None:
    """The default: ``actor.failed`` at error level with the exception (its traceback), the
    restart at warning, the stop and the new start at info."""
    events = await _fail_once(Worker)
    failed = next(e for e in events if e["event"] == "actor.failed")
    assert isinstance(failed["exc_info"], Boom) and failed["error"] == "Boom: w exploded"
    assert "expected" not in failed
    assert _levels(events) == {
        ("actor.started", 0): "info",
        ("actor.failed", 0): "error",
        ("actor.stopped", 0): "info",
        ("actor.restarting", 0): "warning",
        ("actor.started", 1): "info",
    }


async def test_an_expected_failure_is_logged_at_debug_only() -> None:
    """``failure_expected`` true: the same events, each at debug level (the traceback travels
    with the debug event only); the first start is still info."""
    events = await _fail_once(Expecting)
    failed = next(e for e in events if e["event"] == "actor.failed")
    assert failed["expected"] is True and isinstance(failed["exc_info"], Boom)
    assert _levels(events) == {
        ("actor.started", 0): "info",
        ("actor.failed", 0): "debug",
        ("actor.stopped", 0): "debug",
        ("actor.restarting", 0): "debug",
        ("actor.started", 1): "debug",
    }


async def test_a_failure_expected_that_raises_counts_as_a_bug() -> None:
    """A hook that raises cannot hide a failure: it is logged as a bug."""
    events = await _fail_once(Raising)
    assert _levels(events)[("actor.failed", 0)] == "error"
