"""Consuming the result streams of one request's choices together."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from types import TracebackType

from .._logging import get_logger
from ..engine import Delta
from ..errors import EngineStopped, StoicError
from ._engine import RequestStreamLike

__all__ = ["ChoiceFailed", "Fanin", "close_streams"]

_log = get_logger("stoic.http")


class ChoiceFailed(Exception):
    """A choice's stream ended with an error (``index`` None: the server is shutting down)."""

    def __init__(self, index: int | None, error: StoicError) -> None:
        super().__init__(error.message)
        self.index = index
        self.error = error


class _End:
    pass


_END = _End()
_Item = tuple[int | None, Delta | Exception | _End]


async def close_streams(streams: Sequence[RequestStreamLike]) -> None:
    """Close (abort if unfinished) every stream, even if the caller is being cancelled."""

    async def close_all() -> None:
        for stream in streams:
            try:
                await stream.aclose()
            except Exception:
                _log.exception("http.stream_close_failed", engine_request_id=stream.request_id)

    if streams:
        await asyncio.shield(close_all())


class Fanin:
    """Runs the streams of one request's choices concurrently and yields ``(index, delta)``.

    Iteration ends when every stream has finished. A stream's error is raised as
    :class:`ChoiceFailed` at once (an unexpected exception is re-raised as it is); ``stop`` being set raises it too (with an
    :class:`~stoic.errors.EngineStopped`). Leaving the ``async with`` block aborts every stream
    that has not finished, freeing its KV blocks, also when the block is left by cancellation.
    A slow reader never blocks the engine: each stream coalesces what the reader has not taken.
    """

    def __init__(self, streams: Sequence[RequestStreamLike], *, stop: asyncio.Event) -> None:
        self._streams = streams
        self._stop = stop
        self._queue: asyncio.Queue[_Item] = asyncio.Queue(maxsize=max(1, len(streams)))
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Fanin:
        self._tasks = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(self._streams)]
        self._tasks.append(asyncio.create_task(self._watch_stop()))
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for task in self._tasks:
            task.cancel()
        await close_streams(self._streams)
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _pump(self, index: int, stream: RequestStreamLike) -> None:
        item: Exception | _End
        try:
            async for delta in stream:
                await self._queue.put((index, delta))
            item = _END
        except Exception as exc:  # delivered to the reader, which decides
            item = exc
        await self._queue.put((index, item))

    async def _watch_stop(self) -> None:
        await self._stop.wait()
        await self._queue.put((None, EngineStopped("the server is shutting down")))

    async def __aiter__(self) -> AsyncIterator[tuple[int, Delta]]:
        running = len(self._streams)
        while running:
            index, item = await self._queue.get()
            if isinstance(item, _End):
                running -= 1
            elif isinstance(item, StoicError):
                raise ChoiceFailed(index, item)
            elif isinstance(item, Exception):
                raise item
            else:
                assert index is not None
                yield index, item
