"""Running ``stoic serve`` once its arguments are valid: the engine (or Ray replicas) behind the
HTTP server until a signal or a failure, the ``stoic.ready`` line, and the exit status of a start
that fails (1, or 2 for a configuration error)."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._logging import get_logger
from ..config import EngineConfig
from ..errors import InsufficientMemory, ModelUnavailable, StoicError
from ._serve_flags import config_from_args
from ._signals import cancel_on_signals

if TYPE_CHECKING:
    from ..http import AccessPolicy, ServerLimits

__all__ = ["serve"]

_log = get_logger("stoic.cli")


async def serve(args: argparse.Namespace, access: AccessPolicy, limits: ServerLimits) -> int:
    """Serve what ``args`` describe until a signal or a failure; return the exit status.

    Run by :func:`asyncio.run` in the main thread, the arguments already checked
    (:func:`~stoic.cli.config_from_args` and :func:`~stoic.cli.http_options` succeeded on them).
    SIGINT/SIGTERM cancel the start-up until the server handles them (:func:`cancel_on_signals`):
    0 then. A start that fails is logged as ``stoic.start_failed``: 2 for a configuration error
    (an unusable ``--model``, memory the configuration cannot fit), else 1 (the port is taken,
    the device fails...). Otherwise the server's own status (:func:`stoic.http.serve`).

    :raises asyncio.CancelledError: when cancelled by anything but a signal.
    """
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
    from ..http import ResponseStore, default_responses_db, is_loopback
    from ..http import serve as serve_http

    config = config_from_args(args)
    if args.replicas is not None:  # scale-out on Ray Serve (stoic.ray)
        from ..ray._cli import serve_replicas

        return await serve_replicas(args, config, access, limits)
    if not access.api_keys and not is_loopback(args.host):
        _log.warning(
            "stoic.no_api_key",
            host=args.host,
            hint="anyone who reaches the port can generate: set --api-key or STOIC_API_KEY",
        )
    _log.info("stoic.starting", model=config.model, device=config.device, dtype=config.dtype)
    try:
        responses = ResponseStore(
            args.responses_db or default_responses_db(), retention=args.responses_retention
        )
        # the port is bound before the model loads: /health says "starting" meanwhile, and a
        # taken port fails at once
        return await serve_http(
            config,
            host=args.host,
            port=args.port,
            drain_timeout=args.drain_timeout,
            exit_on_fatal=args.exit_on_fatal,
            on_ready=_log_ready(args, config, access),
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


def _log_ready(
    args: argparse.Namespace, config: EngineConfig, access: AccessPolicy
) -> Callable[[str, Any], None]:
    """The ``on_ready`` callback of :func:`stoic.http.serve`: logs ``stoic.ready`` with what the
    engine loaded (its device and dtypes, the KV cache's size) and how it is served."""

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

    return ready
