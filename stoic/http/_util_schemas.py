"""Pydantic models of the request bodies of stoic's endpoints that do not generate:
``POST /tokenize``, ``POST /detokenize`` (vLLM's shapes) and ``POST /admin/faults``.

Split from :mod:`stoic.http._schemas` (the generation bodies), whose base model and
:class:`~stoic.http._schemas.ChatMessage` they share: unknown top-level fields are a 400 here too.
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field

from ..config import FaultKind
from ._schemas import ChatMessage, _Model

__all__ = ["DetokenizeRequest", "FaultRequest", "TokenizeRequest"]


class TokenizeRequest(_Model):
    """Body of ``POST /tokenize`` (vLLM's shape): a ``prompt`` or chat ``messages``."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    #: also answer each token's text (``token_strs``)
    return_token_strs: bool = False

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
