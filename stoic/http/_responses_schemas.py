"""The ``POST /v1/responses`` request body, and its translation to a chat completion request.

A Responses request is served by the chat completions path: its ``input`` items (messages with
text parts, ``function_call``, ``function_call_output``), after the stored conversation of
``previous_response_id`` and under ``instructions``, become chat messages; its function
``tools``, ``tool_choice``, ``text.format`` and ``max_output_tokens`` become the chat fields
(:meth:`ResponsesRequest.chat_request`), so tools, structured outputs and sampling are checked
and applied by the same code as ``/v1/chat/completions``.

Like the chat schemas: strict types, ``null`` means "not set", a field that is in no OpenAI spec
is a 400 ("unknown parameter"); OpenAI's fields that do not change stoic's output (``user``,
``reasoning``, ``include``, ``truncation``...) are accepted and ignored; ``background``,
``conversation``, ``prompt`` and non-text inputs are a 400 naming the field.
"""

from __future__ import annotations

import secrets
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..errors import InvalidRequest
from ._schemas import MAX_MESSAGES, MAX_TOOLS

__all__ = ["ResponsesRequest", "chat_messages", "input_items", "new_id"]

_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = ("user", "system", "developer", "assistant")
#: chat fields named differently here (for error messages)
_PARAM_NAMES = {
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "messages": "input",
}


def new_id(prefix: str) -> str:
    """A fresh object id (``resp_...``, ``msg_...``, ``fc_...``)."""
    return f"{prefix}_{secrets.token_hex(16)}"


def _text_of(content: Any, param: str) -> str:
    """The text of a message's ``content`` (a string, or text parts joined by newlines)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest("content must be a string or a list of content parts", param=param)
    texts: list[str] = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
            continue
        if kind not in _TEXT_PARTS:
            raise InvalidRequest(
                f"content part type {kind!r} is not supported (only text: input_text, output_text)",
                param=f"{param}.{i}",
            )
        if not isinstance(part.get("text"), str):
            raise InvalidRequest("a text part needs a string 'text'", param=f"{param}.{i}")
        texts.append(part["text"])
    return "\n".join(texts)


def _string(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidRequest(f"{item.get('type')} needs a string '{key}'", param=f"{param}.{key}")
    return value


def input_items(value: Any) -> list[dict[str, Any]]:
    """``input`` as a list of items, each checked and given an ``id`` and a ``type``.

    :raises InvalidRequest: naming the item (``input.N``) that is malformed or not supported.
    """
    if value is None:
        return []
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise InvalidRequest("input must be a string or a list of items", param="input")
    if len(value) > MAX_MESSAGES:
        raise InvalidRequest(f"input has more than {MAX_MESSAGES} items", param="input")
    items: list[dict[str, Any]] = []
    for i, raw in enumerate(value):
        param = f"input.{i}"
        if not isinstance(raw, dict):
            raise InvalidRequest("an input item must be an object", param=param)
        item = dict(raw)
        kind = item.setdefault("type", "message")
        if kind == "message":
            if item.get("role") not in _ROLES:
                raise InvalidRequest(f"a message's role must be one of {_ROLES}", param=param)
            text = _text_of(item.get("content"), f"{param}.content")
            part = "output_text" if item["role"] == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": text}]
            item.setdefault("id", new_id("msg"))
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                _string(item, key, param)
            item.setdefault("id", new_id("fc"))
        elif kind == "function_call_output":
            _string(item, "call_id", param)
            output = item.get("output")
            item["output"] = _text_of(output, f"{param}.output")
            item.setdefault("id", new_id("fco"))
        elif kind == "reasoning":
            continue  # a reasoning model's notes: nothing stoic's models can read
        else:
            raise InvalidRequest(
                f"input item type {kind!r} is not supported (message, function_call, "
                "function_call_output)",
                param=param,
            )
        items.append(item)
    return items


def chat_messages(items: list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """The chat messages of a conversation's items (checked by :func:`input_items`, or output
    items): consecutive calls join one assistant message, each output is a ``tool`` message."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    for item in items:
        kind = item["type"]
        if kind == "message":
            text = "\n".join(p.get("text", p.get("refusal", "")) for p in item["content"])
            messages.append({"role": item["role"], "content": text})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
            )
    return messages


def _chat_tools(tools: list[Any] | None) -> list[Any] | None:
    if tools is None:
        return None
    out: list[Any] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise InvalidRequest(
                f"tool type {kind!r} is not supported (only 'function')", param=f"tools.{i}"
            )
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise InvalidRequest(
                "tool_choice must be 'none', 'auto', 'required' or "
                "{'type': 'function', 'name': ...}",
                param="tool_choice",
            )
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise InvalidRequest("text.format must be an object", param="text.format")
    if fmt.get("type") != "json_schema":
        return fmt
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


def chat_param(error: InvalidRequest) -> InvalidRequest:
    """``error`` (raised by the chat path) naming this API's field instead of the chat one."""
    param = error.param
    if param is None:
        return error
    head, dot, rest = param.partition(".")
    name = _PARAM_NAMES.get(head, head)
    if head == "messages":
        rest = ""
    return InvalidRequest(error.message, param=name + (dot + rest if rest else ""), code=error.code)


class ResponsesRequest(BaseModel):
    """``POST /v1/responses`` (OpenAI's Responses API, the fields stoic serves)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    model: str | None = None
    input: Any = None
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[Any] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    stream: bool | None = None
    # accepted and ignored: they do not change stoic's output
    stream_options: Any = None
    user: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    service_tier: Any = None
    truncation: Any = None
    reasoning: Any = None
    include: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None
    # not supported (a 400 when set)
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None

    def check_supported(self) -> None:
        """:raises InvalidRequest: naming a field stoic does not serve, or missing input."""
        if self.background:
            raise InvalidRequest("background responses are not supported", param="background")
        for name in ("conversation", "prompt"):
            if getattr(self, name) is not None:
                raise InvalidRequest(f"{name} is not supported", param=name)
        if self.input in (None, []) and self.previous_response_id is None:
            raise InvalidRequest("input is required", param="input")

    @property
    def stored(self) -> bool:
        return self.store is not False

    def chat_request(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """The chat completion request body that serves this request over ``messages``.

        :raises InvalidRequest: a tool or tool_choice this API shapes differently.
        """
        body: dict[str, Any] = {
            "model": self.model or "default",
            "messages": messages,
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "tools": _chat_tools(self.tools),
            "tool_choice": _chat_tool_choice(self.tool_choice),
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": _response_format(self.text),
        }
        return {k: v for k, v in body.items() if v is not None}

    def echo(self) -> dict[str, Any]:
        """The request's settings as the response object repeats them."""
        fmt = (self.text or {}).get("format") or {"type": "text"}
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata or {},
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "previous_response_id": self.previous_response_id,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "tool_choice": self.tool_choice or ("auto" if self.tools else "none"),
            "tools": list(self.tools or []),
            "text": {"format": fmt},
            "truncation": "disabled",
            "store": self.stored,
            "user": self.user if isinstance(self.user, str) else None,
            "background": False,
            "reasoning": {"effort": None, "summary": None},
            "service_tier": "default",
        }
