"""A counter actor under a supervisor: it crashes, is restarted, and keeps serving.

    python examples/supervised_counter.py

Uses only :mod:`stoic.runtime`, the generic runtime (nothing of the inference engine). It shows
typed messages, ``tell`` and ``ask``, a crash, the supervisor's ``on_failure`` hook, the restart
(a fresh instance behind the same ``ActorRef``; messages queued meanwhile are kept) and the
restart intensity: a third crash within the window makes the supervisor give up (escalate).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

import structlog

from stoic.runtime import (
    Actor,
    ActorRef,
    ActorSystem,
    ChildFailure,
    ChildSpec,
    Reply,
    SupervisorEscalation,
)


@dataclass(frozen=True)
class Add:
    amount: int


@dataclass(frozen=True)
class Get:
    reply: Reply[int]


@dataclass(frozen=True)
class Crash:
    why: str


CounterMsg = Add | Get | Crash


class Counter(Actor[CounterMsg]):
    """Counts. Its state lives in the instance: a restart starts again from zero."""

    def __init__(self) -> None:
        self.value = 0

    async def on_start(self) -> None:
        print(f"  counter: incarnation {self.context.incarnation} started, value {self.value}")

    async def receive(self, message: CounterMsg) -> None:
        match message:
            case Add(amount=amount):
                self.value += amount
            case Get(reply=reply):
                reply.send(self.value)
            case Crash(why=why):
                raise RuntimeError(why)  # fails this incarnation; the supervisor decides


async def on_failure(failure: ChildFailure) -> None:
    """Awaited by the supervisor after the crash and before the restart (stoic's engine
    runs its recovery procedure here). Returning None counts the failure toward the restart
    intensity; returning False would exempt it."""
    print(f"  on_failure: incarnation {failure.incarnation} died of {failure.reason!r}")


async def on_escalate(escalation: SupervisorEscalation) -> None:
    print(f"  on_escalate: {escalation}")


async def demo(system: ActorSystem) -> None:
    supervisor = await system.spawn_supervisor(
        "counter-supervisor",
        [ChildSpec("counter", Counter, on_failure=on_failure, mailbox_size=16)],
        max_restarts=2,  # more than 2 restarts ...
        within=10.0,  # ... within 10 seconds: give up
        on_escalate=on_escalate,
    )
    counter: ActorRef[CounterMsg] = supervisor.child("counter")  # stable across restarts
    for _ in range(3):
        await counter.tell(Add(1))
    value: int = await counter.ask(Get, timeout=1.0)  # ask builds Get(reply) and awaits the reply
    print("value:", value)

    print("crash once:")
    await counter.tell(Crash("bad input"))
    await counter.tell(Add(10))  # queued while the counter restarts; the new incarnation gets it
    value = await counter.ask(Get, timeout=1.0)
    print("value after the restart:", value)
    print("restarts so far:", supervisor.statistics().restart_count)

    print("crash twice more, quickly:")
    await counter.tell(Crash("again"))
    await counter.tell(Crash("and again"))
    escalation = await asyncio.wait_for(system.wait_failed(), timeout=5.0)
    print(f"the supervisor gave up after {escalation.restarts} failures in the window;")
    print("the counter is alive:", counter.is_alive)


def quiet_logs() -> None:
    """Show the runtime's warnings and errors as one line each, without tracebacks."""

    def drop_traceback(_logger: Any, _method: str, event: MutableMapping[str, Any]) -> Any:
        event.pop("exc_info", None)
        return event

    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            drop_traceback,
            structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
    )


async def main() -> None:
    quiet_logs()
    try:
        async with ActorSystem("example") as system:
            await demo(system)
    except SupervisorEscalation as exc:
        # a top-level supervisor's escalation is re-raised when the system's block is left
        print(f"leaving the system re-raised it: {type(exc).__name__}")


if __name__ == "__main__":
    asyncio.run(main())
