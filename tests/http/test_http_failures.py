"""Failures: overload, a failed engine, an executor failure mid-generation, unexpected bugs.

The executor failure is real (the engine's fault injection through ``POST /admin/faults``);
overload, a failed engine and an unexpected exception use a scripted fake engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aiohttp
import openai
import pytest
import structlog
from http_fakes import FakeEngine, partial
from http_helpers import Server, chat_body, completion_body, read_sse, stream_with_error_at_step
from support import wait_idle

import stoic
from stoic.errors import EngineFailed, Overloaded

pytestmark = pytest.mark.asyncio(loop_scope="session")

StartFake = Callable[..., Any]


@pytest.mark.usefixtures("fault_cleanup")
async def test_executor_failure_mid_stream_sends_error_event(
    server: Server, http: aiohttp.ClientSession, engine: stoic.Engine
) -> None:
    """An executor failure after streaming began ends the stream with one error event carrying
    the partial output, then [DONE]; the engine recovers and the next request succeeds."""
    restarts = engine.stats().restarts
    events = await stream_with_error_at_step(http, server.url, 4)
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["type"] == "server_error" and error["code"].startswith("executor_")
    text = "".join(e["choices"][0]["text"] for e in events[:-2])
    assert 0 < error["partial"]["completion_tokens"] < 16
    assert error["partial"]["text"].startswith(text)
    await wait_idle(engine, 10.0, serving=True)
    assert engine.stats().restarts == restarts + 1
    async with http.post(f"{server.url}/v1/completions", json=completion_body()) as r:
        assert r.status == 200


@pytest.mark.usefixtures("fault_cleanup")
async def test_executor_failure_non_streaming_is_500_with_partial(
    server: Server, http: aiohttp.ClientSession, client: openai.AsyncOpenAI
) -> None:
    """A non-streaming request whose generation fails gets a 500 (never a 200) with the
    partial output in error.partial and x-should-retry: true; the SDK raises
    InternalServerError, and a streaming SDK call raises APIError."""
    fault = {"kind": "error", "after_steps": 3}
    async with http.post(f"{server.url}/admin/faults", json=fault) as r:
        assert r.status == 200
    body = chat_body(max_tokens=16, ignore_eos=True)
    async with http.post(f"{server.url}/v1/chat/completions", json=body) as r:
        assert r.status == 500
        assert r.headers["x-should-retry"] == "true"
        error = (await r.json())["error"]
    assert error["partial"]["completion_tokens"] >= 1
    assert isinstance(error["partial"]["text"], str)
    async with http.post(f"{server.url}/admin/faults", json=fault) as r:
        assert r.status == 200
    stream = await client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Count to ten."}],
        max_tokens=16,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    with pytest.raises(openai.APIError) as raised:
        _ = [chunk async for chunk in stream]
    assert raised.value.code is not None and raised.value.code.startswith("executor_")


async def test_admin_fault_validation(server: Server, http: aiohttp.ClientSession) -> None:
    """POST /admin/faults rejects bad specs with a 400 naming the field."""
    url = f"{server.url}/admin/faults"
    cases = [
        ({"kind": "meteor", "after_steps": 1}, "kind"),
        ({"kind": "error"}, "after_steps"),
        ({"kind": "error", "after_steps": 1, "bogus": 1}, "bogus"),
        ({"kind": "error", "probability": 2.0, "seed": 1}, "probability"),
    ]
    for body, param in cases:
        async with http.post(url, json=body) as r:
            assert r.status == 400, body
            assert (await r.json())["error"]["param"] == param


async def test_admin_routes_absent_without_switch(fake_server: StartFake) -> None:
    """Without fault injection enabled, /admin/faults does not exist (404)."""
    server: Server = await fake_server(FakeEngine())
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{server.url}/admin/faults", json={"kind": "error"}) as r:
            assert r.status == 404
        async with http.delete(f"{server.url}/admin/faults") as r:
            assert r.status == 404


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_overload_is_429_with_retry_after(fake_server: StartFake, stream: bool) -> None:
    """Overloaded is a 429 with Retry-After and x-should-retry: true (RateLimitError)."""
    engine = FakeEngine(submit_error=Overloaded("too busy", retry_after=2.5))
    server: Server = await fake_server(engine)
    async with aiohttp.ClientSession() as http:
        body = chat_body(stream=stream)
        async with http.post(f"{server.url}/v1/chat/completions", json=body) as r:
            assert r.status == 429
            assert r.headers["Retry-After"] == "3"
            assert r.headers["x-should-retry"] == "true"
            assert (await r.json())["error"]["type"] == "rate_limit_error"
    async with server.client() as client:
        with pytest.raises(openai.RateLimitError):
            await client.completions.create(model="fake-model", prompt="x", stream=stream)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_engine_failed_is_503(fake_server: StartFake, stream: bool) -> None:
    """A failed engine refuses at once with 503 and x-should-retry: false; /health is 503
    with the state and the reason."""
    engine = FakeEngine(
        submit_error=EngineFailed("engine failed: too many restarts"),
        health_state=stoic.Health("failed", "too many restarts"),
    )
    server: Server = await fake_server(engine)
    async with aiohttp.ClientSession() as http:
        body = completion_body(stream=stream)
        async with http.post(f"{server.url}/v1/completions", json=body) as r:
            assert r.status == 503
            assert r.headers["x-should-retry"] == "false"
            assert (await r.json())["error"]["code"] == "engine_failed"
        async with http.get(f"{server.url}/health") as r:
            assert r.status == 503
            body = await r.json()
            assert (body["status"], body["reason"]) == ("failed", "too many restarts")
    async with server.client() as client:
        with pytest.raises(openai.InternalServerError):
            await client.completions.create(model="fake-model", prompt="x", stream=stream)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_engine_failure_mid_generation(fake_server: StartFake, stream: bool) -> None:
    """EngineFailed while generating: a 503 with the partial output, or an error event and
    [DONE] when streaming."""
    engine = FakeEngine(
        tokens=3, stream_error=EngineFailed("engine failed", partial=partial("abc"))
    )
    server: Server = await fake_server(engine)
    async with aiohttp.ClientSession() as http:
        body = completion_body(model="fake-model", stream=stream)
        async with http.post(f"{server.url}/v1/completions", json=body) as r:
            if stream:
                assert r.status == 200
                events = await read_sse(r)
                assert events[-1] == "[DONE]"
                error = events[-2]["error"]
            else:
                assert r.status == 503
                error = (await r.json())["error"]
    assert error["partial"] == {"text": "abc", "completion_tokens": 3, "index": 0}
    assert all(s.closed for s in engine.streams)


async def test_unexpected_exception_is_500_and_logged(fake_server: StartFake) -> None:
    """A bug in the engine gives a 500 with error JSON (no traceback) and an error log event
    carrying the request id."""
    engine = FakeEngine(submit_error=RuntimeError("boom: secret internals"))
    server: Server = await fake_server(engine)
    async with aiohttp.ClientSession() as http:
        with structlog.testing.capture_logs(
            processors=[structlog.contextvars.merge_contextvars]
        ) as logs:
            headers = {"x-request-id": "bug-1"}
            body = chat_body(model="fake-model")
            async with http.post(
                f"{server.url}/v1/chat/completions", json=body, headers=headers
            ) as r:
                assert r.status == 500
                assert r.headers["x-request-id"] == "bug-1"
                error = (await r.json())["error"]
    assert "boom" not in error["message"] and "bug-1" in error["message"]
    assert engine.contexts[-1]["request_id"] == "bug-1"
    events = [e for e in logs if e["event"] == "http.unhandled_error"]
    assert events and events[0]["request_id"] == "bug-1" and events[0]["log_level"] == "error"


async def test_unexpected_exception_mid_stream(fake_server: StartFake) -> None:
    """A bug after streaming began ends the stream with an internal error event and [DONE]."""
    engine = FakeEngine(tokens=2, stream_error=KeyError("bug"))
    server: Server = await fake_server(engine)
    async with aiohttp.ClientSession() as http:
        body = completion_body(model="fake-model", stream=True)
        async with http.post(f"{server.url}/v1/completions", json=body) as r:
            events = await read_sse(r)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["type"] == "internal_error"
    assert [e["choices"][0]["text"] for e in events[:-2]] == ["a", "b"]
