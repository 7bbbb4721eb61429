"""MigratingStream against scripted replicas (no Ray cluster): what a migration sends, what the
client gets, and where it stops."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray")

from ray.exceptions import ActorDiedError
from ray.serve.exceptions import BackPressureError
from tokenizers.decoders import DecodeStream

from stoic import Constraint, EngineConfig
from stoic.engine import (
    Delta,
    EngineStats,
    Request,
    SamplingParams,
    TokenCodec,
    load_token_codec,
)
from stoic.errors import EngineFailed, InvalidRequest, Overloaded
from stoic.ray import RayEngine
from stoic.ray._stats import ReplicaView
from stoic.ray._wire import Admitted, pack_error

PROMPT = "Tell me a story"
OUTPUT = "Once upon a time, in Zürich, a café served ☕ to everyone"
Script = Callable[[Request], list[Any]]


class FakeCall:
    """A streaming handle call that plays a script (an exception item is raised)."""

    def __init__(self, items: list[Any]) -> None:
        self._items = iter(items)
        self.cancelled = False

    async def __anext__(self) -> Any:
        item = next(self._items, StopAsyncIteration())
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    """Serve's handle: each call plays the next script."""

    def __init__(self, scripts: list[Script]) -> None:
        self.scripts = list(scripts)
        self.requests: list[Request] = []
        self.calls: list[FakeCall] = []

    def options(self, **_: Any) -> FakeHandle:
        return self

    @property
    def generate(self) -> FakeHandle:
        return self

    def remote(self, request: Request) -> FakeCall:
        self.requests.append(request)
        call = FakeCall(self.scripts.pop(0)(request))
        self.calls.append(call)
        return call


@pytest.fixture(scope="module")
def codec(tiny_model_dir: Path) -> TokenCodec:
    return load_token_codec(EngineConfig(model=str(tiny_model_dir)))


@pytest.fixture
def output_ids(codec: TokenCodec) -> list[int]:
    return codec.tokenize(Request(OUTPUT, add_special_tokens=False))


def deltas(codec: TokenCodec, ids: list[int], *, last: bool, decode: bool = True) -> list[Delta]:
    """One delta per token; the text as a replica decodes it from the first of ``ids`` (or
    garbage: the ingress must not use a continuation's own text)."""
    stream = DecodeStream(skip_special_tokens=True)
    backend = codec.tokenizer.backend_tokenizer
    return [
        Delta(
            "r",
            (stream.step(backend, t) or "") if decode else "#",
            (t,),
            None,
            "length" if last and i == len(ids) - 1 else None,
            99,
            i + 1,
        )
        for i, t in enumerate(ids)
    ]


def dies_after(codec: TokenCodec, ids: list[int]) -> Script:
    """A replica that admits the request, generates ``ids`` and dies."""

    def script(r: Request) -> list[Any]:
        return [Admitted(r.request_id, 4, "a"), *deltas(codec, ids, last=False), ActorDiedError()]

    return script


def finishes(codec: TokenCodec, ids: list[int], *, decode: bool = False) -> Script:
    """A replica that admits the request and generates ``ids`` to the end (with garbage text
    unless ``decode``: a continuation's own text must not reach the client)."""

    def script(r: Request) -> list[Any]:
        return [Admitted(r.request_id, 9, "b"), *deltas(codec, ids, last=True, decode=decode)]

    return script


def engine(codec: TokenCodec, handle: FakeHandle, **kwargs: Any) -> RayEngine:
    view = ReplicaView(board=None, idle=EngineStats.idle())
    return RayEngine(
        handle,
        EngineConfig(),
        codec,
        model_name="m",
        max_model_len=512,
        view=view,
        retry_delay=0.0,
        **kwargs,
    )


async def read(stream: Any) -> tuple[str, list[int], list[Delta]]:
    got = [d async for d in stream]
    return "".join(d.text for d in got), [t for d in got for t in d.token_ids], got


