"""stoic's loggers: structlog on top of the standard :mod:`logging` module, quiet unless asked.

Every logger stoic uses is :func:`get_logger`'s: a :class:`structlog.stdlib.BoundLogger` over
the stdlib logger of the same name (``stoic.engine``, ``stoic.runtime``, ``stoic.http``...),
children of ``stoic``, which carries a :class:`logging.NullHandler` and nothing else. So an
application embedding stoic decides: nothing is printed until it configures :mod:`logging`
(``logging.basicConfig(level=logging.INFO)`` shows stoic's events as ``event key=value`` lines),
and stoic never touches the root logger or structlog's global configuration.

It lives in the runtime, the lowest layer, because the runtime logs too and must import nothing
else of stoic's (an import-linter contract): every other layer reaches it through
:mod:`stoic._logging`, which re-exports it, so there is one definition of stoic's loggers.

The processor chain is structlog's global one once the application (or ``stoic serve``, or
:func:`structlog.testing.capture_logs`) has called :func:`structlog.configure`; until then it is
:data:`PROCESSORS`, which drops events below the stdlib logger's level, merges the context
variables (``request_id``) and hands the event dictionary to :mod:`logging` in a form both plain
:class:`logging.Formatter` and :class:`structlog.stdlib.ProcessorFormatter` understand.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

__all__ = ["PROCESSORS", "StoicLogger", "get_logger", "to_logging"]

_ROOT = "stoic"
logging.getLogger(_ROOT).addHandler(logging.NullHandler())


def _value(value: Any) -> str:
    if isinstance(value, str) and value and not any(c.isspace() or c == "=" for c in value):
        return value
    return repr(value)


class _Event(dict[str, Any]):
    """A structlog event dictionary as a :class:`logging.LogRecord`'s ``msg``.

    :class:`structlog.stdlib.ProcessorFormatter` reads the dictionary; any other formatter
    calls ``str()``: ``engine.started model=SmolLM2-135M-Instruct kv_blocks=1456``.
    """

    def __str__(self) -> str:
        fields = " ".join(
            f"{key}={_value(value)}"
            for key, value in self.items()
            if key not in ("event", "exc_info", "stack_info")
        )
        event = str(self.get("event", ""))
        return f"{event} {fields}" if fields else event


def to_logging(
    logger: WrappedLogger, method_name: str, event_dict: EventDict
) -> tuple[tuple[_Event], dict[str, Any]]:
    """The last processor: the arguments of the stdlib logger's call.

    Like :meth:`structlog.stdlib.ProcessorFormatter.wrap_for_formatter`, plus a readable
    ``str()`` of the message and the exception (``exc_info``) on the record itself, for formatters
    that are not structlog's.
    """
    kwargs: dict[str, Any] = {"extra": {"_logger": logger, "_name": method_name}}
    exc_info = event_dict.get("exc_info")
    if exc_info:
        kwargs["exc_info"] = exc_info
    return (_Event(event_dict),), kwargs


#: the chain used while structlog is not configured
PROCESSORS: list[Processor] = [
    structlog.stdlib.filter_by_level,
    structlog.contextvars.merge_contextvars,
    to_logging,
]


class StoicLogger(structlog.stdlib.BoundLogger):
    """A stdlib bound logger whose processors are looked up at each event: structlog's
    configured chain if there is one, :data:`PROCESSORS` otherwise."""

    @property
    def _processors(self) -> Iterable[Processor]:
        if structlog.is_configured():
            processors: Iterable[Processor] = structlog.get_config()["processors"]
            return processors
        return PROCESSORS

    @_processors.setter
    def _processors(self, _value: Iterable[Processor]) -> None:
        pass  # BoundLoggerBase.__init__ and bind() pass one along: always looked up instead


def get_logger(name: str) -> StoicLogger:
    """The structlog logger for ``name``, a stdlib logger under ``stoic``."""
    if name != _ROOT and not name.startswith(_ROOT + "."):
        raise ValueError(f"not a stoic logger name: {name!r}")
    return StoicLogger(logging.getLogger(name), PROCESSORS, {})
