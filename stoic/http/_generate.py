"""Running one generation request: submit every choice, then stream or collect the output.

Everything that can be wrong with a request is raised by :func:`submit_all`, before any byte of
the response is written; errors after that point end a stream with an ``error`` event (and a
non-streaming response with a 5xx carrying the partial output).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from aiohttp import web

from .._logging import get_logger
from ..engine import Delta, Request
from ..errors import EngineStopped, PartialOutput, StoicError
from ._engine import RequestStreamLike
from ._errors import dumps, error_object, error_response, internal_error_object
from ._fanin import ChoiceFailed, Fanin, close_streams
from ._format import ChoiceState, ResponseFormat
from ._metrics import outcome_of
from ._sse import SSEWriter
from ._state import AppState, RequestRecord

__all__ = ["Job", "Run", "StreamErrors", "release_streams", "run_generation", "submit_all"]

_log = get_logger("stoic.http")


@dataclass(frozen=True)
class Job:
    """One choice to generate: the engine request, and where its output goes in the response."""

    #: the choice's ``index`` in the response
    index: int
    #: which prompt of the request (usage counts each prompt once)
    prompt_group: int
    #: its ``request_id`` is given when it is submitted (the HTTP request's, made unique)
    request: Request


async def submit_all(state: AppState, jobs: list[Job], request_id: str) -> list[RequestStreamLike]:
    """Submit every job; if one is refused, abort the ones already admitted and raise.

    :raises ~stoic.errors.StoicError: the engine's refusal (400, 429, 503...).
    """
    if state.draining:
        raise EngineStopped("the server is shutting down")
    streams: list[RequestStreamLike] = []
    try:
        for job in jobs:
            engine_id = state.claim_id(
                request_id if len(jobs) == 1 else f"{request_id}-{job.index}"
            )
            try:
                stream = await state.engine.submit(replace(job.request, request_id=engine_id))
            except BaseException:
                state.release_id(engine_id)
                raise
            streams.append(stream)
    except BaseException:
        await release_streams(state, streams)
        raise
    return streams


async def release_streams(state: AppState, streams: list[RequestStreamLike]) -> None:
    """Abort the unfinished streams and release their engine request ids (even if cancelled)."""
    try:
        await close_streams(streams)
    finally:
        for stream in streams:
            state.release_id(stream.request_id)


def _prompt_tokens(
    jobs: list[Job], streams: list[RequestStreamLike], *, cached: bool = False
) -> int:
    """Prompt tokens of the request (each distinct prompt once), or those served from cache."""
    seen: dict[int, int] = {}
    for job, stream in zip(jobs, streams, strict=True):
        seen.setdefault(job.prompt_group, stream.cached_tokens if cached else stream.prompt_tokens)
    return sum(seen.values())


class Run:
    """The output side of one request, streamed or not."""

    def __init__(
        self,
        state: AppState,
        record: RequestRecord,
        fmt: ResponseFormat,
        jobs: list[Job],
        streams: list[RequestStreamLike],
    ) -> None:
        self.state = state
        self.record = record
        self.fmt = fmt
        self.streams = streams
        self.choices = [
            ChoiceState(j.index, s.prompt_tokens) for j, s in zip(jobs, streams, strict=True)
        ]
        self.prompt_tokens = _prompt_tokens(jobs, streams)
        self.jobs = jobs
        state.metrics.prompt_tokens.inc(self.prompt_tokens)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache (read at the end, once all are admitted)."""
        return _prompt_tokens(self.jobs, self.streams, cached=True)

    def take(self, position: int, delta: Delta) -> ChoiceState:
        """Record ``delta`` of the choice at ``position`` (and its latency metrics)."""
        choice = self.choices[position]
        if delta.token_ids:
            now = time.monotonic()
            metrics = self.state.metrics
            metrics.generation_tokens.inc(len(delta.token_ids))
            if choice.last_token_at is None:
                metrics.ttft.observe(now - self.record.started)
            else:
                metrics.itl.observe((now - choice.last_token_at) / len(delta.token_ids))
            choice.last_token_at = now
        choice.add(delta)
        return choice

    def failure(self, failed: ChoiceFailed) -> tuple[StoicError, PartialOutput, int]:
        """The error to report, the partial output and the choice index it belongs to."""
        position = failed.index
        if position is None:  # shutdown: report the first unfinished choice
            position = next((i for i, c in enumerate(self.choices) if not c.done), 0)
        choice = self.choices[position]
        engine_partial = getattr(failed.error, "partial", None)
        partial = engine_partial if isinstance(engine_partial, PartialOutput) else choice.partial()
        self.record.outcome = outcome_of(failed.error)
        _log.warning(
            "http.generation_failed",
            error=type(failed.error).__name__,
            message=failed.error.message,
            completion_tokens=partial.completion_tokens,
        )
        return failed.error, partial, choice.index

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)

    async def gather(
        self,
        consume: Callable[[Fanin], Awaitable[None]],
        headers: dict[str, str],
        *,
        indexed: bool = True,
    ) -> web.Response | None:
        """Run ``consume`` over the streams' output; None when it ran to the end, or the error
        response carrying the partial output when a choice failed (its ``index`` if
        ``indexed``)."""
        async with Fanin(self.streams, stop=self.state.stopping) as fanin:
            try:
                await consume(fanin)
            except ChoiceFailed as failed:
                error, partial, index = self.failure(failed)
                response = error_response(error, partial=partial, index=index if indexed else None)
                response.headers.update(headers)
                return response
        return None

    async def stream_with(
        self,
        sse: SSEWriter,
        produce: Callable[[Fanin], Awaitable[None]],
        errors: StreamErrors,
        *,
        marker: bool = True,
    ) -> web.StreamResponse:
        """Stream: ``produce`` sends the events of the streams' output; a failure after the
        stream began ends it with ``errors``' event (a failed choice: its error and partial
        output; anything else: an internal error, logged), then the end of the stream (and the
        ``[DONE]`` ``marker``). A client that went away is logged, and the request ``aborted``.
        """
        try:
            async with Fanin(self.streams, stop=self.state.stopping) as fanin:
                await sse.start()
                try:
                    await produce(fanin)
                except ChoiceFailed as failed:
                    await errors.failed(*self.failure(failed))
                except ConnectionResetError:
                    raise
                except Exception:
                    _log.exception("http.stream_failed")
                    self.record.outcome = "error"
                    await errors.internal(internal_error_object(self.record.request_id)["error"])
                try:
                    await sse.done(marker=marker)
                finally:
                    self.record.delivered = sse.finished
        except ConnectionResetError:
            if not sse.finished:
                self.record.outcome = "aborted"
                _log.info("http.client_disconnected", completion_tokens=self.completion_tokens)
        return sse.response

    async def collect(self, headers: dict[str, str]) -> web.Response:
        async def consume(fanin: Fanin) -> None:
            async for position, delta in fanin:
                self.take(position, delta)

        failed = await self.gather(consume, headers)
        if failed is not None:
            return failed
        body = self.fmt.full(self.choices, self.prompt_tokens, self.cached_tokens)
        return web.json_response(body, headers=headers, dumps=dumps)

    async def stream(
        self, request: web.Request, headers: dict[str, str], *, include_usage: bool
    ) -> web.StreamResponse:
        sse = SSEWriter(request, headers)
        fmt = self.fmt

        async def produce(fanin: Fanin) -> None:
            for choice in self.choices:
                role = fmt.role_chunk_choice(choice.index)
                if role is not None:
                    await sse.send(fmt.chunk([role], include_usage=include_usage))
            async for position, delta in fanin:
                choice = self.take(position, delta)
                if delta.text or delta.logprobs or delta.finish_reason:
                    out = fmt.chunk_choice(choice, delta)
                    if out is not None:  # None: held back (a tool call may begin)
                        await sse.send(fmt.chunk([out], include_usage=include_usage))
            if include_usage:
                await sse.send(
                    fmt.usage_chunk(self.prompt_tokens, self.completion_tokens, self.cached_tokens)
                )

        return await self.stream_with(sse, produce, _ChatErrors(sse))


