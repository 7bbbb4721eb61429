"""Compute threads that follow the CPU this process really gets, step by step.

The products run on OpenMP pools (torch's, and the C kernels') whose threads split each
operator's work evenly and wait for each other at its end, spinning. That is the fastest way to
use cores one has to oneself; it collapses when another process takes one of them: every
operator then waits for the descheduled thread's next time slice (milliseconds, the scheduler's
slice for the neighbour), hundreds of times a step. Measured on 2 cores with one busy process in
another session: a 16-sequence decode step 33 ms with both threads quiet, 464 ms with both
threads next to the neighbour, 63 ms with one thread (which the kernel then gives a core of its
own). Passive waits (``OMP_WAIT_POLICY=passive``) do not help: 101 ms quiet, 133 ms next to the
neighbour (a futex wake per operator); nor does dynamic scheduling (the region still ends at a
barrier every thread must reach). What helps is fewer threads: as many as there are CPUs nobody
else wants (docs/benchmarks.md, "Next to a busy neighbour").

:class:`ThreadGovernor` measures that, at most once per ``interval``, before a step and on the
thread that runs it (OpenMP's thread count is per calling thread): how much CPU *other*
processes used on this process's CPUs: the CPUs' busy time (``/proc/stat``, the affinity's CPUs)
less what the engine's own processes used (``/proc/<pid>/stat``: this one, and the server for a
worker process). The CPUs left, ``available``, size the pool:

* ``available <= threads - 0.75``: others take CPUs from us; the pool shrinks to what is left
  (never below one);
* ``available >= threads + 0.5``, after a hold (:data:`HOLD`, 2 s): it grows again (up to the
  budget, :mod:`._cpu`). A raise that the next windows undo doubles
  the hold (up to :data:`MAX_HOLD`), so a neighbour that comes and goes cannot make the pool
  flap every second.

Why not the kernel's per-thread run-queue delay (schedstat), the direct measure of waiting: on a
quiet machine the engine's own threads keep about one thread waiting on 2 cores (torch's pool and
the C kernels' pool are two OpenMP runtimes whose spinning threads overlap, and the server's event
loop runs beside them), the same reading a neighbour gives. Others' CPU time tells the two apart.

Where ``/proc`` cannot be read the thread count stays at the budget.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from .._logging import get_logger
from ._cpu import affinity

__all__ = ["ContentionProbe", "ThreadGovernor"]

_log = get_logger("stoic.model")
#: how often the governor looks (seconds)
INTERVAL = 1.0
#: shrink when the CPUs others leave us fall this far below the threads: a neighbour that is
#: always runnable takes a whole CPU's share and collapses a full-width pool; one that runs now
#: and then (the client generating the load, ~0.5 CPU) costs the pool little (measured:
#: 382 tokens/s at full width next to it, 256 on one thread fewer)
LOWER_BY = 0.75
#: grow back where the CPUs left reach one thread fewer than this below the new width (the
#: quarter CPU between the two keeps the pool from flapping at the boundary)
RAISE_BY = 0.5
#: after the pool shrank, how long before it may grow again (doubled after a failed raise)
HOLD = 2.0
MAX_HOLD = 64.0
#: a raise that lasts this long without being undone resets the hold
_STABLE = 10.0


class ContentionProbe:
    """Reads, from ``/proc``, the CPU time other processes used on the given CPUs: their busy
    time less the CPU time of ``pids`` (this process, and the rest of the engine)."""

    def __init__(
        self, cpu_ids: Sequence[int], pids: Sequence[int] = (), *, proc: Path = Path("/proc")
    ) -> None:
        self._stat = proc / "stat"
        self._pids = [proc / "self" / "stat", *(proc / str(p) / "stat" for p in pids)]
        self._cpus = {f"cpu{i}" for i in cpu_ids}
        #: the number of CPUs watched
        self.cpus = len(cpu_ids)
        self._tick = 1.0 / os.sysconf("SC_CLK_TCK")
        self._busy = 0
        self._ours: dict[Path, int] = {}
        self.available = self._read_busy() is not None and bool(self._read_ours())
        if self.available:
            self.sample()

    def _read_busy(self) -> int | None:
        """Busy ticks of the watched CPUs since boot (all but idle and iowait)."""
        try:
            lines = self._stat.read_text().splitlines()
        except OSError:
            return None
        busy = 0
        for line in lines:
            name, _, rest = line.partition(" ")
            if name in self._cpus:
                values = [int(v) for v in rest.split()[:8]]  # user..steal; guest is in user
                busy += sum(values) - values[3] - values[4]
        return busy

    def _read_ours(self) -> dict[Path, int]:
        """User + system ticks of each of our processes that can be read."""
        ours = {}
        for path in self._pids:
            try:
                fields = path.read_text().rpartition(")")[2].split()
                ours[path] = int(fields[11]) + int(fields[12])  # utime, stime
            except (OSError, IndexError, ValueError):  # gone
                continue
        return ours

    def sample(self) -> float:
        """CPU seconds other processes used on the watched CPUs since the previous call (a
        process of ours that is gone, or new, counts from the calls that read it twice)."""
        busy, ours = self._read_busy() or 0, self._read_ours()
        used = sum(ticks - self._ours.get(path, ticks) for path, ticks in ours.items())
        others = (busy - self._busy) - used
        self._busy, self._ours = busy, ours
        return max(0.0, others * self._tick)


class ThreadGovernor:
    """Sizes the calling thread's compute pools (torch's intra-op threads, which the C kernels
    follow) to the CPUs this process gets; call :meth:`before_step` before each step and between
    its layers (the runner does, through the step's progress ticks), on the thread that runs it.

    :param budget: the most threads (:attr:`._cpu.CpuBudget.threads`).
    :param adapt: False: always ``budget`` threads (``--no-adapt-threads``).
    :param family: the other processes of the engine whose CPU time is ours, not a neighbour's
        (a worker process passes the server's pid).
    """

    def __init__(
        self,
        budget: int,
        *,
        adapt: bool = True,
        family: Sequence[int] = (),
        probe: ContentionProbe | None = None,
        clock: Callable[[], float] = time.monotonic,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        interval: float = INTERVAL,
    ) -> None:
        self.budget = max(1, budget)
        #: the threads the next step runs with
        self.threads = self.budget
        #: how many times the count changed
        self.changes = 0
        self._adapt = adapt
        self._family = tuple(family)
        self._probe = probe
        self._clock = clock
        self._set = set_threads
        self._interval = interval
        self._applied: int | None = None
        self._last = clock()
        self._lowered_at = float("-inf")
        self._raised_at = float("-inf")
        self._hold = HOLD

    @property
    def adaptive(self) -> bool:
        """Whether the count follows contention (asked for, and measurable here)."""
        if not self._adapt:
            return False
        if self._probe is None:
            self._probe = _default_probe(self._family)
        return self._probe.available

    def before_step(self) -> int:
        """Look at the last window if one has passed, apply the thread count; returns it."""
        now = self._clock()
        if now - self._last >= self._interval and self.adaptive:
            assert self._probe is not None
            others = self._probe.sample()
            window, self._last = now - self._last, now
            self._decide(now, self._probe.cpus - others / window)
        if self._applied != self.threads:
            self._set(self.threads)
            self._applied = self.threads
        return self.threads

    def _decide(self, now: float, available: float) -> None:
        before = self.threads
        _log.debug("cpu.window", threads=before, available=round(available, 2))
        if available <= before - LOWER_BY and before > 1:
            # the widest pool that this availability would not shrink
            self.threads = max(1, min(before - 1, math.ceil(available + LOWER_BY) - 1))
            if now - self._raised_at <= 3 * self._interval:  # the last raise did not hold
                self._hold = min(MAX_HOLD, self._hold * 2)
            self._lowered_at = now
        elif (
            available >= before + 1 - RAISE_BY
            and before < self.budget
            and now - self._lowered_at >= self._hold
        ):
            self.threads = min(self.budget, math.floor(available + RAISE_BY))
            self._raised_at = now
        elif self._raised_at > self._lowered_at and now - self._raised_at >= _STABLE:
            self._hold = HOLD  # the last raise held
        if self.threads != before:
            self.changes += 1
            _log.info(
                "cpu.threads_changed",
                threads=self.threads,
                before=before,
                available_cpus=round(available, 2),
                hold_s=self._hold,
            )


def _default_probe(family: Sequence[int]) -> ContentionProbe:
    return ContentionProbe(affinity(), family)
