"""Chat and text completions with the real default model, through the official OpenAI SDK."""

from __future__ import annotations

from collections.abc import Callable

import aiohttp
import openai
import pytest
from http_helpers import Server, chat_body, completion_body, read_sse
from support import record_intake_requests

import stoic

pytestmark = pytest.mark.asyncio(loop_scope="session")

MESSAGES = [{"role": "user", "content": "Write a sentence about the sea."}]


async def test_models_list_and_retrieve(client: openai.AsyncOpenAI, engine: stoic.Engine) -> None:
    """/v1/models lists the served model with its max_model_len, how it computes and how its KV
    cache was sized; it can be
    retrieved by name and as "default"; an unknown name is a 404 NotFoundError."""
    models = await client.models.list()
    assert [m.id for m in models.data] == [engine.model_name]
    assert models.data[0].model_extra["max_model_len"] == engine.max_model_len
    compute = models.data[0].model_extra["compute"]  # how it runs (docs/models.md)
    assert compute == engine.stats().compute.card()
    assert (compute["architecture"], compute["decoder"]) == ("LlamaForCausalLM", "fused")
    memory = models.data[0].model_extra["memory"]  # how the KV cache was sized
    assert memory == engine.kv_sizing.describe()
    assert memory["kv_blocks"] == engine.stats().kv_blocks_total > 0
    assert (await client.models.retrieve(engine.model_name)).id == engine.model_name
    assert (await client.models.retrieve("default")).id == engine.model_name
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("no-such-model")


async def test_chat_non_streaming(client: openai.AsyncOpenAI, engine: stoic.Engine) -> None:
    """A chat completion returns assistant text, finish_reason "length" at max_tokens, and usage
    whose prompt_tokens is the templated prompt's length and completion_tokens is max_tokens."""
    result = await client.chat.completions.create(
        model=engine.model_name,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
    )
    choice = result.choices[0]
    assert result.object == "chat.completion"
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    text = engine.tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False
    )
    prompt_len = len(engine.tokenizer.encode(text, add_special_tokens=False))
    assert result.usage is not None
    assert result.usage.prompt_tokens == prompt_len
    assert result.usage.completion_tokens == 6
    assert result.usage.total_tokens == prompt_len + 6


