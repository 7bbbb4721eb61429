"""Structured-output request fields: OpenAI's ``response_format`` and vLLM's extras, turned
into one :class:`~stoic.engine.Constraint` (compiled by the engine's intake at admission, so a
bad one is a 400 before any byte is streamed).

===============================  ============================================================
field                            the output is
===============================  ============================================================
``response_format: text``        unconstrained
``response_format: json_object`` one JSON object
``response_format: json_schema`` JSON valid under ``json_schema.schema``
``structured_outputs.json``      JSON valid under the schema (vLLM; a dict or JSON text)
``structured_outputs.json_object`` one JSON object (vLLM; ``true``)
``structured_outputs.regex``     a match of the regular expression (vLLM)
``structured_outputs.choice``    exactly one of the strings (vLLM)
``structured_outputs.grammar``   a sentence of the Lark or GBNF grammar (vLLM)
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``: vLLM's older names
===============================  ============================================================
"""

from __future__ import annotations

import json
from typing import Any

from ..engine import Constraint
from ..errors import InvalidRequest

__all__ = ["constraint_of"]

_EXTRA_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
#: the fields of vLLM's ``structured_outputs`` accepted (the options after ``json_object`` do
#: not change what is valid output; they are ignored)
_EXTRA_FIELDS = {
    *_EXTRA_KINDS,
    "json_object",
    "backend",
    "whitespace_pattern",
    "disable_fallback",
    "disable_any_whitespace",
    "disable_additional_properties",
}


def _schema_text(value: Any, param: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise InvalidRequest(f"the schema is not valid JSON: {exc}", param=param) from exc
    if not isinstance(value, dict | bool):
        raise InvalidRequest("a JSON schema must be an object", param=param)
    return json.dumps(value)  # the schema's key order is the output's (as OpenAI's)


def _extra(kind: str, value: Any, param: str) -> Constraint:
    if kind == "json":
        return Constraint("json_schema", _schema_text(value, param), param)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise InvalidRequest("choice must be a non-empty list of strings", param=param)
        return Constraint("choice", json.dumps(value), param)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{kind} must be a non-empty string", param=param)
    return Constraint(_EXTRA_KINDS[kind], value, param)  # type: ignore[arg-type]


def _response_format(value: dict[str, Any]) -> Constraint | None:
    param = "response_format"
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object", "", param)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidRequest("response_format.json_schema must be an object", param=param)
        # what the SDKs send: {"name", "schema", "strict"}; vLLM also accepts the schema itself
        schema = spec.get("schema", spec.get("json_schema", {"type": "object"}))
        return Constraint("json_schema", _schema_text(schema, param), param)
    raise InvalidRequest(
        f"response_format type {kind!r} is not supported (text, json_object, json_schema)",
        param=param,
    )


def constraint_of(
    response_format: dict[str, Any] | None,
    structured_outputs: dict[str, Any] | None,
    guided: dict[str, Any],
) -> Constraint | None:
    """The one constraint a request asks for, or None.

    ``guided`` maps vLLM's older field names (``guided_json``...) to their values.

    :raises InvalidRequest: naming the field if it is malformed or more than one is given.
    """
    found: list[Constraint] = []
    if response_format is not None:
        c = _response_format(response_format)
        if c is not None:
            found.append(c)
    if structured_outputs:
        unknown = set(structured_outputs) - _EXTRA_FIELDS
        if unknown:
            raise InvalidRequest(
                f"structured_outputs field(s) {sorted(unknown)} are not supported",
                param="structured_outputs",
            )
        for k in (*_EXTRA_KINDS, "json_object"):
            value = structured_outputs.get(k)
            if value is None or value is False:
                continue
            if k == "json_object":
                found.append(Constraint("json_object", "", "structured_outputs"))
            else:
                found.append(_extra(k, value, "structured_outputs"))
    for name, value in guided.items():
        if value is not None:
            found.append(_extra(name.removeprefix("guided_"), value, name))
    if len(found) > 1:
        raise InvalidRequest(
            "give at most one of response_format (json), structured_outputs and guided_*",
            param=found[1].param,
        )
    return found[0] if found else None
