"""``stoic serve`` and SIGINT/SIGTERM before the server handles them itself (a drain).

Three phases, so that a signal at any moment ends the command with status 0 and no traceback:

1. until the event loop runs (Python imports the CLI and torch, the model's file is checked):
   :func:`exit_on_signals` exits the process at once, printing nothing (from the command's first
   module on, before any heavy import: :mod:`stoic._entry`). Nothing that needs
   stopping has started, and a :class:`KeyboardInterrupt` raised inside an import would end in
   a traceback, or even an :class:`ImportError` (numpy's module cannot be initialised twice);
2. from the event loop on: :func:`cancel_on_signals` cancels the start-up, so what began is
   stopped (the port, a Ray cluster), and logs ``stoic.interrupted``;
3. once :func:`stoic.http.serve` installs its handlers: a drain (``http.signal``).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Callable, Iterator

from .._entry import SIGNALS, exit_at_once, quiet_signals
from .._logging import get_logger

__all__ = ["SIGNALS", "cancel_on_signals", "exit_on_signals"]

_log = get_logger("stoic.cli")


@contextlib.contextmanager
def exit_on_signals() -> Iterator[Callable[..., None]]:
    """SIGINT and SIGTERM exit the process at once, status 0, until the event loop handles them
    or the callable this yields restores the previous handlers (of the signals it is given; all
    by default, as leaving does). In the main thread only (elsewhere nothing changes)."""
    previous = quiet_signals()  # Python's own handlers, even if the entry point quieted them

    def restore(*signums: int) -> None:
        for signum in signums or SIGNALS:
            if signum in previous and signal.getsignal(signum) is exit_at_once:
                signal.signal(signum, previous[signum])

    try:
        yield restore
    finally:
        restore()


def cancel_on_signals() -> asyncio.Event:
    """SIGINT and SIGTERM cancel the calling task (until another handler replaces these: the
    server's); the event says a signal came. Call it from the task to cancel; in the main
    thread only (elsewhere nothing changes)."""
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    assert task is not None
    interrupted = asyncio.Event()

    def cancel(signum: signal.Signals) -> None:
        _log.info("stoic.interrupted", signal=signum.name)
        interrupted.set()
        task.cancel()

    if threading.current_thread() is threading.main_thread():  # signals reach that one only
        for signum in SIGNALS:
            loop.add_signal_handler(signum, cancel, signum)
    return interrupted