async def test_chat_streaming_matches_non_streaming(client: openai.AsyncOpenAI) -> None:
    """Greedy streaming yields the same text as non-streaming; the first chunk carries the role,
    the last choice chunk the finish_reason, and include_usage adds a final usage-only chunk."""
    args = {"model": "default", "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    whole = await client.chat.completions.create(**args)
    stream = await client.chat.completions.create(
        **args, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


async def test_usage_reports_prompt_tokens_served_from_the_prefix_cache(
    client: openai.AsyncOpenAI,
) -> None:
    """A repeated prompt reports its cached prompt tokens in usage.prompt_tokens_details (whole
    16-token blocks, never the last prompt token), streamed or not; a new prompt reports at most
    what it shares with earlier requests (the chat template's system prompt)."""
    content = "Repeat after me: " + " ".join(f"word{i}" for i in range(40))
    args = {
        "model": "default",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        "temperature": 0,
    }
    first = await client.chat.completions.create(**args)
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    first_cached = first.usage.prompt_tokens_details.cached_tokens
    again = await client.chat.completions.create(**args)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    cached = again.usage.prompt_tokens_details.cached_tokens
    prompt = again.usage.prompt_tokens
    assert cached == (prompt - 1) // 16 * 16 and first_cached < cached
    stream = await client.chat.completions.create(
        **args, stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in stream]
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == cached


async def test_stream_wire_format(server: Server, http: aiohttp.ClientSession) -> None:
    """The SSE stream is `data: {json}` events ending with `data: [DONE]`; without
    include_usage no chunk has a usage key and none has an empty choices list."""
    async with http.post(f"{server.url}/v1/chat/completions", json=chat_body(stream=True)) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        assert r.headers["x-request-id"]
        events = await read_sse(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["choices"] for c in chunks)
    assert all("usage" not in c for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


async def test_completion_streaming_and_not(client: openai.AsyncOpenAI) -> None:
    """Text completions stream the same greedy text as the whole response, with usage right."""
    args = {"model": "default", "prompt": "The capital of France is", "max_tokens": 6}
    whole = await client.completions.create(**args, temperature=0)
    assert whole.object == "text_completion"
    assert whole.usage is not None and whole.usage.completion_tokens <= 6
    stream = await client.completions.create(
        **args, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].usage == whole.usage


async def test_stop_string_is_cut(client: openai.AsyncOpenAI) -> None:
    """A stop string ends generation with finish_reason "stop" and is not in the output: the
    text is the greedy output up to the stop string's first occurrence."""
    args = {"model": "default", "prompt": "1, 2, 3, 4, 5,", "max_tokens": 12, "temperature": 0}
    free = (await client.completions.create(**args)).choices[0].text
    assert len(free) > 4
    stop = free[2:5]
    cut = await client.completions.create(**args, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == free[: free.index(stop)]
    stream = await client.completions.create(**args, stop=stop, stream=True)
    text = "".join([c.choices[0].text async for c in stream])
    assert text == free[: free.index(stop)]


async def test_max_tokens_gives_length(client: openai.AsyncOpenAI) -> None:
    """max_completion_tokens (and max_tokens) bound the output; hitting it is "length"."""
    result = await client.chat.completions.create(
        model="default",
        messages=MESSAGES,
        max_completion_tokens=3,
        extra_body={"ignore_eos": True},
    )
    assert result.choices[0].finish_reason == "length"
    assert result.usage is not None and result.usage.completion_tokens == 3


async def test_seed_reproducible(client: openai.AsyncOpenAI) -> None:
    """At temperature 1, the same seed gives the same text."""

    async def sample(seed: int) -> str:
        result = await client.completions.create(
            model="default", prompt="My favourite animal is", max_tokens=8, temperature=1, seed=seed
        )
        return result.choices[0].text

    assert await sample(1234) == await sample(1234)


async def test_n_choices_use_seed_plus_index(client: openai.AsyncOpenAI) -> None:
    """n=2 returns choices 0 and 1; choice i is sampled with seed + i."""
    args = {"model": "default", "messages": MESSAGES, "max_tokens": 6, "temperature": 1}
    both = await client.chat.completions.create(**args, n=2, seed=7)
    assert [c.index for c in both.choices] == [0, 1]
    first = await client.chat.completions.create(**args, seed=7)
    second = await client.chat.completions.create(**args, seed=8)
    assert both.choices[0].message.content == first.choices[0].message.content
    assert both.choices[1].message.content == second.choices[0].message.content
    assert both.usage is not None and first.usage is not None and second.usage is not None
    assert both.usage.prompt_tokens == first.usage.prompt_tokens
    assert both.usage.completion_tokens == (
        first.usage.completion_tokens + second.usage.completion_tokens
    )


async def test_n_choices_streaming(client: openai.AsyncOpenAI) -> None:
    """Streaming n=2 interleaves both choices, each with its role chunk and a finish_reason."""
    stream = await client.chat.completions.create(
        model="default",
        messages=MESSAGES,
        max_tokens=4,
        n=2,
        stream=True,
    )
    roles: set[int] = set()
    finished: set[int] = set()
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.role == "assistant":
                roles.add(choice.index)
            if choice.finish_reason is not None:
                finished.add(choice.index)
    assert roles == finished == {0, 1}


async def test_prompt_forms(client: openai.AsyncOpenAI, engine: stoic.Engine) -> None:
    """prompt may be a string, a list of strings (one choice each), token ids or lists of them;
    usage counts each prompt once."""
    ids = engine.tokenizer.encode("Hello there")
    several = await client.completions.create(
        model="default", prompt=["Hello there", "Good morning"], max_tokens=2, n=2
    )
    assert [c.index for c in several.choices] == [0, 1, 2, 3]
    single = await client.completions.create(model="default", prompt=ids, max_tokens=2)
    assert single.usage is not None and single.usage.prompt_tokens == len(ids)
    nested = await client.completions.create(model="default", prompt=[ids, ids[:1]], max_tokens=2)
    assert len(nested.choices) == 2
    assert nested.usage is not None and nested.usage.prompt_tokens == len(ids) + 1


async def test_chat_logprobs(client: openai.AsyncOpenAI) -> None:
    """Chat logprobs give one entry per token, each with top_logprobs alternatives."""
    result = await client.chat.completions.create(
        model="default",
        messages=MESSAGES,
        max_tokens=4,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    logprobs = result.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert len(logprobs.content) == 4
    for entry in logprobs.content:
        assert entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob


async def test_completion_logprobs(client: openai.AsyncOpenAI) -> None:
    """Completion logprobs=k gives tokens, token_logprobs, k top_logprobs and text offsets."""
    result = await client.completions.create(
        model="default", prompt="Hello", max_tokens=4, logprobs=2, extra_body={"ignore_eos": True}
    )
    logprobs = result.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.tokens is not None and len(logprobs.tokens) == 4
    assert logprobs.token_logprobs is not None and len(logprobs.token_logprobs) == 4
    assert logprobs.top_logprobs is not None
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset is not None and logprobs.text_offset[0] == 0


async def test_request_id_honoured(server: Server, http: aiohttp.ClientSession) -> None:
    """x-request-id is echoed back and names the response; absent, one is generated."""
    url = f"{server.url}/v1/chat/completions"
    async with http.post(url, json=chat_body(), headers={"x-request-id": "my-id-1"}) as r:
        assert r.headers["x-request-id"] == "my-id-1"
        assert (await r.json())["id"] == "chatcmpl-my-id-1"
    async with http.post(url, json=chat_body()) as r:
        assert len(r.headers["x-request-id"]) >= 16


async def test_same_request_id_concurrently(server: Server, http: aiohttp.ClientSession) -> None:
    """Two requests sent at once with the same x-request-id both succeed."""
    import asyncio

    url = f"{server.url}/v1/completions"
    async with aiohttp.ClientSession() as other:

        async def one(session: aiohttp.ClientSession) -> int:
            headers = {"x-request-id": "same-id"}
            async with session.post(url, json=completion_body(), headers=headers) as r:
                await r.read()
                return r.status

        assert await asyncio.gather(one(http), one(other)) == [200, 200]


async def test_chat_template_kwargs(
    client: openai.AsyncOpenAI, set_chat_template: Callable[[str], None]
) -> None:
    """chat_template_kwargs reach the chat template as variables."""
    set_chat_template(
        "{% if shout %}LOUD LOUD LOUD {% endif %}{{ messages[0]['content'] }}\nassistant:"
    )

    async def prompt_tokens(**extra: object) -> int:
        result = await client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=1,
            extra_body=extra,
        )
        assert result.usage is not None
        return result.usage.prompt_tokens

    assert await prompt_tokens(chat_template_kwargs={"shout": True}) > await prompt_tokens()


async def test_a_chat_request_reaches_the_intake_as_one_request(
    server: Server, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the route parsed reaches the engine's intake as one ``stoic.Request``: the messages,
    the template's variables, the sampling parameters and the HTTP request's id, with nothing
    restated (and dropped) on the way from the handler through the facade."""
    seen = record_intake_requests(monkeypatch)
    body = chat_body(chat_template_kwargs={"unused": 1}, max_tokens=3, seed=7, temperature=0.5)
    headers = {"x-request-id": "one-request"}
    async with http.post(f"{server.url}/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
    [request] = seen
    assert request.request_id == "one-request"
    assert request.prompt is None and list(request.messages or ()) == body["messages"]
    assert request.chat_template_kwargs == {"unused": 1}
    params = request.params
    assert (params.max_tokens, params.seed, params.temperature) == (3, 7, 0.5)


async def test_routine_client_fields_are_ignored(client: openai.AsyncOpenAI) -> None:
    """Fields clients routinely send that do not change the output (user, metadata, store,
    parallel_tool_calls without tools, whole assistant messages echoed back) are accepted."""
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "refusal": None, "annotations": []},
        {"role": "user", "content": [{"type": "text", "text": "Bye"}], "name": "me"},
    ]
    result = await client.chat.completions.create(
        model="default",
        messages=messages,
        max_tokens=2,
        user="u-1",
        metadata={"k": "v"},
        store=False,
        parallel_tool_calls=False,
    )
    assert result.choices[0].finish_reason in ("stop", "length")