async def test_a_stream_moves_with_its_prompt_and_tokens_and_keeps_its_text(
    codec: TokenCodec, output_ids: list[int]
) -> None:
    """The replica dies after k tokens: the next replica gets the prompt's ids, those k tokens
    as ``generated`` and the original params (its whole budget: the replica counts the k
    tokens in it; the seed and penalties as they were) less the stop strings, which the ingress
    cuts; the client's text, token ids and counts are exactly the uninterrupted request's,
    whatever k."""
    n = len(output_ids)
    for k in range(1, n):
        handle = FakeHandle([dies_after(codec, output_ids[:k]), finishes(codec, output_ids[k:])])
        params = SamplingParams(
            max_tokens=n,
            min_tokens=n - 1,
            temperature=0.8,
            seed=5,
            presence_penalty=0.5,
            frequency_penalty=0.25,
            stop=("never seen",),
        )
        stream = await engine(codec, handle).submit(Request(PROMPT, params, request_id="x"))
        text, ids, got = await read(stream)
        assert (text, ids) == (OUTPUT, output_ids), k
        assert [d.completion_tokens for d in got] == list(range(1, n + 1))
        assert {d.prompt_tokens for d in got} == {4}  # the original prompt's
        moved = handle.requests[1]
        assert moved.prompt == tuple(codec.tokenize(Request(PROMPT)))
        assert moved.generated == tuple(output_ids[:k])
        assert moved.params == dataclasses.replace(params, stop=())
        assert moved.request_id != "x" and moved.messages is None
        assert stream.migrations == 1 and stream.replicas == ["a", "b"]
        assert handle.calls[0].cancelled


async def test_a_stream_moves_at_most_max_migrations_times(
    codec: TokenCodec, output_ids: list[int]
) -> None:
    """Past its migrations the request ends with EngineFailed carrying what it generated."""

    def dies_after_two(r: Request) -> list[Any]:
        start = len(r.generated)
        assert r.generated == tuple(output_ids[:start])
        ids = output_ids[start : start + 2]
        return [Admitted(r.request_id, 4, "a"), *deltas(codec, ids, last=False), ActorDiedError()]

    handle = FakeHandle([dies_after_two] * 3)
    stream = await engine(codec, handle, max_migrations=2).submit(Request(PROMPT, SamplingParams()))
    with pytest.raises(EngineFailed) as raised:
        await read(stream)
    assert raised.value.partial is not None
    assert raised.value.partial.token_ids == tuple(output_ids[:6])
    assert [len(r.generated) for r in handle.requests] == [0, 2, 4]


async def test_a_constrained_request_moves_with_its_constraint_and_tokens(
    codec: TokenCodec, output_ids: list[int]
) -> None:
    """A constrained request whose replica dies moves like any other: the next replica gets the
    constraint and the tokens so far as ``generated`` (its grammar matcher replays them: see
    tests/engine/test_continue.py), and the client gets the uninterrupted output."""
    n = len(output_ids)
    handle = FakeHandle([dies_after(codec, output_ids[:3]), finishes(codec, output_ids[3:])])
    params = SamplingParams(max_tokens=n, constraint=Constraint(kind="regex", text=".+"))
    stream = await engine(codec, handle).submit(Request(PROMPT, params))
    text, ids, _ = await read(stream)
    assert (text, ids) == (OUTPUT, output_ids)
    moved = handle.requests[1]
    assert moved.generated == tuple(output_ids[:3])
    assert moved.params.constraint == params.constraint
    assert stream.migrations == 1


async def test_admission_tries_again_past_failed_replicas_but_not_past_a_refusal(
    codec: TokenCodec, output_ids: list[int]
) -> None:
    """A failed or lost replica before admission: the request is sent again; a refusal of the
    request itself (400) and Serve's full queue (429) reach the caller at once."""
    failed = pack_error(EngineFailed("engine failed"))
    ok = finishes(codec, output_ids, decode=True)
    handle = FakeHandle([lambda r: [failed], lambda r: [ActorDiedError()], ok])
    stream = await engine(codec, handle).submit(Request(PROMPT, SamplingParams()))
    assert (await read(stream))[0] == OUTPUT
    assert stream.migrations == 0 and len(handle.requests) == 3
    refused = pack_error(InvalidRequest("bad", param="temperature"))
    with pytest.raises(InvalidRequest):
        await engine(codec, FakeHandle([lambda r: [refused]])).submit(Request(PROMPT))
    with pytest.raises(Overloaded):
        await engine(codec, FakeHandle([lambda r: [BackPressureError(9, 8)]])).submit(
            Request(PROMPT)
        )
    gone = FakeHandle([lambda r: [failed]] * 50)
    with pytest.raises(EngineFailed, match="no replica admitted"):
        await engine(codec, gone, admission_timeout=0.0).submit(Request(PROMPT))


async def test_closing_a_stream_cancels_the_call_on_its_replica(
    codec: TokenCodec, output_ids: list[int]
) -> None:
    """aclose before the end cancels the handle call (the replica aborts the request)."""
    handle = FakeHandle([finishes(codec, output_ids, decode=True)])
    stream = await engine(codec, handle).submit(Request(PROMPT))
    await stream.__anext__()
    await stream.aclose()
    assert handle.calls[0].cancelled and stream.done
