"""``stoic``'s parser and dispatch: ``stoic serve`` (the OpenAI-compatible server) and
``stoic cache`` (the converted models, :mod:`stoic.cli._cache`) from the command line.

Exit status: 0 after a clean shutdown (SIGINT/SIGTERM, whenever it arrives: see :func:`main`),
1 when the engine cannot start for another reason (the port is taken, the device fails, the
first worker process dies), 2 for a usage or configuration error (bad arguments; a model that
is missing or unusable, reported on one line), 70 when the engine fails and ``--exit-on-fatal``
is set.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Callable, Sequence

from .._logging import get_logger
from .._prestart import discard as discard_prestarted
from .._prestart import prestart
from .._version import installed_version
from ..errors import ModelUnavailable
from ._cache import add_cache_parser
from ._logs import configure_logging
from ._serve import serve
from ._serve_flags import add_serve_args, config_from_args
from ._server_flags import http_options
from ._signals import exit_on_signals

__all__ = ["build_parser", "main"]

_log = get_logger("stoic.cli")


def build_parser() -> argparse.ArgumentParser:
    """The ``stoic`` parser: ``--version``, and the ``serve`` and ``cache`` subcommands
    (without importing torch: ``stoic cache`` imports :mod:`stoic.gguf` when it runs)."""
    parser = argparse.ArgumentParser(
        prog="stoic", description="An LLM inference server that keeps serving through failures."
    )
    parser.add_argument("--version", action="version", version=f"stoic {installed_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_serve_args(sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API"))
    add_cache_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``stoic`` command; returns the exit status.

    SIGINT or SIGTERM at any moment ends ``stoic serve`` with status 0 and no traceback
    (:mod:`stoic.cli._signals`).
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
        from ._cache import run_cache

        return run_cache(args)
    if args.command != "serve":
        parser.print_help(sys.stderr)
        return 2
    if args.fault and not args.enable_fault_injection:
        parser.error("--fault needs --enable-fault-injection")  # exits with status 2
    try:
        config = config_from_args(args)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    if config.executor == "process" and args.replicas is None:
        # the worker's interpreter imports torch while this process does (stoic._prestart):
        # nothing before this line imports it
        prestart()
    try:
        try:
            access, limits = http_options(args)  # key files are read once, here
        except (ValueError, OSError) as exc:
            parser.error(str(exc))
        configure_logging(args.log_format, args.log_level)
        if not _model_usable(args.model, weights=args.load_format != "dummy", device=args.device):
            return 2
        # SIGINT cancels asyncio.run's task until serve() installs its handlers; SIGTERM exits
        restore_signals(signal.SIGINT)
        return asyncio.run(serve(args, access, limits))
    finally:
        discard_prestarted()  # nobody adopted it: the start failed first


def _model_usable(model: str, *, weights: bool, device: str) -> bool:
    """Check ``--model`` and a CUDA ``--device`` cheaply before anything starts
    (:func:`stoic.model.check_model_source`, :func:`stoic.model.resolve_device`).

    An unusable model or device is logged as one ``stoic.start_failed`` line, the only output,
    saying what is wrong and what to do; returns False then.
    """
    from ..model import check_model_source, resolve_device

    try:
        check_model_source(model, weights=weights)
        if device.startswith("cuda"):  # not a traceback from the first tensor moved there
            resolve_device(device)
    except ModelUnavailable as exc:
        _log.error("stoic.start_failed", error=type(exc).__name__, message=exc.message)
        return False
    return True
