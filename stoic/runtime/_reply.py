"""The one-shot reply channel that travels inside an ``ask`` message."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["Reply"]

R = TypeVar("R")


class Reply(Generic[R]):
    """A one-shot channel back to the task waiting in :meth:`ActorRef.ask`.

    ``ask`` creates it and hands it to the message factory; the callee (or
    whoever it hands the reply on to) answers exactly once with :meth:`send`
    or :meth:`fail`.  Answering after the asker gave up (timeout or
    cancellation), or after the runtime failed the reply because the callee
    died, is a harmless no-op.
    """

    __slots__ = ("_aborted", "_answered", "_future", "_on_done", "_target")

    def __init__(self, future: asyncio.Future[R], target: str) -> None:
        self._future = future
        self._target = target
        self._answered = False
        self._aborted = False
        self._on_done: Callable[[Reply[Any]], None] | None = None

    @property
    def done(self) -> bool:
        """True once answered, given up on by the asker, or failed by the runtime."""
        return self._answered or self._aborted or self._future.done()

    def send(self, value: R) -> None:
        """Answer the ``ask`` with ``value``.

        :raises RuntimeError: if this reply was already answered.
        """
        if self._claim() and not self._future.done():
            self._future.set_result(value)

    def fail(self, error: BaseException) -> None:
        """Make the waiting ``ask`` raise ``error``.

        :raises RuntimeError: if this reply was already answered.
        """
        if self._claim() and not self._future.done():
            self._future.set_exception(error)

    def _claim(self) -> bool:
        if self._answered:
            raise RuntimeError(f"the reply to an ask of {self._target!r} was already sent")
        self._answered = True
        self._finished()
        return not self._aborted

    def _abort(self, error: BaseException) -> None:
        """Runtime side: fail the asker unless already answered; later answers are no-ops."""
        if self._answered or self._aborted:
            return
        self._aborted = True
        if not self._future.done():
            self._future.set_exception(error)
        self._finished()

    def _abandon(self) -> None:
        """Asker side: stop waiting; later answers are no-ops."""
        if not self._future.done():
            self._future.cancel()
        self._finished()

    def _finished(self) -> None:
        on_done, self._on_done = self._on_done, None
        if on_done is not None:
            on_done(self)

    def __repr__(self) -> str:
        state = "done" if self.done else "pending"
        return f"<Reply to {self._target!r} {state}>"
