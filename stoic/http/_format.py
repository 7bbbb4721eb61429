"""OpenAI response objects for chat completions and text completions, streamed or whole."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..engine import Delta, TokenLogprob
from ..errors import PartialOutput
from ._toolparse import ToolCall, ToolCallStream, parse_output, tool_finish_reason
from ._tools import ToolPlan

__all__ = ["ChatFormat", "ChoiceState", "CompletionFormat", "ResponseFormat", "usage"]

#: what an infinite log-probability (a token the sampler could never pick) is reported as
_MIN_LOGPROB = -9999.0


def _lp(value: float) -> float:
    return value if math.isfinite(value) else _MIN_LOGPROB


@dataclass
class ChoiceState:
    """What one choice has produced so far."""

    index: int
    prompt_tokens: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    completion_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    #: character offset of the next token in the text (completions ``text_offset``)
    offset: int = 0
    #: monotonic time of the latest delta with tokens (None before the first token)
    last_token_at: float | None = None

    def add(self, delta: Delta) -> None:
        if delta.text:
            self.text.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        self.completion_tokens = delta.completion_tokens
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def partial(self) -> PartialOutput:
        return PartialOutput(text="".join(self.text), token_ids=tuple(self.token_ids))


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class ResponseFormat:
    """Builds the response objects of one request."""

    id_prefix = ""
    object_full = ""
    object_chunk = ""

    def __init__(self, request_id: str, model: str) -> None:
        self.id = self.id_prefix + request_id
        self.model = model
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def chunk(self, choices: list[dict[str, Any]], *, include_usage: bool) -> dict[str, Any]:
        body = self._envelope(self.object_chunk, choices)
        if include_usage:
            body["usage"] = None
        return body

    def usage_chunk(
        self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
    ) -> dict[str, Any]:
        body = self._envelope(self.object_chunk, [])
        body["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
        return body

    def full(
        self, choices: list[ChoiceState], prompt_tokens: int, cached_tokens: int = 0
    ) -> dict[str, Any]:
        body = self._envelope(self.object_full, [self.full_choice(c) for c in choices])
        completion = sum(c.completion_tokens for c in choices)
        body["usage"] = usage(prompt_tokens, completion, cached_tokens)
        return body

    # -- per kind ---------------------------------------------------------------------------------
    def role_chunk_choice(self, index: int) -> dict[str, Any] | None:
        """The first chunk of a choice, before any token (chat: the role), or None."""
        return None

    def chunk_choice(self, state: ChoiceState, delta: Delta) -> dict[str, Any] | None:
        """The chunk's choice for ``delta``, or None when there is nothing to send yet."""
        raise NotImplementedError

    def full_choice(self, state: ChoiceState) -> dict[str, Any]:
        raise NotImplementedError


class ChatFormat(ResponseFormat):
    id_prefix = "chatcmpl-"
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    @staticmethod
    def _logprobs(entries: tuple[TokenLogprob, ...] | list[TokenLogprob] | None) -> Any:
        if entries is None:
            return None
        return {
            "content": [
                {
                    "token": e.token,
                    "logprob": _lp(e.logprob),
                    "bytes": list(e.token.encode("utf-8")),
                    "top_logprobs": [
                        {"token": tok, "logprob": _lp(lp), "bytes": list(tok.encode("utf-8"))}
                        for _, tok, lp in e.top
                    ],
                }
                for e in entries
            ],
            "refusal": None,
        }

    def __init__(
        self,
        request_id: str,
        model: str,
        *,
        tools: ToolPlan | None = None,
        count_tool_calls: Callable[[int, int], None] | None = None,
    ) -> None:
        super().__init__(request_id, model)
        #: the offered tools: the output is parsed for calls (:mod:`stoic.http._toolparse`)
        self.tools = tools
        self._tool_streams: dict[int, ToolCallStream] = {}
        #: called once per finished choice with its calls returned and rejected
        self._count = count_tool_calls or (lambda returned, rejected: None)

    def role_chunk_choice(self, index: int) -> dict[str, Any]:
        return {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }

    def chunk_choice(self, state: ChoiceState, delta: Delta) -> dict[str, Any] | None:
        finish: str | None = delta.finish_reason
        if self.tools is None:
            body: dict[str, Any] = {"content": delta.text} if delta.text else {}
        else:
            parser = self._tool_streams.setdefault(state.index, ToolCallStream(self.tools))
            content, calls = parser.feed(delta.text, final=finish is not None)
            body = {"content": content} if content else {}
            if calls:
                body["tool_calls"] = [_call(c, delta=True) for c in calls]
            finish = tool_finish_reason(finish, len(parser.calls))
            if finish is not None:
                self._count(len(parser.calls), parser.rejected)
            if not body and finish is None and not delta.logprobs:
                return None
        return {
            "index": state.index,
            "delta": body,
            "logprobs": self._logprobs(delta.logprobs),
            "finish_reason": finish,
        }

    def full_choice(self, state: ChoiceState) -> dict[str, Any]:
        text = "".join(state.text)
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        finish: str | None = state.finish_reason
        if self.tools is not None:
            found = parse_output(text, self.tools)
            self._count(len(found.calls), found.rejected)
            message["content"] = found.content
            if found.calls:
                message["tool_calls"] = [_call(c) for c in found.calls]
            finish = tool_finish_reason(finish, len(found.calls))
        return {
            "index": state.index,
            "message": message,
            "logprobs": self._logprobs(state.logprobs),
            "finish_reason": finish,
        }


def _call(call: ToolCall, *, delta: bool = False) -> dict[str, Any]:
    """A call as ``message.tool_calls`` holds it, or (``delta``) as a streamed delta does: the
    whole call, with its ``index``, in one delta."""
    out: dict[str, Any] = {"index": call.index} if delta else {}
    out.update(id=call.id, type="function")
    out["function"] = {"name": call.name, "arguments": call.arguments}
    return out


class CompletionFormat(ResponseFormat):
    id_prefix = "cmpl-"
    object_full = "text_completion"
    object_chunk = "text_completion"

    @staticmethod
    def _logprobs(
        state: ChoiceState, entries: tuple[TokenLogprob, ...] | list[TokenLogprob] | None
    ) -> Any:
        """Legacy logprobs; advances ``state.offset`` over the tokens' text."""
        if entries is None:
            return None
        offsets = []
        for e in entries:
            offsets.append(state.offset)
            state.offset += len(e.token)
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [_lp(e.logprob) for e in entries],
            "top_logprobs": [{tok: _lp(lp) for _, tok, lp in e.top} for e in entries],
            "text_offset": offsets,
        }

    def chunk_choice(self, state: ChoiceState, delta: Delta) -> dict[str, Any]:
        return {
            "index": state.index,
            "text": delta.text,
            "logprobs": self._logprobs(state, delta.logprobs),
            "finish_reason": delta.finish_reason,
        }

    def full_choice(self, state: ChoiceState) -> dict[str, Any]:
        state.offset = 0
        return {
            "index": state.index,
            "text": "".join(state.text),
            "logprobs": self._logprobs(state, state.logprobs),
            "finish_reason": state.finish_reason,
        }
