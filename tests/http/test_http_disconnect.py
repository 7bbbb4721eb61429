"""Clients that go away mid-stream: their requests are aborted and their KV blocks freed."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from http_helpers import Server, completion_body
from prometheus_client.parser import text_string_to_metric_families
from support import wait_idle

import stoic

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def _aborted(server: Server) -> float:
    """``stoic_requests_total{endpoint="completions",outcome="aborted"}`` (0 before the first)."""
    async with aiohttp.ClientSession() as http, http.get(f"{server.url}/metrics") as r:
        assert r.status == 200
        text = await r.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {"endpoint": "completions", "outcome": "aborted"}
            if sample.name == "stoic_requests_total" and sample.labels == labels:
                return float(sample.value)
    return 0.0


async def _stream_then_vanish(server: Server, started: asyncio.Event, go: asyncio.Event) -> None:
    body = completion_body(max_tokens=500, ignore_eos=True, stream=True)
    async with aiohttp.ClientSession() as http:
        response = await http.post(f"{server.url}/v1/completions", json=body)
        assert response.status == 200
        await response.content.readline()  # the first event: generation is under way
        started.set()
        await go.wait()
        response.close()  # drop the connection without reading further


async def test_disconnecting_clients_free_their_blocks(
    server: Server, engine: stoic.Engine
) -> None:
    """8 streaming clients that disconnect mid-stream leave no running sequence and every KV
    block free shortly after (the app runs without handler cancellation: a failed write is
    enough to abort); /metrics counts exactly these 8 as aborted."""
    await wait_idle(engine, 10.0, serving=True)
    before = await _aborted(server)
    started = [asyncio.Event() for _ in range(8)]
    go = asyncio.Event()
    clients = [asyncio.create_task(_stream_then_vanish(server, e, go)) for e in started]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
    stats = engine.stats()
    assert stats.running + stats.waiting == 8 and stats.kv_blocks_used > 0
    go.set()
    await asyncio.gather(*clients)
    await wait_idle(engine, 10.0, serving=True)
    # each handler records its outcome once its write failed: poll a little, then the exact 8
    deadline = asyncio.get_running_loop().time() + 10
    while (aborted := await _aborted(server) - before) < 8:
        assert asyncio.get_running_loop().time() < deadline, f"{aborted} aborted, not 8"
        await asyncio.sleep(0.05)
    assert await _aborted(server) - before == 8
