"""stoic's loggers (:func:`get_logger`): structlog on top of the standard :mod:`logging` module,
quiet unless asked.

The definition is :mod:`stoic.runtime._log`: the actor runtime logs too and imports nothing else
of stoic's, so the one definition lives in the lowest layer and this module, the name the rest of
stoic imports, re-exports it. Its docstring states the contract (logger names, the ``stoic``
:class:`logging.NullHandler`, the processor chain).
"""

from __future__ import annotations

from .runtime._log import PROCESSORS, StoicLogger, get_logger, to_logging

__all__ = ["PROCESSORS", "StoicLogger", "get_logger", "to_logging"]
