"""Penalties, ``logit_bias``, ``min_p`` and ``/tokenize`` / ``/detokenize`` with the real default
model, through the official OpenAI SDK (raw HTTP for the vLLM-only routes)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import openai
import pytest
import pytest_asyncio
from http_helpers import Server

import stoic
from stoic.http._deferred import DeferredEngine

pytestmark = pytest.mark.asyncio(loop_scope="session")

#: a prompt the model answers greedily with the same token again and again
REPETITIVE = [
    {"role": "user", "content": "Write the word 'apple' twenty times, separated by spaces."}
]
MESSAGES = [{"role": "user", "content": "Write a sentence about the sea."}]


@pytest_asyncio.fixture(loop_scope="session")
async def client(server: Server) -> AsyncIterator[openai.AsyncOpenAI]:
    """The SDK client with a generous timeout: these tests generate tens of tokens per request,
    on a CPU that other tests may share."""
    async with openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600
    ) as client:
        yield client


def _token_id(engine: stoic.Engine, text: str) -> int:
    ids: list[int] = engine.tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 1, ids
    return ids[0]


@pytest.mark.parametrize("route", ["chat", "completions"])
async def test_a_logit_bias_of_100_forces_a_token(
    client: openai.AsyncOpenAI, engine: stoic.Engine, route: str
) -> None:
    """Greedy decoding with +100 on one token generates that token and nothing else."""
    cat = _token_id(engine, " cat")
    expected = engine.tokenizer.decode([cat] * 6)
    if route == "chat":
        chat = await client.chat.completions.create(
            model="default", messages=MESSAGES, max_tokens=6, temperature=0, logit_bias={cat: 100}
        )
        text = chat.choices[0].message.content
    else:
        completion = await client.completions.create(
            model="default", prompt="Once upon a time", max_tokens=6, temperature=0,
            logit_bias={str(cat): 100},
        )  # fmt: skip
        text = completion.choices[0].text
    assert text == expected


async def test_a_logit_bias_of_minus_100_bans_the_greedy_token(
    client: openai.AsyncOpenAI, engine: stoic.Engine
) -> None:
    """-100 on the token greedy decoding picks first makes it pick another one."""
    args: dict[str, Any] = {"model": "default", "prompt": "Once upon a", "temperature": 0}
    first = (await client.completions.create(**args, max_tokens=1)).choices[0].text
    banned = await client.completions.create(
        **args, max_tokens=1, logit_bias={str(_token_id(engine, first)): -100}
    )
    assert banned.choices[0].text not in ("", first)


async def _repeat_fraction(client: openai.AsyncOpenAI, **sampling: Any) -> float:
    """1 - distinct / generated tokens of the greedy answer to :data:`REPETITIVE`."""
    result = await client.chat.completions.create(
        model="default", messages=REPETITIVE, max_tokens=32, temperature=0, logprobs=True,
        **sampling,
    )  # fmt: skip
    logprobs = result.choices[0].logprobs
    assert logprobs is not None and logprobs.content
    tokens = [entry.token for entry in logprobs.content]
    return 1.0 - len(set(tokens)) / len(tokens)


async def test_penalties_reduce_repetition(client: openai.AsyncOpenAI) -> None:
    """Each penalty makes the greedy answer to a prompt that invites repetition repeat itself
    less (a smaller share of repeated tokens) than the same request without it (the requests
    run batched together: rows without penalties are unaffected by those that have them)."""
    plain, frequency, presence, repetition = await asyncio.gather(
        _repeat_fraction(client),
        _repeat_fraction(client, frequency_penalty=1.0),
        _repeat_fraction(client, presence_penalty=1.5),
        _repeat_fraction(client, extra_body={"repetition_penalty": 1.5}),
    )
    assert plain > 0.9  # the prompt does make the model repeat itself
    assert plain == await _repeat_fraction(client)  # alone, the same answer
    for penalised in (frequency, presence, repetition):
        assert penalised < plain - 0.1


async def test_min_p_of_one_samples_the_greedy_answer(client: openai.AsyncOpenAI) -> None:
    """``min_p=1`` keeps only the most likely token, so sampling at temperature 1 with any seed
    gives the greedy answer (and without it, some seed does not)."""
    args: dict[str, Any] = {"model": "default", "messages": MESSAGES, "max_tokens": 12}
    seeds = range(4)
    greedy, *answers = await asyncio.gather(
        client.chat.completions.create(**args, temperature=0),
        *(
            client.chat.completions.create(
                **args, temperature=1.0, seed=seed, extra_body={"min_p": 1.0}
            )
            for seed in seeds
        ),
        *(client.chat.completions.create(**args, temperature=1.0, seed=seed) for seed in seeds),
    )
    texts = [a.choices[0].message.content for a in answers]
    assert set(texts[: len(seeds)]) == {greedy.choices[0].message.content}
    assert set(texts[len(seeds) :]) != {greedy.choices[0].message.content}


async def _post(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with http.post(url, json=body) as response:
        return response.status, await response.json()


async def test_tokenize_and_detokenize_round_trip(
    server: Server, http: aiohttp.ClientSession, engine: stoic.Engine
) -> None:
    """``/tokenize`` gives the prompt's token ids (what a completion's prompt is fed as), their
    count and the context length; ``/detokenize`` turns them back into the same text."""
    text = "Hello world, tokenized and back."
    status, body = await _post(http, f"{server.url}/tokenize", {"model": "default", "prompt": text})
    assert status == 200, body
    assert body == {
        "count": len(body["tokens"]),
        "max_model_len": engine.max_model_len,
        "tokens": engine.tokenizer.encode(text),
    }
    status, back = await _post(http, f"{server.url}/detokenize", {"tokens": body["tokens"]})
    assert (status, back) == (200, {"prompt": text})
    status, strs = await _post(
        http, f"{server.url}/tokenize", {"prompt": text, "return_token_strs": True}
    )
    assert status == 200 and strs["tokens"] == body["tokens"]
    assert strs["token_strs"] == [engine.tokenizer.decode([t]) for t in body["tokens"]]
    assert "".join(strs["token_strs"]) == text


async def test_tokenize_messages_counts_the_chat_prompt(
    server: Server, http: aiohttp.ClientSession, client: openai.AsyncOpenAI
) -> None:
    """Tokenizing chat messages gives as many tokens as the chat completion's prompt_tokens;
    without the generation prompt there are fewer."""
    url = f"{server.url}/tokenize"
    status, body = await _post(http, url, {"model": "default", "messages": MESSAGES})
    assert status == 200, body
    chat = await client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=1)
    assert chat.usage is not None and body["count"] == chat.usage.prompt_tokens
    status, bare = await _post(http, url, {"messages": MESSAGES, "add_generation_prompt": False})
    assert status == 200 and bare["count"] < body["count"]
    assert bare["tokens"] == body["tokens"][: bare["count"]]


@pytest.mark.parametrize(
    ("route", "body", "status", "param"),
    [
        ("detokenize", {"tokens": [1, 49152]}, 400, "tokens"),
        ("detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("detokenize", {"tokens": ["1"]}, 400, "tokens.0"),
        ("detokenize", {"tokens": [1], "model": "gpt-9"}, 404, "model"),
        ("tokenize", {"model": "default"}, 400, "prompt"),
        ("tokenize", {"prompt": "a", "messages": MESSAGES}, 400, "prompt"),
        ("tokenize", {"prompt": 5}, 400, "prompt"),
        ("tokenize", {"prompt": "a", "return_token_strs": 1}, 400, "return_token_strs"),
    ],
)
async def test_bad_tokenize_requests_are_client_errors(
    server: Server, http: aiohttp.ClientSession, route: str, body: Any, status: int, param: str
) -> None:
    """Ids outside the vocabulary, malformed bodies and unknown models are 4xx naming the
    parameter, never a 5xx."""
    got, answer = await _post(http, f"{server.url}/{route}", body)
    assert got == status, answer
    assert answer["error"]["param"] == param


async def test_tokenize_waits_for_the_model_like_generation(
    fake_server: Callable[..., Any], engine: stoic.Engine, http: aiohttp.ClientSession
) -> None:
    """While the model loads, ``/tokenize`` and ``/detokenize`` are 503 ``engine_starting``
    with Retry-After; once the engine is attached they answer."""
    deferred = DeferredEngine(engine.config)
    server = await fake_server(deferred)
    routes = {"tokenize": {"prompt": "Hello"}, "detokenize": {"tokens": [19556]}}
    for route, body in routes.items():
        async with http.post(f"{server.url}/{route}", json=body) as r:
            assert r.status == 503 and int(r.headers["Retry-After"]) >= 1
            assert (await r.json())["error"]["code"] == "engine_starting"
    deferred.attach(engine)
    assert await _post(http, f"{server.url}/tokenize", routes["tokenize"]) == (
        200,
        {"count": 1, "max_model_len": engine.max_model_len, "tokens": [19556]},
    )
    assert await _post(http, f"{server.url}/detokenize", routes["detokenize"]) == (
        200,
        {"prompt": "Hello"},
    )
