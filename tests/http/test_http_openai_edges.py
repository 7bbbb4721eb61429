"""OpenAI's request edges, over HTTP with a fake engine: a null is "not set" for every optional
field; the OpenAI parameters stoic cannot act on are accepted and ignored, while a name in no
OpenAI spec stays a 400; ``tool_choice`` required or named without ``tools`` is a 400."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import aiohttp
import pytest
from http_fakes import FakeEngine
from http_helpers import chat_body, completion_body

from stoic.http._openai_params import IGNORED_PARAMETERS
from stoic.http._schemas import ChatCompletionRequest, CompletionRequest

pytestmark = pytest.mark.asyncio(loop_scope="session")

#: the optional fields of each request, every one of them null
CHAT_NULLS = {
    name: None
    for name, field in ChatCompletionRequest.model_fields.items()
    if not field.is_required()
}
COMPLETION_NULLS = {
    name: None for name, field in CompletionRequest.model_fields.items() if not field.is_required()
}
#: the nullable fields of OpenAI's Chat Completions and Completions request schemas
OPENAI_NULLABLE = {
    "n", "stream", "stop", "temperature", "top_p", "max_tokens", "max_completion_tokens",
    "seed", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "user",
    "response_format", "tools", "tool_choice", "stream_options", "logit_bias", "metadata",
    "store", "service_tier", "modalities", "audio", "prediction", "reasoning_effort",
    "verbosity", "parallel_tool_calls", "best_of", "echo", "suffix",
}  # fmt: skip


async def _post(
    fake_server: Callable[..., Any], path: str, body: dict[str, Any]
) -> tuple[int, dict[str, Any], FakeEngine]:
    engine = FakeEngine()
    server = await fake_server(engine)
    async with aiohttp.ClientSession() as http, http.post(server.url + path, json=body) as r:
        return r.status, await r.json(), engine


async def test_every_openai_nullable_field_is_a_field_or_ignored() -> None:
    """Each field OpenAI marks nullable is one stoic reads (null allowed) or ignores."""
    known = set(CHAT_NULLS) | set(COMPLETION_NULLS) | set(IGNORED_PARAMETERS)
    assert known >= OPENAI_NULLABLE


@pytest.mark.parametrize(
    ("path", "body", "nulls"),
    [
        ("/v1/chat/completions", chat_body(), CHAT_NULLS),
        ("/v1/completions", completion_body(), COMPLETION_NULLS),
    ],
)
async def test_null_is_not_set_for_every_optional_field(
    fake_server: Callable[..., Any], path: str, body: dict[str, Any], nulls: dict[str, Any]
) -> None:
    """A body whose every optional field is null (``"n": null``, ``"stream": null``...) and
    every ignored parameter too is answered as if they were left out: 200, one choice, not
    streamed, the same sampling parameters."""
    model = ChatCompletionRequest if "chat" in path else CompletionRequest
    plain = model.model_validate(body)
    # (the body's own max_tokens stays: completions' max_tokens null means "to the context")
    nulled = {**nulls, **dict.fromkeys(IGNORED_PARAMETERS), **body}
    assert model.model_validate(nulled) == plain
    status, answer, _ = await _post(fake_server, path, {**nulled, "model": "fake-model"})
    assert status == 200, answer
    assert answer["object"] in ("chat.completion", "text_completion")
    assert len(answer["choices"]) == 1


async def test_ignored_openai_parameters_are_accepted(fake_server: Callable[..., Any]) -> None:
    """The OpenAI parameters stoic cannot act on are accepted with any value and change
    nothing stoic does."""
    body = chat_body(model="fake-model")
    values = {name: {"any": ["value"]} for name in IGNORED_PARAMETERS}
    values.update(reasoning_effort="low", verbosity="high", store=True, user="u-1")
    status, answer, engine = await _post(fake_server, "/v1/chat/completions", {**body, **values})
    assert status == 200, answer
    plain = await _post(fake_server, "/v1/chat/completions", body)
    # the same request (its id is the request's own)
    same = [replace(r, request_id="same") for r in engine.submitted]
    assert same == [replace(r, request_id="same") for r in plain[2].submitted]
    status, answer, _ = await _post(
        fake_server, "/v1/completions", {**completion_body(model="fake-model"), **values}
    )
    assert status == 200, answer


@pytest.mark.parametrize("typo", ["reasoning_efort", "max_token", "verbose", "temprature"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_a_name_in_no_openai_spec_is_a_400(
    fake_server: Callable[..., Any], path: str, typo: str
) -> None:
    """A parameter that is in no OpenAI spec (a typo) is a 400 naming it, null or not."""
    body = chat_body() if "chat" in path else completion_body()
    for value in ("low", None):
        status, answer, _ = await _post(fake_server, path, {**body, typo: value})
        assert status == 400
        assert answer["error"]["param"] == typo
        assert answer["error"]["message"] == f"unknown parameter '{typo}'"


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
@pytest.mark.parametrize("tools", [None, []])
async def test_forced_tool_choice_without_tools_is_a_400(
    fake_server: Callable[..., Any], choice: Any, tools: Any
) -> None:
    """tool_choice required or named with no tools is OpenAI's 400 (invalid_request_error,
    param tool_choice), before any generation; auto and none without tools are accepted."""
    body = chat_body(model="fake-model", tool_choice=choice, tools=tools, stream=True)
    status, answer, engine = await _post(fake_server, "/v1/chat/completions", body)
    assert status == 400
    assert answer["error"]["type"] == "invalid_request_error"
    assert answer["error"]["param"] == "tool_choice"
    assert engine.submitted == []
    for allowed in ("auto", "none"):
        body = chat_body(model="fake-model", tool_choice=allowed, tools=tools)
        status, answer, _ = await _post(fake_server, "/v1/chat/completions", body)
        assert status == 200, answer
