"""Pydantic models of the request bodies of stoic's endpoints that do not generate:
``POST /tokenize``, ``POST /detokenize`` (vLLM's shapes) and ``POST /admin/faults``.

Split from :mod:`stoic.http._schemas` (the generation bodies), whose base model and
:class:`~stoic.http._schemas.ChatMessage` they share: unknown top-level fields are a 400 here too.
"""

from __future__ import annotations

import dataclasses
from typing import Any, get_type_hints

from pydantic import ConfigDict, Field, create_model

from ..config import FaultSpec
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


class _FaultBody(_Model):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def _fault_request() -> type[_FaultBody]:
    """The body of ``POST /admin/faults``: a model of :class:`~stoic.FaultSpec`'s fields (their
    types and defaults read from it, so the two never differ); ``FaultSpec(**body.model_dump())``
    checks what the types do not."""
    hints = get_type_hints(FaultSpec)
    fields: dict[str, Any] = {
        f.name: (hints[f.name], _default(f)) for f in dataclasses.fields(FaultSpec)
    }
    return create_model(
        "FaultRequest",
        __base__=_FaultBody,
        __doc__="Body of ``POST /admin/faults``: the fields of :class:`~stoic.FaultSpec`.",
        __module__=__name__,
        **fields,
    )


def _default(field: dataclasses.Field[Any]) -> Any:
    """A dataclass field's default as pydantic takes it (``...``: required)."""
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return Field(default_factory=field.default_factory)
    return ...


FaultRequest = _fault_request()
