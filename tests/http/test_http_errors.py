"""Everything wrong with a request is answered before any byte of output: a proper status with
OpenAI error JSON, for streaming requests too, and the connection stays usable."""

from __future__ import annotations

from typing import Any

import aiohttp
import openai
import pytest
from http_helpers import Server, chat_body, completion_body

pytestmark = pytest.mark.asyncio(loop_scope="session")

_SDK_ERRORS: dict[int, type[openai.APIStatusError]] = {
    400: openai.BadRequestError,
    404: openai.NotFoundError,
    429: openai.RateLimitError,
    500: openai.InternalServerError,
    503: openai.InternalServerError,
}


def _drop(body: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != key}


#: (case id, body, status, param, code)
CHAT_CASES: list[tuple[str, Any, int, str | None, str | None]] = [
    ("not_an_object", [1, 2], 400, None, None),
    ("missing_messages", _drop(chat_body(), "messages"), 400, "messages", None),
    ("messages_not_a_list", chat_body(messages="hi"), 400, "messages", None),
    ("empty_messages", chat_body(messages=[]), 400, "messages", None),
    ("unknown_role", chat_body(messages=[{"role": "wizard", "content": "x"}]), 400,
     "messages.0.role", None),
    ("second_role_unknown", chat_body(messages=[{"role": "user", "content": "x"},
                                                {"role": "robot", "content": "y"}]), 400,
     "messages.1.role", None),
    ("tool_result_without_id", chat_body(messages=[{"role": "user", "content": "x"},
                                                   {"role": "tool", "content": "y"}]), 400,
     "messages.1.tool_call_id", None),
    ("content_wrong_type", chat_body(messages=[{"role": "user", "content": 5}]), 400,
     "messages.0.content", None),
    ("image_content", chat_body(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), 400,
     "messages.0.content", None),
    ("missing_model", _drop(chat_body(), "model"), 400, "model", None),
    ("unknown_parameter", chat_body(max_token=3), 400, "max_token", None),
    ("vllm_only_parameter", chat_body(prompt_logprobs=1), 400, "prompt_logprobs", None),
    ("max_tokens_string", chat_body(max_tokens="5"), 400, "max_tokens", None),
    ("max_tokens_zero", chat_body(max_tokens=0), 400, "max_tokens", None),
    ("temperature_too_high", chat_body(temperature=3), 400, "temperature", None),
    ("top_p_zero", chat_body(top_p=0), 400, "top_p", None),
    ("n_zero", chat_body(n=0), 400, "n", None),
    ("n_too_large", chat_body(n=1000), 400, "n", None),
    ("presence_penalty_too_high", chat_body(presence_penalty=2.5), 400, "presence_penalty",
     None),
    ("frequency_penalty_too_low", chat_body(frequency_penalty=-3), 400, "frequency_penalty",
     None),
    ("repetition_penalty_zero", chat_body(repetition_penalty=0), 400, "repetition_penalty",
     None),
    ("min_p_too_high", chat_body(min_p=1.5), 400, "min_p", None),
    ("logit_bias_too_high", chat_body(logit_bias={"50": 101}), 400, "logit_bias", None),
    ("logit_bias_key_not_an_id", chat_body(logit_bias={"fifty": 1}), 400, "logit_bias", None),
    ("logit_bias_value_string", chat_body(logit_bias={"50": "1"}), 400, "logit_bias", None),
    ("logit_bias_not_an_object", chat_body(logit_bias=[50, 1]), 400, "logit_bias", None),
    ("logit_bias_outside_vocab", chat_body(logit_bias={"49152": 1}), 400, "logit_bias", None),
    ("tool_name_invalid", chat_body(tools=[{"type": "function", "function": {"name": "f g"}}]),
     400, "tools.0", None),
    ("functions_deprecated", chat_body(functions=[{"name": "f"}]), 400, "functions", None),
    ("response_format_yaml", chat_body(response_format={"type": "yaml"}), 400,
     "response_format", None),
    ("stop_wrong_type", chat_body(stop=5), 400, "stop", None),
    ("top_logprobs_alone", chat_body(top_logprobs=2), 400, "top_logprobs", None),
    ("top_logprobs_too_many", chat_body(logprobs=True, top_logprobs=50), 400,
     "top_logprobs", None),
    ("negative_seed", chat_body(seed=-1), 400, "seed", None),
    ("beyond_context", chat_body(max_tokens=100_000), 400, None, "context_length_exceeded"),
    ("unknown_model", chat_body(model="gpt-9"), 404, "model", "model_not_found"),
]  # fmt: skip

COMPLETION_CASES: list[tuple[str, Any, int, str | None, str | None]] = [
    ("missing_prompt", _drop(completion_body(), "prompt"), 400, "prompt", None),
    ("empty_prompt_list", completion_body(prompt=[]), 400, "prompt", None),
    ("empty_token_list", completion_body(prompt=[[]]), 400, "prompt", None),
    ("negative_token", completion_body(prompt=[-1]), 400, "prompt", None),
    ("token_outside_vocab", completion_body(prompt=[10**9]), 400, "prompt", None),
    ("mixed_prompt", completion_body(prompt=[1, "a"]), 400, "prompt", None),
    ("logprobs_too_many", completion_body(logprobs=50), 400, "logprobs", None),
    ("logit_bias_outside_vocab", completion_body(logit_bias={"1000000": 5}), 400, "logit_bias",
     None),
    ("repetition_penalty_too_high", completion_body(repetition_penalty=2.5), 400,
     "repetition_penalty", None),
    ("echo", completion_body(echo=True), 400, "echo", None),
    ("suffix", completion_body(suffix="end"), 400, "suffix", None),
    ("prompt_too_long", completion_body(prompt="word " * 9000), 400, None,
     "context_length_exceeded"),
    ("unknown_model", completion_body(model="gpt-9"), 404, "model", "model_not_found"),
]  # fmt: skip

