"""Tool calls streamed and not, and cut by ``max_tokens``: with the real default model in
float32 (greedy), the streamed answer, assembled as a client does, is the non-streamed message
token for token, for every ``tool_choice``; a call ``max_tokens`` cuts off is dropped both ways
(``finish_reason: "length"``), never streamed, and no piece of its framing reaches the content.
With a scripted fake engine: the two leaks the issue reported (a cut ``</tool_call`` in the
content, a cut call streamed with arguments that do not parse)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import openai
import pytest
from http_fakes import FakeEngine

pytestmark = pytest.mark.asyncio(loop_scope="session")

#: the issue's tool: get_weather(city)
WEATHER: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
ARGS: dict[str, Any] = {
    "model": "default",
    "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
    "tools": WEATHER,
    "temperature": 0,
    "logprobs": True,
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@dataclass
class Answer:
    """One choice as the client ends up with it, streamed or not."""

    content: str
    #: (name, arguments) of each call, in order
    calls: list[tuple[str, str]]
    finish: str | None
    #: the generated tokens (from the logprobs)
    tokens: list[str]
    completion_tokens: int


async def _whole(client: openai.AsyncOpenAI, **args: Any) -> Answer:
    result = await client.chat.completions.create(**args)
    choice = result.choices[0]
    assert result.usage is not None and choice.logprobs is not None
    calls = choice.message.tool_calls or []
    return Answer(
        choice.message.content or "",
        [(c.function.name, c.function.arguments) for c in calls],  # type: ignore[union-attr]
        choice.finish_reason,
        [t.token for t in choice.logprobs.content or []],
        result.usage.completion_tokens,
    )


async def _streamed(client: openai.AsyncOpenAI, **args: Any) -> Answer:
    """The streamed answer assembled; checks that each call comes once, whole, in one delta
    whose arguments parse."""
    answer = Answer("", [], None, [], 0)
    stream = await client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **args
    )
    async for chunk in stream:
        if chunk.usage is not None:
            answer.completion_tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            answer.content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                assert d.index == len(answer.calls) and d.id and d.function is not None
                assert d.function.name and d.function.arguments is not None
                json.loads(d.function.arguments)  # never a call that does not parse
                answer.calls.append((d.function.name, d.function.arguments))
            if choice.logprobs is not None:
                answer.tokens += [t.token for t in choice.logprobs.content or []]
            answer.finish = choice.finish_reason or answer.finish
    return answer


async def _both(client: openai.AsyncOpenAI, **args: Any) -> Answer:
    """The non-streamed answer, after checking the streamed one is the same."""
    whole = await _whole(client, **args)
    assert await _streamed(client, **args) == whole
    return whole


@pytest.mark.parametrize(
    ("choice", "parallel"),
    [
        ("auto", True),
        ("auto", False),
        ("required", True),
        ("required", False),
        ("none", True),
        (NAMED, True),
        (NAMED, False),
    ],
)
async def test_streamed_equals_non_streamed_for_every_tool_choice(
    client: openai.AsyncOpenAI, choice: Any, parallel: bool
) -> None:
    """Greedy, float32: for each tool_choice, with and without parallel calls, the streamed
    answer assembled (content, calls, finish reason, tokens, usage) is the non-streamed one."""
    answer = await _both(
        client, tool_choice=choice, parallel_tool_calls=parallel, max_tokens=48, **ARGS
    )
    assert answer.tokens and len(answer.tokens) == answer.completion_tokens
    if choice in ("required", NAMED):
        assert answer.calls and answer.content == ""
        assert len(answer.calls) == 1 or (parallel and choice == "required")


def _cut_points(tokens: list[str]) -> list[int]:
    """Token counts that end a repeated-call answer inside the first call's closing tag (the
    issue's ``</tool_call``), inside the second call's opening tag, and inside its object."""
    texts = ["".join(tokens[:n]) for n in range(len(tokens) + 1)]
    full = texts[-1]
    close = full.index("</tool_call>")
    second = full.index("<tool_call>", close)
    obj = full.index("{", second)
    spans = [
        (close, "</tool_call>"),
        (second, "<tool_call>"),
        (obj, full[obj : full.index("}}", obj) + 2]),
    ]
    points = []
    for start, part in spans:
        inside = [n for n, t in enumerate(texts) if start < len(t) < start + len(part)]
        assert inside, f"no token boundary inside {part!r}"
        points.append(inside[-1])
    return points


async def test_a_call_cut_by_max_tokens_is_dropped_both_ways(client: openai.AsyncOpenAI) -> None:
    """The issue's repro: required, parallel calls, get_weather(city); the model repeats the
    call, and max_tokens cuts the answer in the first call's closing tag, in the second call's
    opening tag and in its object.
    Streamed and not: the first call only, content null, finish_reason length, and the cut call
    is never streamed."""
    args = {**ARGS, "tool_choice": "required", "parallel_tool_calls": True}
    full = await _whole(client, max_tokens=64, **args)
    assert len(full.calls) >= 2, "the model no longer repeats the call: pick another prompt"
    for max_tokens in _cut_points(full.tokens):
        cut = await _both(client, max_tokens=max_tokens, **args)
        assert cut.tokens == full.tokens[:max_tokens]
        assert cut.calls == full.calls[:1]
        assert cut.content == "" and cut.finish == "length"


#: two calls, the second cut by max_tokens in its closing tag (as a Delta stream would end)
TWO_CALLS = (
    "<tool_call>\n",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "\n</tool_call>\n<tool_call>\n",
    '{"name": "get_weather", "arguments": {"city',
)


@pytest.mark.parametrize(
    ("script", "choice"),
    [
        (TWO_CALLS, "required"),
        (TWO_CALLS, "auto"),
        ((*TWO_CALLS[:2], "\n</tool_call"), "required"),
        ((*TWO_CALLS[:2], "\n</tool_call"), "auto"),
        (TWO_CALLS[:3], "auto"),
    ],
)
async def test_cut_framing_never_reaches_the_content(
    fake_server: Callable[..., Any], script: tuple[str, ...], choice: str
) -> None:
    """A scripted answer cut by max_tokens (finish length): inside the second call, in the first
    call's closing tag, right after the second call's opening tag. Both ways: one call, no
    content, finish_reason length; streamed, the cut call is never sent."""
    server = await fake_server(FakeEngine(script=script, script_finish="length"))
    args = {**ARGS, "model": "fake-model", "tool_choice": choice, "logprobs": False}
    async with server.client() as client:
        whole = await client.chat.completions.create(**args)
        message = whole.choices[0].message
        assert message.content is None
        assert [c.function.arguments for c in message.tool_calls or []] == ['{"city": "Paris"}']
        assert whole.choices[0].finish_reason == "length"
        deltas = []
        content = ""
        async for chunk in await client.chat.completions.create(stream=True, **args):
            for c in chunk.choices:
                deltas += c.delta.tool_calls or []
                content += c.delta.content or ""
    assert content == ""
    assert [(d.index, d.function.arguments) for d in deltas] == [(0, '{"city": "Paris"}')]
