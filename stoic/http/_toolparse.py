"""Tool calling, the response side: the model's text split into content and tool calls, whole
or as it streams.

:func:`scan` reads the calls out of a text in any of the syntaxes of
:mod:`stoic.http._tools`: after the syntax's marker (``<tool_call>``, ``[TOOL_CALLS]``, or a
``{`` opening a llama3 answer) every top-level JSON object is a call; the framing between them
(tags, brackets, separators, whitespace) is skipped. A call is returned only if its object
parses, names one of the request's tools and carries an arguments object: anything else stays
text (``content``), so nothing the model wrote is lost. Without ``parallel_tool_calls`` only the
first call is returned.

Streaming (:class:`ToolCallStream`) re-scans the text so far at each delta and sends what is
new: content up to where a marker could begin (a marker's prefix is held back), then for each
call its id and name once and its arguments in pieces. When a grammar enforces the calls
(``required`` or a named function) a call's name is sent as soon as it is complete and its
arguments as they arrive; in ``auto`` a call is sent once its object is complete and valid.
The streamed content and calls, joined, equal the non-streamed ones.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any

from ._tools import ToolPlan

__all__ = ["ScannedCall", "ToolCallStream", "call_id", "scan", "tool_calls_of"]

_MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}
#: the framing between calls: tags, brackets, separators and whitespace
_FRAMING = re.compile(r"(?:</?tool_call>|\[TOOL_CALLS\]|[\[\],;\s])*")
_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_ALNUM = string.ascii_letters + string.digits


@dataclass(frozen=True, slots=True)
class ScannedCall:
    name: str
    #: JSON text of the arguments object (a prefix of it while ``complete`` is False)
    arguments: str
    complete: bool


@dataclass(frozen=True, slots=True)
class Scan:
    #: the text that is not calls (excluding what is held back, unless the scan was final)
    content: str
    calls: tuple[ScannedCall, ...]
    #: call objects that are not valid calls (kept as text)
    rejected: int = 0


#: what matters to a JSON value's extent: a string (its end group empty when the text ends
#: inside it) or a bracket; everything between is skipped by the regex engine, not in Python
_STRUCTURE = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(?P<closed>"?)|[{}\[\]]')


def _value_end(text: str, start: int) -> int | None:
    """Index just past the JSON object or array starting at ``text[start]``, or None if the
    text ends inside it."""
    depth = 0
    for match in _STRUCTURE.finditer(text, start):
        token = match.group()
        if token[0] == '"':
            if not match.group("closed"):
                return None
            continue
        depth += 1 if token in "{[" else -1
        if depth == 0:
            return match.end()
    return None


def _head(obj: str) -> tuple[str, int] | None:
    """The name and where the arguments value starts, if the object begins with both."""
    match = _HEAD.match(obj)
    if match is None:
        return None
    try:
        name = json.loads(match.group(1))
    except ValueError:
        return None
    return name, match.end()


def _complete_call(obj: str, names: frozenset[str]) -> ScannedCall | None:
    """A whole call object as a call, or None if it is not a valid one."""
    try:
        body = json.loads(obj)
    except ValueError:
        return None
    if not isinstance(body, dict) or body.get("name") not in names:
        return None
    key = "parameters" if "parameters" in body and "arguments" not in body else "arguments"
    arguments = body.get(key)
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
        if isinstance(arguments, dict):
            return ScannedCall(body["name"], json.dumps(arguments, ensure_ascii=False), True)
    if not isinstance(arguments, dict):
        return None
    head = _head(obj)
    if head is not None and obj[head[1]] == "{":  # the model's own text of the arguments
        end = _value_end(obj, head[1])
        assert end is not None
        return ScannedCall(body["name"], obj[head[1] : end], True)
    return ScannedCall(body["name"], json.dumps(arguments, ensure_ascii=False), True)


def _partial_call(obj: str, names: frozenset[str]) -> ScannedCall | None:
    head = _head(obj)
    if head is None or head[0] not in names or not obj[head[1] :].startswith("{"):
        return None
    end = _value_end(obj, head[1])
    return ScannedCall(head[0], obj[head[1] : end], False)


def _marker_at(text: str, plan: ToolPlan) -> tuple[int, int] | None:
    """Where the calls' marker starts and ends in ``text``, if it is there."""
    kind = plan.syntax.kind
    if kind == "llama3":  # a llama3 call is a JSON object that is the whole answer
        stripped = text.lstrip()
        if stripped.startswith("{"):
            at = len(text) - len(stripped)
            return at, at
        return None
    at = text.find(_MARKERS[kind])
    return None if at < 0 else (at, at + len(_MARKERS[kind]))


