"""Text in and out of a model's tokenizer: prompt tokenisation, incremental detokenising and stop
strings, in one place.

The replica's scheduler (:class:`Detokenizer` per sequence), the intake and the facade
(:class:`TokenCodec`) and the Ray ingress re-decoding a migrated request's continuation all use
these classes, so a stop string cuts a stream at the same place whichever of them sees it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers.decoders import DecodeStream

from ..errors import InvalidRequest
from ._chat import apply_chat_template
from ._request import Request

__all__ = ["Detokenizer", "StopStrings", "TokenCodec"]


class StopStrings:
    """Stop-string matching over a text that grows at its end (pure string logic).

    A stop string *matches* when it is completed by the characters just added; of several, the
    one completed first wins (ties: the longest, which cuts earliest). That is what a stream
    decoded one character at a time would see, so the cut never depends on how the text was
    split into tokens, deltas or a migration.
    """

    __slots__ = ("_longest", "strings")

    def __init__(self, strings: Sequence[str]) -> None:
        #: the stop strings (empty ones dropped: :meth:`SamplingParams.validate` refuses them)
        self.strings = tuple(s for s in strings if s)
        self._longest = max((len(s) for s in self.strings), default=0)

    def __bool__(self) -> bool:
        return bool(self.strings)

    def match(self, text: str, added: int) -> tuple[int, str] | None:
        """Where ``text`` is to be cut, and the stop string that matched, when one ends within
        its last ``added`` characters (a stop string wholly before them is not looked for: it
        was present before, when stop strings did not apply yet); None if none does."""
        new_from = len(text) - added
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self.strings:
            at = text.find(stop, max(0, new_from - len(stop) + 1))
            if at != -1 and (best is None or (at + len(stop), at) < best[:2]):
                best = (at + len(stop), at, stop)
        return None if best is None else (best[1], best[2])

    def held(self, text: str) -> int:
        """How many characters at the end of ``text`` may begin a stop string (the longest tail
        that is a proper prefix of one; 0 if none)."""
        for n in range(min(self._longest - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(len(s) > n and s.startswith(tail) for s in self.strings):
                return n
        return 0


class Detokenizer:
    """Turns one sequence's generated token ids into text, a batch of tokens at a time, and cuts
    the text at the first stop string (see :class:`StopStrings`).

    Stop strings apply from the ``min_tokens``-th generated token on (counted token by token, so
    where a batch of tokens begins does not matter). Text that may be the beginning of a stop
    string is held back by :meth:`take` until it cannot be, so a client never sees text that a
    stop string later removes.

    ``backend`` is a ``tokenizers.Tokenizer`` (a transformers tokenizer's ``backend_tokenizer``).
    ``generated``: tokens generated before this decoder took over (a migrated request's): they
    are decoded first, without matching stop strings, and count towards ``min_tokens``;
    ``emitted``: how many characters of their text the client already has (None: all of it).
    """

    __slots__ = (
        "_backend",
        "_count",
        "_decoder",
        "_emitted",
        "_min_tokens",
        "_stop",
        "stop_matched",
        "text",
    )

    def __init__(
        self,
        backend: Any,
        *,
        stop: Sequence[str] = (),
        min_tokens: int = 0,
        skip_special_tokens: bool = True,
        generated: Sequence[int] = (),
        emitted: int | None = None,
    ) -> None:
        self._backend = backend
        self._decoder = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._stop = StopStrings(stop)
        self._min_tokens = min_tokens
        #: the text decoded so far (cut at a stop string once one matched)
        self.text = ""
        #: the stop string that ended the text, once one did
        self.stop_matched: str | None = None
        for tid in generated:
            self._step(tid)
        self._count = len(generated)
        self._emitted = len(self.text) if emitted is None else emitted

    def token_text(self, token_id: int) -> str:
        """One token as text, the way OpenAI's logprobs show it (``" it"``, not ``"Ġit"``)."""
        text: str = self._backend.decode([token_id], skip_special_tokens=False)
        return text

    def decode(self, token_ids: list[int]) -> str:
        """Any token ids as text (independent of the stream's state)."""
        text: str = self._backend.decode(token_ids, skip_special_tokens=False)
        return text

    def add(self, token_ids: Sequence[int]) -> str | None:
        """Decode ``token_ids`` after the text so far.

        Returns the stop string that matched (the text is cut where it begins, the rest of
        ``token_ids`` is not decoded, and later calls decode nothing), or None.
        """
        if self.stop_matched is not None:
            return None
        for tid in token_ids:
            self._count += 1
            piece = self._step(tid)
            if piece and self._stop and self._count >= self._min_tokens:
                matched = self._stop.match(self.text, len(piece))
                if matched is not None:
                    self.text = self.text[: matched[0]]
                    self.stop_matched = matched[1]
                    return matched[1]
        return None

    def take(self, *, final: bool) -> str:
        """The text not yet taken: all of it when ``final`` or a stop string matched; otherwise
        without a tail that may begin a stop string."""
        if final or self.stop_matched is not None:
            end = len(self.text)
        else:
            end = max(self._emitted, len(self.text) - self._stop.held(self.text))
        new = self.text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return new

    def _step(self, tid: int) -> str:
        piece: str | None = self._decoder.step(self._backend, tid)
        if piece:
            self.text += piece
        return piece or ""


class TokenCodec:
    """A model's tokenizer and vocabulary size: prompt tokenisation (text, token ids or chat
    messages) and detokenisation, for the intake, the facade and a front end holding no model.
    """

    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int] = frozenset()
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        #: the model's end-of-sequence token ids (:attr:`.LoadedModel.eos_token_ids`)
        self.eos_token_ids = eos_token_ids

    @property
    def chat_template(self) -> str | dict[str, str] | None:
        """The tokenizer's chat template (named templates as a dict), or None."""
        template: str | dict[str, str] | None = getattr(self.tokenizer, "chat_template", None)
        return template

    def tokenize(self, request: Request) -> list[int]:
        """The token ids ``request`` feeds the model: its text prompt tokenised, its token ids
        checked against the vocabulary, or its ``messages`` rendered with the model's chat
        template (see :class:`Request` for the options that apply).

        :raises InvalidRequest: neither prompt nor messages or both, a token id outside the
            vocabulary, the messages malformed, no chat template or the template raising.
        """
        prompt, messages = request.prompt, request.messages
        if messages is not None:
            if prompt is not None:
                raise InvalidRequest("give either a prompt or messages, not both", param="prompt")
            return apply_chat_template(
                self.tokenizer,
                messages,
                add_generation_prompt=request.add_generation_prompt,
                template_kwargs=request.chat_template_kwargs,
            )
        if isinstance(prompt, str):
            ids: list[int] = self.tokenizer.encode(
                prompt, add_special_tokens=request.add_special_tokens
            )
            return ids
        if prompt is None:
            raise InvalidRequest("a prompt or messages is required", param="prompt")
        return self.check_ids(prompt, param="prompt")

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids`` (special tokens included).

        :raises InvalidRequest: an id that is not a token of the vocabulary.
        """
        ids = self.check_ids(token_ids, param="tokens")
        text: str = self.tokenizer.decode(ids)
        return text

    def check_ids(self, token_ids: Sequence[int], *, param: str) -> list[int]:
        """``token_ids`` as a list.

        :raises InvalidRequest: (naming ``param``) an id that is not a token of the vocabulary.
        """
        ids = list(token_ids)
        vocab = self.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidRequest(
                    f"token id {t!r} is outside the vocabulary (size {vocab})", param=param
                )
        return ids
