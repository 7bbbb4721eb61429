"""OpenAI's Responses API: ``POST /v1/responses``, ``GET``/``DELETE /v1/responses/{id}`` and
``GET /v1/responses/{id}/input_items``.

A request is translated into a chat completion request
(:meth:`~stoic.http._responses_schemas.ResponsesRequest.chat_request`) and served by the chat
path (:func:`~stoic.http._routes.chat_inputs`, :func:`~stoic.http._generate.submit_all`, the
chat format's tool parser); :class:`~stoic.http._responses_stream.ResponseBuilder` turns its
output into the response object and its events. Failure semantics are the chat ones: anything
wrong before admission is a 4xx/5xx with no event sent; a failure after it ends the stream with
an ``error`` event carrying the partial output (a non-streamed request: the error status with
it). A stored response (``store``, the default) is committed before ``response.completed`` is
sent (or the JSON returned); if the database fails, the request ends with that error instead.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ..engine import Request
from ..errors import InvalidRequest, NotFound, PartialOutput, StoicError, StorageFailed
from ._auth import OWNER, route_access
from ._errors import dumps, error_response
from ._fanin import Fanin
from ._generate import Job, Run, release_streams, submit_all
from ._responses_schemas import (
    ResponsesRequest,
    chat_messages,
    chat_param,
    input_items,
    new_id,
)
from ._responses_stream import ResponseBuilder, response_usage
from ._routes import _generation, _parse, _served_name, chat_format, chat_inputs, read_body
from ._scheduling import scheduling_fields
from ._schemas import ChatCompletionRequest
from ._sse import SSEWriter
from ._state import AppState, RequestRecord
from ._store import ResponseStore

__all__ = ["STORE", "add_response_routes"]

STORE = web.AppKey("stoic_responses", ResponseStore)
#: ``GET .../input_items`` pages: at most this many items
_MAX_PAGE = 100


@dataclass
class _Turn:
    """One request's conversation, and where its response is stored."""

    store: ResponseStore
    owner: str
    #: earlier turns' items and this request's input
    items: list[dict[str, Any]]
    stored: bool

    async def finish(self, run: Run, builder: ResponseBuilder) -> dict[str, Any]:
        """The final response object, stored if asked.

        :raises StorageFailed: carrying the output (the request's outcome is ``error``).
        """
        usage = response_usage(run.prompt_tokens, run.completion_tokens, run.cached_tokens)
        response = builder.snapshot(builder.status, usage)
        if self.stored:
            try:
                await self.store.put(self.owner, response, self.items)
            except StorageFailed as exc:
                run.record.outcome = "error"
                raise StorageFailed(exc.message, partial=run.choices[0].partial()) from None
        return response


def _owner(request: web.Request) -> str:
    owner: str = request.get(OWNER, "")
    return owner


async def _conversation(request: web.Request, req: ResponsesRequest) -> list[dict[str, Any]]:
    """The stored conversation ``previous_response_id`` continues, then this request's input.

    :raises NotFound: no such response (or not this key's).
    """
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        stored = await request.app[STORE].get(_owner(request), req.previous_response_id)
        if stored is None:
            raise NotFound(
                f"no stored response {req.previous_response_id!r}", param="previous_response_id"
            )
        history = stored.items + stored.response["output"]
    return history + input_items(req.input)


async def _create(
    request: web.Request, state: AppState, record: RequestRecord
) -> web.StreamResponse:
    req = await read_body(request, ResponsesRequest)
    req.check_supported()
    model = _served_name(state.engine, req.model or "default")
    items = await _conversation(request, req)
    try:
        chat = _parse(
            ChatCompletionRequest, req.chat_request(chat_messages(items, req.instructions))
        )
        messages, kwargs, plan, params = chat_inputs(state, chat)
        request_fields = scheduling_fields(request)
        job = Job(
            0,
            0,
            Request(
                messages=messages, params=params, chat_template_kwargs=kwargs, **request_fields
            ),
        )
        streams = await submit_all(state, [job], record.request_id)
    except InvalidRequest as exc:
        raise chat_param(exc) from None
    base = {
        "id": new_id("resp"),
        "object": "response",
        "created_at": int(time.time()),
        "model": model,
        **req.echo(),
    }
    turn = _Turn(request.app[STORE], _owner(request), items, req.stored)
    try:
        run = Run(state, record, chat_format(state, record, model, plan), [job], streams)
        headers = {"x-request-id": record.request_id}
        if req.stream:
            return await _stream(request, run, ResponseBuilder(base), turn, headers)
        return await _collect(run, ResponseBuilder(base), turn, headers)
    finally:
        await release_streams(state, streams)


