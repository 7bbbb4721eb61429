"""Per-request result streams: the scheduler pushes without ever blocking; a slow consumer gets
its pending pieces coalesced into one delta.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import StoicError
from ..scheduler import FinishReason, TokenLogprob

__all__ = ["Delta", "FinishReason", "ResultStream", "TokenLogprob"]


@dataclass(frozen=True, slots=True)
class Delta:
    """New output of one request since the previous delta."""

    request_id: str
    #: newly generated text (stop strings already cut)
    text: str
    #: newly generated token ids
    token_ids: tuple[int, ...]
    #: per new token, when logprobs were asked for
    logprobs: tuple[TokenLogprob, ...] | None
    #: set on the last delta only
    finish_reason: FinishReason | None
    prompt_tokens: int
    #: completion tokens generated so far, this delta included
    completion_tokens: int
    #: which stop string or token id ended the sequence, when one did
    stop_reason: str | int | None = None
    #: prompt tokens whose keys/values came from the prefix cache (known once admitted)
    cached_tokens: int = 0


class ResultStream:
    """Single-producer, single-consumer stream of :class:`Delta` with coalescing.

    Producer side (:meth:`push`, :meth:`finish`, :meth:`fail`) never blocks and never drops: pieces
    pushed faster than the consumer reads are merged into one delta. The consumer side is an async
    iterator that ends after the delta carrying ``finish_reason``, or raises the error passed to
    :meth:`fail` (after which nothing more is delivered). Exactly one terminal outcome is recorded;
    later calls to ``finish``/``fail`` are ignored.
    """

    def __init__(
        self,
        request_id: str,
        prompt_tokens: int,
        *,
        on_close: Callable[[ResultStream], None] | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        #: prompt tokens served from the prefix cache, set by the scheduler on admission
        self.cached_tokens = 0
        self._text: list[str] = []
        self._ids: list[int] = []
        self._logprobs: list[TokenLogprob] | None = None
        self._completion_tokens = 0
        self._finish: FinishReason | None = None
        self._stop_reason: str | int | None = None
        self._error: StoicError | None = None
        self._delivered_terminal = False
        self._wakeup = asyncio.Event()
        self._on_close = on_close

    # -- producer -------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        """A terminal outcome was recorded (not necessarily consumed yet)."""
        return self._finish is not None or self._error is not None

    def push(
        self,
        text: str,
        token_ids: tuple[int, ...] | list[int],
        logprobs: list[TokenLogprob] | None = None,
    ) -> None:
        if self.done:
            return
        if text:
            self._text.append(text)
        self._ids.extend(token_ids)
        self._completion_tokens += len(token_ids)
        if logprobs is not None:
            if self._logprobs is None:
                self._logprobs = []
            self._logprobs.extend(logprobs)
        self._wakeup.set()

    def finish(self, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        if self.done:
            return
        self._finish = reason
        self._stop_reason = stop_reason
        self._wakeup.set()
        self._closed()

    def fail(self, error: StoicError) -> None:
        if self.done:
            return
        self._error = error
        self._wakeup.set()
        self._closed()

    def _closed(self) -> None:
        if self._on_close is not None:
            callback, self._on_close = self._on_close, None
            callback(self)

    # -- consumer -------------------------------------------------------------------------------
    def __aiter__(self) -> ResultStream:
        return self

    async def __anext__(self) -> Delta:
        while True:
            if self._delivered_terminal:
                raise StopAsyncIteration
            if self._error is not None:
                self._delivered_terminal = True
                raise self._error
            if self._text or self._ids or self._finish is not None:
                return self._take()
            self._wakeup.clear()
            await self._wakeup.wait()

    def _take(self) -> Delta:
        delta = Delta(
            request_id=self.request_id,
            text="".join(self._text),
            token_ids=tuple(self._ids),
            logprobs=tuple(self._logprobs) if self._logprobs is not None else None,
            finish_reason=self._finish,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self._completion_tokens,
            stop_reason=self._stop_reason,
            cached_tokens=self.cached_tokens,
        )
        self._text.clear()
        self._ids.clear()
        if self._logprobs is not None:
            self._logprobs = []
        if self._finish is not None:
            self._delivered_terminal = True
        return delta
