"""Pydantic models of the OpenAI request bodies stoic accepts.

Types are strict (no ``"1"`` for ``1``, no ``true`` for ``1``). A top-level null is the field's
default, and the OpenAI parameters stoic cannot act on (``user``, ``metadata``, ``store``,
``reasoning_effort``...) are accepted and ignored: both in :mod:`stoic.http._openai_params`.
The sampling fields (``presence_penalty``, ``frequency_penalty``,
``logit_bias``, and vLLM's ``repetition_penalty``, ``min_p``, ``top_k``, ``min_tokens``...) map onto
:class:`~stoic.engine.SamplingParams`, whose ranges the engine checks (a 400 naming the field);
``tools`` / ``tool_choice`` / ``parallel_tool_calls`` become a
:class:`~stoic.http._tools.ToolPlan`; fields that would change the output and that stoic does
not implement (the deprecated ``functions``, audio output...) are rejected by
:meth:`_GenerationRequest.check_supported` with a 400 naming the parameter; any other top-level
field is a 400 ("unknown parameter"), so a typo such as ``max_token`` is never silently ignored.
Inside messages, unknown fields are ignored (clients echo whole assistant messages back).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ..engine import SamplingParams
from ..errors import InvalidRequest
from ._openai_params import document_request, drop_nulls_and_ignored
from ._structured import constraint_of
from ._tools import ToolPlan, ToolSyntax, tool_plan

__all__ = [
    "MAX_CHOICES",
    "MAX_MESSAGES",
    "MAX_TOOLS",
    "TOOL_CALL_SCHEMA",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "Prompt",
    "StreamOptions",
]

#: most choices one request may ask for (``n`` times the number of prompts)
MAX_CHOICES = 16
#: most messages in one chat request (a long agent conversation has hundreds)
MAX_MESSAGES = 2048
#: most tools in one request (OpenAI's own limit)
MAX_TOOLS = 128
#: completions ``logprobs`` upper bound (the sampler's top-k logprobs limit)
MAX_COMPLETION_LOGPROBS = 20

#: one prompt: text or token ids
Prompt = str | list[int]

# What the validators below accept, for the OpenAPI document (/openapi.json): the fields are
# typed ``Any`` because a validator turns each accepted shape into one type.
_TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
_CONTENT_SCHEMA = WithJsonSchema(
    {
        "anyOf": [
            {"type": "string"},
            {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["type", "text"],
                    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                },
            },
            {"type": "null"},
        ]
    }
)
_STOP_SCHEMA = WithJsonSchema(
    {
        "anyOf": [
            {"type": "string"},
            {"type": "array", "items": {"type": "string"}},
            {"type": "null"},
        ]
    }
)
_PROMPT_SCHEMA = WithJsonSchema(
    {
        "anyOf": [
            {"type": "string"},
            {"type": "array", "minItems": 1, "items": {"type": "string"}},
            _TOKEN_IDS,
            {"type": "array", "minItems": 1, "items": _TOKEN_IDS},
        ]
    }
)


def _invalid(message: str) -> PydanticCustomError:
    return PydanticCustomError("invalid_value", message)


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)


class StreamOptions(_Model):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


#: one tool call of an assistant message (``type`` may be left out in a request)
TOOL_CALL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["id", "function"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name", "arguments"],
            "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
        },
    },
}
_TOOL_CALLS_SCHEMA = WithJsonSchema(
    {"anyOf": [{"type": "array", "items": TOOL_CALL_SCHEMA}, {"type": "null"}]}
)


def _tool_calls(value: Any) -> tuple[dict[str, Any], ...] | None:
    """An assistant message's ``tool_calls`` (as the API returned them), normalised."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise _invalid("tool_calls must be a list")
    calls = []
    for call in value:
        fn = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(fn, dict)
            or not isinstance(call.get("id"), str)
            or call.get("type", "function") != "function"
            or not isinstance(fn.get("name"), str)
            or not isinstance(fn.get("arguments"), str)
        ):
            raise _invalid(
                "a tool call must be {'id': str, 'type': 'function', "
                "'function': {'name': str, 'arguments': str}}"
            )
        calls.append(
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": fn["name"], "arguments": fn["arguments"]},
            }
        )
    return tuple(calls) or None


