"""Server limits: body size and deadline, header deadline (slowloris), keep-alive, connection
cap, and the per-request caps of the schemas (no model: a scripted engine)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from http_fakes import FakeEngine
from http_helpers import chat_body, metric, serving
from yarl import URL

from stoic.http import ServerLimits
from stoic.http._schemas import MAX_MESSAGES, MAX_TOOLS

_session_loop = pytest.mark.asyncio(loop_scope="session")


async def _connect(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    u = URL(url)
    assert u.host is not None and u.port is not None
    return await asyncio.open_connection(u.host, u.port)


def _request(body: bytes, *, length: int | None = None) -> bytes:
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body) if length is None else length}\r\n\r\n"
    )
    return head.encode() + body


async def _response(reader: asyncio.StreamReader, within: float = 5.0) -> tuple[int, Any]:
    """Status and JSON body of one HTTP/1.1 response (Content-Length framed)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), within)
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {
        k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)
    }
    body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), within)
    return status, json.loads(body)


async def _closed(reader: asyncio.StreamReader, within: float) -> bool:
    """Whether the server closes the connection within ``within`` seconds."""
    try:
        return await asyncio.wait_for(reader.read(), within) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


@_session_loop
async def test_a_body_over_the_limit_is_a_413_with_error_json() -> None:
    """A body above max_request_bytes is a 413 with OpenAI error JSON naming the limit; the
    engine never sees it; a body under the limit is served."""
    engine = FakeEngine()
    limits = ServerLimits(max_request_bytes=2048)
    async with serving(engine, limits=limits) as (url, _, _), aiohttp.ClientSession() as http:
        big = chat_body(messages=[{"role": "user", "content": "x" * 4000}])
        async with http.post(f"{url}/v1/chat/completions", json=big) as r:
            assert r.status == 413
            error = (await r.json())["error"]
        assert error["code"] == "request_too_large" and "2048" in error["message"]
        assert engine.streams == []
        assert await metric(url, 'stoic_http_refused_total{reason="too_large"}') == 1
        async with http.post(f"{url}/v1/chat/completions", json=chat_body()) as r:
            assert r.status == 200


@_session_loop
async def test_a_body_that_stops_arriving_is_a_408() -> None:
    """A client that sends a request head and part of its body, then stalls, gets a 408 after
    the body deadline, and the engine never sees the request."""
    engine = FakeEngine()
    limits = ServerLimits(body_timeout=0.5)
    async with serving(engine, limits=limits) as (url, _, _):
        reader, writer = await _connect(url)
        body = json.dumps(chat_body()).encode()
        writer.write(_request(body[:10], length=len(body)))
        status, payload = await _response(reader)
        writer.close()
        assert status == 408 and "0.5 seconds" in payload["error"]["message"]
        assert engine.streams == []
        assert await metric(url, 'stoic_http_refused_total{reason="body_timeout"}') == 1


@_session_loop
async def test_a_slow_request_head_is_cut_off_and_others_are_served() -> None:
    """Slowloris: a connection that starts a request head and does not finish it is closed
    after the header deadline, while other clients are served meanwhile."""
    limits = ServerLimits(header_timeout=0.5)
    async with serving(FakeEngine(), limits=limits) as (url, _, _), aiohttp.ClientSession() as http:
        reader, writer = await _connect(url)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nX-Slow: ")
        async with http.post(f"{url}/v1/chat/completions", json=chat_body()) as r:
            assert r.status == 200
        assert await _closed(reader, 3.0)
        writer.close()
        assert await metric(url, 'stoic_http_refused_total{reason="header_timeout"}') == 1


@_session_loop
async def test_a_request_slower_than_the_header_deadline_is_not_cut_off() -> None:
    """The header deadline covers the head only: a request whose handler runs longer than it
    (a long generation) completes, and the connection serves a second request afterwards."""
    limits = ServerLimits(header_timeout=0.3)
    engine = FakeEngine(tokens=40, delay=0.02)  # about 0.8 s per request
    async with serving(engine, limits=limits) as (url, _, _):
        reader, writer = await _connect(url)
        for _ in range(2):
            writer.write(_request(json.dumps(chat_body()).encode()))
            status, payload = await _response(reader)
            assert status == 200 and payload["choices"][0]["finish_reason"] == "length"
        writer.close()


@_session_loop
async def test_an_idle_keep_alive_connection_is_closed() -> None:
    """After its response, a connection that sends nothing is closed after the keep-alive
    timeout."""
    limits = ServerLimits(keepalive_timeout=0.5)
    async with serving(FakeEngine(), limits=limits) as (url, _, _):
        reader, writer = await _connect(url)
        writer.write(_request(json.dumps(chat_body()).encode()))
        assert (await _response(reader))[0] == 200
        assert await _closed(reader, 5.0)
        writer.close()


@_session_loop
async def test_connections_over_the_cap_get_a_503_and_the_cap_frees_up() -> None:
    """With max_connections=2, a third connection is answered 503 (error JSON, retryable) and
    closed; once one of the two closes, a new connection is served."""
    limits = ServerLimits(max_connections=2)
    async with serving(FakeEngine(), limits=limits) as (url, _, _):
        held = [await _connect(url) for _ in range(2)]
        await asyncio.sleep(0.05)
        reader, writer = await _connect(url)
        status, payload = await _response(reader)
        assert status == 503 and payload["error"]["code"] == "too_many_connections"
        assert await _closed(reader, 2.0)
        writer.close()
        held[1][1].close()
        await held[1][1].wait_closed()
        await asyncio.sleep(0.1)
        assert await metric(url, "stoic_http_connections_open") == 2  # held[0] and the scrape
        assert await metric(url, 'stoic_http_refused_total{reason="too_many_connections"}') == 1
        held[0][1].close()
        await held[0][1].wait_closed()
        await asyncio.sleep(0.1)
        reader, writer = await _connect(url)
        writer.write(_request(json.dumps(chat_body()).encode()))
        assert (await _response(reader))[0] == 200
        writer.close()


@_session_loop
@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("messages", [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1), "messages"),
        ("tools", [{"type": "function"}] * (MAX_TOOLS + 1), "tools"),
        ("n", 17, "n"),
        ("stop", ["s"] * 17, "stop"),
        ("top_logprobs", 21, "top_logprobs"),
    ],
)
async def test_request_caps_are_400s_naming_the_parameter(
    field: str, value: Any, param: str
) -> None:
    """Each per-request cap is a 400 whose ``param`` names the field; nothing is admitted."""
    engine = FakeEngine()
    body = chat_body(**{field: value})
    if field == "top_logprobs":
        body["logprobs"] = True
    async with serving(engine) as (url, _, _), aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/chat/completions", json=body) as r:
            assert r.status == 400
            error = (await r.json())["error"]
        assert error["param"] == param, error
        assert engine.streams == []


@pytest.mark.parametrize(
    "kwargs",
    [{"max_request_bytes": 0}, {"header_timeout": 0}, {"max_connections": -1}],
)
def test_limits_must_be_positive(kwargs: dict[str, Any]) -> None:
    """A limit of zero or below is a configuration error, not an unlimited server."""
    with pytest.raises(ValueError, match="positive"):
        ServerLimits(**kwargs)
