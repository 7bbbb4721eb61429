"""CPU used by other processes during a measurement (the machine is shared), per-thread
scheduling of a server, and what the machine is."""

from __future__ import annotations

import contextlib
import os
import platform
from collections.abc import Sequence
from pathlib import Path


def jiffies(pid: int, children: bool = False) -> int:
    """CPU ticks of ``pid`` (utime + stime), plus its reaped children's with ``children``."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        ticks = int(fields[11]) + int(fields[12])
        return ticks + (int(fields[13]) + int(fields[14]) if children else 0)
    except (OSError, IndexError, ValueError):
        return 0


def all_jiffies() -> dict[int, int]:
    out: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError):
            out[int(stat.parent.name)] = jiffies(int(stat.parent.name))
    return out


def top_processes(before: dict[int, int], after: dict[int, int], ours: set[int]) -> str:
    """The two processes (not ours) that used the most CPU between the snapshots."""
    deltas = sorted(
        ((after[p] - before.get(p, 0), p) for p in after if p not in ours), reverse=True
    )[:2]
    parts = []
    for delta, pid in deltas:
        if delta <= 0:
            continue
        with contextlib.suppress(OSError):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:60]
            parts.append(f"{pid} {cmd.strip()}")
    return "; ".join(parts) or "short-lived processes"


def schedstat(pid: int) -> dict[int, tuple[int, int]]:
    """Per OS thread of ``pid``: (ns on a CPU, ns runnable but waiting for a CPU)."""
    out: dict[int, tuple[int, int]] = {}
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, ValueError):
                run, wait, _ = (task / "schedstat").read_text().split()
                out[int(task.name)] = (int(run), int(wait))
    return out


def sched_delta(
    before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]], wall: float
) -> list[tuple[int, float, float]]:
    """Threads that ran or waited >= 1% of ``wall``: (tid, on-CPU share, waiting share)."""
    rows = []
    for tid, (run1, wait1) in after.items():
        run0, wait0 = before.get(tid, (0, 0))
        run, waited = (run1 - run0) / 1e9 / wall, (wait1 - wait0) / 1e9 / wall
        if run >= 0.01 or waited >= 0.01:
            rows.append((tid, run, waited))
    return sorted(rows, key=lambda r: -r[1])


def _cpu_total() -> tuple[int, int]:
    try:
        values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    except (OSError, ValueError):
        return 0, 0
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


class CpuWatch:
    """Share of the machine's CPU that processes other than ours used between start and stop."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids = list(pids)
        self.busy0, self.total0 = _cpu_total()
        self.ours0 = self._ours()

    def _ours(self) -> int:
        # this process, its finished worker processes, and the servers
        return jiffies(os.getpid(), children=True) + sum(jiffies(p) for p in self.pids)

    def stop(self) -> float | None:
        busy, total = _cpu_total()
        ours = self._ours()
        if total <= self.total0:
            return None
        return max(0.0, (busy - self.busy0) - (ours - self.ours0)) / (total - self.total0)


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_flags() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
                return ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in wanted)
    return "?"


def mem_gib() -> str:
    with contextlib.suppress(OSError, ValueError):
        kib = int(Path("/proc/meminfo").read_text().split()[1])
        return f"{kib / 2**20:.0f} GiB"
    return "?"


def versions() -> str:
    import importlib.metadata as md

    import torch
    import transformers

    parts = [
        f"python {platform.python_version()}",
        f"torch {torch.__version__}",
        f"transformers {transformers.__version__}",
    ]
    for dist in ("stoic", "aiohttp", "fastapi", "uvicorn", "py-spy"):
        with contextlib.suppress(md.PackageNotFoundError):
            parts.append(f"{dist} {md.version(dist)}")
    return ", ".join(parts)
