"""Tool calling, the response side: the model's text split into content and tool calls, whole
or as it streams. Shared by every API that returns tool calls (Chat Completions here).

:func:`parse_output` reads the calls out of a whole answer, in any of the syntaxes of
:mod:`stoic.http._tools`: after the syntax's marker (``<tool_call>``, ``[TOOL_CALLS]``, or a
``{`` opening a llama3 answer) every top-level JSON object is a call; the framing between them
(tags, brackets, separators, whitespace) is skipped. A call is returned only if its object
parses, names one of the request's tools and carries an arguments object; a complete object that
is not a valid call stays text (``content``), so nothing the model wrote is lost. Without
``parallel_tool_calls`` only the first call is returned.

Truncation (``max_tokens``, a stop string): a call whose object the end of the text cuts off is
*dropped*, with the framing before it; a framing tag cut off (``</tool_c``) is framing, never
content, and so is a marker cut off at the end of an answer without calls (``Sure. <tool``).
A hermes object that never closes but is followed by ``</tool_call>`` was not cut off: it is a
malformed call, kept as text. With llama3's bare objects, a cut-off first object that does not
yet name a tool is kept as text (it may be a JSON answer).

Streaming (:class:`ToolCallStream`) re-scans the text so far at each delta and returns what is
new: content up to where a marker could begin (a marker's prefix is held back), and each call
*once, whole*, as soon as its object is complete and valid. A call's arguments are never sent
in pieces, so a call the end of the text cuts off is never sent at all: the streamed content and
calls, joined, are exactly :func:`parse_output`'s, however the text is cut into deltas.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass

from ._tools import ToolPlan

__all__ = [
    "Scan",
    "ScannedCall",
    "ToolCall",
    "ToolCallStream",
    "ToolOutput",
    "call_id",
    "parse_output",
    "scan",
    "tool_finish_reason",
]

_MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}
#: every framing tag of every syntax
_TAGS = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]")
#: the framing between calls: tags, brackets, separators and whitespace
_FRAMING = re.compile(r"(?:</?tool_call>|\[TOOL_CALLS\]|[\[\],;\s])*")
#: framing at the end of text that is not a call: whitespace and whole tags
_TAIL = re.compile(r"(?:\s|</?tool_call>|\[TOOL_CALLS\])*\Z")
_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_ALNUM = string.ascii_letters + string.digits


@dataclass(frozen=True, slots=True)
class ScannedCall:
    """A valid call read from the text (no id yet)."""

    name: str
    #: JSON text of the arguments object (the model's own text when it wrote an object)
    arguments: str


@dataclass(frozen=True, slots=True)
class Scan:
    #: the text that is not calls (excluding what is held back, unless the scan was final)
    content: str
    calls: tuple[ScannedCall, ...]
    #: complete call objects that are not valid calls (kept as text)
    rejected: int = 0
    #: a call was cut off by the end of the text, and dropped (known once the scan is final)
    cut: bool = False


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call returned to the client."""

    #: its position among the answer's calls (0, 1, ...)
    index: int
    #: a fresh id (:func:`call_id`)
    id: str
    name: str
    #: the arguments object as JSON text (always complete and valid JSON)
    arguments: str


@dataclass(frozen=True, slots=True)
class ToolOutput:
    """A whole answer split into content and calls (:func:`parse_output`)."""

    #: the text that is not calls; None when the answer was nothing else (calls only, or a call
    #: dropped because it was cut off, or a grammar-enforced answer)
    content: str | None
    calls: tuple[ToolCall, ...]
    #: complete call objects that are not valid calls (kept in ``content``)
    rejected: int
    #: a call was cut off by the end of the text (``max_tokens``) and dropped
    cut: bool


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
            return ScannedCall(body["name"], json.dumps(arguments, ensure_ascii=False))
    if not isinstance(arguments, dict):
        return None
    head = _head(obj)
    if head is not None and obj[head[1]] == "{":  # the model's own text of the arguments
        end = _value_end(obj, head[1])
        assert end is not None
        return ScannedCall(body["name"], obj[head[1] : end])
    return ScannedCall(body["name"], json.dumps(arguments, ensure_ascii=False))


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


def _prefix_at_end(text: str, words: tuple[str, ...]) -> int:
    """The length of the longest proper prefix of one of ``words`` that ``text`` ends with."""
    longest = 0
    for word in words:
        for k in range(min(len(word) - 1, len(text)), longest, -1):
            if text.endswith(word[:k]):
                longest = k
                break
    return longest


def _marker_prefix(text: str, plan: ToolPlan) -> int:
    """The length of the proper prefix of the marker that ``text`` ends with (0 if none)."""
    marker = _MARKERS.get(plan.syntax.kind)  # (llama3 has no marker to begin)
    return 0 if marker is None else _prefix_at_end(text, (marker,))


def _held(text: str, plan: ToolPlan) -> int:
    """How many trailing characters of marker-free ``text`` may still begin a marker."""
    if plan.syntax.kind == "llama3":
        return len(text) if not text.strip() else 0
    body = text[: len(text) - _marker_prefix(text, plan)]
    return len(text) - len(body.rstrip())


def _body_end(segment: str) -> int:
    """Where the framing that ends ``segment`` (whitespace, whole tags) begins."""
    tail = _TAIL.search(segment)
    assert tail is not None  # (it matches the empty string at the end)
    return tail.start()


