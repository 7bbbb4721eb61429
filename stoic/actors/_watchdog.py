"""The step watchdog's rule: a step is hung when its progress counter has not moved for the step
timeout, however long the step has run. A slow step (a busy machine, a big batch) keeps ticking
(:class:`stoic.model.StepProgress`: once per decoder layer) and is never called hung.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["ProgressWatch"]

#: the watcher looks at least this often, and at most every second
_MIN_INTERVAL = 0.01
_MAX_INTERVAL = 1.0


class ProgressWatch:
    """Watches one step's progress counter (``read``: its current value) from the moment it is
    created (just before the step is sent).

    The caller calls :meth:`stalled` every :attr:`interval` seconds. A change is seen at the
    next look, so a hang is reported between ``timeout`` and ``timeout + interval`` seconds
    after the last tick.
    """

    def __init__(
        self,
        read: Callable[[], int],
        timeout: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read = read
        self._clock = clock
        self.timeout = timeout
        #: how often to look: a quarter of the timeout, at most a second
        self.interval = min(_MAX_INTERVAL, max(_MIN_INTERVAL, timeout / 4))
        self._first = self._last = read()
        self.started = self._changed = clock()

    def stalled(self) -> bool:
        """Look at the counter: whether it has not moved for ``timeout`` seconds."""
        now, value = self._clock(), self._read()
        if value != self._last:
            self._last, self._changed = value, now
        return now - self._changed >= self.timeout

    @property
    def ticks(self) -> int:
        """Ticks seen since the step was sent (1 at its start, then 1 per decoder layer)."""
        return self._last - self._first

    def fields(self) -> dict[str, Any]:
        """What a log event says about the step: seconds since its last progress and since it
        was sent, and its ticks."""
        now = self._clock()
        return {
            "since_progress": round(now - self._changed, 2),
            "step_seconds": round(now - self.started, 2),
            "ticks": self.ticks,
        }