async def _feed(
    run: Run, builder: ResponseBuilder, fanin: Fanin
) -> AsyncIterator[list[dict[str, Any]]]:
    """Feed the builder the choice's chunks; yields the events of each."""
    async for position, delta in fanin:
        choice = run.take(position, delta)
        if delta.text or delta.finish_reason:
            out = run.fmt.chunk_choice(choice, delta)
            if out is not None:
                yield builder.feed(out)


async def _collect(
    run: Run, builder: ResponseBuilder, turn: _Turn, headers: dict[str, str]
) -> web.Response:
    async def consume(fanin: Fanin) -> None:
        async for _ in _feed(run, builder, fanin):
            pass

    failed = await run.gather(consume, headers, indexed=False)
    if failed is not None:
        return failed
    try:
        body = await turn.finish(run, builder)
    except StorageFailed as exc:
        response = error_response(exc)
        response.headers.update(headers)
        return response
    return web.json_response(body, headers=headers, dumps=dumps)


@dataclass(frozen=True)
class _Events:
    """Sends a response's events, and its ``error`` event when the stream fails."""

    sse: SSEWriter
    builder: ResponseBuilder

    async def send(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            await self.sse.send(event, name=event["type"])

    async def failed(self, error: StoicError, partial: PartialOutput, index: int) -> None:
        await self.send([self.builder.error(error, partial)])

    async def internal(self, body: dict[str, Any]) -> None:
        fields = {"code": body["code"], "message": body["message"], "param": body["param"]}
        await self.send([self.builder.event("error", **fields)])


async def _stream(
    request: web.Request,
    run: Run,
    builder: ResponseBuilder,
    turn: _Turn,
    headers: dict[str, str],
) -> web.StreamResponse:
    events = _Events(SSEWriter(request, headers), builder)

    async def produce(fanin: Fanin) -> None:
        await events.send(builder.start())
        async for chunk_events in _feed(run, builder, fanin):
            await events.send(chunk_events)
        try:
            body = await turn.finish(run, builder)
        except StorageFailed as exc:
            await events.failed(exc, exc.partial or run.choices[0].partial(), 0)
            return
        await events.send([builder.end(body)])

    return await run.stream_with(events.sse, produce, events, marker=False)


async def _stored(request: web.Request) -> Any:
    """The stored response the path names. :raises NotFound: no such response for this key."""
    response_id = request.match_info["response_id"]
    stored = await request.app[STORE].get(_owner(request), response_id)
    if stored is None:
        raise NotFound(f"no stored response {response_id!r}", param="response_id")
    return stored


async def _get(request: web.Request) -> web.Response:
    stored = await _stored(request)
    return web.json_response(stored.response, dumps=dumps)


async def _delete(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    if not await request.app[STORE].delete(_owner(request), response_id):
        raise NotFound(f"no stored response {response_id!r}", param="response_id")
    return web.json_response({"id": response_id, "object": "response.deleted", "deleted": True})


def _page_query(request: web.Request) -> tuple[int, str, str | None]:
    """``limit`` (1 to 100, default 20), ``order`` (``asc`` or ``desc``, the default) and
    ``after`` of an ``input_items`` page. :raises InvalidRequest: naming the bad one."""
    query = request.query
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= _MAX_PAGE:
        raise InvalidRequest(f"limit must be an integer from 1 to {_MAX_PAGE}", param="limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("order must be 'asc' or 'desc'", param="order")
    return limit, order, query.get("after")


async def _input_items(request: web.Request) -> web.Response:
    limit, order, after = _page_query(request)
    items = (await _stored(request)).items
    if order == "desc":
        items = items[::-1]
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise InvalidRequest(f"no input item {after!r} in this response", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    body = {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }
    return web.json_response(body, dumps=dumps)


def add_response_routes(app: web.Application, store: ResponseStore) -> None:
    """Register the Responses API on ``app``, storing in ``store`` (closed with the app)."""
    app[STORE] = store

    async def close(_app: web.Application) -> None:
        store.close()

    app.on_cleanup.append(close)
    router = app.router
    route_access(app, router.add_post("/v1/responses", _generation("responses", _create)), "api")
    route_access(app, router.add_get("/v1/responses/{response_id}", _get), "api")
    route_access(app, router.add_delete("/v1/responses/{response_id}", _delete), "api")
    route_access(
        app, router.add_get("/v1/responses/{response_id}/input_items", _input_items), "api"
    )
