"""``POST /v1/responses`` with a scripted engine: the response object and its typed event
stream agree, function calls become output items (a cut one never does), conversations continue
from stored responses (in SQLite: a file survives the app, retention, API-key scoping, a locked
or corrupt database is a clear error), and failures keep the chat completions' semantics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from http_fakes import FakeEngine, partial
from http_helpers import Server, read_events, run_app

from stoic.cli import build_parser
from stoic.errors import ExecutorFailed, StorageFailed
from stoic.http import AccessPolicy, EngineLike, ResponseStore, create_app

pytestmark = pytest.mark.asyncio(loop_scope="session")

TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }
]
CALL_TEXT = (
    "Checking.",
    "\n<tool",
    '_call>\n{"name": "get_weather", "arguments": {"city": "Par',
    'is"}}\n</tool_call>',
)
TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]


@contextlib.asynccontextmanager
async def serving(
    engine: EngineLike, store: ResponseStore | None = None, **kwargs: Any
) -> AsyncIterator[Server]:
    async with run_app(create_app(engine, responses=store, **kwargs)) as server:
        yield server


async def create(http: aiohttp.ClientSession, url: str, **body: Any) -> tuple[int, Any]:
    """POST /v1/responses: the status and the JSON body, or the events when streamed."""
    body.setdefault("model", "fake-model")
    async with http.post(f"{url}/v1/responses", json=body) as r:
        if body.get("stream") and r.status == 200:
            return r.status, await read_events(r)
        return r.status, await r.json()


async def test_text_response_whole_and_streamed_agree() -> None:
    """A text answer: the SDK's response (output_text, usage, status) equals what GET returns,
    and the stream's typed events (named, numbered) end with the same output."""
    engine = FakeEngine(script=("Hello", " world"))
    async with serving(engine) as server, server.client() as client:
        whole = await client.responses.create(
            model="fake-model", input="Hi", instructions="Be brief.", metadata={"k": "v"}
        )
        assert whole.output_text == "Hello world" and whole.status == "completed"
        assert whole.usage is not None and whole.usage.output_tokens == 2
        assert whole.instructions == "Be brief." and whole.metadata == {"k": "v"}
        stored = await client.responses.retrieve(whole.id)
        assert stored.model_dump() == whole.model_dump()
        async with aiohttp.ClientSession() as http:
            status, events = await create(http, server.url, input="Hi", stream=True)
    assert status == 200 and [e["type"] for e in events] == TEXT_EVENTS
    assert "".join(e["delta"] for e in events if e["type"].endswith("text.delta")) == "Hello world"
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == "Hello world"
    assert [m["role"] for m in engine.submitted[0].messages] == ["system", "user"]


async def test_function_calls_are_output_items_streamed_or_not() -> None:
    """auto: text then a call gives a message item and a function_call item; streamed, the
    same items, the call's arguments whole in one delta and in function_call_arguments.done."""
    engine = FakeEngine(script=CALL_TEXT)
    async with serving(engine) as server, aiohttp.ClientSession() as http:
        status, whole = await create(http, server.url, input="Weather in Paris?", tools=TOOLS)
        assert status == 200
        _, events = await create(http, server.url, input="x", tools=TOOLS, stream=True)
    kinds = [(i["type"], i["status"]) for i in whole["output"]]
    assert kinds == [("message", "completed"), ("function_call", "completed")]
    call = whole["output"][1]
    assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "Paris"})
    assert call["call_id"].startswith("call_") and whole["status"] == "completed"
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [(e["name"], e["arguments"]) for e in done] == [("get_weather", call["arguments"])]
    streamed = events[-1]["response"]["output"]
    assert [(i["type"], i.get("arguments")) for i in streamed] == [
        (i["type"], i.get("arguments")) for i in whole["output"]
    ]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_call_cut_by_max_output_tokens_is_never_sent(stream: bool) -> None:
    """required, parallel: the second call is cut by the token limit. The first call is
    returned, the cut one is not (no item, no arguments event), and the response is
    incomplete with reason max_output_tokens."""
    script = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city',
    )
    engine = FakeEngine(script=script, script_finish="length")
    async with serving(engine) as server, aiohttp.ClientSession() as http:
        status, out = await create(
            http,
            server.url,
            input="x",
            tools=TOOLS,
            tool_choice="required",
            max_output_tokens=40,
            stream=stream,
        )
    assert status == 200
    response = out[-1]["response"] if stream else out
    if stream:
        assert out[-1]["type"] == "response.incomplete"
        args = [e["arguments"] for e in out if e["type"].endswith("arguments.done")]
        assert args == ['{"city": "Paris"}']
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    calls = [i for i in response["output"] if i["type"] == "function_call"]
    assert [json.loads(c["arguments"]) for c in calls] == [{"city": "Paris"}]


