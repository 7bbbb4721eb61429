"""A step's progress counter: ticked by the model code while a step runs, read by the watchdog
that tells a slow step from a hung one (a step is hung when its counter stops moving, however
long it has run).

:class:`StepProgress` is one unsigned 64-bit counter in a buffer: private memory when the model
runs in a thread of the server (the thread executor), or a page of memory shared with the server
when it runs in a worker process (:meth:`StepProgress.shared` there, :meth:`StepProgress.attach`
in the worker). A tick is one add into that buffer: no system call, no lock. There is one writer
(the thread that runs the step) and any number of readers, and an aligned 8-byte word is never
read half-written.

The runner ticks at a step's start and end (:meth:`StepProgress.running`) and the model code once
per decoder layer (:func:`tick`, which ticks the counter of the step running on the calling
thread: the layer code needs no reference to it).
"""

from __future__ import annotations

import mmap
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["StepProgress", "tick"]

#: the step running on each thread (its :class:`StepProgress`), for :func:`tick`
_active = threading.local()
_WORD = 8


class StepProgress:
    """A counter of progress ticks, in private memory or in a page shared with another process.

    :param buffer: a writable buffer of at least 8 bytes, 8-byte aligned (an ``mmap``); None:
        private memory.
    :raises ValueError: if ``buffer`` is read-only or smaller than 8 bytes.
    """

    def __init__(self, buffer: Any = None) -> None:
        view = memoryview(buffer if buffer is not None else bytearray(_WORD))
        if view.readonly or view.nbytes < _WORD:
            raise ValueError("the progress counter needs a writable buffer of at least 8 bytes")
        self._buffer = buffer  # kept alive as long as the view
        self._cells = view.cast("B")[:_WORD].cast("Q")
        #: seconds every tick waits after it counts (:meth:`throttle`); 0: none
        self._delay = 0.0
        #: called at every tick of the running step (:meth:`running`'s ``checkpoint``)
        self._checkpoint: Callable[[], object] | None = None

    @classmethod
    def shared(cls) -> tuple[StepProgress, int]:
        """A counter in a new page of shared memory, and the page's file descriptor for a child
        process (``subprocess.Popen(pass_fds=...)``), which maps it with :meth:`attach`. The
        page is an anonymous ``memfd`` where the platform has one, else an unlinked temporary
        file. The caller closes the descriptor once the child has it; the mapping keeps the
        page.

        :raises OSError: if the page cannot be created or mapped.
        """
        if hasattr(os, "memfd_create"):
            fd = os.memfd_create("stoic-step-progress", os.MFD_CLOEXEC)
        else:  # pragma: no cover - not Linux
            fd, path = tempfile.mkstemp(prefix="stoic-step-progress-")
            os.unlink(path)
        try:
            os.ftruncate(fd, mmap.PAGESIZE)
            return cls.attach(fd), fd
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, fd: int) -> StepProgress:
        """The counter in the shared page ``fd`` (from :meth:`shared`). The mapping holds its own
        reference to the page: ``fd`` may be closed afterwards.

        :raises OSError: if ``fd`` cannot be mapped.
        """
        return cls(mmap.mmap(fd, mmap.PAGESIZE))

    @property
    def count(self) -> int:
        """The ticks so far (only ever grows)."""
        return int(self._cells[0])

    def tick(self) -> None:
        """Count one unit of progress (then wait, if the step is throttled), then call the running
        step's checkpoint, if any."""
        self._cells[0] += 1
        if self._delay:
            time.sleep(self._delay)
        if self._checkpoint is not None:
            self._checkpoint()

    def throttle(self, seconds: float) -> None:
        """Make every tick wait ``seconds`` after it counts, until the next step (or the one
        running) ends: a step slowed many times over that keeps progressing, as on a busy
        machine (the ``slow`` fault)."""
        self._delay = max(0.0, seconds)

    @contextmanager
    def running(self, checkpoint: Callable[[], object] | None = None) -> Iterator[None]:
        """Run one step: a tick at its start and at its end; :func:`tick` on this thread counts
        here meanwhile. The throttle (if any) ends with it, whether it returns or raises.
        ``checkpoint``: called on the step's thread after every tick but the first (between
        decoder layers: the thread governor, :class:`stoic.worker._threads.ThreadGovernor`, which can then
        shrink a pool in the middle of a step slowed many times over)."""
        previous = getattr(_active, "progress", None)
        _active.progress = self
        try:
            self.tick()
            self._checkpoint = checkpoint
            yield
            self.tick()
        finally:
            self._delay = 0.0
            self._checkpoint = None
            _active.progress = previous


def tick() -> None:
    """One unit of progress (a decoder layer) of the step running on this thread; nothing when
    no step runs here (a model called outside :meth:`StepProgress.running`)."""
    progress: StepProgress | None = getattr(_active, "progress", None)
    if progress is not None:
        progress.tick()
