"""The text of a migrated request's continuation, decoded as the first replica would have.

A replica that continues a request sees the tokens generated so far as part of its prompt, so
its own text would start afresh: a character split between two tokens, or a stop string split
across the migration, would come out wrong. The ingress decodes the continuation's tokens itself
instead, with a decoder primed with the tokens generated before, and cuts stop strings itself
(the continuation runs without them); the client gets exactly the text an uninterrupted request
would have produced.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers.decoders import DecodeStream

from ..engine import Delta, SamplingParams

__all__ = ["Continuation"]


class Continuation:
    """Decodes a continuation's deltas after ``generated`` (the tokens generated before the
    migration, of which the client has received ``emitted`` as text).

    :param backend: the model's ``tokenizers.Tokenizer``.
    """

    def __init__(
        self, backend: Any, params: SamplingParams, generated: Sequence[int], emitted: str
    ) -> None:
        self._backend = backend
        self._decoder = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self._stop = params.stop
        self._hold = max((len(s) for s in params.stop), default=1) - 1
        self._min_tokens = params.min_tokens
        self._generated = len(generated)
        self.text = ""
        for tid in generated:
            self._step(tid)
        #: the client has this much of ``text``
        self._emitted = len(emitted)
        self.stop_matched: str | None = None

    def _step(self, tid: int) -> str:
        piece: str | None = self._decoder.step(self._backend, tid)
        if piece:
            self.text += piece
        return piece or ""

    def take(self, delta: Delta) -> tuple[str, str | None]:
        """The client's text for ``delta`` (a delta of the continuation), and the stop string
        that ended the request in it (None if none did)."""
        ids = list(delta.token_ids)
        if delta.finish_reason == "stop" and isinstance(delta.stop_reason, int) and ids:
            ids = ids[:-1]  # an EOS or stop token is not part of the text
        self._generated += len(delta.token_ids)
        stops_allowed = self._generated >= self._min_tokens
        for tid in ids:
            piece = self._step(tid)
            if piece and self._stop and stops_allowed and self._match(len(piece)):
                break
        final = delta.finish_reason is not None or self.stop_matched is not None
        end = len(self.text) if final else max(self._emitted, len(self.text) - self._hold)
        new = self.text[self._emitted : end]
        self._emitted = end
        return new, self.stop_matched

    def _match(self, added: int) -> bool:
        window = max(0, len(self.text) - added - self._hold)
        best: tuple[int, str] | None = None
        for stop in self._stop:
            at = self.text.find(stop, window)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return False
        self.text = self.text[: best[0]]
        self.stop_matched = best[1]
        return True
