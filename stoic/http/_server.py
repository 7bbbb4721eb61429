"""Serving an app on a socket until a signal, then draining gracefully."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable

import structlog
from aiohttp import web

from ._app import create_app, drain
from ._engine import EngineLike
from ._state import STATE

__all__ = ["EXIT_ENGINE_FAILED", "serve"]

_log = structlog.get_logger("stoic.http")

#: process exit status when the engine failed and ``exit_on_fatal`` is set (EX_SOFTWARE)
EXIT_ENGINE_FAILED = 70
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


async def serve(
    engine: EngineLike,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    drain_timeout: float | None = None,
    exit_on_fatal: bool = False,
    enable_admin: bool | None = None,
    handle_signals: bool = True,
    stop: asyncio.Event | None = None,
    on_ready: Callable[[str], None] | None = None,
) -> int:
    """Serve ``engine`` on ``host:port`` until SIGINT/SIGTERM (or ``stop`` is set).

    Shutdown: the socket stops accepting, new generation requests get 503, running ones have
    ``drain_timeout`` seconds (default ``engine.config.drain_timeout``) to finish, and the rest
    end with an error. A second signal ends them at once.

    :param exit_on_fatal: return :data:`EXIT_ENGINE_FAILED` as soon as the engine is failed.
    :param on_ready: called with the base URL once the socket listens.
    :returns: the process exit status: 0, or :data:`EXIT_ENGINE_FAILED`.
    """
    if drain_timeout is None:
        drain_timeout = engine.config.drain_timeout
    if enable_admin is None:
        enable_admin = engine.config.enable_fault_injection
    app = create_app(engine, enable_admin=enable_admin)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    stop = stop if stop is not None else asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(signum: signal.Signals) -> None:
        if stop.is_set():
            _log.warning("http.second_signal", signal=signum.name)
            app[STATE].stopping.set()
        else:
            _log.info("http.signal", signal=signum.name)
            stop.set()

    exit_code = 0
    waiters: list[asyncio.Task[object]] = []
    try:
        if handle_signals:
            for signum in _SIGNALS:
                loop.add_signal_handler(signum, on_signal, signum)
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound_host, bound_port = runner.addresses[0][:2]
        url = f"http://{bound_host}:{bound_port}"
        _log.info("http.serving", url=url, model=engine.model_name, admin=enable_admin)
        if on_ready is not None:
            on_ready(url)
        waiters.append(asyncio.create_task(stop.wait()))
        if exit_on_fatal:
            waiters.append(asyncio.create_task(engine.wait_failed()))
        done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        if exit_on_fatal and waiters[1] in done:
            error = waiters[1].result()
            _log.error(
                "http.engine_failed_exiting", reason=str(error), exit_code=EXIT_ENGINE_FAILED
            )
            exit_code = EXIT_ENGINE_FAILED
            drain_timeout = 0.0
        _log.info("http.shutting_down", inflight=app[STATE].inflight, drain_timeout=drain_timeout)
        await site.stop()
        drained = await drain(app, drain_timeout)
        _log.info("http.drained", complete=drained)
    finally:
        for task in waiters:
            task.cancel()
        if handle_signals:
            for signum in _SIGNALS:
                with contextlib.suppress(ValueError, RuntimeError):
                    loop.remove_signal_handler(signum)
        await runner.cleanup()
    return exit_code
