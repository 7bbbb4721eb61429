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

from ..engine import Delta, Detokenizer, SamplingParams

__all__ = ["Continuation"]


class Continuation:
    """Decodes a continuation's deltas after ``generated`` (the tokens generated before the
    migration, of which the client has received ``emitted`` as text), with the replica's own
    :class:`~stoic.engine.Detokenizer`: the same stop-string semantics on either side of the
    migration.

    :param backend: the model's ``tokenizers.Tokenizer``.
    """

    def __init__(
        self, backend: Any, params: SamplingParams, generated: Sequence[int], emitted: str
    ) -> None:
        self._detok = Detokenizer(
            backend,
            stop=params.stop,
            min_tokens=params.min_tokens,
            skip_special_tokens=params.skip_special_tokens,
            generated=generated,
            emitted=len(emitted),
        )

    def take(self, delta: Delta) -> tuple[str, str | None]:
        """The client's text for ``delta`` (a delta of the continuation), and the stop string
        that ended the request in it (None if none did)."""
        ids = list(delta.token_ids)
        if delta.finish_reason == "stop" and isinstance(delta.stop_reason, int) and ids:
            ids = ids[:-1]  # an EOS or stop token is not part of the text
        self._detok.add(ids)
        return self._detok.take(final=delta.finish_reason is not None), self._detok.stop_matched
