"""The guardian: watches the engine's long-lived actors and reports any crash as fatal."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, assert_never

from ..runtime import Actor, ActorRef, Terminated
from ._health import EngineHealth

__all__ = ["Guardian"]


class Guardian(Actor[Terminated]):
    """Death-watches ``refs``; when one stops with an error (a bug in the scheduler, say), the
    engine is marked failed instead of leaving callers waiting on an actor that no longer runs.
    A normal stop (shutdown) is not a failure.
    """

    def __init__(self, refs: Sequence[ActorRef[Any]], health: EngineHealth) -> None:
        self._refs = tuple(refs)
        self._health = health

    async def on_start(self) -> None:
        for ref in self._refs:
            self.context.watch(ref)

    async def receive(self, message: Terminated) -> None:
        match message:
            case Terminated(ref=ref, reason=reason):
                if reason is not None:
                    self.context.log.error(
                        "guardian.actor_crashed", crashed=ref.name, reason=repr(reason)
                    )
                    self._health.fail(
                        f"actor {ref.name!r} crashed: {type(reason).__name__}: {reason}"
                    )
            case _:
                assert_never(message)
