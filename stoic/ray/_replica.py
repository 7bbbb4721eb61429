"""The engine replica: one :class:`stoic.Engine` in a Ray Serve replica.

The ingress (:class:`~stoic.ray.RayEngine`) calls :meth:`EngineReplica.generate` through a
streaming deployment handle. Serve replaces a replica whose :meth:`~EngineReplica.check_health`
raises: only when the engine is failed (its restart budget spent), never while it recovers
(stoic's own supervision is doing its job then). Stopping a replica drains its engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from .._logging import get_logger
from ..config import EngineConfig, FaultSpec
from ..engine import Delta, Engine, Health, Request, cuda_devices
from ..errors import StoicError
from ._board import BOARD_NAMESPACE
from ._wire import Admitted, Failure, pack_error

__all__ = [
    "EngineReplica",
    "ReplicaInfo",
    "check_engine_health",
    "check_replica_device",
    "replica_config",
]

_log = get_logger("stoic.ray")

#: how often a replica posts its statistics to the board
POST_PERIOD = 1.0


@dataclass(frozen=True, slots=True)
class ReplicaInfo:
    """What the ingress learns from a replica at start."""

    model_name: str
    max_model_len: int
    replica: str
    pid: int


def check_engine_health(health: Health) -> None:
    """Serve's verdict on a replica from its engine's health.

    :raises RuntimeError: the engine is failed (its executor's restart budget is spent, or a
        fatal error it cannot recover from): Serve replaces the replica. Every other state
        (serving, recovering, starting, stopping) passes: a recovering engine gets itself back.
    """
    if health.state == "failed":
        raise RuntimeError(f"the engine is failed: {health.reason}")


def replica_config(config: EngineConfig, threads: int | None, gpus: float) -> EngineConfig:
    """A replica's engine configuration: ``threads``, its share of the machine's cores, as its
    compute budget where ``config`` sets none (workers included; they still shrink while a
    neighbour takes CPUs, ``adapt_threads``); and with a fraction of a GPU (``--replica-gpus
    0.5``: two replicas on one device) its share of that device's memory,
    ``gpu_memory_utilization`` times the fraction. Each would otherwise size its KV cache for
    0.9 of the whole device: the second replica's start, or its steps, would run out of memory."""
    if threads is not None and config.threads is None:
        config = replace(config, threads=threads)
    if 0.0 < gpus < 1.0:
        config = replace(config, gpu_memory_utilization=config.gpu_memory_utilization * gpus)
    return config


def check_replica_device(device: str, gpus: float, visible: int, build: str) -> None:
    """Refuse a replica that landed without the device it was asked for, rather than let it
    serve on the CPU.

    :param device: the engine's ``device`` (``--device``).
    :param gpus: the GPUs Ray reserved for this replica (``--replica-gpus``).
    :param visible: the CUDA devices this replica's torch sees; ``build``: its description.
    :raises RuntimeError: (one line) GPUs were reserved, or ``device`` is ``cuda...``, and torch
        sees no CUDA device.
    """
    if visible > 0 or not (gpus > 0 or device.startswith("cuda")):
        return
    asked = f"{gpus:g} GPU(s) from Ray" if gpus > 0 else f"--device {device}"
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = "unset" if hidden is None else repr(hidden)
    raise RuntimeError(
        f"this replica was given {asked} but {build} sees no CUDA device "
        f"(CUDA_VISIBLE_DEVICES={shown}): refusing to serve on the CPU"
    )


def _replica_id() -> str:
    """Serve's id of this replica (a fresh one outside Serve, e.g. in a test)."""
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # not in a Serve replica
        return f"local-{uuid.uuid4().hex[:8]}"


class EngineReplica:
    """A Serve deployment class: starts an engine from ``config`` and serves requests to it.

    :param threads: compute threads of this replica (the launcher splits a machine's cores
        between its replicas), unless ``config.threads`` is set; ``None``: the engine's CPU
        budget.
    :param board: the name of the :class:`~stoic.ray._board.StatsBoard` actor to post to.
    :param gpus: the GPUs Ray reserved for this replica: with any, a replica whose torch sees
        no CUDA device fails at start (:func:`check_replica_device`).
    """

    async def __init__(  # type: ignore[misc]  # Serve awaits an async __init__
        self,
        config: EngineConfig,
        threads: int | None = None,
        board: str | None = None,
        gpus: float = 0.0,
    ) -> None:
        config = replica_config(config, threads, gpus)
        self.replica = _replica_id()
        try:
            check_replica_device(config.device, gpus, *cuda_devices())
        except RuntimeError as exc:
            _log.error("ray.replica_device_missing", replica=self.replica, error=str(exc))
            raise
        self._stack = contextlib.AsyncExitStack()
        self.engine: Engine = await self._stack.enter_async_context(Engine.start(config))
        self._board: Any = None
        if board is not None:
            self._poster = asyncio.create_task(self._post_forever(board))
        _log.info("ray.replica_started", replica=self.replica, pid=os.getpid())

    async def _post_forever(self, board: str) -> None:
        """Post stats and health every :data:`POST_PERIOD` seconds (finding the board first:
        in a config-file deployment the ingress creates it, maybe after this replica started)."""
        import ray

        while True:
            with contextlib.suppress(Exception):  # no board yet, or it restarts: try again
                if self._board is None:
                    self._board = ray.get_actor(board, namespace=BOARD_NAMESPACE)
                await self._board.post.remote(
                    self.replica, os.getpid(), self.engine.stats(), self.engine.health()
                )
            await asyncio.sleep(POST_PERIOD)

    def info(self) -> ReplicaInfo:
        return ReplicaInfo(
            self.engine.model_name, self.engine.max_model_len, self.replica, os.getpid()
        )

    async def generate(self, request: Request) -> AsyncIterator[Admitted | Delta | Failure]:
        """Submit ``request`` and stream its output (see :mod:`stoic.ray._wire`).

        Cancelling the call (the ingress's client went away) aborts the engine request: its KV
        blocks are freed at once.
        """
        try:
            stream = await self.engine.submit(request)
        except StoicError as exc:
            yield pack_error(exc)
            return
        async with stream:
            yield Admitted(stream.request_id, stream.prompt_tokens, self.replica)
            try:
                async for delta in stream:
                    yield delta
            except StoicError as exc:
                yield pack_error(exc)

    async def inject_fault(self, spec: FaultSpec) -> str | Failure:
        """Arm a fault in this replica's engine; returns the replica's id (or the refusal)."""
        try:
            await self.engine.inject_fault(spec)
        except StoicError as exc:
            return pack_error(exc)
        return self.replica

    async def clear_faults(self) -> str | Failure:
        try:
            await self.engine.clear_faults()
        except StoicError as exc:
            return pack_error(exc)
        return self.replica

    def check_health(self) -> None:
        """Serve's health check (see :func:`check_engine_health`)."""
        check_engine_health(self.engine.health())

    async def __del__(self) -> None:
        """Serve stops this replica: drain the engine (``drain_timeout``), leave the board."""
        if hasattr(self, "_poster"):
            self._poster.cancel()
        await self._stack.aclose()
        if self._board is not None:
            with contextlib.suppress(Exception):
                await self._board.leave.remote(self.replica)
        _log.info("ray.replica_stopped", replica=self.replica)
