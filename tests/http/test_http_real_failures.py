"""Failures from a real engine over HTTP (no fake): overload at ``max_waiting``, a failed engine
mid-generation, the rollback of a refused ``n>1`` request, and an out-of-memory failure while
the request itself was prefilling.

Each test starts its own small engine (the tiny random model) and app on 127.0.0.1, closed at the
end of the test, so the shared session engine is never touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from http_helpers import Server, read_sse, run_app
from prometheus_client.parser import text_string_to_metric_families
from support import until, wait_idle

import stoic
from stoic.http import create_app

pytestmark = [pytest.mark.model, pytest.mark.asyncio(loop_scope="session")]

Started = tuple[stoic.Engine, Server]
Start = Callable[..., Awaitable[Started]]


@pytest_asyncio.fixture(loop_scope="session")
async def start(tiny_model_dir: Path) -> AsyncIterator[Start]:
    """Factory: a tiny-model engine (``overrides`` on its config) served by its own app."""
    stack = contextlib.AsyncExitStack()

    async def start(**overrides: Any) -> Started:
        config: dict[str, Any] = {
            "model": str(tiny_model_dir),
            "dtype": "float32",
            "num_kv_blocks": 128,
            "enable_fault_injection": True,
            "drain_timeout": 2.0,
        }
        config.update(overrides)
        engine = await stack.enter_async_context(stoic.Engine.start(stoic.EngineConfig(**config)))
        server = await stack.enter_async_context(run_app(create_app(engine)))
        return engine, server

    async with stack:
        yield start


def _body(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": "Once upon a time",
        "max_tokens": 4,
        "ignore_eos": True,
    }
    body.update(overrides)
    return body


async def _model(http: aiohttp.ClientSession, server: Server) -> str:
    async with http.get(f"{server.url}/v1/models") as r:
        assert r.status == 200
        return str((await r.json())["data"][0]["id"])


async def _counter(http: aiohttp.ClientSession, server: Server, name: str, **labels: str) -> float:
    """One sample of /metrics (0 when it has no sample yet)."""
    async with http.get(f"{server.url}/metrics") as r:
        assert r.status == 200
        text = await r.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return 0.0


async def _in_flight(engine: stoic.Engine, count: int, within: float = 30.0) -> None:
    """Wait until ``count`` sequences are admitted (running or waiting)."""

    def admitted() -> bool:
        stats = engine.stats()
        return stats.running + stats.waiting == count

    await until(admitted, within, f"{count} in flight")


async def _hold(engine: stoic.Engine, seconds: float) -> None:
    """Make the engine's next step block ``seconds`` (requests admitted meanwhile stay in flight)."""
    await engine.inject_fault(stoic.FaultSpec(kind="hang", after_steps=1, seconds=seconds))


async def test_overload_at_max_waiting_is_429_with_retry_after(start: Start) -> None:
    """With ``max_waiting=2`` and two requests in flight, a third is refused with 429,
    Retry-After and x-should-retry: true, counted once as ``outcome="overloaded"``; once the
    two are gone, a request is admitted again."""
    engine, server = await start(max_waiting=2)
    overloaded = {"endpoint": "completions", "outcome": "overloaded"}
    async with aiohttp.ClientSession() as http:
        model = await _model(http, server)
        before = await _counter(http, server, "stoic_requests_total", **overloaded)
        await _hold(engine, 3.0)
        long = _body(model=model, max_tokens=400, stream=True)
        holders = [
            asyncio.create_task(http.post(f"{server.url}/v1/completions", json=long))
            for _ in range(2)
        ]
        await _in_flight(engine, 2)
        async with http.post(f"{server.url}/v1/completions", json=_body(model=model)) as r:
            assert r.status == 429
            assert r.headers["Retry-After"] == "1"
            assert r.headers["retry-after-ms"] == "1000"
            assert r.headers["x-should-retry"] == "true"
            error = (await r.json())["error"]
        assert (error["type"], error["code"]) == ("rate_limit_error", "overloaded")
        after = await _counter(http, server, "stoic_requests_total", **overloaded)
        assert after - before == 1
        for response in await asyncio.gather(*holders):
            assert response.status == 200
            response.close()  # the client goes away: its request is aborted
        await wait_idle(engine, 30.0, serving=True)
        async with http.post(f"{server.url}/v1/completions", json=_body(model=model)) as r:
            assert r.status == 200


async def _fail_mid_stream(
    engine: stoic.Engine, server: Server, fault: dict[str, Any]
) -> dict[str, Any]:
    """Arm ``fault``, stream a completion through it: the error event that ended the stream
    (checked to come after the text, with the partial output, then [DONE])."""
    async with aiohttp.ClientSession() as http:
        model = await _model(http, server)
        async with http.post(f"{server.url}/admin/faults", json=fault) as r:
            assert r.status == 200
        body = _body(model=model, max_tokens=64, stream=True)
        async with http.post(f"{server.url}/v1/completions", json=body) as r:
            assert r.status == 200
            events = await asyncio.wait_for(read_sse(r), 60)
    assert events[-1] == "[DONE]"
    error: dict[str, Any] = events[-2]["error"]
    assert 0 < error["partial"]["completion_tokens"] < 64
    text = "".join(e["choices"][0]["text"] for e in events[:-2])
    assert error["partial"]["text"].startswith(text)
    return error


