"""Tool calling over HTTP through the official OpenAI SDK: with the real default model
(generic syntax, and native Mistral / Hermes templates installed on it) for ``required``,
named, ``none`` and conversations with tool results; with a scripted fake engine for ``auto``
(what the model chooses to write is parsed into text or calls, whole and streamed)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import aiohttp
import jsonschema
import openai
import pytest
from http_fakes import FakeEngine
from http_helpers import Server, check_examples, json_schemas
from support import wait_idle

import stoic

pytestmark = pytest.mark.asyncio(loop_scope="session")

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": WEATHER_PARAMS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The current time in a time zone",
            "parameters": {
                "type": "object",
                "properties": {"tz": {"type": "string", "maxLength": 20}},
                "required": ["tz"],
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
ARGS: dict[str, Any] = {
    "model": "default",
    "messages": MESSAGES,
    "tools": TOOLS,
    "max_tokens": 64,
    "temperature": 0,
}

#: a template that renders tools and calls as Mistral's do
MISTRAL_TEMPLATE = (
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{% elif m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | map(attribute='function') "
    "| list | tojson }}</s>"
    "{% else %}{{ m.content }}</s>{% endif %}{% endfor %}"
)
#: a ChatML template with Hermes tool calls (as Qwen 2.5's)
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}Call them in <tool_call></tool_call> tags.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{{ c.function | tojson }}\n</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _check_calls(message: Any, names: set[str] | None = None) -> list[Any]:
    """The message's calls: each names a tool (one of ``names``), has a fresh id and
    arguments that validate against the function's schema."""
    calls = message.tool_calls or []
    assert len({c.id for c in calls}) == len(calls)
    for call in calls:
        assert call.type == "function"
        assert call.function.name in (names or SCHEMAS)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return calls


async def _metric(server: Server, name: str) -> float:
    async with aiohttp.ClientSession() as http, http.get(f"{server.url}/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
    raise AssertionError(f"{name} not exported")


async def _stream_calls(client: openai.AsyncOpenAI, **args: Any) -> tuple[str, list[Any], Any]:
    """Stream a request; the content, the calls reassembled from their deltas (id and name
    sent once per call), and the finish reason."""
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    async for chunk in await client.chat.completions.create(stream=True, **args):
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id is not None:
                    assert call["id"] is None
                    call["id"], call["name"] = d.id, d.function.name
                call["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return "".join(content), [calls[i] for i in sorted(calls)], finish


async def test_required_returns_a_valid_call(client: openai.AsyncOpenAI) -> None:
    """tool_choice required (one call): finish_reason tool_calls, no content, one call whose
    arguments validate against its function's schema."""
    result = await client.chat.completions.create(
        tool_choice="required", parallel_tool_calls=False, **ARGS
    )
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert len(_check_calls(choice.message)) == 1


async def test_named_choice_calls_that_function_once(client: openai.AsyncOpenAI) -> None:
    """A named function: exactly one call, to that function, valid arguments."""
    choice = {"type": "function", "function": {"name": "get_time"}}
    result = await client.chat.completions.create(tool_choice=choice, **ARGS)
    (call,) = _check_calls(result.choices[0].message, {"get_time"})
    assert result.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_time"


async def test_streamed_calls_reassemble_to_the_whole_answer(
    client: openai.AsyncOpenAI,
) -> None:
    """Greedy, float32: the calls reassembled from streamed deltas (arguments in several
    pieces) are the non-streamed calls, with the same finish reason."""
    args = {**ARGS, "tool_choice": "required", "parallel_tool_calls": False}
    whole = await client.chat.completions.create(**args)
    content, calls, finish = await _stream_calls(client, **args)
    expected = whole.choices[0].message.tool_calls or []
    assert content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in expected
    ]
    assert finish == whole.choices[0].finish_reason == "tool_calls"
    assert all(c["id"].startswith("call_") for c in calls)


async def test_sampled_calls_always_validate(client: openai.AsyncOpenAI) -> None:
    """At temperature 1 with several seeds (n=4, batched), every returned call validates;
    a call cut by max_tokens is never returned."""
    result = await client.chat.completions.create(
        **{**ARGS, "temperature": 1.0, "seed": 7, "n": 4, "tool_choice": "required"}
    )
    assert len(result.choices) == 4
    for choice in result.choices:
        calls = _check_calls(choice.message)
        assert calls or choice.finish_reason == "length"


async def test_none_offers_no_tools(client: openai.AsyncOpenAI) -> None:
    """tool_choice none: the prompt is the one without tools and the answer is text."""
    plain = await client.chat.completions.create(**{**ARGS, "tools": openai.omit})
    none = await client.chat.completions.create(tool_choice="none", **ARGS)
    assert none.usage is not None and plain.usage is not None
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].message.content == plain.choices[0].message.content


