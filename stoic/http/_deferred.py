"""An engine that is still loading: what the server answers before its model is ready."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from ..config import EngineConfig, FaultSpec
from ..engine import EngineStats, Health, Request
from ..errors import EngineFailed, EngineStarting
from ..worker import CacheSizing
from ._engine import EngineLike, RequestStreamLike

__all__ = ["DeferredEngine"]

#: what ``Retry-After`` tells a client that asks while the model loads
_RETRY_AFTER = 5.0


class DeferredEngine:
    """Stands in for the engine while it loads, then forwards to it.

    Until :meth:`attach`: ``/health`` is 503 ``starting``, generation, the model routes and
    ``/tokenize``, ``/detokenize`` raise
    :class:`~stoic.errors.EngineStarting` (503 with ``Retry-After``), ``/metrics`` shows an idle
    engine in state ``starting``. After it, every call goes to the real engine. The server binds
    its port first and attaches the engine once it is ready, so that a taken port fails at once
    and orchestrators read readiness from ``/health`` from the first second.
    """

    def __init__(self, config: EngineConfig) -> None:
        self._config = config
        self._engine: EngineLike | None = None
        self._attached = asyncio.Event()

    def attach(self, engine: EngineLike) -> None:
        self._engine = engine
        self._attached.set()

    @property
    def ready(self) -> bool:
        return self._engine is not None

    def _loaded(self) -> EngineLike:
        if self._engine is None:
            raise EngineStarting(
                "the model is loading; retry in a few seconds", retry_after=_RETRY_AFTER
            )
        return self._engine

    @property
    def model_name(self) -> str:
        if self._engine is not None:
            return self._engine.model_name
        config = self._config
        if config.served_model_name:
            return config.served_model_name
        return "default" if config.model == "default" else Path(config.model).stem

    @property
    def max_model_len(self) -> int:
        return self._loaded().max_model_len

    @property
    def chat_template(self) -> str | dict[str, str] | None:
        return self._loaded().chat_template

    @property
    def kv_sizing(self) -> CacheSizing | None:
        return self._loaded().kv_sizing

    @property
    def config(self) -> EngineConfig:
        return self._config if self._engine is None else self._engine.config

    async def submit(self, request: Request) -> RequestStreamLike:
        return await self._loaded().submit(request)

    def tokenize(self, request: Request) -> list[int]:
        return self._loaded().tokenize(request)

    def detokenize(self, token_ids: list[int]) -> str:
        return self._loaded().detokenize(token_ids)

    def stats(self) -> EngineStats:
        if self._engine is not None:
            return self._engine.stats()
        return EngineStats.idle("starting", token_budget=self._config.max_num_batched_tokens or 0)

    def activity(self) -> Any:
        """The engine's :meth:`stoic.Engine.activity` once loaded (None before, and for an engine
        without one)."""
        read = getattr(self._engine, "activity", None)
        return read() if callable(read) else None

    def health(self) -> Health:
        if self._engine is not None:
            return self._engine.health()
        return Health(state="starting", reason="the model is loading")

    async def inject_fault(self, spec: FaultSpec) -> None:
        await self._loaded().inject_fault(spec)

    async def clear_faults(self) -> None:
        await self._loaded().clear_faults()

    async def wait_failed(self) -> EngineFailed:
        await self._attached.wait()
        return await self._loaded().wait_failed()
