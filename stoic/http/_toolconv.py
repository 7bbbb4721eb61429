"""A conversation with tools, calls and tool results, rendered for the served model's template.

A native template (:class:`~stoic.http._tools.ToolSyntax`) gets ``tools=`` and keeps the
assistant messages' ``tool_calls`` (arguments as objects, as Hugging Face templates expect) and
the ``tool`` messages. Any other template gets plain text: the tools in the system message, the
calls as the assistant's text in the generic (hermes) syntax, consecutive tool results as one
``user`` message of ``<tool_response>`` blocks (so roles still alternate).
"""

from __future__ import annotations

import json
from typing import Any

from ._tools import ToolPlan, ToolSyntax

__all__ = ["generic_tools_prompt", "render_conversation"]

_GENERIC_PROMPT = """\
You can call functions. To call one or more, reply with only the calls, each in this form:
<tool_call>
{{"name": "<function name>", "arguments": <the arguments as a JSON object>}}
</tool_call>
Otherwise reply to the user normally. The functions, as JSON Schema:
<tools>
{tools}
</tools>"""


def generic_tools_prompt(plan: ToolPlan) -> str:
    """The system text that offers ``plan``'s tools to a model without a tool template."""
    return _GENERIC_PROMPT.format(tools="\n".join(json.dumps(t.openai()) for t in plan.tools))


def _arguments_object(arguments: Any) -> Any:
    """Arguments as an object where they are JSON text of one (templates ``tojson`` them)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _call_text(call: dict[str, Any]) -> str:
    fn = call["function"]
    body = {"name": fn["name"], "arguments": _arguments_object(fn["arguments"])}
    return "<tool_call>\n" + json.dumps(body) + "\n</tool_call>"


def _native(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if calls:
            m["tool_calls"] = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {
                        "name": c["function"]["name"],
                        "arguments": _arguments_object(c["function"]["arguments"]),
                    },
                }
                for c in calls
            ]
            names.update((c["id"], c["function"]["name"]) for c in calls)
        if m["role"] == "tool" and "name" not in m and m.get("tool_call_id") in names:
            m["name"] = names[m["tool_call_id"]]
        out.append(m)
    return out


def _generic(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    results_open = False  # the last message is a user message of tool results
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if results_open:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            results_open = True
            continue
        results_open = False
        calls = m.get("tool_calls")
        if calls:
            texts = ([content] if content else []) + [_call_text(c) for c in calls]
            content = "\n".join(texts)
        out.append({"role": role, "content": content})
    return out


def render_conversation(
    messages: list[dict[str, Any]],
    plan: ToolPlan | None,
    syntax: ToolSyntax,
    template_kwargs: dict[str, Any] | None,
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """``messages`` and the template's keyword arguments, ready for the chat template.

    ``plan`` is None when the request has no tools (its conversation may still hold calls and
    results from earlier turns).
    """
    offered = plan is not None and plan.offered
    if syntax.native:
        rendered = _native(messages)
        if offered:
            assert plan is not None
            template_kwargs = {**(template_kwargs or {}), "tools": [t.openai() for t in plan.tools]}
        return rendered, template_kwargs
    rendered = _generic(messages)
    if offered:
        assert plan is not None
        prompt = generic_tools_prompt(plan)
        if rendered and rendered[0]["role"] == "system":
            first = rendered[0]
            rendered[0] = {**first, "content": f"{first['content']}\n\n{prompt}".lstrip()}
        else:
            rendered.insert(0, {"role": "system", "content": prompt})
    return rendered, template_kwargs
