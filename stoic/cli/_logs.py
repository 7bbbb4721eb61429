"""How ``stoic serve`` logs: structlog and stdlib logging to stderr, readable or one JSON object a
line (``--log-format``), at ``--log-level``.

The command's (an application's) choice; the library configures no logging
(:mod:`stoic._logging`), and an embedding application may call :func:`configure_logging` too.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from typing import Any

import structlog

from .._logging import PROCESSORS

__all__ = ["configure_logging"]


def configure_logging(fmt: str = "console", level: str = "info") -> None:
    """Route structlog and stdlib logging to stderr, one event per line in JSON mode.

    Every event carries a timestamp, level, logger name and the context variables bound for
    the current request (``request_id``). This is the ``stoic`` command's (an application's)
    choice: it replaces the root logger's handlers and structlog's configuration. The library
    itself configures neither (:mod:`stoic._logging`).

    :raises KeyError: for a ``level`` that is not a logging level's name.
    """
    level_no = logging.getLevelNamesMapping()[level.upper()]
    # structlog's own events (stoic's and the application's) arrive as event dictionaries and
    # skip foreign_pre_chain; other libraries' records arrive as text and go through it
    enrich: list[Any] = [
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    # a traceback (only bugs carry one: expected failures are single events) shows the locals
    # of every frame only at debug level, where 20 lines a frame are what was asked for
    debug = level_no <= logging.DEBUG
    renderer: Any
    if fmt == "json":
        enrich.append(
            structlog.processors.ExceptionRenderer(
                structlog.tracebacks.ExceptionDictTransformer(show_locals=debug)
            )
        )
        renderer = structlog.processors.JSONRenderer()
        _quiet_progress_bars()
    else:
        renderer = structlog.dev.ConsoleRenderer(
            colors=sys.stderr.isatty(), exception_formatter=_exception_formatter(debug)
        )
    structlog.configure(
        processors=list(PROCESSORS),
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.contextvars.merge_contextvars],
            processors=[
                *enrich,
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                renderer,
            ],
        )
    )
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level_no)
    logging.captureWarnings(True)


def _exception_formatter(debug: bool) -> Any:
    """How the console shows a traceback: Python's own compact format, or at debug level rich's
    with every frame's locals (when rich is installed)."""
    if debug and importlib.util.find_spec("rich") is not None:
        return structlog.dev.RichTracebackFormatter(show_locals=True)
    return structlog.dev.plain_traceback


def _quiet_progress_bars() -> None:
    """No progress bars on stderr: in JSON mode every line must be a JSON object."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover
        return
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
