"""The stats board: where every engine replica posts its statistics and health, for the ingress
to export as metrics and answer ``/health`` with (a Serve handle cannot address one replica, so
the replicas report instead of being asked)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

__all__ = ["BOARD_NAMESPACE", "Posting", "StatsBoard"]

#: the Ray namespace of the named board actor
BOARD_NAMESPACE = "stoic"


@dataclass(frozen=True, slots=True)
class Posting:
    """One replica's latest report."""

    replica: str
    #: the replica's process
    pid: int
    #: :class:`~stoic.EngineStats`
    stats: Any
    #: :class:`~stoic.Health`
    health: Any
    #: when the board received it (``time.monotonic()`` of the board's process)
    received: float


class StatsBoard:
    """Latest posting per replica; a replica silent for ``expiry`` seconds is gone (it died or
    was stopped: Serve starts a new one under a new id). Run as a named Ray actor."""

    def __init__(self, expiry: float = 5.0) -> None:
        self._expiry = expiry
        self._postings: dict[str, Posting] = {}

    def post(self, replica: str, pid: int, stats: Any, health: Any) -> None:
        self._postings[replica] = Posting(replica, pid, stats, health, time.monotonic())

    def leave(self, replica: str) -> None:
        """The replica stopped (its ``__del__``)."""
        self._postings.pop(replica, None)

    def read(self) -> list[Posting]:
        """The postings of the replicas alive, by replica id."""
        now = time.monotonic()
        for replica in [r for r, p in self._postings.items() if now - p.received > self._expiry]:
            del self._postings[replica]
        return sorted(self._postings.values(), key=lambda p: p.replica)