async def test_auto_offers_the_tools_in_the_prompt(client: openai.AsyncOpenAI) -> None:
    """auto (the default with tools): the generic syntax describes the tools to the model in
    the system message, so the prompt is longer; the answer is text or valid calls."""
    plain = await client.chat.completions.create(**{**ARGS, "tools": openai.omit})
    auto = await client.chat.completions.create(**ARGS)
    assert auto.usage is not None and plain.usage is not None
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 50
    message = auto.choices[0].message
    assert message.content or _check_calls(message)


async def test_a_conversation_with_a_tool_result(
    client: openai.AsyncOpenAI, http: aiohttp.ClientSession, server: Server
) -> None:
    """The assistant's call and the tool's result go back in: the call and the result reach
    the prompt (generic syntax: as text), and the model answers."""
    first = await client.chat.completions.create(
        tool_choice="required", parallel_tool_calls=False, **ARGS
    )
    message = first.choices[0].message
    (call,) = _check_calls(message)
    conversation = [
        *MESSAGES,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear", "temp": 21}'},
    ]
    answer = await client.chat.completions.create(**{**ARGS, "messages": conversation})
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    body = {"model": "default", "messages": conversation}
    async with http.post(f"{server.url}/tokenize", json=body) as r:
        assert r.status == 200
        tokens = (await r.json())["tokens"]
    async with http.post(f"{server.url}/detokenize", json={"tokens": tokens}) as r:
        prompt = (await r.json())["prompt"]
    assert call.function.arguments in prompt.replace(" ", "")  # the call, as JSON
    assert '<tool_response>\n{"sky": "clear", "temp": 21}\n</tool_response>' in prompt


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"messages": [*MESSAGES, {"role": "tool", "content": "x"}]}, "messages.1.tool_call_id"),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "1"}]}]},
            "messages.0.tool_calls",
        ),
    ],
)
async def test_bad_tool_requests_are_400_before_streaming(
    client: openai.AsyncOpenAI, change: dict[str, Any], param: str
) -> None:
    """A malformed tool request is a 400 naming the field, even when streaming (no event)."""
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(stream=True, **{**ARGS, **change})
    assert info.value.status_code == 400
    assert isinstance(info.value.body, dict) and info.value.body["param"] == param


async def test_native_mistral_template_calls(
    client: openai.AsyncOpenAI, set_chat_template: Callable[[str], None]
) -> None:
    """With a Mistral-style template: the tools go to the template, the calls come back
    parsed from ``[TOOL_CALLS][...]`` with Mistral's 9-character ids, streamed or not."""
    set_chat_template(MISTRAL_TEMPLATE)
    args = {**ARGS, "tool_choice": "required"}
    result = await client.chat.completions.create(**args)
    calls = _check_calls(result.choices[0].message)
    assert calls and all(len(c.id) == 9 and c.id.isalnum() for c in calls)
    _, streamed, _ = await _stream_calls(client, **args)
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in calls
    ]