def _held(text: str, plan: ToolPlan) -> int:
    """How many trailing characters of marker-free ``text`` may still begin a marker."""
    if plan.syntax.kind == "llama3":
        return len(text) if not text.strip() else 0
    marker = _MARKERS[plan.syntax.kind]
    keep = 0
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            keep = k
            break
    body = text[: len(text) - keep]
    return len(text) - len(body.rstrip())


def scan(text: str, plan: ToolPlan, *, final: bool, trusted: bool = False) -> Scan:
    """Split ``text`` into content and calls (see the module). ``trusted``: a grammar enforced
    the calls, so a call still being written is reported (its arguments so far)."""
    marker = _marker_at(text, plan)
    if marker is None:
        return Scan(text if final else text[: len(text) - _held(text, plan)], ())
    names = frozenset(t.name for t in plan.tools)
    pre = text[: marker[0]].rstrip()
    calls: list[ScannedCall] = []
    junk: list[str] = []
    rejected = 0
    i = marker[1]
    while i < len(text):
        framing = _FRAMING.match(text, i)
        assert framing is not None
        j = framing.end()
        if j >= len(text):
            break
        if text[j] != "{":  # text that is not a call: up to the next object
            nxt = text.find("{", j)
            nxt = len(text) if nxt < 0 else nxt
            junk.append(text[j:nxt].strip())
            i = nxt
            continue
        end = _value_end(text, j)
        if end is None:
            partial = _partial_call(text[j:], names) if trusted and not final else None
            if partial is not None:
                calls.append(partial)
            elif final and not trusted:  # (a cut-off enforced call is neither call nor text)
                junk.append(text[j:])
                rejected += 1
            break
        call = _complete_call(text[j:end], names)
        if call is None:
            junk.append(text[j:end])
            rejected += 1
        else:
            calls.append(call)
        i = end
    if not plan.parallel:
        calls = calls[:1]
    if not final:
        return Scan(pre, tuple(calls))
    if not calls and not trusted:
        return Scan(text, (), rejected)
    return Scan("\n".join(part for part in (pre, *junk) if part), tuple(calls), rejected)


def call_id(plan: ToolPlan) -> str:
    """A new tool call id (Mistral's templates want 9 letters and digits)."""
    if plan.syntax.kind == "mistral":
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return "call_" + secrets.token_hex(12)


def tool_calls_of(calls: tuple[ScannedCall, ...], plan: ToolPlan) -> list[dict[str, Any]]:
    """The calls as ``message.tool_calls``."""
    return [
        {
            "id": call_id(plan),
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        for c in calls
    ]


class ToolCallStream:
    """One streamed choice's text turned into content and tool-call deltas (OpenAI's shape)."""

    def __init__(self, plan: ToolPlan) -> None:
        self._plan = plan
        #: call objects rejected (known once the choice is final)
        self.rejected = 0
        self._text = ""
        self._content_sent = 0
        #: per call sent: its id and how much of its arguments
        self._sent: list[list[Any]] = []

    @property
    def called(self) -> int:
        """How many calls have been sent."""
        return len(self._sent)

    def feed(self, text: str, *, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """Take the next piece of text; the new content and tool-call deltas. ``final``: the
        choice ended with this piece (whatever was held back is resolved)."""
        self._text += text
        found = scan(self._text, self._plan, final=final, trusted=self._plan.enforced)
        self.rejected = found.rejected
        content = found.content[self._content_sent :]
        self._content_sent = max(self._content_sent, len(found.content))
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(found.calls):
            if index == len(self._sent):
                self._sent.append([call_id(self._plan), 0])
                deltas.append(
                    {
                        "index": index,
                        "id": self._sent[index][0],
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                )
            piece = call.arguments[self._sent[index][1] :]
            if not piece:
                continue
            self._sent[index][1] = len(call.arguments)
            if deltas and deltas[-1]["index"] == index:
                deltas[-1]["function"]["arguments"] += piece
            else:
                deltas.append({"index": index, "function": {"arguments": piece}})
        return content, deltas
