"""``GET /openapi.json``: an OpenAPI 3.1 description of the routes, generated from the request
models (so it cannot drift from what the server validates) plus hand-written response schemas.

What the request schemas cannot say (ranges checked by :meth:`SamplingParams.validate`, the
served model's name, the context length) is a 400 or 404 the document lists for each route;
schemathesis checks the server against this document in CI (tests/http/test_http_openapi.py).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from ._responses_schemas import ResponsesRequest
from ._schemas import (
    TOOL_CALL_SCHEMA,
    ChatCompletionRequest,
    CompletionRequest,
)
from ._util_schemas import DetokenizeRequest, FaultRequest, TokenizeRequest

__all__ = ["openapi_document"]

_REF = "#/components/schemas/{model}"

_NULLABLE_STR = {"type": ["string", "null"]}
_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": _NULLABLE_STR,
                "code": _NULLABLE_STR,
                "partial": {
                    "type": "object",
                    "required": ["text", "completion_tokens"],
                    "properties": {
                        "text": {"type": "string"},
                        "completion_tokens": {"type": "integer", "minimum": 0},
                        "index": {"type": "integer", "minimum": 0},
                    },
                },
            },
        }
    },
}
_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        "prompt_tokens": {"type": "integer", "minimum": 0},
        "completion_tokens": {"type": "integer", "minimum": 0},
        "total_tokens": {"type": "integer", "minimum": 0},
    },
}
_FINISH = {"enum": ["stop", "length", "tool_calls", "timeout", None]}


def _completion_object(obj: str, choice: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": obj},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "minItems": 1, "items": choice},
            "usage": _USAGE,
        },
    }


def _choice(name: str, output: dict[str, Any]) -> dict[str, Any]:
    """One choice: its index, its output under ``name`` and its finish reason."""
    return {
        "type": "object",
        "required": ["index", name, "finish_reason"],
        "properties": {
            "index": {"type": "integer", "minimum": 0},
            name: output,
            "finish_reason": _FINISH,
        },
    }


_TOOL_CALL = {**TOOL_CALL_SCHEMA, "required": ["id", "type", "function"]}
_CHAT_MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"const": "assistant"},
        "content": _NULLABLE_STR,
        "tool_calls": {"type": "array", "items": _TOOL_CALL},
    },
}
_CHAT_CHOICE = _choice("message", _CHAT_MESSAGE)
_TEXT_CHOICE = _choice("text", {"type": "string"})
_MODEL = {
    "type": "object",
    "required": ["id", "object", "created", "owned_by"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "model"},
        "created": {"type": "integer"},
        "owned_by": {"type": "string"},
        "max_model_len": {"type": "integer", "minimum": 1},
        "compute": {"type": ["object", "null"]},
        "memory": {"type": ["object", "null"]},
    },
}
_TOKENIZED = {
    "type": "object",
    "required": ["count", "max_model_len", "tokens"],
    "properties": {
        "count": {"type": "integer", "minimum": 0},
        "max_model_len": {"type": "integer", "minimum": 1},
        "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "token_strs": {"type": "array", "items": {"type": "string"}},
    },
}
_DETOKENIZED = {
    "type": "object",
    "required": ["prompt"],
    "properties": {"prompt": {"type": "string"}},
}
_HEALTH = {
    "type": "object",
    "required": ["status"],
    "properties": {"status": {"type": "string"}, "reason": _NULLABLE_STR},
}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*statuses: int) -> dict[str, Any]:
    reasons = {
        400: "invalid request (the error names the parameter)",
        401: "missing or wrong API key (only when the server has keys)",
        403: "not allowed (admin routes: an API key, or a non-loopback client without admin key)",
        404: "unknown model (or stored response)",
        408: "the request body did not arrive in time",
        413: "request body over --max-request-bytes",
        429: "overloaded (Retry-After)",
        500: "the model failed while generating (with the partial output)",
        503: "starting, stopping, or the engine failed",
    }
    return {str(s): _json({"$ref": "#/components/schemas/Error"}, reasons[s]) for s in statuses}


_GENERATION_ERRORS = (400, 401, 404, 408, 413, 429, 500, 503)


def _post(
    request: type[BaseModel], ok: dict[str, Any], summary: str, errors: tuple[int, ...]
) -> dict[str, Any]:
    body = {"$ref": f"#/components/schemas/{request.__name__}"}
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": {"200": ok, **_errors(*errors)},
        }
    }


def _generation(request: type[BaseModel], response: str, summary: str) -> dict[str, Any]:
    ok = {
        "description": "the completion; with stream=true, server-sent events",
        "content": {
            "application/json": {"schema": {"$ref": f"#/components/schemas/{response}"}},
            # each server-sent event, as OpenAPI 3.2's event-stream media type describes one
            # (and schemathesis validates every event of a streamed answer against it)
            "text/event-stream": {"schema": _SSE_EVENT},
        },
    }
    return _post(request, ok, summary, _GENERATION_ERRORS)


#: one server-sent event: ``data`` is a chunk object (or the error object) as JSON text, or
#: ``[DONE]``; an ``event: error`` event ends a failed stream
_SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {"type": "string"},
        "event": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
}


_RESPONSE = {
    "type": "object",
    "required": ["id", "object", "created_at", "model", "status", "output"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "response"},
        "created_at": {"type": "integer"},
        "model": {"type": "string"},
        "status": {"enum": ["completed", "incomplete"]},
        "output": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["id", "type"],
                "properties": {"type": {"enum": ["message", "function_call"]}},
            },
        },
    },
}
_RESPONSE_ID = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
_PAGE = [
    {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
    {"name": "order", "in": "query", "schema": {"enum": ["asc", "desc"]}},
    {"name": "after", "in": "query", "schema": {"type": "string"}},
]


def _response_paths() -> dict[str, Any]:
    """``/v1/responses`` and the stored responses' routes."""
    stored = _json({"$ref": "#/components/schemas/Response"}, "the stored response")
    deleted = _json({"type": "object", "required": ["id", "deleted"]}, "deleted")
    items = _json({"type": "object", "required": ["object", "data", "has_more"]}, "its items")
    return {
        "/v1/responses": _generation(ResponsesRequest, "Response", "Create a response"),
        "/v1/responses/{response_id}": {
            "parameters": [_RESPONSE_ID],
            "get": {
                "summary": "A stored response",
                "responses": {"200": stored, **_errors(401, 404, 503)},
            },
            "delete": {
                "summary": "Delete a stored response",
                "responses": {"200": deleted, **_errors(401, 404, 503)},
            },
        },
        "/v1/responses/{response_id}/input_items": {
            "get": {
                "summary": "The conversation a stored response answered",
                "parameters": [_RESPONSE_ID, *_PAGE],
                "responses": {"200": items, **_errors(400, 401, 404, 503)},
            }
        },
    }


