"""Helpers shared by the engine tests."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import stoic


def engine_config(model_dir: Path, **overrides: Any) -> stoic.EngineConfig:
    """float32 (exact outputs), 256 KV blocks, fault injection on; ``overrides`` on top."""
    base: dict[str, Any] = {
        "model": str(model_dir),
        "dtype": "float32",
        "num_kv_blocks": 256,
        "enable_fault_injection": True,
    }
    base.update(overrides)
    return stoic.EngineConfig(**base)


async def wait_idle(engine: stoic.Engine, limit: float = 5.0) -> stoic.EngineStats:
    """Wait until no sequence runs or waits and every KV block is free; return the stats.

    Freeing is one message hop behind a stream's end (the scheduler tells the cache manager), so
    a test must not expect ``kv_blocks_used == 0`` in the same instant a stream finishes.

    :raises AssertionError: if the engine is not idle within ``limit`` seconds (a leak).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while True:
        stats = engine.stats()
        if stats.running == 0 and stats.waiting == 0 and stats.kv_blocks_used == 0:
            return stats
        if loop.time() > deadline:
            raise AssertionError(f"engine not idle after {limit}s: {stats}")
        await asyncio.sleep(0.005)


async def wait_restarts(engine: stoic.Engine, n: int, limit: float = 60.0) -> None:
    """Wait until the engine has restarted its executor ``n`` times.

    :raises AssertionError: if it has not within ``limit`` seconds.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while engine.stats().restarts < n:
        assert loop.time() < deadline, f"fewer than {n} restarts: {engine.stats()}"
        await asyncio.sleep(0.005)


async def collect(stream: Any) -> tuple[str, BaseException | None]:
    """Read a request stream to its end: the text received, and the error that ended it."""
    text = ""
    try:
        async for delta in stream:
            text += delta.text
    except stoic.errors.StoicError as exc:
        return text, exc
    return text, None
