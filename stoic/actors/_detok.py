"""Incremental detokenisation and stop strings for one sequence."""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream

__all__ = ["Detokenizer"]


class Detokenizer:
    """Turns a sequence's generated token ids into text, one batch of tokens at a time, and cuts
    the text at the first stop string.

    Text that could be the beginning of a stop string is held back by :meth:`take` until it
    cannot be, so a client never sees text that a stop string later removes.

    ``backend`` is a ``tokenizers.Tokenizer`` (a transformers tokenizer's
    ``backend_tokenizer``).
    """

    __slots__ = ("_backend", "_decoder", "_emitted", "_hold", "_stop", "text")

    def __init__(
        self, backend: Any, *, stop: tuple[str, ...] = (), skip_special_tokens: bool = True
    ) -> None:
        self._backend = backend
        self._decoder = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._emitted = 0
        #: the text decoded so far (cut at a stop string once one matched)
        self.text = ""

    def token_text(self, token_id: int) -> str:
        """One token as text, the way OpenAI's logprobs show it (``" it"``, not ``"Ġit"``)."""
        text: str = self._backend.decode([token_id], skip_special_tokens=False)
        return text

    def decode(self, token_ids: list[int]) -> str:
        """Any token ids as text (independent of the stream's state)."""
        text: str = self._backend.decode(token_ids, skip_special_tokens=False)
        return text

    def add(self, token_ids: list[int], *, stops_allowed: bool = True) -> str | None:
        """Decode ``token_ids`` after the text so far.

        Returns the stop string that matched (the text is cut where it begins and the rest of
        ``token_ids`` is not decoded), or None. With ``stops_allowed`` False (``min_tokens`` not
        reached) stop strings do not match.
        """
        for tid in token_ids:
            piece = self._decoder.step(self._backend, tid)
            if not piece:
                continue
            self.text += piece
            if self._stop and stops_allowed:
                matched = self._match_stop(len(piece))
                if matched is not None:
                    return matched
        return None

    def take(self, *, final: bool) -> str:
        """The text not yet taken; unless ``final``, without a tail that may begin a stop string."""
        end = len(self.text) if final else max(self._emitted, len(self.text) - self._hold)
        new = self.text[self._emitted : end]
        self._emitted = end
        return new

    def _match_stop(self, added: int) -> str | None:
        window_start = max(0, len(self.text) - added - self._hold)
        best: tuple[int, str] | None = None
        for stop in self._stop:
            at = self.text.find(stop, window_start)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        return best[1]