async def _refused_as_failed(engine: stoic.Engine, server: Server) -> None:
    """A failed engine: a request gets 503 engine_failed (no retry), /health is 503 failed."""
    async with aiohttp.ClientSession() as http:
        body = _body(model=await _model(http, server))
        async with http.post(f"{server.url}/v1/completions", json=body) as r:
            assert r.status == 503
            assert r.headers["x-should-retry"] == "false"
            error = (await r.json())["error"]
        assert (error["type"], error["code"]) == ("service_unavailable", "engine_failed")
        async with http.get(f"{server.url}/health") as r:
            assert r.status == 503
            assert (await r.json())["status"] == "failed"
    stats = engine.stats()
    assert stats.running + stats.waiting == 0


async def test_engine_failed_mid_stream_then_503(start: Start) -> None:
    """A step hanging past ``step_timeout`` (thread executor: the engine is marked failed) while
    streaming: the stream ends with an error event (service_unavailable / engine_failed, with
    the partial output) then [DONE]; afterwards a request gets 503 with x-should-retry: false,
    and /health is 503 failed."""
    engine, server = await start(step_timeout=1.0)
    fault = {"kind": "hang", "after_steps": 4, "seconds": 3.0}
    error = await _fail_mid_stream(engine, server, fault)
    assert (error["type"], error["code"]) == ("service_unavailable", "engine_failed")
    await _refused_as_failed(engine, server)


async def test_restart_limit_exceeded_mid_stream_then_503(start: Start) -> None:
    """``max_restarts=0`` and an executor error while streaming: the stream ends with an error
    event and [DONE]; the engine is failed, so the next request gets 503 engine_failed."""
    engine, server = await start(max_restarts=0)
    await _fail_mid_stream(engine, server, {"kind": "error", "after_steps": 4})
    await _refused_as_failed(engine, server)


async def test_restart_limit_exceeded_mid_stream_reports_engine_failed(start: Start) -> None:
    """When the failure exhausts the restart intensity, the stream's error should say the
    engine failed (service_unavailable / engine_failed), not that it recovered."""
    engine, server = await start(max_restarts=0)
    error = await _fail_mid_stream(engine, server, {"kind": "error", "after_steps": 4})
    assert (error["type"], error["code"]) == ("service_unavailable", "engine_failed")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_refused_choice_rolls_back_the_admitted_ones(start: Start, stream: bool) -> None:
    """``n=3`` with ``max_waiting=2``: the third choice is refused, so the request is a 429 and
    the two choices already admitted are aborted: nothing runs or waits, no KV block is used,
    and the admission slots are free again (an ``n=2`` request then succeeds)."""
    engine, server = await start(max_waiting=2)
    async with aiohttp.ClientSession() as http:
        model = await _model(http, server)
        await _hold(engine, 1.0)  # the admitted choices cannot finish before the refusal
        body = _body(model=model, n=3, max_tokens=200, stream=stream)
        async with http.post(f"{server.url}/v1/completions", json=body) as r:
            assert r.status == 429
            assert r.headers["Retry-After"] == "1"
            assert (await r.json())["error"]["code"] == "overloaded"
        stats = await wait_idle(engine, 30.0, serving=True)
        assert (stats.running, stats.waiting, stats.kv_blocks_used) == (0, 0, 0)
        body = _body(model=model, n=2, max_tokens=3)
        async with http.post(f"{server.url}/v1/completions", json=body) as r:
            assert r.status == 200
            assert len((await r.json())["choices"]) == 2


async def test_an_oom_while_the_request_was_prefilling_is_500_not_retryable(
    start: Start,
) -> None:
    """An out-of-memory failure in the second chunk of a long prompt's prefill (16 tokens per
    step): 500 with code executor_oom and x-should-retry: false (the same request would fail
    again); the engine recovers and serves the next request. An OOM while a short request was
    already decoding is a 500 with x-should-retry: true."""
    engine, server = await start(max_num_seqs=4, max_num_batched_tokens=16)
    async with aiohttp.ClientSession() as http:
        model = await _model(http, server)
        fault = {"kind": "oom", "after_steps": 2}
        async with http.post(f"{server.url}/admin/faults", json=fault) as r:
            assert r.status == 200
        rng = random.Random(7)
        prompt = [rng.randrange(100, 20000) for _ in range(100)]  # 7 chunks of 16
        body = _body(model=model, prompt=prompt, max_tokens=4)
        async with http.post(f"{server.url}/v1/completions", json=body) as r:
            assert r.status == 500
            assert r.headers["x-should-retry"] == "false"
            error = (await r.json())["error"]
        assert (error["type"], error["code"]) == ("server_error", "executor_oom")
        assert error["partial"]["completion_tokens"] == 0
        await wait_idle(engine, 30.0, serving=True)
        assert dict(engine.stats().restarts_by_kind).get("oom") == 1
        async with http.post(f"{server.url}/v1/completions", json=_body(model=model)) as r:
            assert r.status == 200
        # the rule is about the request that was prefilling: one already decoding may retry
        fault = {"kind": "oom", "after_steps": 3}
        async with http.post(f"{server.url}/admin/faults", json=fault) as r:
            assert r.status == 200
        body = _body(model=model, max_tokens=16)
        async with http.post(f"{server.url}/v1/completions", json=body) as r:
            assert r.status == 500
            assert r.headers["x-should-retry"] == "true"
            error = (await r.json())["error"]
        assert error["code"] == "executor_oom" and error["partial"]["completion_tokens"] >= 1
