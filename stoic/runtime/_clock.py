"""The clock the runtime measures restart windows and sleeps backoff delays on."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol, runtime_checkable

__all__ = ["Clock", "MonotonicClock"]


@runtime_checkable
class Clock(Protocol):
    """A source of monotonic time and of sleeps measured in that time.

    Supervisors read :meth:`now` for their sliding restart-intensity window
    and :meth:`sleep` for backoff delays, so tests can inject a clock they
    control (see :class:`stoic.runtime.testing.MockClock`).  Shutdown timeouts
    and ``ask`` timeouts are always real (event loop) time.
    """

    def now(self) -> float:
        """Return the current time in seconds; never decreases."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Return once ``seconds`` have passed on this clock (at once if ``<= 0``)."""
        ...


class MonotonicClock:
    """The real clock: :func:`time.monotonic` and :func:`asyncio.sleep`."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(seconds, 0.0))

    def __repr__(self) -> str:
        return "MonotonicClock()"
