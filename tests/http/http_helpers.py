"""Helpers shared by the HTTP tests (importable: ``from http_helpers import ...``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stoic.http import EngineLike, serve


@dataclass
class Server:
    """An app listening on 127.0.0.1."""

    url: str
    app: web.Application
    runner: web.AppRunner

    def client(self, prefix: str = "") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.url}{prefix}/v1", api_key="unused", max_retries=0, timeout=60
        )


@contextlib.asynccontextmanager
async def run_app(
    app: web.Application, *, handler_cancellation: bool = False
) -> AsyncIterator[Server]:
    runner = web.AppRunner(app, handler_cancellation=handler_cancellation, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield Server(f"http://{host}:{port}", app, runner)
    finally:
        await runner.cleanup()


def chat_body(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "default",
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 4,
    }
    body.update(overrides)
    return body


def completion_body(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "default", "prompt": "Once upon a time", "max_tokens": 4}
    body.update(overrides)
    return body


async def read_sse(response: aiohttp.ClientResponse) -> list[Any]:
    """Every ``data:`` payload of an SSE response, JSON-decoded (``[DONE]`` kept as a string)."""
    text = await response.text()
    events: list[Any] = []
    for block in (b.strip() for b in text.split("\n\n")):
        if not block:
            continue
        assert block.startswith("data: "), block
        data = block.removeprefix("data: ")
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def read_events(response: aiohttp.ClientResponse) -> list[dict[str, Any]]:
    """Every event of a Responses stream; each block's ``event:`` line names its ``type``."""
    events = []
    for block in (b for b in (await response.text()).split("\n\n") if b.strip()):
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


@contextlib.asynccontextmanager
async def serving(
    engine: EngineLike, **kwargs: Any
) -> AsyncIterator[tuple[str, asyncio.Event, asyncio.Task[int]]]:
    """Run ``serve()`` in a task on a free port; yield (url, stop event, task)."""
    stop = asyncio.Event()
    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(
        serve(
            engine,
            port=0,
            handle_signals=False,
            stop=stop,
            on_ready=lambda url, _engine: ready.set_result(url),
            **kwargs,
        )
    )
    try:
        url = await asyncio.wait_for(asyncio.shield(ready), 10)
        yield url, stop, task
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def metric(url: str, name: str) -> float:
    """The value of one sample of ``url``'s /metrics (``name`` with its labels), 0 if absent."""
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as r:
        text = await r.text()
    for line in text.splitlines():
        sample, _, value = line.rpartition(" ")
        if sample == name:
            return float(value)
    return 0.0


async def stream_with_error_at_step(http: aiohttp.ClientSession, url: str, step: int) -> list[Any]:
    """Arm an executor error ``step`` steps ahead, then stream a 16-token completion (EOS
    ignored) from ``url``; its SSE events (the error event and [DONE] end them)."""
    fault = {"kind": "error", "after_steps": step}
    async with http.post(f"{url}/admin/faults", json=fault) as r:
        assert r.status == 200
    body = completion_body(max_tokens=16, ignore_eos=True, stream=True)
    async with http.post(f"{url}/v1/completions", json=body) as r:
        assert r.status == 200
        return await read_sse(r)


_schema_leaf = st.sampled_from(
    [
        {"type": "string", "maxLength": 5},
        {"type": "integer", "minimum": -5, "maximum": 500},
        {"type": "boolean"},
        {"type": "number"},
        {"type": "null"},
        {"enum": ["a", "b", 3]},
        {"type": "string", "pattern": "^[a-c]{1,3}$"},
        {"type": "string", "format": "date"},
    ]
)
#: small JSON schemas (objects, arrays, anyOf over string/number/enum/pattern leaves)
json_schemas = st.recursive(
    _schema_leaf,
    lambda inner: (
        st.dictionaries(st.from_regex(r"[a-z]{1,6}", fullmatch=True), inner, max_size=3).map(
            lambda props: {
                "type": "object",
                "properties": props,
                "required": sorted(props),
                "additionalProperties": False,
            }
        )
        | inner.map(lambda item: {"type": "array", "items": item, "maxItems": 2})
        | st.lists(inner, min_size=2, max_size=2).map(lambda xs: {"anyOf": xs})
    ),
    max_leaves=5,
)


async def check_examples(
    strategy: st.SearchStrategy[Any],
    check: Callable[[aiohttp.ClientSession, Any], Awaitable[None]],
    *,
    max_examples: int,
    request_timeout: float = 60.0,
    suppress: Sequence[HealthCheck] = (),
) -> None:
    """Run ``check`` on derandomized hypothesis examples of ``strategy``, one at a time, on the
    running event loop (hypothesis drives them from a worker thread), with a client session
    whose requests time out after ``request_timeout`` seconds; each example gets 5 seconds more.
    ``suppress``: health checks to skip besides ``too_slow``."""
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=request_timeout)) as http:

        @settings(
            max_examples=max_examples,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, *suppress],
        )
        @given(strategy)
        def run(example: Any) -> None:
            call = check(http, example)
            asyncio.run_coroutine_threadsafe(call, loop).result(timeout=request_timeout + 5)

        await asyncio.to_thread(run)
