"""Overload over HTTP (issue 47): a request that cannot start in time is a 429 with
``Retry-After`` before any byte (streaming too), a deadline that passes mid-answer ends it with
``finish_reason: "timeout"`` and its output so far, and tenants (a header, or the API key)
reach /metrics. On the real default model, through the shared engine."""

from __future__ import annotations

import asyncio
import hashlib

import aiohttp
import pytest
from http_helpers import Server, chat_body, completion_body, metric, read_sse, run_app
from support import until, wait_idle

import stoic
from stoic.http import AccessPolicy, create_app
from stoic.scheduler import MIN_STEPS

pytestmark = pytest.mark.asyncio(loop_scope="session")

LONG = {"max_tokens": 4000, "ignore_eos": True}


async def test_a_request_that_cannot_start_in_time_is_refused_at_once(
    server: Server, engine: stoic.Engine, http: aiohttp.ClientSession
) -> None:
    """Behind a queue of long prompts, a streaming request with a 0.05 s timeout is a 429 with
    ``Retry-After`` and a JSON error (no event stream) within a fraction of a second; one with
    room to wait is admitted; the queue's requests are unaffected."""
    # the meter prices steps once it has seen MIN_STEPS of them
    warm = stoic.SamplingParams(max_tokens=MIN_STEPS + 4, ignore_eos=True)
    await engine.complete("warm up the step meter", warm)
    words = " ".join(f"word{i}" for i in range(200))  # ~600 tokens each
    params = stoic.SamplingParams(max_tokens=2, ignore_eos=True)
    queued: list[stoic.RequestStream] = []
    try:
        for i in range(2):
            queued.append(await engine.submit(f"{i} {words}", params))
        await _refused_then_admitted(server, engine, http, queued)
    finally:
        for stream in queued:
            await stream.aclose()
        await wait_idle(engine, 60.0, serving=True)


async def _refused_then_admitted(
    server: Server,
    engine: stoic.Engine,
    http: aiohttp.ClientSession,
    queued: list[stoic.RequestStream],
) -> None:
    steps = engine.stats().steps
    await until(lambda: engine.stats().steps >= steps + 2, 60, "the queue's first steps")
    started = asyncio.get_running_loop().time()
    body = chat_body(stream=True, timeout=0.05)
    async with http.post(f"{server.url}/v1/chat/completions", json=body) as r:
        refused_after = asyncio.get_running_loop().time() - started
        assert r.status == 429, await r.text()
        assert r.content_type == "application/json"
        assert int(r.headers["Retry-After"]) >= 1
        error = (await r.json())["error"]
    assert "timeout" in error["message"] and error["type"] == "rate_limit_error"
    assert refused_after < 1.0
    patient = chat_body(timeout=600)
    async with http.post(f"{server.url}/v1/chat/completions", json=patient) as r:
        assert r.status == 200, await r.text()
    for stream in queued:
        result = await stream.collect()
        assert result.finish_reason == "length"


async def test_a_deadline_that_passes_mid_answer_ends_it_with_timeout(
    server: Server, http: aiohttp.ClientSession
) -> None:
    """A non-streaming answer past its ``timeout`` ends with ``finish_reason: "timeout"`` and the
    tokens it had (fewer than asked); a stream past its ``x-request-timeout`` ends the same way
    and then ``[DONE]``."""
    body = completion_body(timeout=1.0, **LONG)
    async with http.post(f"{server.url}/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        answer = await r.json()
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "timeout"
    assert 0 < answer["usage"]["completion_tokens"] < 4000
    assert choice["text"]
    headers = {"x-request-timeout": "1"}
    body = chat_body(stream=True, **LONG)
    async with http.post(f"{server.url}/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status == 200
        events = await read_sse(r)
    assert events[-1] == "[DONE]"
    finishes = [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["timeout"]


@pytest.mark.parametrize(
    ("body", "headers", "param"),
    [
        (chat_body(timeout=0), {}, "timeout"),
        (chat_body(timeout=-3), {}, "timeout"),
        (chat_body(priority="high"), {}, "priority"),
        (chat_body(priority=2**40), {}, "priority"),
        (chat_body(), {"x-request-timeout": "soon"}, "x-request-timeout"),
        (chat_body(), {"x-request-timeout": "inf"}, "x-request-timeout"),
    ],
)
async def test_a_bad_timeout_or_priority_is_a_400_naming_it(
    server: Server,
    http: aiohttp.ClientSession,
    body: dict[str, object],
    headers: dict[str, str],
    param: str,
) -> None:
    async with http.post(f"{server.url}/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status == 400, await r.text()
        assert (await r.json())["error"]["param"] == param


async def test_the_tenant_header_and_the_api_key_name_the_tenant_on_metrics(
    engine: stoic.Engine,
) -> None:
    """With ``tenant_header``, a request's header names its tenant; without the header, its API
    key does (``key-`` and 12 hex digits of its SHA-256, never the key); each tenant's admitted
    requests and computed tokens are on /metrics."""
    policy = AccessPolicy(api_keys=("sk-tenant-test",), tenant_header="x-tenant")
    auth = {"Authorization": "Bearer sk-tenant-test"}
    async with (
        run_app(create_app(engine, access=policy)) as server,
        aiohttp.ClientSession() as http,
    ):
        for headers in ({**auth, "x-tenant": "alpha"}, auth):
            body = chat_body(priority=-1)
            async with http.post(
                f"{server.url}/v1/chat/completions", json=body, headers=headers
            ) as r:
                assert r.status == 200, await r.text()
        keyed = "key-" + hashlib.sha256(b"sk-tenant-test").hexdigest()[:12]
        for tenant in ("alpha", keyed):
            admitted = await metric(
                server.url, f'stoic_tenant_requests_admitted_total{{tenant="{tenant}"}}'
            )
            computed = await metric(
                server.url, f'stoic_tenant_computed_tokens_total{{tenant="{tenant}"}}'
            )
            assert admitted >= 1 and computed >= 1, tenant
        async with http.get(f"{server.url}/metrics") as r:
            assert "sk-tenant-test" not in await r.text()
