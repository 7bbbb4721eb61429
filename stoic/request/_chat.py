"""Applying the model's own chat template, with typed errors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import InvalidRequest

__all__ = ["apply_chat_template"]

_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


def apply_chat_template(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Render ``messages`` with the tokenizer's chat template and tokenise the result.

    :raises InvalidRequest: if the messages are malformed, the model has no chat template, or the
        template itself raises (for example "Conversation roles must alternate ..."); the
        template's own message is kept.
    """
    if not messages:
        raise InvalidRequest("messages must be a non-empty list", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequest(f"messages[{i}] must be an object", param=f"messages.{i}")
        role = m.get("role")
        if role not in _ROLES:
            raise InvalidRequest(
                f"messages[{i}].role {role!r} is not one of {sorted(_ROLES)}",
                param=f"messages.{i}.role",
            )
        content = m.get("content")
        if not isinstance(content, str | None) and not isinstance(content, list):
            raise InvalidRequest(
                f"messages[{i}].content must be a string", param=f"messages.{i}.content"
            )
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest(
            "this model has no chat template; use /v1/completions", param="messages"
        )
    try:
        rendered = tokenizer.apply_chat_template(
            list(messages),
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **(template_kwargs or {}),
        )
    except Exception as exc:  # jinja2 TemplateError, TypeError from bad content, ...
        message = str(exc) or type(exc).__name__
        raise InvalidRequest(
            f"chat template error: {message}", param="messages", code="invalid_chat"
        ) from exc
    if not isinstance(rendered, str):
        raise InvalidRequest("chat template did not render to text", param="messages")
    ids: list[int] = tokenizer.encode(rendered, add_special_tokens=False)
    return ids