class StreamErrors(Protocol):
    """How a stream's failure is told to its client (the stream's last event)."""

    async def failed(self, error: StoicError, partial: PartialOutput, index: int) -> None:
        """A choice failed: ``error``, with the output it had (``index``: its choice)."""

    async def internal(self, body: dict[str, Any]) -> None:
        """An unexpected failure: ``body`` is the error object's ``error`` (no details)."""


@dataclass(frozen=True)
class _ChatErrors:
    """Chat and legacy completions: the OpenAI error object as the last ``data:``."""

    sse: SSEWriter

    async def failed(self, error: StoicError, partial: PartialOutput, index: int) -> None:
        await self.sse.send(error_object(error, partial=partial, index=index))

    async def internal(self, body: dict[str, Any]) -> None:
        await self.sse.send({"error": body})


async def run_generation(
    request: web.Request,
    state: AppState,
    record: RequestRecord,
    fmt: ResponseFormat,
    jobs: list[Job],
    *,
    stream: bool,
    include_usage: bool,
) -> web.StreamResponse:
    """Submit ``jobs`` and answer: an SSE stream or one JSON object.

    :raises ~stoic.errors.StoicError: when the engine refuses the request (nothing sent yet).
    """
    streams = await submit_all(state, jobs, record.request_id)
    try:
        run = Run(state, record, fmt, jobs, streams)
        headers = {"x-request-id": record.request_id}
        if stream:
            return await run.stream(request, headers, include_usage=include_usage)
        return await run.collect(headers)
    finally:
        await release_streams(state, streams)
