"""The Responses API with the real default model, through the official ``openai`` SDK
(``responses.create``, ``.stream``, ``.parse``, a function-tool round trip, three turns of
``previous_response_id``, an app restart between turns on a file database) and through the
openai-agents SDK's default model class (the Responses one) running an agent with a tool."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any, Literal

import aiohttp
import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIProvider,
    OpenAIResponsesModel,
    RunConfig,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from http_helpers import Server, read_events, run_app
from pydantic import BaseModel, Field
from support import engine_config

import stoic
from stoic.http import ResponseStore, create_app

pytestmark = pytest.mark.asyncio(loop_scope="session")

WEATHER: list[Any] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
    }
]


class Verdict(BaseModel):
    reason: str = Field(max_length=24)
    answer: Literal["yes", "no"]


async def test_create_and_stream_agree(client: openai.AsyncOpenAI) -> None:
    """Greedy: the streamed text deltas join to the final response's text, which equals the
    non-streamed answer's; both count the same tokens. (Cut by max_output_tokens, the stream
    ends with ``response.incomplete``, as OpenAI's does; the SDK's ``get_final_response``
    knows only ``response.completed``.)"""
    args: dict[str, Any] = {
        "model": "default",
        "input": "Name a colour.",
        "max_output_tokens": 8,
        "temperature": 0,
    }
    whole = await client.responses.create(**args)
    assert whole.output_text and whole.status in ("completed", "incomplete")
    deltas: list[str] = []
    final: Any = None
    async with client.responses.stream(**args) as stream:
        async for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            elif event.type in ("response.completed", "response.incomplete"):
                final = event.response
    assert final is not None and final.status == whole.status
    assert "".join(deltas) == final.output_text == whole.output_text
    assert final.usage is not None and whole.usage is not None
    assert final.usage.output_tokens == whole.usage.output_tokens


async def test_parse_gives_the_pydantic_model(client: openai.AsyncOpenAI) -> None:
    """``responses.parse(text_format=Model)``: the output is JSON the model validates."""
    parsed = await client.responses.parse(
        model="default",
        input="Is the sky blue? Answer as JSON.",
        text_format=Verdict,
        max_output_tokens=64,
        temperature=0,
    )
    assert parsed.status == "completed"
    assert isinstance(parsed.output_parsed, Verdict)


async def test_a_function_tool_round_trip(client: openai.AsyncOpenAI) -> None:
    """required: the answer is one function_call with arguments valid for the tool; its
    output sent back (previous_response_id) is in the next prompt, answered with text."""
    first = await client.responses.create(
        model="default",
        input="What is the weather in Paris?",
        tools=WEATHER,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=48,
        temperature=0,
    )
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert isinstance(json.loads(call.arguments)["city"], str)
    second = await client.responses.create(
        model="default",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21C"}],
        tools=WEATHER,
        tool_choice="none",
        max_output_tokens=16,
        temperature=0,
    )
    assert second.output_text and all(i.type == "message" for i in second.output)
    items = await client.responses.input_items.list(second.id, order="asc")
    kinds = [i.type for i in items.data]
    assert kinds == ["message", "function_call", "function_call_output"]
    assert items.data[1].call_id == call.call_id == items.data[2].call_id


async def _turns(client: openai.AsyncOpenAI, inputs: list[str], previous: str | None) -> list[Any]:
    responses = []
    for text in inputs:
        response = await client.responses.create(
            model="default",
            input=text,
            previous_response_id=previous,
            max_output_tokens=6,
            temperature=0,
        )
        responses.append(response)
        previous = response.id
    return responses


async def test_three_turns_carry_the_conversation(client: openai.AsyncOpenAI) -> None:
    """Each turn's prompt holds every earlier input and output (it grows by at least them),
    and the last turn's input items are the whole conversation in order."""
    turns = await _turns(client, ["My name is Ann.", "I live in Oslo.", "Who am I?"], None)
    for before, after in itertools.pairwise(turns):
        assert after.usage.input_tokens > before.usage.input_tokens + before.usage.output_tokens
    items = await client.responses.input_items.list(turns[-1].id, order="asc")
    texts = [i.content[0].text for i in items.data]
    assert texts == [
        "My name is Ann.",
        turns[0].output_text,
        "I live in Oslo.",
        turns[1].output_text,
        "Who am I?",
    ]


