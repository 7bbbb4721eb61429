"""Prompt tokenisation and detokenisation with a model's tokenizer, without the model.

:class:`stoic.Engine` answers ``/tokenize`` and ``/detokenize`` with it; so does a front end that
holds no engine (the Ray Serve ingress, :mod:`stoic.ray`), which loads the tokenizer alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..config import EngineConfig
from ..errors import InvalidRequest
from ..model import apply_chat_template, load_model

__all__ = ["TokenCodec"]


class TokenCodec:
    """A model's tokenizer and vocabulary size: what :meth:`stoic.Engine.tokenize` and
    :meth:`~stoic.Engine.detokenize` need."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    @classmethod
    def load(cls, config: EngineConfig) -> TokenCodec:
        """The tokenizer of ``config.model`` (no weights; blocking: call it off the event loop).

        :raises ~stoic.errors.ModelUnavailable: the model or its tokenizer cannot be found.
        """
        loaded = load_model(
            config.model,
            device="cpu",
            dtype="float32",  # no dtype probe: no weights are loaded
            cache_root=config.cache_dir,
            served_name=config.served_model_name,
            weights=False,
        )
        vocab = int(getattr(loaded.config, "vocab_size", 0) or len(loaded.tokenizer))
        return cls(loaded.tokenizer, vocab)

    @property
    def chat_template(self) -> str | dict[str, str] | None:
        """The tokenizer's chat template (named templates as a dict), or None."""
        template: str | dict[str, str] | None = getattr(self.tokenizer, "chat_template", None)
        return template

    def tokenize(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[dict[str, Any]] | None = None,
        add_special_tokens: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The token ids of ``prompt``, or of ``messages`` rendered with the model's chat
        template (``add_special_tokens`` applies to a prompt; a chat template adds its own).

        :raises InvalidRequest: neither or both given, the messages malformed, no chat template
            or the template raising.
        """
        if (prompt is None) == (messages is None):
            raise InvalidRequest("give either a prompt or messages", param="prompt")
        if messages is not None:
            return apply_chat_template(
                self.tokenizer,
                messages,
                add_generation_prompt=add_generation_prompt,
                template_kwargs=chat_template_kwargs,
            )
        ids: list[int] = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        return ids

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids`` (special tokens included).

        :raises InvalidRequest: an id that is not a token of the vocabulary.
        """
        vocab = self.vocab_size
        for t in token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidRequest(
                    f"token id {t!r} is outside the vocabulary (size {vocab})", param="tokens"
                )
        text: str = self.tokenizer.decode(list(token_ids))
        return text
