"""A Responses API response built from the chat completion path's output, and the typed events
that stream it.

:class:`ResponseBuilder` takes the chat chunks of the one choice
(:meth:`~stoic.http._format.ChatFormat.chunk_choice`: content and tool-call deltas, parsed by
:mod:`stoic.http._toolparse`) and turns them into output items, a ``message`` (its
``output_text``) and ``function_call`` items, with OpenAI's event sequence::

    response.created, response.in_progress
    response.output_item.added (message), response.content_part.added,
        response.output_text.delta..., response.output_text.done, response.content_part.done,
        response.output_item.done
    response.output_item.added (function_call), response.function_call_arguments.delta,
        response.function_call_arguments.done, response.output_item.done        (per call)
    response.completed | response.incomplete                        (or one ``error`` event)

A non-streamed response is built by the same builder (its events dropped), so the two agree.

Each call arrives whole, in one chunk (:class:`~stoic.http._toolparse.ToolCallStream` never
sends a call's arguments in pieces, nor a call the end of the output cut off); its events are
sent when the next call begins or the output ends. A response whose output hit the token limit
(``max_output_tokens``) is ``incomplete``, with ``incomplete_details.reason:
"max_output_tokens"``.
"""

from __future__ import annotations

import copy
from typing import Any

from ..errors import PartialOutput, StoicError
from ._errors import error_object
from ._responses_schemas import new_id

__all__ = ["ResponseBuilder", "response_usage"]


def response_usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


#: the finish reasons that leave a response ``incomplete``
_INCOMPLETE = frozenset({"length", "timeout"})


class ResponseBuilder:
    """One response's output items and the events that stream them (see the module).

    ``base``: the response object's fixed fields (``id``, ``object``, ``created_at``, ``model``
    and the request's settings).
    """

    def __init__(self, base: dict[str, Any]) -> None:
        self.base = base
        self.output: list[dict[str, Any]] = []
        self.finish_reason: str | None = None
        self._sequence = 0
        self._message: dict[str, Any] | None = None
        self._text: list[str] = []
        #: the last call received, not sent yet: ``{"call_id", "name", "arguments"}``
        self._call: dict[str, Any] | None = None

    # -- the response object ---------------------------------------------------------------------
    def snapshot(
        self, status: str, usage: dict[str, Any] | None = None, error: Any = None
    ) -> dict[str, Any]:
        """The response object now, with ``status``."""
        incomplete = None
        if status == "incomplete":
            # "timeout": the request's own deadline passed (stoic's reason; OpenAI has none)
            reason = "timeout" if self.finish_reason == "timeout" else "max_output_tokens"
            incomplete = {"reason": reason}
        return {
            **self.base,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "output": copy.deepcopy(self.output),
            "usage": usage,
        }

    @property
    def status(self) -> str:
        """``completed``, or ``incomplete`` when the output hit the token limit or the
        request's deadline."""
        return "incomplete" if self.finish_reason in _INCOMPLETE else "completed"

    @property
    def output_text(self) -> str:
        """The text of the output's messages."""
        return "".join(
            part["text"]
            for item in self.output
            if item["type"] == "message"
            for part in item["content"]
        ) + ("".join(self._text) if self._message is not None else "")

    # -- events ---------------------------------------------------------------------------------
    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        """The next event of the stream (numbered)."""
        body = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return body

    def start(self) -> list[dict[str, Any]]:
        """The stream's first events."""
        created = self.snapshot("in_progress")
        return [
            self.event("response.created", response=created),
            self.event("response.in_progress", response=created),
        ]

    def end(self, response: dict[str, Any]) -> dict[str, Any]:
        """The stream's last event, carrying the final ``response`` (``snapshot(status)``)."""
        return self.event(f"response.{response['status']}", response=response)

    def error(self, error: StoicError, partial: PartialOutput) -> dict[str, Any]:
        """The ``error`` event ending a stream: the error, the partial output (as in chat
        completions) and the response so far (``failed``)."""
        body = error_object(error, partial=partial)["error"]
        failed = self.snapshot("failed", error={"code": error.code, "message": error.message})
        return self.event(
            "error",
            code=body["code"],
            message=body["message"],
            param=body["param"],
            partial=body["partial"],
            response=failed,
        )

    # -- chat chunks in -------------------------------------------------------------------------
    def feed(self, choice: dict[str, Any]) -> list[dict[str, Any]]:
        """Take one chat chunk choice (``{"delta", "finish_reason", ...}``); its events."""
        events: list[dict[str, Any]] = []
        delta = choice["delta"]
        if delta.get("content"):
            events += self._add_text(delta["content"])
        for call in delta.get("tool_calls") or ():
            events += self._add_call(call)
        finish = choice.get("finish_reason")
        if finish is not None:
            self.finish_reason = finish
            events += self._flush_call()
            events += self._close_message()
        return events

    def _add_text(self, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._message is None:
            self._message = {
                "id": new_id("msg"),
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            self._text = []
            self.output.append(self._message)
            index = len(self.output) - 1
            events.append(
                self.event(
                    "response.output_item.added",
                    output_index=index,
                    item=copy.deepcopy(self._message),
                )
            )
            events.append(
                self.event(
                    "response.content_part.added",
                    item_id=self._message["id"],
                    output_index=index,
                    content_index=0,
                    part=_text_part(""),
                )
            )
        self._text.append(text)
        events.append(
            self.event(
                "response.output_text.delta",
                item_id=self._message["id"],
                output_index=len(self.output) - 1,
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
        return events

    def _close_message(self) -> list[dict[str, Any]]:
        message = self._message
        if message is None:
            return []
        self._message = None
        index = self.output.index(message)
        part = _text_part("".join(self._text))
        message["content"] = [part]
        message["status"] = "incomplete" if self.finish_reason in _INCOMPLETE else "completed"
        ids = {"item_id": message["id"], "output_index": index, "content_index": 0}
        return [
            self.event("response.output_text.done", **ids, text=part["text"], logprobs=[]),
            self.event("response.content_part.done", **ids, part=copy.deepcopy(part)),
            self.event(
                "response.output_item.done", output_index=index, item=copy.deepcopy(message)
            ),
        ]

    def _add_call(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """Take a whole call (a chat ``tool_calls`` delta); send the one before it."""
        events = self._flush_call()
        fn = delta["function"]
        self._call = {"call_id": delta["id"], "name": fn["name"], "arguments": fn["arguments"]}
        return events

    def _flush_call(self) -> list[dict[str, Any]]:
        call, self._call = self._call, None
        if call is None:
            return []
        events = self._close_message()
        item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress", **call}
        index = len(self.output)
        added = {**item, "arguments": ""}
        ids = {"item_id": item["id"], "output_index": index}
        item["status"] = "completed"
        self.output.append(item)
        events += [
            self.event("response.output_item.added", output_index=index, item=added),
            self.event("response.function_call_arguments.delta", **ids, delta=call["arguments"]),
            self.event(
                "response.function_call_arguments.done",
                **ids,
                name=call["name"],
                arguments=call["arguments"],
            ),
            self.event("response.output_item.done", output_index=index, item=copy.deepcopy(item)),
        ]
        return events


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
