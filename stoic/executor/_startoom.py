"""A worker's start that meets an out-of-memory error waits for the memory, within a limit.

A replacement worker on a GPU starts while its predecessor's memory may not be free yet: after
``kill -9`` (or the watchdog's kill of a hang) the driver releases a dead process's device
memory some time after the process is gone, and a spare started while the old worker served
meets the same. Loading the weights or allocating the KV pools then raises an out-of-memory
error that a moment later would not happen. :func:`ride_out_oom` runs a start again after a
short wait until it passes or ``within`` seconds have gone by, freeing what the failed try
held in between; any other error, and an OOM past the limit, is raised as it is.

The first worker gets no such wait (``within`` 0): it sizes the cache from the memory free
when it starts, so an OOM there is the configuration's (weights that do not fit), and waiting
would only delay the error.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import TypeVar

from ._failures import classify_failure

__all__ = ["ride_out_oom"]

T = TypeVar("T")

#: the first wait after an OOM at start, doubled each time up to :data:`_MAX_PAUSE`
_FIRST_PAUSE = 0.25
_MAX_PAUSE = 2.0


def ride_out_oom(
    start: Callable[[], T],
    *,
    within: float,
    release: Callable[[], None],
    report: Callable[[str], None],
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """``start()``, tried again while it fails with an out-of-memory error (what
    :func:`~stoic.executor.classify_failure` calls ``"oom"``) and ``within`` seconds since the
    first try have not passed. Between tries the failed try's objects are collected and
    ``release()`` gives the allocator's cached memory back (``torch.cuda.empty_cache``);
    ``report`` gets one line per retry (the worker's stderr, relayed by the server).

    :raises BaseException: what ``start`` raised: any error but an OOM at once, an OOM once
        the time is up.
    """
    began = clock()
    pause = _FIRST_PAUSE
    tries = 1
    while True:
        try:
            return start()
        except Exception as exc:
            waited = clock() - began
            if classify_failure(exc) != "oom" or waited + pause > within:
                raise
            report(
                f"out of memory while starting (try {tries}: {str(exc).splitlines()[0][:160]}); "
                f"the memory of a worker that just ended may not be free yet: trying again in "
                f"{pause:.2f} s ({waited:.1f} of {within:.0f} s waited)"
            )
        # outside the except block: the failed try's frames (and the tensors they held) are
        # no longer referenced by the exception's traceback
        gc.collect()
        release()
        sleep(pause)
        pause = min(pause * 2, _MAX_PAUSE)
        tries += 1