class ChatMessage(_Model):
    """One chat message. ``content`` is a string or a list of text parts (joined); an
    assistant message may carry ``tool_calls`` (then ``content`` may be null), a ``tool``
    message answers one of them (``tool_call_id``)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[Any, _CONTENT_SCHEMA] = Field(default=None, validate_default=True)
    name: str | None = None
    tool_calls: Annotated[Any, _TOOL_CALLS_SCHEMA] = None
    tool_call_id: str | None = Field(default=None, validate_default=True)

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any, info: ValidationInfo) -> str:
        if value is None:
            if info.data.get("role") == "assistant":
                return ""
            raise _invalid("content is required for this role")
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            texts: list[str] = []
            for part in value:
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise _invalid("content parts must be objects with a 'type'")
                if part["type"] != "text":
                    raise _invalid(
                        f"content part type {part['type']!r} is not supported (only 'text')"
                    )
                text = part.get("text")
                if not isinstance(text, str):
                    raise _invalid("a text content part needs a string 'text'")
                texts.append(text)
            return "\n".join(texts)
        raise _invalid("content must be a string or a list of content parts")

    @field_validator("tool_calls", mode="before")
    @classmethod
    def _tool_calls(cls, value: Any, info: ValidationInfo) -> tuple[dict[str, Any], ...] | None:
        calls = _tool_calls(value)
        if calls and info.data.get("role") != "assistant":
            raise _invalid("only assistant messages carry tool_calls")
        return calls

    @field_validator("tool_call_id", mode="after")
    @classmethod
    def _tool_call_id(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None and info.data.get("role") == "tool":
            raise _invalid("a tool message needs the tool_call_id it answers")
        return value

    def to_engine(self) -> dict[str, Any]:
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [dict(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message

    @property
    def has_tools(self) -> bool:
        """The message is part of a tool exchange (a call or a result)."""
        return self.role == "tool" or bool(self.tool_calls)


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise _invalid("stop must be a string or a list of strings")


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"token id": bias}`` (keys are strings of integers) as ``(id, bias)`` pairs;
    ranges and the vocabulary are checked by the engine."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise _invalid("logit_bias must be an object mapping token ids to biases")
    pairs: list[tuple[int, float]] = []
    for key, bias in value.items():
        if not isinstance(key, str) or not _TOKEN_KEY.fullmatch(key):
            raise _invalid(f"logit_bias key {key!r} is not a token id")
        if isinstance(bias, bool) or not isinstance(bias, int | float):
            raise _invalid(f"logit_bias of token {key} must be a number")
        pairs.append((int(key), float(bias)))
    return tuple(pairs)


_TOKEN_KEY = re.compile(r"-?[0-9]{1,18}")
_NonNegInt = Annotated[int, Field(ge=0)]


class _GenerationRequest(_Model):
    """Fields common to chat and text completions."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=document_request)

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stop: Annotated[Any, _STOP_SCHEMA] = Field(default=None, validate_default=True)
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    #: ``{"token id": bias}``, parsed to ``(id, bias)`` pairs
    logit_bias: Any = Field(default=None, validate_default=True)
    best_of: int | None = None
    # vLLM extensions
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[_NonNegInt] | None = None
    skip_special_tokens: bool = True
    # structured outputs (see stoic.http._structured): OpenAI's, then vLLM's current and older
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted and ignored (one backend)
    guided_whitespace_pattern: str | None = None  # accepted and ignored
    # scheduling: vLLM's priority (lower first, within a tenant); stoic's deadline in seconds
    # (also the x-request-timeout header): see stoic.http._scheduling
    priority: int | None = None
    timeout: float | None = Field(default=None, gt=0)

    #: the fields whose null is not their default
    keep_null: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _openai_optional(cls, data: Any) -> Any:
        return drop_nulls_and_ignored(data, cls.model_fields, cls.keep_null)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> tuple[str, ...]:
        return _stop(value)

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias(cls, value: Any) -> tuple[tuple[int, float], ...]:
        return _logit_bias(value)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def check_supported(self) -> None:
        """Reject parameters stoic does not implement.

        :raises ~stoic.errors.InvalidRequest: naming the parameter.
        """
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequest("best_of is not supported (must equal n)", param="best_of")

    def _params(
        self,
        max_tokens: int | None,
        *,
        logprobs: bool,
        top_logprobs: int,
        tools: ToolPlan | None = None,
    ) -> SamplingParams:
        constraint = constraint_of(
            self.response_format,
            self.structured_outputs,
            {
                "guided_json": self.guided_json,
                "guided_regex": self.guided_regex,
                "guided_choice": self.guided_choice,
                "guided_grammar": self.guided_grammar,
            },
        )
        skip_special = self.skip_special_tokens
        if tools is not None:
            constraint = tools.constraint(constraint)
            # Mistral's calls begin with a special token; the parser must see it
            skip_special = skip_special and not (tools.offered and tools.syntax.kind == "mistral")
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            skip_special_tokens=skip_special,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_p=self.min_p or 0.0,
            logit_bias=self.logit_bias,
            constraint=constraint,
        )


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """The parameters of choice ``index`` of ``n``: same, except the seed (``seed + index``)."""
    if index == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=params.seed + index)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    # vLLM extension: extra variables for the chat template
    chat_template_kwargs: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.functions:
            raise InvalidRequest("functions are deprecated: use tools", param="functions")
        if self.function_call not in (None, "none"):
            raise InvalidRequest(
                "function_call is deprecated: use tool_choice", param="function_call"
            )
        if self.modalities is not None and self.modalities != ["text"]:
            raise InvalidRequest("only the 'text' modality is supported", param="modalities")
        if self.audio is not None:
            raise InvalidRequest("audio output is not supported", param="audio")

    def sampling_params(self, tools: ToolPlan | None = None) -> SamplingParams:
        """:raises InvalidRequest: naming the field that is out of place."""
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        top = self.top_logprobs or 0
        if top and not self.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
        return self._params(max_tokens, logprobs=bool(self.logprobs), top_logprobs=top, tools=tools)

    @property
    def uses_tools(self) -> bool:
        """The request offers tools, sets ``tool_choice`` (checked even without tools), or its
        conversation holds tool calls or results."""
        return (
            bool(self.tools)
            or self.tool_choice is not None
            or any(m.has_tools for m in self.messages)
        )

    def tool_plan(self, syntax: ToolSyntax) -> ToolPlan:
        """:raises InvalidRequest: a malformed tool or tool_choice."""
        return tool_plan(self.tools, self.tool_choice, self.parallel_tool_calls, syntax)

    def engine_messages(self) -> list[dict[str, Any]]:
        return [m.to_engine() for m in self.messages]


