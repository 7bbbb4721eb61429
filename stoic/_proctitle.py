"""The executor worker process's title, as ``ps`` and ``top`` show it.

``stoic: executor (starting)`` while it imports, ``(pre-started)`` once it waits for a model,
``(loading)``, ``(spare)`` once a warm spare, ``stoic: executor 3 (serving)`` while it runs
executor incarnation 3. The worker sets the first three itself; the server tells it the others
(``("role", role, incarnation)``, :meth:`stoic.executor._process.WorkerProcess.set_role`).

Through the ``setproctitle`` package (a dependency); without it the title stays the command
line (``python -m stoic._procmain FD PARENT_PID``) and nothing fails.

The executor's, not the CLI's, yet at the top of the package for :mod:`stoic._procmain`'s sake:
the worker sets its first title before it imports :mod:`stoic.executor` (and so torch, seconds),
and importing ``stoic.executor._proctitle`` would import the package first.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["set_title", "title"]

_setproctitle: Callable[[str], None] | None
try:
    from setproctitle import setproctitle as _setproctitle
except ImportError:  # pragma: no cover  (an installation without it)
    _setproctitle = None


def title(role: str, incarnation: int | None = None) -> str:
    """``stoic: executor (spare)``, ``stoic: executor 3 (serving)``..."""
    number = "" if incarnation is None else f" {incarnation}"
    return f"stoic: executor{number} ({role})"


def set_title(role: str, incarnation: int | None = None) -> None:
    """Set this process's title to :func:`title`; a no-op without ``setproctitle``."""
    if _setproctitle is not None:
        _setproctitle(title(role, incarnation))