def _components(*models: type[BaseModel]) -> dict[str, Any]:
    schemas: dict[str, Any] = {
        "Error": _ERROR,
        "ChatCompletion": _completion_object("chat.completion", _CHAT_CHOICE),
        "Completion": _completion_object("text_completion", _TEXT_CHOICE),
        "Model": _MODEL,
        "ModelList": {
            "type": "object",
            "required": ["object", "data"],
            "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _MODEL}},
        },
        "Health": _HEALTH,
        "Response": _RESPONSE,
    }
    for model in models:
        schema = model.model_json_schema(ref_template=_REF)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    return schemas


def openapi_document(*, admin: bool, version: str) -> dict[str, Any]:
    """The OpenAPI 3.1 document of an app; ``admin``: with the ``/admin/faults`` routes."""
    paths: dict[str, Any] = {
        "/v1/chat/completions": _generation(
            ChatCompletionRequest, "ChatCompletion", "Create a chat completion"
        ),
        "/v1/completions": _generation(CompletionRequest, "Completion", "Create a completion"),
        **_response_paths(),
        "/v1/models": {
            "get": {
                "summary": "List the served model",
                "responses": {
                    "200": _json({"$ref": "#/components/schemas/ModelList"}, "the model"),
                    **_errors(401),
                },
            }
        },
        "/v1/models/{model}": {
            "get": {
                "summary": "Describe the served model",
                "parameters": [
                    {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
                ],
                "responses": {
                    "200": _json({"$ref": "#/components/schemas/Model"}, "the model"),
                    **_errors(401, 404),
                },
            }
        },
        "/tokenize": _post(
            TokenizeRequest,
            _json(_TOKENIZED, "the prompt's token ids"),
            "Tokenize a prompt or a conversation (as generation would)",
            (400, 401, 404, 408, 413, 503),
        ),
        "/detokenize": _post(
            DetokenizeRequest,
            _json(_DETOKENIZED, "the text"),
            "Turn token ids back into text",
            (400, 401, 404, 408, 413, 503),
        ),
        "/health": {
            "get": {
                "summary": "Liveness and readiness",
                "responses": {
                    "200": _json({"$ref": "#/components/schemas/Health"}, "serving"),
                    "503": _json({"$ref": "#/components/schemas/Health"}, "not serving"),
                },
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics",
                "responses": {
                    "200": {
                        "description": "the metrics",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    },
                    **_errors(401),
                },
            }
        },
    }
    if admin:
        ok = _json({"type": "object", "required": ["status"]}, "done")
        paths["/admin/faults"] = {
            "post": {
                "summary": "Arm a fault (fault injection only)",
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {"$ref": "#/components/schemas/FaultRequest"}
                        }
                    },
                },
                "responses": {"200": ok, **_errors(400, 401, 403, 408, 413)},
            },
            "delete": {
                "summary": "Disarm every fault",
                "responses": {"200": ok, **_errors(401, 403)},
            },
        }
    return {
        "openapi": "3.1.0",
        "info": {"title": "stoic", "version": version},
        "paths": paths,
        "components": {
            "schemas": _components(
                ChatCompletionRequest,
                CompletionRequest,
                ResponsesRequest,
                TokenizeRequest,
                DetokenizeRequest,
                FaultRequest,
            ),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{}, {"bearer": []}],
    }
