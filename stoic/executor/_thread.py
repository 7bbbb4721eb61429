"""The thread executor's worker: one dedicated daemon thread that runs callables in order."""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from .._logging import get_logger

__all__ = ["StepWorker"]

T = TypeVar("T")
_log = get_logger("stoic.executor")

#: how long leaving a StepWorker waits for its thread to end. In an orderly stop its callables
#: are done and it ends at once; the wait matters because a thread that ran torch and is still
#: ending while the interpreter exits aborted the process ("terminate called without an active
#: exception": a server stopped while its model loaded). One still running (a hung step) is
#: left to the daemon thread.
_JOIN_TIMEOUT = 2.0


def _nothing() -> None:
    return None


class StepWorker:
    """One dedicated daemon thread that runs callables in order.

    A daemon thread, so a step that hangs forever cannot keep the process from exiting.
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[
            tuple[Callable[[], Any], concurrent.futures.Future[Any]] | None
        ] = queue.SimpleQueue()
        self._idle: Callable[[], bool] | None = None
        self._idle_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def set_idle(self, work: Callable[[], bool] | None) -> None:
        """Short work for the thread while no callable is queued (the KV cache's pages:
        :meth:`stoic.model.PagedKVCache.commit_idle`), called until it returns False or is
        replaced; one call is the longest a queued callable waits for it. None: no more."""
        with self._idle_lock:
            self._idle = work
        if work is not None:  # wake a thread waiting for a callable
            self._queue.put((_nothing, concurrent.futures.Future()))

    def _next(self) -> tuple[Callable[[], Any], concurrent.futures.Future[Any]] | None:
        while (idle := self._idle) is not None:
            try:
                return self._queue.get_nowait()
            except queue.Empty:
                pass
            try:
                more = idle()
            except Exception as exc:  # optional work: never the end of the step thread
                _log.warning("executor.idle_work_failed", error=repr(exc))
                more = False
            if not more:
                with self._idle_lock:  # unless set_idle replaced it meanwhile
                    if self._idle is idle:
                        self._idle = None
        return self._queue.get()

    def _loop(self) -> None:
        while (item := self._next()) is not None:
            fn, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

    async def run(self, fn: Callable[[], T]) -> T:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._queue.put((fn, future))
        return await asyncio.wrap_future(future)

    def close(self) -> None:
        """Let the thread exit once the callables queued before this one have run."""
        self._queue.put(None)

    def __enter__(self) -> StepWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        self._thread.join(timeout=_JOIN_TIMEOUT)
