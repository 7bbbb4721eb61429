"""``stoic serve``: the OpenAI-compatible server from the command line.

Exit status: 0 after a clean shutdown (SIGINT/SIGTERM, whenever it arrives: see :func:`main`),
1 when the engine cannot start for another reason (the port is taken, the device fails, the
first worker process dies), 2 for a usage or configuration error (bad arguments; a model that
is missing or unusable, reported on one line), 70 when the engine fails and ``--exit-on-fatal``
is set. ``stoic cache`` lists and prunes converted models (:mod:`stoic._cache_cli`).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import structlog

from ._cli_signals import cancel_on_signals, exit_on_signals
from ._http_args import http_options
from ._logging import PROCESSORS, get_logger
from ._serve_args import add_serve_args, config_from_args
from ._version import installed_version
from .errors import InsufficientMemory, ModelUnavailable, StoicError

__all__ = ["build_parser", "config_from_args", "configure_logging", "main"]

if TYPE_CHECKING:
    from .http import AccessPolicy, ServerLimits

_log = get_logger("stoic.cli")


def configure_logging(fmt: str = "console", level: str = "info") -> None:
    """Route structlog and stdlib logging to stderr, one event per line in JSON mode.

    Every event carries a timestamp, level, logger name and the context variables bound for
    the current request (``request_id``). This is the ``stoic`` command's (an application's)
    choice: it replaces the root logger's handlers and structlog's configuration. The library
    itself configures neither (:mod:`stoic._logging`).
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stoic", description="An LLM inference server that keeps serving through failures."
    )
    parser.add_argument("--version", action="version", version=f"stoic {installed_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_serve_args(serve)
    from ._cache_cli import add_cache_parser  # imports stoic.model, and so torch

    add_cache_parser(sub)
    return parser


async def _serve(args: argparse.Namespace, access: AccessPolicy, limits: ServerLimits) -> int:
    interrupted = cancel_on_signals()  # until serve() handles them
    try:
        return await _serve_until_stopped(args, access, limits)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if interrupted.is_set() and task is not None and task.uncancel() == 0:
            return 0
        raise


async def _serve_until_stopped(
    args: argparse.Namespace, access: AccessPolicy, limits: ServerLimits
) -> int:
    from .http import ResponseStore, default_responses_db, is_loopback, serve

    config = config_from_args(args)
    if args.replicas is not None:  # scale-out on Ray Serve (stoic.ray)
        from .ray._cli import serve_replicas

        return await serve_replicas(args, config, access, limits)
    if not access.api_keys and not is_loopback(args.host):
        _log.warning(
            "stoic.no_api_key",
            host=args.host,
            hint="anyone who reaches the port can generate: set --api-key or STOIC_API_KEY",
        )
    _log.info("stoic.starting", model=config.model, device=config.device, dtype=config.dtype)

    def ready(url: str, engine: Any) -> None:  # the Engine that serve() started
        stats = engine.stats()
        loaded = engine.loaded
        _log.info(
            "stoic.ready",
            url=url,
            model=engine.model_name,
            device=str(loaded.device),
            dtype=str(loaded.dtype).removeprefix("torch."),
            dense_dtype=str(loaded.dense_dtype or loaded.dtype).removeprefix("torch."),
            kv_cache_dtype=str(loaded.cache_dtype).removeprefix("torch."),
            kv_blocks=stats.kv_blocks_total,
            kv_tokens=stats.kv_blocks_total * config.block_size,
            max_model_len=engine.max_model_len,
            fault_injection=config.enable_fault_injection,
            exit_on_fatal=args.exit_on_fatal,
            api_keys=len(access.api_keys),
            admin_key=access.admin_key is not None,
        )

    try:
        responses = ResponseStore(
            args.responses_db or default_responses_db(), retention=args.responses_retention
        )
        # the port is bound before the model loads: /health says "starting" meanwhile, and a
        # taken port fails at once
        return await serve(
            config,
            host=args.host,
            port=args.port,
            drain_timeout=args.drain_timeout,
            exit_on_fatal=args.exit_on_fatal,
            on_ready=ready,
            access=access,
            limits=limits,
            responses=responses,
        )
    except StoicError as exc:
        _log.error("stoic.start_failed", error=type(exc).__name__, message=exc.message)
        # a bad --model, or memory the configuration cannot fit, is a configuration error
        return 2 if isinstance(exc, ModelUnavailable | InsufficientMemory) else 1
    except OSError as exc:  # e.g. the port is taken
        _log.error("stoic.start_failed", error=type(exc).__name__, message=str(exc))
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``stoic`` command; returns the exit status.

    SIGINT or SIGTERM at any moment ends ``stoic serve`` with status 0 and no traceback
    (:mod:`stoic._cli_signals`).
    """
    with exit_on_signals() as restore:
        try:
            return _main(argv, restore)
        except KeyboardInterrupt:  # after the server: it leaves Python's default handler
            return 0


def _main(argv: Sequence[str] | None, restore_signals: Callable[..., None]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command != "serve":
        restore_signals()  # Ctrl-C in `stoic cache prune` is an interruption, not a success
    if args.command == "cache":
        from ._cache_cli import run_cache

        return run_cache(args)
    if args.command != "serve":
        parser.print_help(sys.stderr)
        return 2
    if args.fault and not args.enable_fault_injection:
        parser.error("--fault needs --enable-fault-injection")  # exits with status 2
    try:
        config_from_args(args)
        access, limits = http_options(args)  # key files are read once, here
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    configure_logging(args.log_format, args.log_level)
    if not _model_usable(args.model):
        return 2
    # SIGINT cancels asyncio.run's task until _serve installs its handlers; SIGTERM exits
    restore_signals(signal.SIGINT)
    return asyncio.run(_serve(args, access, limits))


def _model_usable(model: str) -> bool:
    """Check ``--model`` cheaply before anything starts (:func:`stoic.model.check_model_source`).

    An unusable model is logged as one ``stoic.start_failed`` line, the only output, saying what
    is wrong and what to do; returns False then.
    """
    from .model import check_model_source

    try:
        check_model_source(model)
    except ModelUnavailable as exc:
        _log.error("stoic.start_failed", error=type(exc).__name__, message=exc.message)
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
