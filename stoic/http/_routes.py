"""Route handlers: completions, models, tokenize, health, metrics and the admin fault routes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from .._logging import get_logger
from .._version import installed_version
from ..config import FaultSpec
from ..engine import Request, SamplingParams
from ..errors import InvalidRequest, ModelNotFound
from ._auth import route_access
from ._engine import EngineLike
from ._errors import invalid_from_validation
from ._format import ChatFormat, CompletionFormat
from ._generate import Job, run_generation
from ._metrics import CONTENT_TYPE_LATEST, outcome_of
from ._openapi import openapi_document
from ._scheduling import scheduling_fields
from ._schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    choice_params,
)
from ._state import RECORD, REQUEST_ID, STATE, AppState, RequestRecord
from ._toolconv import render_conversation
from ._tools import ToolPlan, tool_syntax
from ._util_schemas import DetokenizeRequest, FaultRequest, TokenizeRequest

__all__ = ["add_routes", "chat_format", "chat_inputs", "read_body"]

_log = get_logger("stoic.http")
_M = TypeVar("_M", bound=BaseModel)
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _read_json(request: web.Request) -> Any:
    """The request body as JSON, read within the body deadline.

    :raises InvalidRequest: if it is not valid JSON.
    :raises aiohttp.web.HTTPRequestTimeout: if the body is not in within the deadline (408).
    :raises aiohttp.web.HTTPRequestEntityTooLarge: above the size limit (413).
    """
    limit = request.app[STATE].limits.body_timeout
    try:
        async with asyncio.timeout(limit):
            raw = await request.read()
    except TimeoutError:
        _log.warning("http.body_timeout", seconds=limit)
        raise web.HTTPRequestTimeout(
            reason=f"the request body did not arrive within {limit:g} seconds"
        ) from None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None


def _parse(model: type[_M], body: Any) -> _M:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise invalid_from_validation(exc) from None


async def read_body(request: web.Request, model: type[_M]) -> _M:
    """The request body, read (:func:`_read_json`) and validated as ``model``.

    :raises InvalidRequest: not JSON, or not a valid ``model`` (naming the field).
    """
    return _parse(model, await _read_json(request))


def _served_name(engine: EngineLike, requested: str) -> str:
    """The served model's name if ``requested`` names it. :raises ModelNotFound: otherwise."""
    config = engine.config
    names = {engine.model_name, "default", config.model, config.served_model_name}
    if requested not in names:
        raise ModelNotFound(
            f"the model '{requested}' does not exist; this server serves '{engine.model_name}'"
        )
    return engine.model_name


def _generation(
    endpoint: str,
    handler: Callable[[web.Request, AppState, RequestRecord], Awaitable[web.StreamResponse]],
) -> _Handler:
    """Wrap a generation handler with in-flight tracking and the request outcome metric."""

    async def wrapped(request: web.Request) -> web.StreamResponse:
        state = request.app[STATE]
        record = RequestRecord(endpoint=endpoint, request_id=REQUEST_ID.get())
        request[RECORD] = record
        state.enter()
        try:
            return await handler(request, state, record)
        except BaseException as exc:
            if not record.delivered:  # the outcome is what was delivered
                record.outcome = "aborted" if not isinstance(exc, Exception) else outcome_of(exc)
            raise
        finally:
            state.leave()
            state.metrics.request_done(endpoint, record.outcome, record.started)

    return wrapped


def chat_inputs(
    state: AppState, req: ChatCompletionRequest
) -> tuple[list[dict[str, Any]], dict[str, Any] | None, ToolPlan | None, SamplingParams]:
    """What a checked chat request submits: its messages (tools rendered for the served
    model's template), the template variables, the tool plan and the sampling parameters.

    :raises InvalidRequest: a malformed tool, tool_choice or sampling field.
    """
    req.check_supported()
    messages, kwargs = req.engine_messages(), req.chat_template_kwargs
    plan = None
    if req.uses_tools:
        syntax = tool_syntax(state.engine.chat_template)
        plan = req.tool_plan(syntax)
        messages, kwargs = render_conversation(messages, plan, syntax, kwargs)
    return messages, kwargs, plan, req.sampling_params(plan)


def chat_format(
    state: AppState, record: RequestRecord, model: str, plan: ToolPlan | None
) -> ChatFormat:
    """The chat response builder of one request (its output parsed for ``plan``'s calls)."""
    return ChatFormat(
        record.request_id,
        model,
        tools=plan if plan and plan.offered else None,
        count_tool_calls=state.metrics.count_tool_calls,
    )


async def _chat(request: web.Request, state: AppState, record: RequestRecord) -> web.StreamResponse:
    req = await read_body(request, ChatCompletionRequest)
    model = _served_name(state.engine, req.model)
    messages, kwargs, plan, params = chat_inputs(state, req)
    sched = scheduling_fields(request, priority=req.priority, timeout=req.timeout)
    jobs = [
        Job(
            i,
            0,
            Request(
                messages=messages,
                params=choice_params(params, i),
                chat_template_kwargs=kwargs,
                **sched,
            ),
        )
        for i in range(req.n)
    ]
    fmt = chat_format(state, record, model, plan)
    return await run_generation(
        request, state, record, fmt, jobs, stream=req.stream, include_usage=req.include_usage
    )