async def test_native_hermes_template_gets_the_tools(
    client: openai.AsyncOpenAI,
    http: aiohttp.ClientSession,
    server: Server,
    set_chat_template: Callable[[str], None],
) -> None:
    """With a Hermes template (tools rendered by the template): the template's tool list is
    in the prompt, and a call of an earlier turn is rendered by the template itself."""
    set_chat_template(HERMES_TEMPLATE)
    result = await client.chat.completions.create(tool_choice="required", **ARGS)
    assert _check_calls(result.choices[0].message)
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    conversation = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "noon"},
    ]
    async with http.post(
        f"{server.url}/tokenize", json={"model": "default", "messages": conversation}
    ) as r:
        tokens = (await r.json())["tokens"]
    async with http.post(f"{server.url}/detokenize", json={"tokens": tokens}) as r:
        prompt = (await r.json())["prompt"]
    assert '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>' in prompt
    assert "<|im_start|>tool\nnoon" in prompt


AUTO_TEXT = (
    "Checking.",
    "\n<tool",
    '_call>\n{"name": "get_weather", "arguments": {"city": "Par',
    'is", "unit": "celsius"}}\n</tool_call>',
)


async def test_auto_parses_what_the_model_wrote(fake_server: Callable[..., Any]) -> None:
    """auto: a model that writes text then a call gets content and a parsed call, finish
    tool_calls; streamed, the same content and call (the tag never leaks into content)."""
    engine = FakeEngine(script=AUTO_TEXT)
    server = await fake_server(engine)
    args = {**ARGS, "model": "fake-model"}
    async with server.client() as client:
        whole = await client.chat.completions.create(**args)
        message = whole.choices[0].message
        assert message.content == "Checking."
        (call,) = _check_calls(message)
        assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
        assert whole.choices[0].finish_reason == "tool_calls"
        content, calls, finish = await _stream_calls(client, **args)
    assert content == "Checking."
    assert [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", call.function.arguments)
    ]
    assert finish == "tool_calls"
    messages, kwargs = engine.submitted[0].messages, engine.submitted[0].chat_template_kwargs
    assert kwargs is None and "get_weather" in messages[0]["content"]  # generic: system text
    assert await _metric(server, 'stoic_tool_calls_total{outcome="returned"}') == 2.0


async def test_auto_keeps_an_invalid_call_as_text(fake_server: Callable[..., Any]) -> None:
    """A call to an unknown function, or with arguments that do not parse, is never returned:
    the text comes back as content with finish_reason stop."""
    script = ('<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>',)
    server = await fake_server(FakeEngine(script=script))
    async with server.client() as client:
        whole = await client.chat.completions.create(**{**ARGS, "model": "fake-model"})
        content, calls, finish = await _stream_calls(client, **{**ARGS, "model": "fake-model"})
    assert whole.choices[0].message.content == script[0] == content
    assert whole.choices[0].message.tool_calls is None and calls == []
    assert whole.choices[0].finish_reason == "stop" == finish
    assert await _metric(server, 'stoic_tool_calls_total{outcome="rejected"}') == 2.0


async def test_generated_parameter_schemas_never_5xx(server: Server, engine: stoic.Engine) -> None:
    """Hypothesis-generated parameter schemas with tool_choice required: every request is a
    200 (whose calls validate against the schema) or a 400; never a 5xx; the engine is idle
    afterwards."""

    async def post(http: aiohttp.ClientSession, schema: dict[str, Any]) -> None:
        params = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
        tool = {"type": "function", "function": {"name": "f", "parameters": params}}
        body = {**ARGS, "tools": [tool], "tool_choice": "required", "max_tokens": 24}
        body.update(temperature=1.0, seed=1)
        async with http.post(f"{server.url}/v1/chat/completions", json=body) as r:
            assert r.status in (200, 400), await r.text()
            data = await r.json()
        if r.status == 200:
            for call in data["choices"][0]["message"].get("tool_calls") or []:
                jsonschema.validate(json.loads(call["function"]["arguments"]), params)

    await check_examples(json_schemas, post, max_examples=15)
    await wait_idle(engine, 10.0, serving=True)