CASES = [("chat/completions", *c) for c in CHAT_CASES] + [
    ("completions", *c) for c in COMPLETION_CASES
]


def _with_stream(body: Any, stream: bool) -> Any:
    return {**body, "stream": True} if stream and isinstance(body, dict) else body


async def _peer(http: aiohttp.ClientSession, server: Server) -> Any:
    async with http.get(f"{server.url}/_test/peer") as r:
        return (await r.json())["peer"]


async def _assert_error(
    response: aiohttp.ClientResponse, status: int, param: str | None, code: str | None
) -> dict[str, Any]:
    assert response.status == status, await response.text()
    assert response.headers["Content-Type"].startswith("application/json")
    assert response.headers["x-should-retry"] in ("true", "false")
    assert response.headers.get("Connection", "").lower() != "close"
    body = await response.json()
    error = body["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return dict(error)


async def _assert_still_serves(http: aiohttp.ClientSession, server: Server) -> None:
    body = completion_body(prompt="Hi", max_tokens=1)
    async with http.post(f"{server.url}/v1/completions", json=body) as r:
        assert r.status == 200
        assert (await r.json())["choices"][0]["text"] is not None


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(
    ("route", "case", "body", "status", "param", "code"),
    CASES,
    ids=[f"{c[0]}-{c[1]}" for c in CASES],
)
async def test_bad_request_is_answered_before_output(
    server: Server,
    http: aiohttp.ClientSession,
    route: str,
    case: str,
    body: Any,
    status: int,
    param: str | None,
    code: str | None,
    stream: bool,
) -> None:
    """A bad request gets its status and OpenAI error JSON naming the parameter (streaming or
    not), and the next request on the same kept-alive connection succeeds."""
    before = await _peer(http, server)
    url = f"{server.url}/v1/{route}"
    async with http.post(url, json=_with_stream(body, stream)) as response:
        await _assert_error(response, status, param, code)
    await _assert_still_serves(http, server)
    assert await _peer(http, server) == before


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(
    ("route", "case", "body", "status", "param", "code"),
    [c for c in CASES if isinstance(c[2], dict)],
    ids=[f"{c[0]}-{c[1]}" for c in CASES if isinstance(c[2], dict)],
)
async def test_bad_request_sdk_exception(
    client: openai.AsyncOpenAI,
    route: str,
    case: str,
    body: dict[str, Any],
    status: int,
    param: str | None,
    code: str | None,
    stream: bool,
) -> None:
    """The OpenAI SDK raises the exception class of the status (BadRequestError,
    NotFoundError...), with the error's param and code."""
    with pytest.raises(_SDK_ERRORS[status]) as raised:
        await client.post(
            f"/{route}",
            cast_to=object,
            body=_with_stream(body, stream),
            stream=stream,
            stream_cls=openai.AsyncStream[object],
        )
    assert raised.value.status_code == status
    if param is not None:
        assert raised.value.param == param
    if code is not None:
        assert raised.value.code == code


@pytest.mark.parametrize("raw", [b'{"model": "default", "messages": [', b"\xff\xfe", b""])
@pytest.mark.parametrize("route", ["chat/completions", "completions"])
async def test_malformed_json(
    server: Server, http: aiohttp.ClientSession, route: str, raw: bytes
) -> None:
    """A body that is not JSON is a 400 with error JSON; the connection stays usable."""
    before = await _peer(http, server)
    headers = {"Content-Type": "application/json"}
    async with http.post(f"{server.url}/v1/{route}", data=raw, headers=headers) as response:
        error = await _assert_error(response, 400, None, None)
        assert response.headers["x-should-retry"] == "false"
    assert "JSON" in error["message"]
    await _assert_still_serves(http, server)
    assert await _peer(http, server) == before


@pytest.mark.usefixtures("alternating_template")
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_chat_template_error_is_400(
    server: Server, http: aiohttp.ClientSession, client: openai.AsyncOpenAI, stream: bool
) -> None:
    """A chat template that raises (non-alternating roles) gives a 400 carrying its message."""
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    url = f"{server.url}/v1/chat/completions"
    async with http.post(url, json=chat_body(messages=messages, stream=stream)) as response:
        error = await _assert_error(response, 400, "messages", None)
    assert "Conversation roles must alternate" in error["message"]
    with pytest.raises(openai.BadRequestError, match="Conversation roles must alternate"):
        await client.chat.completions.create(
            model="default",
            messages=messages,
            max_tokens=2,
            stream=stream,
        )
    ok = chat_body(messages=[{"role": "user", "content": "a"}], stream=stream)
    async with http.post(url, json=ok) as response:
        assert response.status == 200
        await response.read()


async def test_unknown_route_and_method(server: Server, http: aiohttp.ClientSession) -> None:
    """Unknown routes are 404 and wrong methods 405, both with OpenAI error JSON."""
    async with http.get(f"{server.url}/v1/nothing") as response:
        await _assert_error(response, 404, None, None)
    async with http.get(f"{server.url}/v1/chat/completions") as response:
        await _assert_error(response, 405, None, None)
