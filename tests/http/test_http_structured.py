"""Structured outputs over HTTP with the real default model, through the official OpenAI SDK:
``response_format`` json_object / json_schema (``parse`` with a pydantic model), vLLM's
``structured_outputs`` extras and their older ``guided_*`` names, and 400s at admission."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import aiohttp
import jsonschema
import openai
import pytest
from http_helpers import Server, chat_body, check_examples, completion_body, json_schemas
from pydantic import BaseModel, Field
from support import wait_idle

import stoic

pytestmark = pytest.mark.asyncio(loop_scope="session")

MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    likes_tea: bool


#: as a strict client sends it (the SDK's ``parse`` closes every object the same way)
PERSON_SCHEMA = {**Person.model_json_schema(), "additionalProperties": False}


def _json_schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": True}}


async def test_parse_with_a_pydantic_model(client: openai.AsyncOpenAI) -> None:
    """``chat.completions.parse(response_format=Model)`` returns an instance of the model,
    finished with "stop" (the grammar completes well within max_tokens)."""
    result = await client.chat.completions.parse(
        model="default", messages=MESSAGES, response_format=Person, max_tokens=64, temperature=0
    )
    choice = result.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)
    assert Person.model_validate_json(choice.message.content or "") == choice.message.parsed


async def test_json_schema_streamed_equals_non_streamed(client: openai.AsyncOpenAI) -> None:
    """Greedy json_schema output is the same streamed and not, and validates."""
    args: dict[str, Any] = {
        "model": "default",
        "messages": MESSAGES,
        "max_tokens": 64,
        "temperature": 0,
        "response_format": _json_schema_format(PERSON_SCHEMA),
    }
    whole = await client.chat.completions.create(**args)
    text = whole.choices[0].message.content or ""
    jsonschema.validate(json.loads(text), PERSON_SCHEMA)
    pieces, finish = [], None
    async for chunk in await client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(pieces) == text
    assert finish == "stop"


async def test_sampled_outputs_always_validate(client: openai.AsyncOpenAI) -> None:
    """At temperature 1, with eight seeds batched together (n=2 each for the completions
    route too), every output is JSON valid under the schema."""
    schema = {
        "type": "object",
        "properties": {
            "color": {"type": "string", "enum": ["red", "green", "blue"]},
            "count": {"type": "integer", "minimum": 0, "maximum": 99},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
        },
        "required": ["color", "count", "tags"],
        "additionalProperties": False,
    }

    slow = client.with_options(timeout=600)  # 16 sequences of up to 64 tokens on a busy CPU

    async def one(seed: int) -> list[str]:
        r = await slow.chat.completions.create(
            model="default",
            messages=MESSAGES,
            max_tokens=64,
            temperature=1.0,
            top_p=0.95,
            seed=seed,
            n=2,
            response_format=_json_schema_format(schema),
        )
        assert all(c.finish_reason == "stop" for c in r.choices), r
        return [c.message.content or "" for c in r.choices]

    outputs = [t for texts in await asyncio.gather(*(one(s) for s in range(8))) for t in texts]
    for text in outputs:
        jsonschema.validate(json.loads(text), schema)
    assert len(set(outputs)) > 1  # sampled, not forced to one answer


async def test_json_object_on_both_routes(client: openai.AsyncOpenAI) -> None:
    """``{"type": "json_object"}`` gives one JSON object on chat and on completions (the vLLM
    extension), where the same prompt unconstrained does not start with '{'."""
    ask = "Give me a JSON object with a name and an age."
    chat = await client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": ask}],
        max_tokens=48,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert chat.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(chat.choices[0].message.content or ""), dict)
    prompt = "A person, as a JSON object with a name and an age:"
    free = await client.completions.create(
        model="default", prompt=prompt, max_tokens=8, temperature=0
    )
    assert not free.choices[0].text.lstrip().startswith("{")
    done = await client.completions.create(
        model="default",
        prompt=prompt,
        max_tokens=48,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert done.choices[0].finish_reason == "stop"
    assert json.loads(done.choices[0].text) == {"name": "John", "age": 25}


@pytest.mark.parametrize(
    "extra",
    [
        {"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2,4}"}},
        {"guided_regex": r"[0-9]{3}-[a-z]{2,4}"},
    ],
)
async def test_regex_extra(client: openai.AsyncOpenAI, extra: dict[str, Any]) -> None:
    """vLLM's regex extra (current and old name): the output matches the whole regex, sampled."""
    for seed in range(3):
        r = await client.completions.create(
            model="default", prompt="Code:", max_tokens=16, seed=seed, extra_body=extra
        )
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", r.choices[0].text), r.choices[0].text
        assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("name", ["structured_outputs", "guided_choice"])
