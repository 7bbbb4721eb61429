"""Serving an app on a socket until a signal, then draining gracefully."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable

from aiohttp import web

from .._logging import get_logger
from ..config import EngineConfig
from ..engine import Engine
from ._app import create_app, drain
from ._auth import AccessPolicy
from ._deferred import DeferredEngine
from ._engine import EngineLike
from ._limits import GuardedSite, ServerLimits
from ._state import STATE
from ._store import ResponseStore

__all__ = ["EXIT_ENGINE_FAILED", "serve"]

_log = get_logger("stoic.http")

#: process exit status when the engine failed and ``exit_on_fatal`` is set (EX_SOFTWARE)
EXIT_ENGINE_FAILED = 70
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


async def serve(
    engine: EngineLike | EngineConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    drain_timeout: float | None = None,
    exit_on_fatal: bool = False,
    enable_admin: bool | None = None,
    handle_signals: bool = True,
    stop: asyncio.Event | None = None,
    on_ready: Callable[[str, EngineLike], None] | None = None,
    access: AccessPolicy | None = None,
    limits: ServerLimits | None = None,
    responses: ResponseStore | None = None,
) -> int:
    """Serve ``engine`` on ``host:port`` until SIGINT/SIGTERM (or ``stop`` is set).

    Given an :class:`~stoic.EngineConfig` instead of an engine, the port is bound first (a taken
    port fails at once) and the engine is started behind it: while the model loads, ``/health``
    answers 503 ``starting`` and generation requests 503 with ``Retry-After``; a signal during
    the load stops it. The engine is stopped when the server is.

    Shutdown: new generation requests get 503 and ``/health`` says ``stopping`` (the socket still
    accepts, so probes get that answer), running requests have ``drain_timeout`` seconds (default
    ``engine.config.drain_timeout``) to finish, and the rest end with an error. A second signal
    ends them at once.

    :param exit_on_fatal: return :data:`EXIT_ENGINE_FAILED` as soon as the engine is failed.
    :param on_ready: called with the base URL and the engine once the engine serves.
    :param access: API and admin keys (:class:`~stoic.http.AccessPolicy`).
    :param limits: request size, read deadlines, keep-alive and the connection cap
        (:class:`~stoic.http.ServerLimits`).
    :param responses: the stored responses' database (default: in memory); closed when the
        server stops.
    :returns: the process exit status: 0, or :data:`EXIT_ENGINE_FAILED`.
    :raises OSError: if the port cannot be bound.
    :raises ~stoic.errors.StoicError: if a configured engine cannot start (e.g.
        :class:`~stoic.errors.ModelUnavailable`).
    """
    target: EngineLike = DeferredEngine(engine) if isinstance(engine, EngineConfig) else engine
    config = target.config
    if drain_timeout is None:
        drain_timeout = config.drain_timeout
    if enable_admin is None:
        enable_admin = config.enable_fault_injection
    limits = limits if limits is not None else ServerLimits()
    app = create_app(
        target, enable_admin=enable_admin, access=access, limits=limits, responses=responses
    )
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=5.0,
        keepalive_timeout=limits.keepalive_timeout,
    )
    await runner.setup()
    stop = stop if stop is not None else asyncio.Event()
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()

    def on_signal(signum: signal.Signals) -> None:
        if isinstance(target, DeferredEngine) and not target.ready and main is not None:
            _log.info("http.signal_while_starting", signal=signum.name)
            stop.set()
            main.cancel()  # stop loading the model
        elif stop.is_set():
            _log.warning("http.second_signal", signal=signum.name)
            app[STATE].stopping.set()
        else:
            _log.info("http.signal", signal=signum.name)
            stop.set()

    try:
        if handle_signals:
            for signum in _SIGNALS:
                loop.add_signal_handler(signum, on_signal, signum)
        metrics = app[STATE].metrics
        site = GuardedSite(
            runner, host, port, limits, on_refuse=lambda r: metrics.refused.labels(r).inc()
        )
        metrics.watch_connections(lambda: len(site.connections))
        await site.start()
        bound_host, bound_port = runner.addresses[0][:2]
        url = f"http://{bound_host}:{bound_port}"
        run = _Run(app, site, url, stop, drain_timeout, exit_on_fatal, on_ready)
        if not isinstance(target, DeferredEngine):
            return await run.until_stopped(target)
        _log.info("http.listening", url=url, state="starting")
        async with Engine.start(target.config) as started:
            target.attach(started)
            return await run.until_stopped(started)
    except asyncio.CancelledError:  # a signal while starting: binding the port, loading
        if main is not None and main.uncancel() == 0 and stop.is_set():
            _log.info("http.stopped_while_starting")
            return 0
        raise
    finally:
        if handle_signals:
            for signum in _SIGNALS:
                with contextlib.suppress(ValueError, RuntimeError):
                    loop.remove_signal_handler(signum)
        await runner.cleanup()


class _Run:
    """One server's life once its engine serves: wait for a stop (or the engine's failure),
    then drain."""

    def __init__(
        self,
        app: web.Application,
        site: web.BaseSite,
        url: str,
        stop: asyncio.Event,
        drain_timeout: float,
        exit_on_fatal: bool,
        on_ready: Callable[[str, EngineLike], None] | None,
    ) -> None:
        self.app, self.site, self.url, self.stop = app, site, url, stop
        self.drain_timeout = drain_timeout
        self.exit_on_fatal = exit_on_fatal
        self.on_ready = on_ready

    async def until_stopped(self, engine: EngineLike) -> int:
        _log.info("http.serving", url=self.url, model=engine.model_name)
        if self.on_ready is not None:
            self.on_ready(self.url, engine)
        waiters: list[asyncio.Task[object]] = [asyncio.create_task(self.stop.wait())]
        if self.exit_on_fatal:
            waiters.append(asyncio.create_task(engine.wait_failed()))
        exit_code, drain_timeout = 0, self.drain_timeout
        try:
            done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            if self.exit_on_fatal and waiters[1] in done:
                error = waiters[1].result()
                _log.error(
                    "http.engine_failed_exiting", reason=str(error), exit_code=EXIT_ENGINE_FAILED
                )
                exit_code, drain_timeout = EXIT_ENGINE_FAILED, 0.0
        finally:
            for task in waiters:
                task.cancel()
        state = self.app[STATE]
        _log.info("http.shutting_down", inflight=state.inflight, drain_timeout=drain_timeout)
        # keep accepting while draining: probes see 503 "stopping", new generations a 503
        drained = await drain(self.app, drain_timeout)
        await self.site.stop()
        _log.info("http.drained", complete=drained)
        return exit_code