async def _completions(
    request: web.Request, state: AppState, record: RequestRecord
) -> web.StreamResponse:
    req = await read_body(request, CompletionRequest)
    req.check_supported()
    model = _served_name(state.engine, req.model)
    params = req.sampling_params()
    sched = scheduling_fields(request, priority=req.priority, timeout=req.timeout)
    jobs = [
        Job(p * req.n + i, p, Request(prompt, choice_params(params, i), **sched))
        for p, prompt in enumerate(req.prompts)
        for i in range(req.n)
    ]
    fmt = CompletionFormat(record.request_id, model)
    return await run_generation(
        request, state, record, fmt, jobs, stream=req.stream, include_usage=req.include_usage
    )


def _model_card(state: AppState) -> dict[str, Any]:
    engine = state.engine
    compute = engine.stats().compute
    return {
        "id": engine.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "stoic",
        "root": engine.config.model,
        "parent": None,
        "max_model_len": engine.max_model_len,
        # how the model runs (architecture, decoder path, GGUF matrix types, kernels: see
        # docs/models.md); null until an executor was ready
        "compute": compute.card() if compute is not None else None,
        # how the KV cache was sized, in MiB (the engine.kv_sizing event's figures): what a
        # check of the device's memory compares against (docs/operations.md, "Memory")
        "memory": sizing.describe() if (sizing := engine.kv_sizing) is not None else None,
    }


async def _list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response({"object": "list", "data": [_model_card(state)]})


async def _get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    _served_name(state.engine, request.match_info["model"])
    return web.json_response(_model_card(state))


async def _tokenize(request: web.Request) -> web.Response:
    """vLLM's ``/tokenize``: ``{"count", "max_model_len", "tokens"}``."""
    engine = request.app[STATE].engine
    req = await read_body(request, TokenizeRequest)
    if req.model is not None:
        _served_name(engine, req.model)
    messages, kwargs = req.engine_messages(), req.chat_template_kwargs
    if messages is not None and any(m.has_tools for m in req.messages or ()):
        syntax = tool_syntax(engine.chat_template)
        messages, kwargs = render_conversation(messages, None, syntax, kwargs)
    tokens = engine.tokenize(
        Request(
            req.prompt,
            messages=messages,
            add_special_tokens=req.add_special_tokens,
            add_generation_prompt=req.add_generation_prompt,
            chat_template_kwargs=kwargs,
        )
    )
    body: dict[str, Any] = {
        "count": len(tokens),
        "max_model_len": engine.max_model_len,
        "tokens": tokens,
    }
    if req.return_token_strs:
        body["token_strs"] = [engine.detokenize([t]) for t in tokens]
    return web.json_response(body)


async def _detokenize(request: web.Request) -> web.Response:
    """vLLM's ``/detokenize``: ``{"prompt"}``."""
    engine = request.app[STATE].engine
    req = await read_body(request, DetokenizeRequest)
    if req.model is not None:
        _served_name(engine, req.model)
    return web.json_response({"prompt": engine.detokenize(req.tokens)})


async def _health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    health = state.engine.health()
    if state.draining:
        return web.json_response(
            {"status": "stopping", "reason": "the server is shutting down"}, status=503
        )
    stats = state.engine.stats()
    executor = {
        "pid": stats.executor_pid,
        "incarnation": stats.incarnation,
        "restarts": stats.restarts,
    }
    if health.ok:
        return web.json_response({"status": "ok", "executor": executor})
    return web.json_response(
        {"status": health.state, "reason": health.reason, "executor": executor}, status=503
    )


async def _metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.Response(body=state.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _inject_fault(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_body(request, FaultRequest)
    spec = FaultSpec(**body.model_dump())
    await state.engine.inject_fault(spec)
    _log.warning("http.fault_injected", **body.model_dump())
    return web.json_response({"status": "ok", "fault": body.model_dump()})


async def _clear_faults(request: web.Request) -> web.Response:
    await request.app[STATE].engine.clear_faults()
    _log.info("http.faults_cleared")
    return web.json_response({"status": "ok"})


def _openapi(document: dict[str, Any]) -> _Handler:
    body = json.dumps(document)

    async def handler(request: web.Request) -> web.Response:
        return web.Response(text=body, content_type="application/json")

    return handler


def add_routes(app: web.Application, *, admin: bool) -> None:
    """Register every route on ``app`` (paths relative, so the app can be mounted anywhere),
    each with its access class (:mod:`stoic.http._auth`)."""
    router = app.router
    route_access(app, router.add_post("/v1/chat/completions", _generation("chat", _chat)), "api")
    completions = _generation("completions", _completions)
    route_access(app, router.add_post("/v1/completions", completions), "api")
    route_access(app, router.add_get("/v1/models", _list_models), "api")
    route_access(app, router.add_get("/v1/models/{model}", _get_model), "api")
    route_access(app, router.add_post("/tokenize", _tokenize), "api")
    route_access(app, router.add_post("/detokenize", _detokenize), "api")
    route_access(app, router.add_get("/health", _health), "open")
    route_access(app, router.add_get("/metrics", _metrics), "metrics")
    document = openapi_document(admin=admin, version=installed_version())
    route_access(app, router.add_get("/openapi.json", _openapi(document)), "open")
    if admin:
        route_access(app, router.add_post("/admin/faults", _inject_fault), "admin")
        route_access(app, router.add_delete("/admin/faults", _clear_faults), "admin")
