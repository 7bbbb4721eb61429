"""The aiohttp application: request ids, error mapping, routes."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import uuid

import structlog
from aiohttp import web
from aiohttp.typedefs import Handler

from .._logging import get_logger
from ..errors import StoicError
from ._auth import AccessPolicy, auth_middleware
from ._console import add_console_routes
from ._engine import EngineLike
from ._errors import error_response, http_error_response, internal_error_response
from ._limits import ServerLimits, head_done, head_expected
from ._metrics import Metrics
from ._responses import add_response_routes
from ._routes import add_routes
from ._state import RECORD, REQUEST_ID, STATE, AppState
from ._store import ResponseStore

__all__ = ["create_app", "drain"]

_log = get_logger("stoic.http")
_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
#: statuses that mean a request limit refused the request (``stoic_http_refused`` reasons)
_LIMIT_REASONS = {408: "body_timeout", 413: "too_large"}
#: after the drain timeout, how long the remaining requests get to send their error
_END_GRACE = 5.0


def _request_id(header: str | None) -> str:
    """The client's ``x-request-id`` when it is a sane token, else a fresh one."""
    if header is not None and _REQUEST_ID_RE.fullmatch(header):
        return header
    return uuid.uuid4().hex


@web.middleware
async def _request_context(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Bind the request id for every log line; turn every error into OpenAI error JSON.

    An unexpected exception becomes a 500 (logged with its traceback, never shown to the client).
    """
    head_done(request)
    request_id = _request_id(request.headers.get("x-request-id"))
    token = REQUEST_ID.set(request_id)
    started = time.monotonic()
    try:
        with structlog.contextvars.bound_contextvars(request_id=request_id):
            return await _answer(request, handler, request_id, started)
    finally:
        REQUEST_ID.reset(token)
        head_expected(request)


async def _answer(
    request: web.Request, handler: Handler, request_id: str, started: float
) -> web.StreamResponse:
    """Run the handler; map what it raises to an error response; log the request."""
    response: web.StreamResponse
    try:
        response = await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if exc.status in _LIMIT_REASONS:
            request.app[STATE].metrics.refused.labels(_LIMIT_REASONS[exc.status]).inc()
        response = http_error_response(exc)
    except StoicError as exc:
        response = error_response(exc)
    except asyncio.CancelledError:
        record = request.get(RECORD)
        if record is not None and record.delivered:  # the client hung up after its answer
            _log.info(
                "http.request",
                method=request.method,
                path=request.path,
                status=200,
                duration_ms=round((time.monotonic() - started) * 1000, 1),
                closed_by_client=True,
            )
        else:
            _log.info("http.request_cancelled", method=request.method, path=request.path)
        raise
    except Exception:
        _log.exception("http.unhandled_error", method=request.method, path=request.path)
        response = internal_error_response(request_id)
    if not response.prepared:
        response.headers["x-request-id"] = request_id
    quiet = _is_probe(request.path, response.status)
    (_log.debug if quiet else _log.info)(
        "http.request",
        method=request.method,
        path=request.path,
        status=response.status,
        duration_ms=round((time.monotonic() - started) * 1000, 1),
    )
    return response


def _is_probe(path: str, status: int) -> bool:
    """A health probe (``/health``, ``/health/...``), whatever it answered (a 503 while the
    model loads or the executor recovers), or a successful ``/metrics`` scrape: logged at debug
    level, since orchestrators and scrapers ask every few seconds."""
    health = path.endswith("/health") or "/health/" in path
    return health or (path.endswith("/metrics") and status < 400)


def create_app(
    engine: EngineLike,
    *,
    enable_admin: bool | None = None,
    access: AccessPolicy | None = None,
    limits: ServerLimits | None = None,
    responses: ResponseStore | None = None,
) -> web.Application:
    """An OpenAI-compatible application serving ``engine`` (which the caller started).

    Routes are relative, so the app can be served alone or mounted in a host application:
    ``host.add_subapp("/llm", create_app(engine))``. For requests to be aborted as soon as their
    client disconnects even before any output, run it under a runner with
    ``handler_cancellation=True`` (as :func:`stoic.http.serve` does); streams are aborted on
    the first failed write in any case.

    :param enable_admin: register ``POST``/``DELETE /admin/faults``; ``None`` follows
        ``engine.config.enable_fault_injection``.
    :param access: the API and admin keys (default: none; the admin routes then answer
        loopback clients only).
    :param limits: the request body's size and read deadline (the connection limits apply
        only under :func:`stoic.http.serve`).
    :param responses: where ``POST /v1/responses`` stores responses (default: a new in-memory
        database); the app closes it on cleanup.
    """
    if enable_admin is None:
        enable_admin = engine.config.enable_fault_injection
    access = access if access is not None else AccessPolicy()
    limits = limits if limits is not None else ServerLimits()
    app = web.Application(
        middlewares=[_request_context, auth_middleware(access)],
        client_max_size=limits.max_request_bytes,
    )
    app[STATE] = AppState(engine=engine, metrics=Metrics(engine), limits=limits)
    add_routes(app, admin=enable_admin)
    add_response_routes(app, responses if responses is not None else ResponseStore())
    add_console_routes(app, admin=enable_admin)
    return app


async def drain(app: web.Application, grace: float) -> bool:
    """Stop taking generation requests and wait up to ``grace`` seconds for the running ones.

    New generation requests get 503 and ``/health`` says "stopping". When the grace period expires,
    the remaining requests are ended with an error (an ``error`` event, or a 503 with the partial
    output) and their engine requests aborted.

    :returns: True if every request finished within the grace period.
    """
    state = app[STATE]
    state.draining = True
    try:
        await asyncio.wait_for(state.idle.wait(), grace)
        return True
    except TimeoutError:
        _log.warning("http.drain_timeout", inflight=state.inflight, grace=grace)
        state.stopping.set()
        # the handlers now write their error event; a client too slow to take it is cut off
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(state.idle.wait(), _END_GRACE)
        return False
