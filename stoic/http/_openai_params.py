"""How the generation request bodies treat OpenAI's optional parameters, in one place: a null
is "not set", and the parameters stoic cannot act on are accepted and ignored.

OpenAI's spec marks most optional request fields nullable (``"n": null``, ``"stream": null``...)
and clients send nulls for fields they leave unset; stoic reads a top-level null as the field's
default, for every field but one: completions' ``max_tokens: null`` means "up to the context"
(as vLLM; its default is 16). The parameters of :data:`IGNORED_PARAMETERS` are OpenAI's, and sent by
real clients, but cannot change what stoic answers (or ask for a service stoic has no equivalent
of): they are dropped before validation, whatever their value. Any other name that is not a
field of the request is a 400 "unknown parameter", so a typo (``max_token``) is never ignored.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

__all__ = ["IGNORED_PARAMETERS", "document_request", "drop_nulls_and_ignored"]

#: OpenAI request parameters (Chat Completions, Completions) accepted and ignored, and why
IGNORED_PARAMETERS: dict[str, str] = {
    "user": "an end-user id for OpenAI's abuse monitoring",
    "safety_identifier": "an end-user id for OpenAI's abuse monitoring",
    "metadata": "tags for completions stored by OpenAI",
    "store": "whether OpenAI stores the completion (for its evals and distillation)",
    "service_tier": "OpenAI's processing tier",
    "prompt_cache_key": "OpenAI's prompt-cache routing hint (stoic's prefix cache needs none)",
    "prediction": "a predicted output, a latency optimisation that never changes the output",
    "reasoning_effort": "the effort of OpenAI's reasoning models (stoic's models have no knob)",
    "verbosity": "the answer length of OpenAI's GPT-5 models (no equivalent)",
    "web_search_options": "OpenAI's built-in web search (stoic has none; the model answers)",
}


def drop_nulls_and_ignored(
    data: Any, fields: Collection[str], keep_null: frozenset[str] = frozenset()
) -> Any:
    """A request body without the nulls of its ``fields`` (except those of ``keep_null``:
    fields whose null means something else than their default) and without its ignored
    parameters. A null of an unknown name stays, to be a 400 like any value of it."""
    if not isinstance(data, dict):
        return data
    return {
        k: v
        for k, v in data.items()
        if (v is not None or k in keep_null or k not in fields) and k not in IGNORED_PARAMETERS
    }


def document_request(schema: dict[str, Any]) -> None:
    """Make a request model's JSON schema say what :func:`drop_nulls_and_ignored` accepts:
    every optional field may be null, and the ignored parameters are listed (any value)."""
    properties: dict[str, Any] = schema.get("properties", {})
    required = set(schema.get("required", ()))
    for name, prop in properties.items():
        if name not in required and not _allows_null(prop):
            notes = {k: prop.pop(k) for k in ("title", "default", "description") if k in prop}
            properties[name] = {"anyOf": [prop, {"type": "null"}], **notes}
    for name, why in IGNORED_PARAMETERS.items():
        properties[name] = {"description": f"accepted and ignored: {why}"}


#: the keywords that restrict a JSON schema's type (a schema with none of them is "any value")
_TYPED = {"type", "$ref", "enum", "const", "anyOf", "oneOf", "allOf"}


def _allows_null(prop: dict[str, Any]) -> bool:
    for option in prop.get("anyOf", [prop]):
        kind = option.get("type")
        if kind == "null" or (isinstance(kind, list) and "null" in kind):
            return True
        if not _TYPED & option.keys():
            return True
    return False