def _opens(framing: str) -> bool:
    """Whether ``framing`` opens a call it does not close (the object would come next)."""
    return "[TOOL_CALLS]" in framing or framing.rfind("<tool_call>") > framing.rfind("</tool_call>")


def _is_cut_call(obj: str, plan: ToolPlan, names: frozenset[str], *, first: bool) -> bool:
    """Whether an object the end of the text cuts off is a call (dropped), not text."""
    if plan.syntax.kind != "llama3" or plan.enforced or not first:
        return True  # after a marker, or a grammar's, or after a call: a call
    head = _head(obj)  # a bare llama3 object: a call once it names a tool
    return head is not None and head[0] in names


def scan(text: str, plan: ToolPlan, *, final: bool) -> Scan:
    """Split ``text`` into content and calls (see the module). Not ``final``: the text may go
    on, so only what cannot change is reported (content before any marker, complete calls)."""
    marker = _marker_at(text, plan)
    if marker is None:
        if not final:
            return Scan(text[: len(text) - _held(text, plan)], ())
        cut_marker = _marker_prefix(text, plan)  # a marker cut off is not content
        return Scan(text[: len(text) - cut_marker].rstrip() if cut_marker else text, ())
    names = frozenset(t.name for t in plan.tools)
    pre = text[: marker[0]].rstrip()
    calls: list[ScannedCall] = []
    junk: list[str] = []
    rejected = 0
    cut = False
    #: where the text ends, less a cut-off call or tag and the framing before it
    tail = len(text)
    i = marker[1]
    while True:
        framing = _FRAMING.match(text, i)
        assert framing is not None
        j = framing.end()
        frame_start = marker[0] if i == marker[1] else i
        if j >= len(text):
            if _opens(text[frame_start:]):  # a call began, and the text ends before its object
                cut, tail = True, frame_start
            break
        if text[j] != "{":  # text that is not a call: up to the next object
            nxt = text.find("{", j)
            nxt = len(text) if nxt < 0 else nxt
            segment = text[j:nxt]
            if nxt == len(text):  # the end: a tag it cuts off is framing
                segment = segment[: len(segment) - _prefix_at_end(segment, _TAGS)]
                tail = j + len(segment) if segment else frame_start
            body = _body_end(segment)
            if body:
                junk.append(segment[:body].strip())
            i = j + body if nxt < len(text) else len(text)
            continue
        end = _value_end(text, j)
        if end is None:  # the object is cut off by the end of the text, or malformed
            malformed = plan.syntax.kind == "hermes" and "</tool_call>" in text[j:]
            if not malformed and _is_cut_call(text[j:], plan, names, first=not (calls or junk)):
                cut, tail = True, frame_start
            elif final:  # a malformed call, or a cut-off object that is not a call: text
                junk.append(text[j:])
                rejected += malformed
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
    if not calls and not plan.enforced:  # no call: the text (less what was cut off) is content
        return Scan(text if tail == len(text) else text[:tail].rstrip(), (), rejected, cut)
    return Scan("\n".join(part for part in (pre, *junk) if part), tuple(calls), rejected, cut)


def call_id(plan: ToolPlan) -> str:
    """A new tool call id (Mistral's templates want 9 letters and digits)."""
    if plan.syntax.kind == "mistral":
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return "call_" + secrets.token_hex(12)


def _with_ids(calls: tuple[ScannedCall, ...], plan: ToolPlan, start: int = 0) -> list[ToolCall]:
    return [ToolCall(start + k, call_id(plan), c.name, c.arguments) for k, c in enumerate(calls)]


def parse_output(text: str, plan: ToolPlan) -> ToolOutput:
    """A whole answer (``text``, as the model wrote it) split into content and calls, each
    call with a fresh id."""
    found = scan(text, plan, final=True)
    took = bool(found.calls) or found.cut or plan.enforced
    content = found.content if found.content or not took else None
    return ToolOutput(content, tuple(_with_ids(found.calls, plan)), found.rejected, found.cut)


def tool_finish_reason(finish: str | None, calls: int) -> str | None:
    """The finish reason of an answer with ``calls`` calls: ``tool_calls`` where the model
    stopped by itself after calling; ``length`` stays ``length`` (a cut call was dropped)."""
    return "tool_calls" if finish == "stop" and calls else finish


class ToolCallStream:
    """One streamed answer's text turned into new content and new whole calls."""

    def __init__(self, plan: ToolPlan) -> None:
        self._plan = plan
        #: complete call objects rejected (known once the answer is final)
        self.rejected = 0
        #: a call was cut off and dropped (known once the answer is final)
        self.cut = False
        self._text = ""
        self._content_sent = 0
        self._calls: list[ToolCall] = []

    @property
    def calls(self) -> tuple[ToolCall, ...]:
        """Every call returned so far."""
        return tuple(self._calls)

    def feed(self, text: str, *, final: bool) -> tuple[str, list[ToolCall]]:
        """Take the next piece of the model's text; the new content and the new calls (each
        call once, whole, with its id). ``final``: the answer ended with this piece (whatever
        was held back is resolved, a cut-off call dropped)."""
        self._text += text
        found = scan(self._text, self._plan, final=final)
        self.rejected, self.cut = found.rejected, found.cut
        content = found.content[self._content_sent :]
        self._content_sent = max(self._content_sent, len(found.content))
        new = _with_ids(found.calls[len(self._calls) :], self._plan, len(self._calls))
        self._calls.extend(new)
        return content, new
