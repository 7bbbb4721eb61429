"""The ``stoic`` command's first module (its console script, and ``python -m stoic``).

SIGINT and SIGTERM exit the process at once, status 0 and printing nothing, from before anything
heavy is imported (the CLI's own imports: pydantic, structlog, asyncio; then torch): a
:class:`KeyboardInterrupt` raised inside an import ends in a traceback. This module imports
nothing but the standard library's smallest modules, and neither does ``import stoic``
(:mod:`stoic`'s names are imported at first use). :mod:`stoic.cli._signals` takes it from here.

At the top of the package, not in :mod:`stoic.cli`: importing ``stoic.cli.anything`` runs the
package's ``__init__``, which imports the whole CLI (structlog, pydantic, asyncio).
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

__all__ = ["SIGNALS", "exit_at_once", "main", "quiet_signals"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: the handlers :func:`quiet_signals` replaced (Python's own), what the command restores
_replaced: dict[int, Any] = {}


def exit_at_once(signum: int, frame: object) -> None:
    """The handler: exit, status 0, nothing else (a log line could re-enter the stream the main
    thread is writing)."""
    os._exit(0)


def quiet_signals() -> dict[int, Any]:
    """Make SIGINT and SIGTERM :func:`exit_at_once`; the handlers in place before the first
    call (a later call, the handlers already these, returns the same). In the main thread only
    (elsewhere nothing changes, and this returns ``{}``)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    for signum in SIGNALS:
        previous = signal.signal(signum, exit_at_once)
        if previous is not exit_at_once:
            _replaced[signum] = previous
    return dict(_replaced)


def main() -> int:
    """The ``stoic`` command (:func:`stoic.cli.main`), its signals quiet before it is imported;
    returns its exit status."""
    quiet_signals()
    from .cli import main as cli_main

    return cli_main()