async def test_choice_extra(client: openai.AsyncOpenAI, name: str) -> None:
    """vLLM's choice extra: the output is exactly one of the choices, streamed too."""
    choices = ["sunny day", "rainy night", "snow"]
    body = {"choice": choices} if name == "structured_outputs" else choices
    seen = set()
    for seed in range(4):
        stream = await client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "Weather?"}],
            max_tokens=16,
            seed=seed,
            stream=True,
            extra_body={name: body},
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text in choices
        seen.add(text)


async def test_logprobs_under_a_constraint_are_finite(client: openai.AsyncOpenAI) -> None:
    """Logprobs come from the masked distribution: the chosen tokens' are finite, and top
    alternatives the grammar forbids are reported as -9999.0 (never -inf, which JSON lacks)."""
    r = await client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Pick one."}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
        extra_body={"structured_outputs": {"choice": ["left", "right"]}},
    )
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert r.choices[0].message.content in ("left", "right") and content
    assert -9999.0 < content[0].logprob <= 0.0
    assert all(len(t.top_logprobs) == 5 for t in content)
    assert any(alt.logprob == -9999.0 for t in content for alt in t.top_logprobs)


@pytest.mark.parametrize(
    "grammar", ['start: "yes" | "no" | "maybe"', 'root ::= "yes" | "no" | "maybe"']
)
async def test_grammar_extra_lark_and_gbnf(client: openai.AsyncOpenAI, grammar: str) -> None:
    """vLLM's grammar extra, as Lark and as GBNF: the output is a sentence of the grammar."""
    r = await client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Is water wet?"}],
        max_tokens=8,
        temperature=0,
        extra_body={"structured_outputs": {"grammar": grammar}},
    )
    assert r.choices[0].message.content in ("yes", "no", "maybe")
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("route", ["chat/completions", "completions"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": _json_schema_format({"type": "nope"})}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": _json_schema_format("{not json")}, "response_format"),  # type: ignore[arg-type]
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
        ({"guided_json": {"type": "object", "properties": {"a": {"type": 3}}}}, "guided_json"),
        ({"guided_regex": "x", "guided_choice": ["a"]}, "guided_choice"),
    ],
)
async def test_bad_constraint_is_400_before_streaming(
    server: Server, route: str, stream: bool, fields: dict[str, Any], param: str
) -> None:
    """A schema, regex or grammar that does not compile, or a malformed field, is a 400 naming
    the field, as JSON (never an SSE stream), streamed or not."""
    make = chat_body if route == "chat/completions" else completion_body
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{server.url}/v1/{route}", json=make(stream=stream, **fields)) as r,
    ):
        assert r.status == 400, await r.text()
        assert r.headers["Content-Type"].startswith("application/json")
        error = (await r.json())["error"]
    assert error["param"] == param, error


async def test_generated_schemas_never_5xx(server: Server, engine: stoic.Engine) -> None:
    """Hypothesis-generated JSON schemas: every request is a 200 (whose output validates when
    it finished with "stop") or a 400; never a 5xx; the engine is idle afterwards."""

    async def post(http: aiohttp.ClientSession, schema: dict[str, Any]) -> None:
        body = chat_body(max_tokens=24, temperature=1.0, seed=1)
        body["response_format"] = _json_schema_format(schema)
        async with http.post(f"{server.url}/v1/chat/completions", json=body) as r:
            assert r.status in (200, 400), await r.text()
            data = await r.json()
        if r.status == 200 and data["choices"][0]["finish_reason"] == "stop":
            jsonschema.validate(json.loads(data["choices"][0]["message"]["content"]), schema)

    await check_examples(json_schemas, post, max_examples=20)
    await wait_idle(engine, 10.0, serving=True)


class Reasoned(BaseModel):
    """Keys in an order that is not alphabetical (the common reasoning-first pattern)."""

    reasoning: str = Field(max_length=30)
    answer: int = Field(ge=0, le=100)
    confidence: float


async def test_keys_come_in_the_schema_order(client: openai.AsyncOpenAI) -> None:
    """As OpenAI's, the output's keys follow the schema's order (reasoning before answer),
    not the alphabet, streamed or not."""
    args: dict[str, Any] = {
        "model": "default",
        "messages": [{"role": "user", "content": "What is 2 + 3? Think, then answer."}],
        "max_tokens": 64,
        "temperature": 0,
    }
    result = await client.chat.completions.parse(response_format=Reasoned, **args)
    content = result.choices[0].message.content or ""
    assert result.choices[0].finish_reason == "stop"
    assert list(json.loads(content)) == ["reasoning", "answer", "confidence"]
    async with client.chat.completions.stream(response_format=Reasoned, **args) as stream:
        streamed = await stream.get_final_completion()
    assert streamed.choices[0].message.content == content
