"""Tool calling, the request side: the request's ``tools`` and ``tool_choice``, the syntax the
served model calls tools in, the conversation rendered for its chat template, and the grammar
that enforces ``required`` and named choices.

The syntax comes from the model's chat template (:func:`tool_syntax`):

=========  ==========================================  =====================================
syntax     a call is                                    recognised by (in the template)
=========  ==========================================  =====================================
hermes     ``<tool_call>\\n{"name", "arguments"}\\n</tool_call>`` ``<tool_call>`` (Qwen 2.5+, Hermes)
llama3     ``{"name", "parameters"}`` (``; `` between)  ``"parameters": dictionary`` or
                                                        ``<|python_tag|>`` (Llama 3.1+)
mistral    ``[TOOL_CALLS][{"name", "arguments"}, ...]``  ``[TOOL_CALLS]``
generic    hermes, described in a system message        any other template (SmolLM2: none)
=========  ==========================================  =====================================

A *native* syntax hands ``tools`` to the template (``tools=`` of ``apply_chat_template``) and
keeps assistant ``tool_calls`` and ``tool`` messages for it to render; the generic one writes
the tool list into the system message, earlier calls into the assistant text and tool results
into ``user`` messages (``<tool_response>``), so it works with any template.

``tool_choice``: ``none`` offers no tools (the output is text, never parsed); ``auto`` offers
them and parses the output (text or calls, the model decides); ``required`` and a named function
are enforced by a grammar whose calls' arguments follow each function's parameter schema.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from ..engine import Constraint
from ..errors import InvalidRequest

__all__ = ["Tool", "ToolPlan", "ToolSyntax", "parse_tools", "tool_plan", "tool_syntax"]

SyntaxKind = Literal["hermes", "llama3", "mistral"]
ChoiceKind = Literal["none", "auto", "required", "function"]

_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
#: the compact JSON the grammars produce (no whitespace between tokens: small models otherwise
#: fill the arguments with it)
_COMPACT = {"whitespace_flexible": False}
#: a hermes call's framing
_OPEN = "<tool_call>\n"
_CLOSE = "\n</tool_call>"


@dataclass(frozen=True, slots=True)
class ToolSyntax:
    """How the served model writes tool calls."""

    kind: SyntaxKind
    #: the chat template renders tools, calls and results itself
    native: bool

    @property
    def arguments_key(self) -> str:
        return "parameters" if self.kind == "llama3" else "arguments"


GENERIC = ToolSyntax("hermes", native=False)


def _template_text(template: str | dict[str, str] | None) -> str:
    if isinstance(template, dict):  # named templates: the tool one if there is one
        return template.get("tool_use") or template.get("default") or ""
    return template or ""


def tool_syntax(template: str | dict[str, str] | None) -> ToolSyntax:
    """The tool syntax of a model with chat template ``template`` (see the module's table)."""
    text = _template_text(template)
    if "tools" not in text:
        return GENERIC
    if "[TOOL_CALLS]" in text:
        return ToolSyntax("mistral", native=True)
    if "<tool_call>" in text:
        return ToolSyntax("hermes", native=True)
    if '"parameters": dictionary' in text or "<|python_tag|>" in text:
        return ToolSyntax("llama3", native=True)
    return GENERIC


@dataclass(frozen=True, slots=True)
class Tool:
    """One function the model may call."""

    name: str
    description: str | None
    #: JSON Schema of the arguments object
    parameters: dict[str, Any]

    def openai(self) -> dict[str, Any]:
        """The tool as OpenAI's request shape (what chat templates expect)."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


def parse_tools(value: list[Any] | None) -> tuple[Tool, ...]:
    """The ``tools`` of a request.

    :raises InvalidRequest: naming the tool (``tools.N``) if one is malformed: not a function,
        a name not matching ``[A-Za-z0-9_.-]{1,64}``, a name used twice, parameters that are
        not a JSON Schema object.
    """
    tools: list[Tool] = []
    for i, item in enumerate(value or ()):
        param = f"tools.{i}"
        if not isinstance(item, dict) or item.get("type", "function") != "function":
            raise InvalidRequest(
                "a tool must be {'type': 'function', 'function': {...}}", param=param
            )
        fn = item.get("function")
        if not isinstance(fn, dict):
            raise InvalidRequest("a tool needs a 'function' object", param=param)
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise InvalidRequest(
                "a function name must be 1 to 64 of a-z, A-Z, 0-9, '_', '.', '-'", param=param
            )
        if any(t.name == name for t in tools):
            raise InvalidRequest(f"two tools are named {name!r}", param=param)
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidRequest("a function description must be a string", param=param)
        parameters = fn.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise InvalidRequest("function parameters must be a JSON Schema object", param=param)
        tools.append(Tool(name, description, parameters))
    return tuple(tools)


def _choice(value: Any, tools: tuple[Tool, ...]) -> tuple[ChoiceKind, str | None]:
    """:raises InvalidRequest: an unknown choice, a named function that is not a tool, or
    ``required`` / a named function without tools (OpenAI's 400; ``auto`` without tools is
    accepted: there is nothing to call)."""
    param = "tool_choice"
    if value is None:
        return ("auto" if tools else "none"), None
    if value in ("none", "auto", "required"):
        if value == "required" and not tools:
            raise InvalidRequest("tool_choice 'required' needs tools", param=param)
        return value, None
    if isinstance(value, dict) and value.get("type") == "function":
        fn = value.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise InvalidRequest("a named tool_choice needs function.name", param=param)
        if not tools:
            raise InvalidRequest("a named tool_choice needs tools", param=param)
        if not any(t.name == name for t in tools):
            raise InvalidRequest(f"tool_choice names {name!r}, which is not a tool", param=param)
        return "function", name
    raise InvalidRequest(
        "tool_choice must be 'none', 'auto', 'required' or "
        "{'type': 'function', 'function': {'name': ...}}",
        param=param,
    )


def _closed(parameters: dict[str, Any]) -> dict[str, Any]:
    """``parameters`` without room for properties it does not name, unless it says otherwise:
    what the grammar makes is still valid under the schema, and a small model no longer
    invents arguments (OpenAI's strict mode does the same)."""
    if parameters.get("type") == "object" and "additionalProperties" not in parameters:
        return {**parameters, "additionalProperties": False}
    return parameters


def _call_schema(tools: tuple[Tool, ...], key: str) -> dict[str, Any]:
    """JSON Schema of one call object: the name first, then the arguments of that function."""
    variants = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, key: _closed(t.parameters)},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = variants[0] if len(variants) == 1 else {"anyOf": variants}
    return {**schema, "x-guidance": _COMPACT}


def _lark_str(text: str) -> str:
    return json.dumps(text)


def calls_grammar(syntax: ToolSyntax, tools: tuple[Tool, ...], *, parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect) of one or more calls (one if not ``parallel``)."""
    call_json = "%json " + json.dumps(_call_schema(tools, syntax.arguments_key))
    if syntax.kind == "hermes":
        call = f"{_lark_str(_OPEN)} {call_json} {_lark_str(_CLOSE)}"
        many = 'calls: call ("\\n" call)*'
    elif syntax.kind == "llama3":
        call = call_json
        many = 'calls: call ("; " call)*'
    else:  # mistral: the marker is written as text (llguidance matches text, not the token)
        call = call_json
        many = 'calls: "[TOOL_CALLS][" call ("," call)* "]"'
    if not parallel:
        many = 'calls: "[TOOL_CALLS][" call "]"' if syntax.kind == "mistral" else "calls: call"
    return f"{many}\ncall: {call}\n"


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a chat request asks of tools, and how the served model is told and parsed."""

    tools: tuple[Tool, ...]
    choice: ChoiceKind
    #: the named function (``choice == "function"``)
    function: str | None
    parallel: bool
    syntax: ToolSyntax

    @property
    def offered(self) -> bool:
        """The model is told about the tools and its output is parsed for calls."""
        return bool(self.tools) and self.choice != "none"

    @property
    def enforced(self) -> bool:
        """The output is calls only (a grammar makes sure)."""
        return self.choice in ("required", "function")

    def constraint(self, response: Constraint | None) -> Constraint | None:
        """The request's constraint, tools included.

        ``required`` / named: calls only; ``auto`` with a JSON ``response_format``: either that
        JSON or calls; otherwise ``response`` unchanged.

        :raises InvalidRequest: a forced call together with a ``response_format``, or ``auto``
            together with a regex / choice / grammar constraint.
        """
        if not self.offered:
            return response
        if self.enforced:
            if response is not None:
                raise InvalidRequest(
                    "a required or named tool_choice cannot be combined with "
                    f"{response.param}: the output is tool calls",
                    param="tool_choice",
                )
            tools = self.tools
            if self.function is not None:
                tools = tuple(t for t in tools if t.name == self.function)
            # a named choice calls that function once (OpenAI's semantics)
            parallel = self.parallel and self.function is None
            grammar = "start: calls\n" + calls_grammar(self.syntax, tools, parallel=parallel)
            return Constraint("grammar", grammar, "tool_choice")
        if response is None:
            return None
        if response.kind not in ("json_schema", "json_object"):
            raise InvalidRequest(
                "tools with tool_choice 'auto' combine only with a JSON response_format",
                param=response.param,
            )
        schema = json.loads(response.text) if response.kind == "json_schema" else {"type": "object"}
        if isinstance(schema, dict):
            schema = {**schema, "x-guidance": _COMPACT}
        grammar = "start: answer | calls\nanswer: %json " + json.dumps(schema) + "\n"
        grammar += calls_grammar(self.syntax, self.tools, parallel=self.parallel)
        return Constraint("grammar", grammar, response.param)


def tool_plan(
    tools: list[Any] | None, choice: Any, parallel: bool | None, syntax: ToolSyntax
) -> ToolPlan:
    """The plan of a request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``.

    :raises InvalidRequest: naming the malformed field.
    """
    parsed = parse_tools(tools)
    kind, function = _choice(choice, parsed)
    return ToolPlan(parsed, kind, function, parallel is not False, syntax)
