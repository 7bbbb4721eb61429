"""What a caller holds for one admitted request: a stream of deltas, or the whole result."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ..actors import Delta, ResultStream, TokenLogprob

__all__ = ["CompletionResult", "RequestStream"]


@dataclass(frozen=True)
class CompletionResult:
    """A whole (non-streamed) generation."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    logprobs: tuple[TokenLogprob, ...] | None


class RequestStream:
    """An admitted request's output: an async iterator of :class:`Delta`.

    Iteration raises :class:`~stoic.errors.ExecutorFailed`, :class:`~stoic.errors.EngineFailed`
    or :class:`~stoic.errors.EngineStopped` (each carrying ``partial``) when generation ends
    early. Leaving ``async with`` or calling :meth:`aclose` before the end aborts the request and
    frees its KV blocks at once.
    """

    def __init__(self, stream: ResultStream, abort: Callable[[str], Awaitable[None]]) -> None:
        self._stream = stream
        self._abort = abort
        self.request_id = stream.request_id
        self.prompt_tokens = stream.prompt_tokens

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache (0 until the request is scheduled)."""
        return self._stream.cached_tokens

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Delta:
        return await self._stream.__anext__()

    @property
    def done(self) -> bool:
        return self._stream.done

    async def aclose(self) -> None:
        """Abort the request if it has not ended (idempotent)."""
        if not self._stream.done:
            await self._abort(self.request_id)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def collect(self) -> CompletionResult:
        """Read the stream to its end (aborting it if the caller is cancelled).

        :raises StoicError: what the stream raises if generation fails (carrying ``partial``).
        """
        text: list[str] = []
        ids: list[int] = []
        logprobs: list[TokenLogprob] | None = None
        finish = "stop"
        completion = 0
        async with self:
            async for delta in self:
                text.append(delta.text)
                ids.extend(delta.token_ids)
                completion = delta.completion_tokens
                if delta.logprobs is not None:
                    logprobs = logprobs if logprobs is not None else []
                    logprobs.extend(delta.logprobs)
                if delta.finish_reason is not None:
                    finish = delta.finish_reason
        return CompletionResult(
            self.request_id,
            "".join(text),
            tuple(ids),
            finish,
            self.prompt_tokens,
            completion,
            tuple(logprobs) if logprobs is not None else None,
        )