async def test_previous_response_id_continues_the_conversation() -> None:
    """Three turns: each request's prompt is the earlier turns (inputs and outputs, a call and
    its output included) then its input; instructions are not carried over; input_items lists
    the whole conversation, pageable."""
    engine = FakeEngine(script=CALL_TEXT)
    async with serving(engine) as server, server.client() as client:
        first = await client.responses.create(
            model="fake-model", input="Weather?", instructions="Use tools.", tools=TOOLS
        )
        call = first.output[1]
        assert call.type == "function_call"
        engine.script = ("Sunny.",)
        second = await client.responses.create(
            model="fake-model",
            previous_response_id=first.id,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
            tools=TOOLS,
        )
        third = await client.responses.create(
            model="fake-model", previous_response_id=second.id, input="Thanks!"
        )
        assert third.output_text == "Sunny."
        items = await client.responses.input_items.list(third.id, order="asc", limit=100)
        page = await client.responses.input_items.list(third.id, limit=2)
    messages = engine.submitted[2].messages
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant", "user"]
    assert "<tool_response>\nsunny" in messages[2]["content"]
    assert "Weather?" in messages[0]["content"] and messages[-1]["content"] == "Thanks!"
    kinds = [(i.type, getattr(i, "role", None)) for i in items.data]
    assert kinds == [
        ("message", "user"),
        ("message", "assistant"),
        ("function_call", None),
        ("function_call_output", None),
        ("message", "assistant"),
        ("message", "user"),
    ]
    assert page.has_more and [i.id for i in page.data] == [i.id for i in items.data[::-1][:2]]


async def test_bad_requests_are_4xx_before_any_event() -> None:
    """Malformed or unsupported requests are answered 4xx with OpenAI error JSON naming this
    API's field, also when stream is true; nothing reaches the engine."""
    engine = FakeEngine()
    cases: list[tuple[dict[str, Any], int, str | None]] = [
        ({"input": "x", "max_tokens": 3}, 400, "max_tokens"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, 400, None),
        ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools.0"),
        (
            {"input": "x", "tools": TOOLS, "tool_choice": {"type": "file_search"}},
            400,
            "tool_choice",
        ),
        ({"input": "x", "background": True}, 400, "background"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, 400, "text.format"),
        ({"input": "x", "previous_response_id": "resp_missing"}, 404, "previous_response_id"),
        ({"input": "x", "model": "gpt-9"}, 404, "model"),
        ({}, 400, "input"),
    ]
    async with serving(engine) as server, aiohttp.ClientSession() as http:
        for body, expected, param in cases:
            status, error = await create(http, server.url, stream=True, **body)
            assert status == expected, body
            assert param is None or error["error"]["param"] == param, (body, error)
            if param is None:
                assert "input_image" in error["error"]["message"]
    assert engine.submitted == []


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_executor_failure_ends_with_the_partial_output(stream: bool) -> None:
    """An executor failure after admission: a 500 with the partial output, or a stream ending
    with one error event carrying it (and the failed response so far); nothing is stored."""
    error = ExecutorFailed("step failed", partial=partial("abc"))
    store = ResponseStore()
    engine = FakeEngine(tokens=3, stream_error=error)
    async with serving(engine, store) as server, aiohttp.ClientSession() as http:
        status, out = await create(http, server.url, input="x", stream=stream)
        assert await store.count() == 0
    if stream:
        assert status == 200 and out[-1]["type"] == "error"
        assert [e["type"] for e in out].count("error") == 1
        body = out[-1]
        assert body["response"]["status"] == "failed"
        assert body["response"]["output"][0]["content"] == []  # the message was never closed
    else:
        assert status == 500
        body = out["error"]
    assert body["code"] == "executor_error"
    assert body["partial"]["text"] == "abc" and body["partial"]["completion_tokens"] == 3


async def test_store_false_get_and_delete() -> None:
    """store false: nothing to GET; a stored response is read back, deleted once (a second
    delete, and a GET after, are 404)."""
    async with serving(FakeEngine(script=("ok",))) as server, server.client() as client:
        kept = await client.responses.create(model="fake-model", input="x")
        unstored = await client.responses.create(model="fake-model", input="x", store=False)
        assert unstored.store is False
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(unstored.id)
        assert (await client.responses.retrieve(kept.id)).output_text == "ok"
        await client.responses.delete(kept.id)
        for call in (client.responses.retrieve, client.responses.delete):
            with pytest.raises(openai.NotFoundError):
                await call(kept.id)


