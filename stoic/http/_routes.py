"""Route handlers: completions, models, tokenize, health, metrics and the admin fault routes."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from .._logging import get_logger
from ..config import FaultSpec
from ..errors import InvalidRequest, ModelNotFound
from ._engine import EngineLike
from ._errors import invalid_from_validation
from ._format import ChatFormat, CompletionFormat
from ._generate import Job, run_generation
from ._metrics import CONTENT_TYPE_LATEST, outcome_of
from ._schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    FaultRequest,
    TokenizeRequest,
    choice_params,
)
from ._state import RECORD, REQUEST_ID, STATE, AppState, RequestRecord

__all__ = ["add_routes"]

_log = get_logger("stoic.http")
_M = TypeVar("_M", bound=BaseModel)
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _read_json(request: web.Request) -> Any:
    """The request body as JSON. :raises InvalidRequest: if it is not valid JSON."""
    raw = await request.read()
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None


def _parse(model: type[_M], body: Any) -> _M:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise invalid_from_validation(exc) from None


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


async def _chat(request: web.Request, state: AppState, record: RequestRecord) -> web.StreamResponse:
    req = _parse(ChatCompletionRequest, await _read_json(request))
    req.check_supported()
    model = _served_name(state.engine, req.model)
    params = req.sampling_params()
    messages = req.engine_messages()
    kwargs = req.chat_template_kwargs
    jobs = [Job(i, 0, None, messages, choice_params(params, i), kwargs) for i in range(req.n)]
    fmt = ChatFormat(record.request_id, model)
    return await run_generation(
        request, state, record, fmt, jobs, stream=req.stream, include_usage=req.include_usage
    )


async def _completions(
    request: web.Request, state: AppState, record: RequestRecord
) -> web.StreamResponse:
    req = _parse(CompletionRequest, await _read_json(request))
    req.check_supported()
    model = _served_name(state.engine, req.model)
    params = req.sampling_params()
    jobs = [
        Job(p * req.n + i, p, prompt, None, choice_params(params, i))
        for p, prompt in enumerate(req.prompts)
        for i in range(req.n)
    ]
    fmt = CompletionFormat(record.request_id, model)
    return await run_generation(
        request, state, record, fmt, jobs, stream=req.stream, include_usage=req.include_usage
    )


def _model_card(state: AppState) -> dict[str, Any]:
    engine = state.engine
    return {
        "id": engine.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "stoic",
        "root": engine.config.model,
        "parent": None,
        "max_model_len": engine.max_model_len,
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
    req = _parse(TokenizeRequest, await _read_json(request))
    if req.model is not None:
        _served_name(engine, req.model)
    tokens = engine.tokenize(
        req.prompt,
        messages=req.engine_messages(),
        add_special_tokens=req.add_special_tokens,
        add_generation_prompt=req.add_generation_prompt,
        chat_template_kwargs=req.chat_template_kwargs,
    )
    return web.json_response(
        {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens}
    )


async def _detokenize(request: web.Request) -> web.Response:
    """vLLM's ``/detokenize``: ``{"prompt"}``."""
    engine = request.app[STATE].engine
    req = _parse(DetokenizeRequest, await _read_json(request))
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
    body = _parse(FaultRequest, await _read_json(request))
    spec = FaultSpec(**body.model_dump())
    await state.engine.inject_fault(spec)
    _log.warning("http.fault_injected", **body.model_dump())
    return web.json_response({"status": "ok", "fault": body.model_dump()})


async def _clear_faults(request: web.Request) -> web.Response:
    await request.app[STATE].engine.clear_faults()
    _log.info("http.faults_cleared")
    return web.json_response({"status": "ok"})


def add_routes(app: web.Application, *, admin: bool) -> None:
    """Register every route on ``app`` (paths relative, so the app can be mounted anywhere)."""
    app.router.add_post("/v1/chat/completions", _generation("chat", _chat))
    app.router.add_post("/v1/completions", _generation("completions", _completions))
    app.router.add_get("/v1/models", _list_models)
    app.router.add_get("/v1/models/{model}", _get_model)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_post("/detokenize", _detokenize)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    if admin:
        app.router.add_post("/admin/faults", _inject_fault)
        app.router.add_delete("/admin/faults", _clear_faults)