async def test_a_conversation_survives_an_app_restart(engine: stoic.Engine, tmp_path: Path) -> None:
    """With a file database, a new app (a restarted server) continues a conversation the
    previous one stored."""
    path = tmp_path / "responses.sqlite3"
    app = create_app(engine, responses=ResponseStore(path))
    async with run_app(app) as server, server.client() as client:
        (first,) = await _turns(client, ["Remember the word kiwi."], None)
    app = create_app(engine, responses=ResponseStore(path))
    async with run_app(app) as server, server.client() as client:
        (second,) = await _turns(client, ["Which word?"], first.id)
        items = await client.responses.input_items.list(second.id, order="asc")
    assert [i.content[0].text for i in items.data][:2] == [
        "Remember the word kiwi.",
        first.output_text,
    ]


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
async def test_an_openai_agents_agent_calls_its_tool(server: Server, streamed: bool) -> None:
    """openai-agents' default model class (OpenAIResponsesModel) runs an agent whose tool is
    called with the model's arguments; the tool's result is the final output."""
    set_tracing_disabled(True)
    called: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        called.append(city)
        return f"Sunny in {city}"

    async with server.client() as client:
        provider = OpenAIProvider(openai_client=client)
        assert isinstance(provider.get_model("default"), OpenAIResponsesModel)
        agent = Agent(
            name="weather",
            instructions="Answer questions about the weather with the tool.",
            model="default",
            tools=[get_weather],
            model_settings=ModelSettings(
                tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=64
            ),
            tool_use_behavior="stop_on_first_tool",
        )
        config = RunConfig(model_provider=provider, tracing_disabled=True)
        question = "What is the weather in Paris?"
        if streamed:
            result = Runner.run_streamed(agent, question, run_config=config)
            async for _ in result.stream_events():
                pass
        else:
            result = await Runner.run(agent, question, run_config=config)
    assert len(called) == 1 and result.final_output == f"Sunny in {called[0]}"


STORY: dict[str, Any] = {
    "model": "default",
    "input": "Tell me a long story about a dragon.",
    "max_output_tokens": 16,
    "temperature": 0,
}


async def _stream_events(http: aiohttp.ClientSession, url: str) -> list[dict[str, Any]]:
    async with http.post(f"{url}/v1/responses", json={**STORY, "stream": True}) as r:
        assert r.status == 200
        return await read_events(r)


async def test_an_executor_failure_mid_stream_ends_with_one_error_event(
    server: Server, http: aiohttp.ClientSession, fault_cleanup: None
) -> None:
    """An executor error three steps in: the stream's last event is ``error`` carrying the
    partial output (what the deltas sent, and more); no ``response.completed``."""
    async with http.post(
        f"{server.url}/admin/faults", json={"kind": "error", "after_steps": 3}
    ) as r:
        assert r.status == 200
    events = await _stream_events(http, server.url)
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "error" and kinds.count("error") == 1
    assert "response.completed" not in kinds and "response.incomplete" not in kinds
    error = events[-1]
    assert error["code"].startswith("executor_") and error["partial"]["completion_tokens"] >= 1
    sent = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert error["partial"]["text"].startswith(sent)


async def test_resume_is_invisible_to_a_stream(
    default_model_dir: Path, http: aiohttp.ClientSession
) -> None:
    """``recovery="resume"``: an executor error mid-stream is not seen: the events are those of
    a fault-free run, the text and usage the fault-free ones (float32, greedy)."""
    config = engine_config(default_model_dir, recovery="resume", num_kv_blocks=64)
    async with stoic.Engine.start(config) as engine, run_app(create_app(engine)) as server:
        async with http.post(f"{server.url}/v1/responses", json=STORY) as r:
            reference = await r.json()
        await engine.inject_fault(stoic.FaultSpec(kind="error", after_steps=3))
        events = await _stream_events(http, server.url)
        assert engine.stats().restarts == 1
    final = events[-1]["response"]
    assert events[-1]["type"] == f"response.{reference['status']}"
    assert not any(e["type"] == "error" for e in events)
    assert final["output"][0]["content"] == reference["output"][0]["content"]
    for key in ("input_tokens", "output_tokens"):  # (the second run's prompt is cached)
        assert final["usage"][key] == reference["usage"][key]
