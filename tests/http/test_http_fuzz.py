"""Random JSON bodies thrown at both completion routes: never a 5xx, never a hang.

Hypothesis runs in a worker thread; each example's request runs on the session event loop
(where the server is), through ``run_coroutine_threadsafe``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import aiohttp
import pytest
from http_helpers import Server, check_examples, completion_body
from hypothesis import HealthCheck
from hypothesis import strategies as st
from support import wait_idle

import stoic

pytestmark = pytest.mark.asyncio(loop_scope="session")

EXAMPLES = int(os.environ.get("STOIC_FUZZ_EXAMPLES", "60"))

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.text(max_size=12)
)
json_values = st.recursive(
    _scalars,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3)
    ),
    max_leaves=8,
)
# values that bound generation: a few tokens, or far beyond the context (rejected at once)
_max_tokens = (
    st.integers(min_value=-3, max_value=6)
    | st.integers(min_value=10_000, max_value=2**70)
    | st.text(max_size=4)
    | st.floats()
    | st.booleans()
)
_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system", "developer", "tool", "x"])},
        optional={"content": st.text(max_size=30) | json_values, "name": json_values},
    ),
    max_size=3,
)
_prompt = (
    st.text(max_size=30)
    | st.lists(st.text(max_size=10), max_size=3)
    | st.lists(st.integers(min_value=-2, max_value=60_000), max_size=6)
    | st.lists(st.lists(st.integers(min_value=0, max_value=50_000), max_size=4), max_size=2)
    | json_values
)
_common: dict[str, st.SearchStrategy[Any]] = {
    "temperature": st.floats(min_value=-1, max_value=3) | json_values,
    "top_p": st.floats(min_value=-0.5, max_value=1.5) | json_values,
    "top_k": st.integers(min_value=-3, max_value=100_000) | json_values,
    "n": st.integers(min_value=-1, max_value=4) | json_values,
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3) | json_values,
    "seed": st.integers(min_value=-5, max_value=2**64) | json_values,
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values,
    "presence_penalty": st.floats(min_value=-3, max_value=3) | json_values,
    "frequency_penalty": st.floats(min_value=-3, max_value=3) | json_values,
    "repetition_penalty": st.floats(min_value=-1, max_value=3) | json_values,
    "min_p": st.floats(min_value=-0.5, max_value=1.5) | json_values,
    "min_tokens": st.integers(min_value=-1, max_value=8) | json_values,
    "ignore_eos": st.booleans() | json_values,
    "stop_token_ids": st.lists(st.integers(min_value=-1, max_value=10**12), max_size=3),
    "user": json_values,
    "logit_bias": st.dictionaries(
        st.integers(min_value=-2, max_value=60_000).map(str) | st.text(max_size=4),
        st.floats(min_value=-150, max_value=150) | json_values,
        max_size=3,
    )
    | json_values,
    "skip_special_tokens": st.booleans() | json_values,
    "model": st.sampled_from(["default", "SmolLM2-135M-Instruct", "other"]) | json_values,
}
_TOOL = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {}}}},
}
_NAMED = {"type": "function", "function": {"name": "f"}}
_chat_fields = {
    **_common,
    "messages": _messages | json_values,
    "max_tokens": _max_tokens,
    "logprobs": st.booleans() | json_values,
    "top_logprobs": st.integers(min_value=-1, max_value=25) | json_values,
    "tools": st.just([_TOOL]) | st.lists(st.just(_TOOL), max_size=2) | json_values,
    "tool_choice": st.sampled_from(["none", "auto", "required", _NAMED]) | json_values,
    "parallel_tool_calls": st.booleans() | json_values,
    "response_format": st.just({"type": "text"}) | json_values,
}
_completion_fields = {
    **_common,
    "prompt": _prompt,
    "max_tokens": _max_tokens,
    "logprobs": st.integers(min_value=-1, max_value=25) | json_values,
    "echo": st.booleans() | json_values,
    "suffix": json_values,
}


@st.composite
def _mutated(draw: st.DrawFn, base: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    body = dict(base)
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True)):
        if draw(st.booleans()) and name in body:
            del body[name]
        else:
            body[name] = draw(fields[name])
    return body


_CHAT_BASE = {
    "model": "default",
    "messages": [{"role": "user", "content": "Hi"}],
    "max_completion_tokens": 3,  # never mutated: chat generation stays short
}
_COMPLETION_BASE = {"model": "default", "prompt": "Hi", "max_tokens": 3}

requests = st.one_of(
    st.tuples(st.just("chat/completions"), _mutated(_CHAT_BASE, _chat_fields)),
    st.tuples(st.just("completions"), _mutated(_COMPLETION_BASE, _completion_fields)),
    st.tuples(st.sampled_from(["chat/completions", "completions"]), json_values),
)


async def _post(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, str, str]:
    data = json.dumps(body)
    headers = {"Content-Type": "application/json"}
    async with http.post(url, data=data, headers=headers) as r:
        return r.status, r.headers.get("Content-Type", ""), await r.text()


def _check(status: int, content_type: str, text: str) -> None:
    assert status < 500, text
    if status >= 400:
        error = json.loads(text)["error"]
        assert isinstance(error["message"], str) and "type" in error
        return
    assert 200 <= status < 300
    if content_type.startswith("text/event-stream"):
        events = [b.removeprefix("data: ") for b in text.split("\n\n") if b.strip()]
        assert events[-1] == "[DONE]"
        assert all("error" not in json.loads(e) for e in events[:-1]), text
    else:
        assert json.loads(text)["choices"]


async def test_random_bodies_never_5xx(server: Server, engine: stoic.Engine) -> None:
    """Every random body gets a 2xx, or a 4xx with OpenAI error JSON, within 30 s; never a 5xx
    nor an error event; afterwards the engine is idle and the server still serves."""

    async def check(http: aiohttp.ClientSession, request: tuple[str, Any]) -> None:
        route, body = request
        _check(*await _post(http, f"{server.url}/v1/{route}", body))

    await check_examples(
        requests,
        check,
        max_examples=EXAMPLES,
        request_timeout=30.0,
        suppress=[HealthCheck.data_too_large],
    )
    await wait_idle(engine, 10.0, serving=True)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        status, _, text = await _post(http, f"{server.url}/v1/completions", completion_body())
    assert status == 200, text
