"""A Serve application for ``serve run`` / ``serve deploy`` and KubeRay: the engine replicas and
an ingress deployment that runs stoic's HTTP server (the same app ``stoic serve`` runs) inside a
Serve replica of its own.

    # config.yaml (serve deploy config.yaml, or a RayService's serveConfigV2)
    proxy_location: Disabled          # stoic's server is the endpoint, not Serve's proxy
    applications:
      - name: stoic
        import_path: stoic.ray:build_app
        route_prefix: null
        args:
          port: 8000
          engine: {model: default, max_num_seqs: 32}
          replicas: {replicas: 2, max_replicas: 4, target_ongoing_requests: 16}
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from typing import Any

from .._logging import get_logger
from ..config import EngineConfig
from ._launch import ReplicaOptions, engine_deployment, front_end, make_board

__all__ = ["HttpIngress", "app_options", "build_app"]

_log = get_logger("stoic.ray")


def app_options(args: dict[str, Any]) -> tuple[EngineConfig, ReplicaOptions, str, int]:
    """The engine config, replica options, host and port an application's ``args`` describe:
    ``engine`` (:class:`~stoic.EngineConfig` fields), ``replicas`` (:class:`ReplicaOptions`
    fields), ``host`` (default ``0.0.0.0``: the cluster's network), ``port`` (default 8000).

    :raises ValueError: an unknown key, or a value the config refuses.
    """
    unknown = set(args) - {"engine", "replicas", "host", "port"}
    if unknown:
        raise ValueError(f"unknown application args: {', '.join(sorted(unknown))}")
    engine = dict(args.get("engine") or {})
    known = {f.name for f in dataclasses.fields(EngineConfig)} - {"faults"}
    if set(engine) - known:
        raise ValueError(f"unknown engine options: {', '.join(sorted(set(engine) - known))}")
    try:
        config = EngineConfig(**engine)
        options = ReplicaOptions(**dict(args.get("replicas") or {}))
    except TypeError as exc:
        raise ValueError(str(exc)) from None
    return config, options, str(args.get("host", "0.0.0.0")), int(args.get("port", 8000))


class HttpIngress:
    """A Serve deployment class running stoic's HTTP server on ``host:port`` over the engine
    replicas behind ``replicas`` (a deployment handle). One per node at most (it binds the
    port); Serve's health check fails it if the server stopped."""

    async def __init__(  # type: ignore[misc]  # Serve awaits an async __init__
        self,
        replicas: Any,
        config: EngineConfig,
        options: ReplicaOptions,
        host: str,
        port: int,
        board: str,
    ) -> None:
        from ..http import serve

        self._stack = contextlib.AsyncExitStack()
        engine = await self._stack.enter_async_context(
            front_end(replicas, config, options, make_board(board))
        )
        self._stop = asyncio.Event()
        self._server = asyncio.create_task(
            serve(engine, host=host, port=port, handle_signals=False, stop=self._stop)
        )

    def check_health(self) -> None:
        """:raises RuntimeError: the HTTP server stopped (e.g. its port was taken)."""
        if self._server.done():
            raise RuntimeError(f"the HTTP server stopped: {self._server!r}")

    async def __del__(self) -> None:
        """Serve stops the ingress: drain the HTTP server, then let go of the replicas."""
        self._stop.set()
        with contextlib.suppress(Exception):
            await self._server
        await self._stack.aclose()


def build_app(args: dict[str, Any]) -> Any:
    """The application builder ``serve run stoic.ray:build_app`` and config files name (see the
    module docstring and :func:`app_options`).

    :raises ValueError: bad ``args``.
    """
    from ray import serve

    config, options, host, port = app_options(args)
    board = "stoic-board"
    replicas = engine_deployment(config, options, board)
    ingress = serve.deployment(
        name="HttpIngress",
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        graceful_shutdown_timeout_s=config.drain_timeout + 10.0,
    )(HttpIngress)
    return ingress.bind(replicas, config, options, host, port, board)