async def test_stored_responses_are_scoped_to_their_api_key() -> None:
    """With API keys, one key can neither read, continue, list nor delete another's response."""
    access = AccessPolicy(api_keys=("key-a", "key-b"))
    async with serving(FakeEngine(script=("ok",)), access=access) as server:
        a = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="key-a", max_retries=0)
        b = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="key-b", max_retries=0)
        async with a, b:
            mine = await a.responses.create(model="fake-model", input="secret")
            for call in (
                b.responses.retrieve(mine.id),
                b.responses.delete(mine.id),
                b.responses.input_items.list(mine.id),
                b.responses.create(model="fake-model", input="x", previous_response_id=mine.id),
            ):
                with pytest.raises(openai.NotFoundError):
                    await call
            assert (await a.responses.retrieve(mine.id)).id == mine.id


async def test_a_file_database_outlives_the_app_and_keeps_the_newest(tmp_path: Path) -> None:
    """A response stored in a file continues after the app is restarted; retention keeps the
    newest N (the oldest is gone)."""
    path = tmp_path / "data" / "responses.sqlite3"
    engine = FakeEngine(script=("ok",))
    async with (
        serving(engine, ResponseStore(path, retention=2)) as server,
        server.client() as client,
    ):
        ids = [
            (await client.responses.create(model="fake-model", input=f"q{i}")).id for i in range(3)
        ]
    async with (
        serving(engine, ResponseStore(path, retention=2)) as server,
        server.client() as client,
    ):
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(ids[0])
        await client.responses.create(model="fake-model", previous_response_id=ids[2], input="more")
    assert [m["content"] for m in engine.submitted[-1].messages] == ["q2", "ok", "more"]


async def test_concurrent_writers_lose_nothing(tmp_path: Path) -> None:
    """Two stores (two servers) on one file, writing concurrently: every response is kept."""
    path = tmp_path / "responses.sqlite3"
    stores = [ResponseStore(path), ResponseStore(path)]
    try:
        writes = [
            stores[i % 2].put("", {"id": f"resp_{i}", "created_at": i, "output": []}, [])
            for i in range(60)
        ]
        await asyncio.gather(*writes)
        assert await stores[0].count() == 60
        assert (await stores[1].get("", "resp_7")) is not None
    finally:
        for store in stores:
            store.close()


async def test_a_locked_database_is_a_clear_error_not_a_hang(tmp_path: Path) -> None:
    """Another process holds the write lock past the busy timeout: the request ends with a 503
    (streamed: an error event) naming the database and carrying the output; nothing hangs."""
    path = tmp_path / "responses.sqlite3"
    store = ResponseStore(path, busy_timeout=0.2)
    locker = sqlite3.connect(path, isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")
    try:
        async with (
            serving(FakeEngine(script=("ok",)), store) as server,
            aiohttp.ClientSession() as http,
        ):
            status, whole = await asyncio.wait_for(create(http, server.url, input="x"), 10)
            _, events = await create(http, server.url, input="x", stream=True)
    finally:
        locker.close()
    assert status == 503 and whole["error"]["code"] == "storage_failed"
    assert str(path) in whole["error"]["message"] and whole["error"]["partial"]["text"] == "ok"
    assert events[-1]["type"] == "error" and events[-1]["code"] == "storage_failed"
    assert not any(e["type"] == "response.completed" for e in events)


async def test_a_corrupt_database_is_refused_at_start(tmp_path: Path) -> None:
    """A file that is not a database: the store refuses it at once, naming the file."""
    path = tmp_path / "responses.sqlite3"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StorageFailed, match="responses database") as info:
        ResponseStore(path)
    assert str(path) in info.value.message


async def test_serve_flags_open_the_database_and_a_corrupt_one_stops_the_start(
    tmp_path: Path,
) -> None:
    """``--responses-db``/``--responses-retention`` parse (a retention below 1 is a usage
    error); ``stoic serve`` on a corrupt database exits 1 at once, naming the file, before
    loading the model."""
    args = build_parser().parse_args(
        ["serve", "--responses-db", ":memory:", "--responses-retention", "5"]
    )
    assert (args.responses_db, args.responses_retention) == (":memory:", 5)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--responses-retention", "0"])
    path = tmp_path / "responses.sqlite3"
    path.write_bytes(b"garbage" * 1000)
    proc = await asyncio.create_subprocess_exec(
        *[sys.executable, "-m", "stoic", "serve", "--port", "0", "--log-format", "json"],
        *["--responses-db", str(path)],
        stderr=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.DEVNULL,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 1
    failed = [json.loads(line) for line in err.splitlines() if b"stoic.start_failed" in line]
    assert failed and failed[0]["error"] == "StorageFailed" and str(path) in failed[0]["message"]
