"""Restart intensity: OTP's ``MaxR`` restarts in ``MaxT`` seconds, over a sliding window."""

from __future__ import annotations

from collections import deque

__all__ = ["RestartWindow"]


class RestartWindow:
    """The restarts a supervisor counted, each at the time it happened; one leaves the window
    ``within`` seconds later. More than ``max_restarts`` in the window is too many: the
    supervisor gives up (a limit over the whole lifetime would fail a long-running service
    for failures spread over months).

    :raises ValueError: ``max_restarts`` below 0 or ``within`` not above 0.
    """

    def __init__(self, max_restarts: int, within: float) -> None:
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts!r}")
        if not within > 0:
            raise ValueError(f"within must be > 0, got {within!r}")
        self.max_restarts = max_restarts
        self.within = within
        self._times: deque[float] = deque()
        #: failures the child's ``on_failure`` hook exempted (restarted, not counted)
        self.exempted = 0

    def count(self, now: float) -> int:
        """The restarts in the window that ends at ``now`` (older ones leave it)."""
        times = self._times
        while times and times[0] <= now - self.within:
            times.popleft()
        return len(times)

    def add(self, now: float) -> None:
        """Count a restart at ``now``."""
        self._times.append(now)

    @property
    def exceeded(self) -> bool:
        """More restarts in the window than ``max_restarts`` (as of the last :meth:`count`)."""
        return len(self._times) > self.max_restarts

    @property
    def counted(self) -> int:
        """The restarts in the window as of the last :meth:`count` or :meth:`add`."""
        return len(self._times)

    def clear(self) -> None:
        """Forget every restart (the supervisor itself was restarted)."""
        self._times.clear()
