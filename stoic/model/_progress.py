"""A heartbeat for long blocking work: a log event every few seconds while it runs."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["heartbeat"]


@contextmanager
def heartbeat(log: Any, event: str, *, interval: float = 5.0, **fields: Any) -> Iterator[None]:
    """Log ``event`` with ``elapsed`` (seconds) every ``interval`` seconds while the block runs.

    The events come from a daemon thread: the block needs no cooperation. The thread is stopped
    and joined when the block exits, whether it returns or raises: no event is logged after it.
    """
    started = time.monotonic()
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(interval):
            log.info(event, elapsed=round(time.monotonic() - started, 1), **fields)

    thread = threading.Thread(target=beat, name="stoic-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