def _prompts(value: Any) -> list[Prompt]:
    def token_ids(ids: list[Any]) -> list[int]:
        if not ids:
            raise _invalid("a token id list must not be empty")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise _invalid("token ids must be non-negative integers")
        return ids

    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise _invalid(
            "prompt must be a string, a list of strings, a list of token ids "
            "or a list of token id lists (non-empty)"
        )
    if all(isinstance(p, str) for p in value):
        return list(value)
    if all(isinstance(p, list) for p in value):
        return [token_ids(p) for p in value]
    return [token_ids(value)]


class CompletionRequest(_GenerationRequest):
    prompt: Annotated[Any, _PROMPT_SCHEMA]
    #: 16 by default; null: up to the context (as vLLM)
    max_tokens: int | None = 16
    keep_null: ClassVar[frozenset[str]] = frozenset({"max_tokens"})
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> list[Prompt]:
        return _prompts(value)

    @property
    def prompts(self) -> list[Prompt]:
        prompts: list[Prompt] = self.prompt
        return prompts

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise InvalidRequest("echo is not supported", param="echo")
        if self.suffix:
            raise InvalidRequest("suffix is not supported", param="suffix")
        if len(self.prompts) * self.n > MAX_CHOICES:
            raise InvalidRequest(
                f"at most {MAX_CHOICES} choices per request (number of prompts times n)",
                param="n",
            )

    def sampling_params(self) -> SamplingParams:
        top = self.logprobs
        if top is not None and not 0 <= top <= MAX_COMPLETION_LOGPROBS:
            raise InvalidRequest(
                f"logprobs must be between 0 and {MAX_COMPLETION_LOGPROBS}", param="logprobs"
            )
        return self._params(self.max_tokens, logprobs=top is not None, top_logprobs=top or 0)
