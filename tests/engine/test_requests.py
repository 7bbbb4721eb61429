"""Request semantics on a tiny random model: validation before admission, stops, seeds, logprobs."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from support import engine_config, record_intake_requests, wait_idle

import stoic
from stoic.errors import ContextLengthExceeded, InvalidRequest

pytestmark = pytest.mark.asyncio(loop_scope="module")

ALTERNATING = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}assistant:"
)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_model_dir: Path) -> Any:
    config = engine_config(
        tiny_model_dir, num_kv_blocks=64, max_waiting=64, enable_fault_injection=False
    )
    async with stoic.Engine.start(config) as eng:
        yield eng


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"stop": ("",)}, "stop"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_p": 2.0}, "min_p"),
        ({"logit_bias": ((10**9, 1.0),)}, "logit_bias"),
    ],
)
async def test_bad_sampling_parameters_are_rejected_before_admission(
    engine: Any, kwargs: dict[str, Any], param: str
) -> None:
    """A bad parameter raises InvalidRequest naming it from submit(); nothing is admitted."""
    with pytest.raises(InvalidRequest) as info:
        await engine.submit("hello", stoic.SamplingParams(**kwargs))
    assert info.value.param == param
    await wait_idle(engine, 2.0)


async def test_a_raising_chat_template_is_an_invalid_request(engine: Any) -> None:
    """A template that raises gives InvalidRequest with its message, and the engine still serves."""
    original = engine.tokenizer.chat_template
    engine.tokenizer.chat_template = ALTERNATING
    try:
        bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
        with pytest.raises(InvalidRequest, match="Conversation roles must alternate"):
            await engine.submit(None, stoic.SamplingParams(max_tokens=2), messages=bad)
        good = [{"role": "user", "content": "a"}]
        result = await engine.complete(messages=good, params=stoic.SamplingParams(max_tokens=3))
        assert result.completion_tokens >= 1
    finally:
        engine.tokenizer.chat_template = original


@pytest.mark.parametrize(
    "messages",
    [
        [],
        [{"role": "wizard", "content": "hi"}],
        [{"content": "no role"}],
        ["not an object"],
    ],
)
async def test_malformed_messages_are_invalid_requests(engine: Any, messages: Any) -> None:
    """Malformed messages raise InvalidRequest before admission."""
    with pytest.raises(InvalidRequest):
        await engine.submit(None, stoic.SamplingParams(max_tokens=2), messages=messages)
    await wait_idle(engine, 2.0)


async def test_prompt_beyond_context_is_rejected(engine: Any) -> None:
    """Prompt plus max_tokens beyond the context raises ContextLengthExceeded up front."""
    with pytest.raises(ContextLengthExceeded):
        await engine.submit(list(range(10, 500)), stoic.SamplingParams(max_tokens=100))
    with pytest.raises(InvalidRequest, match="vocabulary"):
        await engine.submit([10, 10**9], stoic.SamplingParams(max_tokens=2))
    await wait_idle(engine, 2.0)


async def test_max_tokens_gives_length_and_exact_count(engine: Any) -> None:
    """max_tokens=N with EOS ignored yields exactly N tokens and finish_reason 'length'."""
    result = await engine.complete("hello", stoic.SamplingParams(max_tokens=7, ignore_eos=True))
    assert result.completion_tokens == 7
    assert len(result.token_ids) == 7
    assert result.finish_reason == "length"


async def test_seeded_sampling_is_reproducible_across_batches(engine: Any) -> None:
    """The same seed gives the same tokens, alone or batched with other requests."""
    params = stoic.SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    alone = await engine.complete("once upon a time", params)
    others = [
        engine.complete("noise", stoic.SamplingParams(max_tokens=12, temperature=1.0))
        for _ in range(4)
    ]
    together, *_ = await asyncio.gather(engine.complete("once upon a time", params), *others)
    assert together.token_ids == alone.token_ids
    different = await engine.complete(
        "once upon a time",
        stoic.SamplingParams(max_tokens=12, temperature=1.0, seed=4321, ignore_eos=True),
    )
    assert different.token_ids != alone.token_ids


async def test_stop_string_is_cut_and_ends_generation(engine: Any) -> None:
    """A stop string ends generation and is not in the text; text before it is kept."""
    free = await engine.complete(
        "abc", stoic.SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    )
    assert len(free.text) > 4
    stop = free.text[3:5]
    cut = await engine.complete(
        "abc", stoic.SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=(stop,))
    )
    assert cut.finish_reason == "stop"
    assert stop not in cut.text
    assert free.text.startswith(cut.text)
    assert cut.text == free.text[: free.text.find(stop)]


async def test_stop_token_id_ends_generation(engine: Any) -> None:
    """A stop token id ends generation with finish_reason 'stop' after that token."""
    free = await engine.complete(
        "xyz", stoic.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    )
    target = free.token_ids[4]
    first = free.token_ids.index(target)
    cut = await engine.complete(
        "xyz",
        stoic.SamplingParams(
            max_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=(target,)
        ),
    )
    assert cut.finish_reason == "stop"
    assert cut.token_ids == free.token_ids[: first + 1]


async def test_min_tokens_holds_off_stop_tokens(engine: Any) -> None:
    """With min_tokens=N, a stop token id cannot end the sequence before N tokens."""
    free = await engine.complete(
        "xyz", stoic.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    )
    target = free.token_ids[0]
    params = stoic.SamplingParams(
        max_tokens=10, min_tokens=5, temperature=0, ignore_eos=True, stop_token_ids=(target,)
    )
    result = await engine.complete("xyz", params)
    assert result.completion_tokens >= 5
    assert target not in result.token_ids[:5]


async def test_logprobs_are_returned_per_token(engine: Any) -> None:
    """logprobs=True with top_logprobs=3 gives one entry per token, 3 sorted alternatives each."""
    params = stoic.SamplingParams(max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    result = await engine.complete("hello", params)
    assert result.logprobs is not None
    assert len(result.logprobs) == result.completion_tokens
    for tok, entry in zip(result.token_ids, result.logprobs, strict=True):
        assert entry.token_id == tok
        assert entry.logprob <= 0.0
        assert len(entry.top) == 3
        values = [lp for _, _, lp in entry.top]
        assert values == sorted(values, reverse=True)
        assert entry.top[0][0] == tok  # greedy picks the most likely token


async def test_overload_is_reported_before_admission(tiny_model_dir: Path) -> None:
    """Past max_waiting, submit raises Overloaded; the admitted ones still complete."""
    config = stoic.EngineConfig(model=str(tiny_model_dir), dtype="float32", max_waiting=2)
    async with stoic.Engine.start(config) as eng:
        params = stoic.SamplingParams(max_tokens=30, ignore_eos=True)
        a = await eng.submit("one", params)
        b = await eng.submit("two", params)
        with pytest.raises(stoic.errors.Overloaded):
            await eng.submit("three", params)
        for stream in (a, b):
            async for _ in stream:
                pass
        result = await eng.complete("four", stoic.SamplingParams(max_tokens=2))
        assert result.completion_tokens >= 1


async def test_a_request_id_in_use_is_rejected_at_submit(engine: Any) -> None:
    """A duplicate request id is an InvalidRequest before admission; once ended it is free again."""
    params = stoic.SamplingParams(max_tokens=20, ignore_eos=True)
    first = await engine.submit("one", params, request_id="same")
    with pytest.raises(InvalidRequest, match="already in use"):
        await engine.submit("two", params, request_id="same")
    async for _ in first:
        pass
    again = await engine.complete("three", stoic.SamplingParams(max_tokens=2), request_id="same")
    assert again.completion_tokens >= 1


async def test_logprob_tokens_are_decoded_text(engine: Any) -> None:
    """Logprob entries carry the token's text as decoded, not the tokenizer's raw piece."""
    params = stoic.SamplingParams(max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    result = await engine.complete("hello there", params)
    assert result.logprobs is not None
    for entry in result.logprobs:
        assert entry.token == engine.tokenizer.decode([entry.token_id])
        assert "Ġ" not in entry.token


@dataclasses.dataclass(frozen=True, slots=True)
class _Tagged(stoic.Request):
    """A request with a field no layer of stoic knows: a new request parameter."""

    tag: str = ""


@pytest.fixture
def intake_requests(monkeypatch: pytest.MonkeyPatch) -> list[stoic.Request]:
    return record_intake_requests(monkeypatch)


async def test_a_new_request_field_reaches_the_intake_with_no_edit_between(
    engine: Any, intake_requests: list[stoic.Request]
) -> None:
    """The request travels from ``submit`` to the intake as the object the caller built: a field
    added to ``stoic.Request`` (here by a subclass) arrives with its value, so a new request
    parameter needs no edit in the facade or the messages."""
    params = stoic.SamplingParams(max_tokens=2, temperature=0)
    request = _Tagged("hello", params, request_id="tagged", tag="through")
    result = await engine.complete(request)
    assert result.completion_tokens == 2
    assert intake_requests == [request]
    assert isinstance(intake_requests[0], _Tagged) and intake_requests[0].tag == "through"


async def test_submit_keywords_build_the_same_request(
    engine: Any, intake_requests: list[stoic.Request]
) -> None:
    """``submit``'s keyword arguments are a request's fields by name (``stoic.Request.of``): the
    intake gets the request they describe; a name that is no field raises TypeError and admits
    nothing."""
    params = stoic.SamplingParams(max_tokens=1)
    messages = [{"role": "user", "content": "hi"}]
    stream = await engine.submit(
        None, params, messages=messages, request_id="by-keyword", add_generation_prompt=False
    )
    await stream.collect()
    assert intake_requests == [
        stoic.Request(
            messages=messages, params=params, request_id="by-keyword", add_generation_prompt=False
        )
    ]
    with pytest.raises(TypeError, match="no_such_field"):
        await engine.submit("hello", params, no_such_field=1)
    assert len(intake_requests) == 1
    await wait_idle(engine, 2.0)


async def test_a_tenant_past_its_queued_limit_is_refused_and_others_are_not(
    tiny_model_dir: Path,
) -> None:
    """``tenant_max_queued`` refuses a tenant's request past its limit (Overloaded, counted on
    its refusals) while another tenant's is admitted; once one ends, the tenant is admitted
    again. A bad tenant, priority or timeout is an InvalidRequest naming it."""
    config = stoic.EngineConfig(model=str(tiny_model_dir), dtype="float32", tenant_max_queued=1)
    async with stoic.Engine.start(config) as eng:
        params = stoic.SamplingParams(max_tokens=20, ignore_eos=True)
        first = await eng.submit("one", params, tenant="a", priority=3)
        with pytest.raises(stoic.errors.Overloaded, match="tenant 'a'"):
            await eng.submit("two", params, tenant="a")
        other = await eng.submit("three", params, tenant="b")
        for stream in (first, other):
            assert (await stream.collect()).finish_reason == "length"
        await eng.complete("four", stoic.SamplingParams(max_tokens=2), tenant="a")
        tenants = dict(eng.stats().tenants)
        assert (tenants["a"].admitted, tenants["a"].refused) == (2, 1)
        assert (tenants["b"].admitted, tenants["b"].refused) == (1, 0)
        assert tenants["a"].computed_tokens > 20
        for field, value in (("tenant", "x" * 200), ("priority", 1.5), ("timeout", 0)):
            with pytest.raises(InvalidRequest) as bad:
                await eng.submit("five", params, **{field: value})
            assert bad.value.param == field
