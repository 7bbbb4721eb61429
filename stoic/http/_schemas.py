"""Pydantic models of the OpenAI request bodies stoic accepts.

Types are strict (no ``"1"`` for ``1``, no ``true`` for ``1``). Fields that OpenAI clients
routinely send but that do not change the output (``user``, ``metadata``, ``store``...) are
accepted and ignored; the sampling fields (``presence_penalty``, ``frequency_penalty``,
``logit_bias``, and vLLM's ``repetition_penalty``, ``min_p``, ``top_k``, ``min_tokens``...) map onto
:class:`~stoic.engine.SamplingParams`, whose ranges the engine checks (a 400 naming the field);
fields that would change the output and that stoic does not implement
(tools...) are rejected by
:meth:`_GenerationRequest.check_supported` with a 400 naming the parameter; any other top-level
field is a 400 ("unknown parameter"), so a typo such as ``max_token`` is never silently ignored.
Inside messages, unknown fields are ignored (clients echo whole assistant messages back).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, WithJsonSchema, field_validator
from pydantic_core import PydanticCustomError

from ..config import FaultKind
from ..engine import SamplingParams
from ..errors import InvalidRequest
from ._structured import constraint_of

__all__ = [
    "MAX_CHOICES",
    "MAX_MESSAGES",
    "MAX_TOOLS",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "DetokenizeRequest",
    "FaultRequest",
    "Prompt",
    "StreamOptions",
    "TokenizeRequest",
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


class ChatMessage(_Model):
    """One chat message. ``content`` is a string or a list of text parts (joined)."""

    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[Any, _CONTENT_SCHEMA] = None
    name: str | None = None
    tool_calls: Any = None

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
    def _no_tool_calls(cls, value: Any) -> None:
        if value:
            raise _invalid("tool calls are not supported")
        return None

    def to_engine(self) -> dict[str, Any]:
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": self.content}


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

    model_config = ConfigDict(extra="forbid")

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
    # accepted and ignored: they do not change the output
    user: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    parallel_tool_calls: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None
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
        self, max_tokens: int | None, *, logprobs: bool, top_logprobs: int
    ) -> SamplingParams:
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
            skip_special_tokens=self.skip_special_tokens,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_p=self.min_p or 0.0,
            logit_bias=self.logit_bias,
            constraint=constraint_of(
                self.response_format,
                self.structured_outputs,
                {
                    "guided_json": self.guided_json,
                    "guided_regex": self.guided_regex,
                    "guided_choice": self.guided_choice,
                    "guided_grammar": self.guided_grammar,
                },
            ),
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
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    # vLLM extension: extra variables for the chat template
    chat_template_kwargs: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise InvalidRequest(f"{name} are not supported", param=name)
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none"):
                raise InvalidRequest(f"{name} is not supported", param=name)
        if self.modalities is not None and self.modalities != ["text"]:
            raise InvalidRequest("only the 'text' modality is supported", param="modalities")
        for name in ("audio", "prediction"):
            if getattr(self, name) is not None:
                raise InvalidRequest(f"{name} is not supported", param=name)

    def sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        top = self.top_logprobs or 0
        if top and not self.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
        return self._params(max_tokens, logprobs=bool(self.logprobs), top_logprobs=top)

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
    max_tokens: int | None = 16
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


class TokenizeRequest(_Model):
    """Body of ``POST /tokenize`` (vLLM's shape): a ``prompt`` or chat ``messages``."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def engine_messages(self) -> list[dict[str, Any]] | None:
        return None if self.messages is None else [m.to_engine() for m in self.messages]


class DetokenizeRequest(_Model):
    """Body of ``POST /detokenize`` (vLLM's shape)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


class FaultRequest(_Model):
    """Body of ``POST /admin/faults``: the fields of :class:`~stoic.FaultSpec`."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    kind: FaultKind
    after_steps: int | None = None
    probability: float | None = None
    seed: int | None = None
    match: str | None = None
    seconds: float = 30.0
