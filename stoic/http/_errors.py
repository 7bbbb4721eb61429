"""Mapping errors to OpenAI error JSON: ``{"error": {"message", "type", "param", "code"}}``.

Every error response carries ``x-should-retry: true|false`` (read by the OpenAI SDKs) and, for
:class:`~stoic.errors.Overloaded`, ``Retry-After`` (whole seconds) and ``retry-after-ms``.
"""

from __future__ import annotations

import json
import math
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from ..errors import (
    EngineFailed,
    EngineStarting,
    EngineStopped,
    ExecutorFailed,
    InsufficientMemory,
    InvalidRequest,
    ModelNotFound,
    ModelUnavailable,
    NotFound,
    Overloaded,
    PartialOutput,
    StoicError,
    StorageFailed,
)

__all__ = [
    "auth_error_response",
    "dumps",
    "error_object",
    "error_response",
    "http_error_response",
    "internal_error_object",
    "internal_error_response",
    "invalid_from_validation",
    "status_of",
]

#: The HTTP status and OpenAI error ``type`` of each stoic error; the first matching class wins
#: (subclasses before their bases). An error class missing here is a 500 ``internal_error``.
_ERROR_STATUS: tuple[tuple[type[StoicError], int, str], ...] = (
    (InvalidRequest, 400, "invalid_request_error"),
    (ModelNotFound, 404, "not_found_error"),
    (NotFound, 404, "not_found_error"),
    (Overloaded, 429, "rate_limit_error"),
    (ExecutorFailed, 500, "server_error"),
    (EngineFailed, 503, "service_unavailable"),
    (EngineStopped, 503, "service_unavailable"),
    (EngineStarting, 503, "service_unavailable"),
    (ModelUnavailable, 503, "service_unavailable"),
    (InsufficientMemory, 503, "service_unavailable"),
    (StorageFailed, 503, "service_unavailable"),
)

_HTTP_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
}


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def status_of(exc: StoicError) -> tuple[int, str]:
    """``(HTTP status, OpenAI error type)`` for ``exc``."""
    for cls, status, error_type in _ERROR_STATUS:
        if isinstance(exc, cls):
            return status, error_type
    return 500, "internal_error"


def error_object(
    exc: StoicError, *, partial: PartialOutput | None = None, index: int | None = None
) -> dict[str, Any]:
    """The ``{"error": {...}}`` body for ``exc``, with ``partial`` when generation had begun."""
    body: dict[str, Any] = {
        "message": exc.message,
        "type": status_of(exc)[1],
        "param": exc.param,
        "code": exc.code,
    }
    partial = partial if partial is not None else exc.partial
    if partial is not None:
        body["partial"] = {"text": partial.text, "completion_tokens": partial.completion_tokens}
        if index is not None:
            body["partial"]["index"] = index
    return {"error": body}


def _json_response(
    status: int, body: dict[str, Any], *, retry: bool, headers: dict[str, str] | None = None
) -> web.Response:
    all_headers = {"x-should-retry": "true" if retry else "false", **(headers or {})}
    return web.Response(
        status=status, text=dumps(body), content_type="application/json", headers=all_headers
    )


def error_response(
    exc: StoicError, *, partial: PartialOutput | None = None, index: int | None = None
) -> web.Response:
    """The HTTP response for ``exc``: its status, OpenAI error JSON and retry headers."""
    headers: dict[str, str] = {}
    if isinstance(exc, Overloaded | EngineStarting):
        seconds = max(0.0, exc.retry_after)
        headers["Retry-After"] = str(max(1, math.ceil(seconds)))
        headers["retry-after-ms"] = str(round(seconds * 1000))
    body = error_object(exc, partial=partial, index=index)
    return _json_response(status_of(exc)[0], body, retry=exc.retryable, headers=headers)


def http_error_response(exc: web.HTTPException) -> web.Response:
    """OpenAI error JSON for aiohttp's own errors (unknown route, wrong method, body too large)."""
    status = exc.status
    error_type = _HTTP_ERROR_TYPES.get(
        status, "server_error" if status >= 500 else "invalid_request_error"
    )
    message, code = exc.reason, None
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        message = f"{exc.text} (the server's --max-request-bytes)"
        code = "request_too_large"
    body = {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    headers = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
    return _json_response(
        status, body, retry=status in (408, 429) or status >= 502, headers=headers
    )


def auth_error_response(
    status: int, message: str, code: str, *, challenge: bool = False
) -> web.Response:
    """401 (``challenge``: with ``WWW-Authenticate: Bearer``) or 403 with OpenAI error JSON."""
    error_type = _HTTP_ERROR_TYPES[status]
    body = {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    headers = {"WWW-Authenticate": 'Bearer realm="stoic"'} if challenge else None
    return _json_response(status, body, retry=False, headers=headers)


def internal_error_object(request_id: str) -> dict[str, Any]:
    """The error body for an unexpected exception: no traceback, the request id to look it up."""
    return {
        "error": {
            "message": f"internal server error (request id {request_id})",
            "type": "internal_error",
            "param": None,
            "code": "internal_error",
        }
    }


def internal_error_response(request_id: str) -> web.Response:
    """500 for an unexpected exception."""
    return _json_response(500, internal_error_object(request_id), retry=False)


def _param(loc: tuple[int | str, ...]) -> str | None:
    return ".".join(str(part) for part in loc) or None


def invalid_from_validation(err: ValidationError) -> InvalidRequest:
    """The first schema error of ``err`` as an :class:`~stoic.errors.InvalidRequest`.

    ``param`` is the dotted path of the offending field (``messages.1.role``).
    """
    first = err.errors(include_url=False, include_input=False)[0]
    param = _param(tuple(first["loc"]))
    message = first["msg"]
    if first["type"] == "model_type" and param is None:
        message = "the request body must be a JSON object"
    elif first["type"] == "extra_forbidden":
        message = f"unknown parameter '{param}'"
    elif param is not None:
        message = f"{param}: {message}"
    return InvalidRequest(message, param=param)
