"""How much CPU this process may really use: its affinity mask and its cgroup's CPU quota.

A container, a Kubernetes pod or a systemd unit limits a process with a CPU quota (cgroup v2
``cpu.max``, v1 ``cpu.cfs_quota_us``/``cpu.cfs_period_us``) while ``os.cpu_count()`` and
OpenMP's default still see every CPU of the host; ``taskset``/cpusets limit it with an affinity
mask. A compute pool wider than the quota spends the quota spinning and is then throttled as a
whole, every thread at once, for the rest of the period. :func:`cpu_budget` reads both limits
once (the quota of the process's cgroup and of every cgroup above it: the smallest binds),
like Go's ``automaxprocs`` and the JVM's container support do: ``threads`` is the affinity's
CPU count, capped by the quota rounded down, at least 1.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CpuBudget", "affinity", "cpu_budget"]


@dataclass(frozen=True)
class CpuBudget:
    """The CPUs this process may use, read once at start."""

    #: the CPUs of the process's affinity mask (``os.sched_getaffinity``)
    cpu_ids: tuple[int, ...]
    #: the cgroup CPU quota in CPUs (``cpu.max`` 150000/100000 -> 1.5); None: no quota
    quota: float | None
    #: where the quota was read (a cgroup directory), or None
    quota_source: str | None = None

    @property
    def cpus(self) -> int:
        """The number of CPUs in the affinity mask."""
        return len(self.cpu_ids)

    @property
    def threads(self) -> int:
        """Compute threads worth running: the affinity's CPUs, capped by the quota rounded down
        (a 1.5-CPU quota runs one thread: a second would be throttled every period), >= 1."""
        cap = self.cpus if self.quota is None else min(self.cpus, math.floor(self.quota))
        return max(1, cap)

    def describe(self) -> dict[str, object]:
        """The fields a log event carries."""
        return {
            "cpus": self.cpus,
            "cpu_quota": None if self.quota is None else round(self.quota, 3),
            "cpu_quota_source": self.quota_source,
            "threads": self.threads,
        }


def cpu_budget(*, proc: Path = Path("/proc"), root: Path = Path("/")) -> CpuBudget:
    """This process's CPU budget (``proc`` and ``root`` are for tests: a laid-out
    ``/proc/self/{cgroup,mountinfo}`` and the file system the mount points are under). Never
    raises: an unreadable or absent cgroup means no quota."""
    quota, source = _cgroup_quota(proc, root)
    return CpuBudget(affinity(), quota, source)


def affinity() -> tuple[int, ...]:
    """The CPUs of this process's affinity mask (every CPU where that cannot be read)."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return tuple(range(os.cpu_count() or 1))


def _cgroup_quota(proc: Path, root: Path) -> tuple[float | None, str | None]:
    best: tuple[float | None, str | None] = (None, None)
    for current in cgroup_chain(proc, root, "cpu"):
        quota = _read_quota(current)
        if quota is not None and (best[0] is None or quota < best[0]):
            best = (quota, "/" + str(current.relative_to(root)))
    return best


def cgroup_chain(proc: Path, root: Path, controller: str) -> list[Path]:
    """The directories of this process's cgroup and of each parent up to its mount point, for
    the v2 hierarchy and the v1 ``controller`` (``"cpu"``, ``"memory"``): where a limit may be
    set (the tightest binds)."""
    chain = []
    for directory, mount in _cgroup_dirs(proc, root, controller):
        current = directory
        while True:
            chain.append(current)
            if current == mount or current.parent == current:
                break
            current = current.parent
    return chain


def _cgroup_dirs(proc: Path, root: Path, controller: str) -> list[tuple[Path, Path]]:
    """``(the process's cgroup directory, its mount point)`` for the v2 hierarchy and the v1
    ``controller``, as far as they can be read."""
    try:
        cgroups = (proc / "self" / "cgroup").read_text().splitlines()
        mounts = (proc / "self" / "mountinfo").read_text().splitlines()
    except OSError:
        return []
    paths: dict[str, str] = {}  # "v2" or "v1" -> the cgroup path of this process
    for line in cgroups:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            paths["v2"] = parts[2]
        elif controller in parts[1].split(","):
            paths["v1"] = parts[2]
    found = []
    for line in mounts:
        # id parent major:minor root mount-point options [optional...] - fstype source super
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        mount_root, mount_point, fstype = fields[3], fields[4], tail[0]
        if fstype == "cgroup2":
            version = "v2"
        elif fstype == "cgroup" and controller in tail[2].split(","):
            version = "v1"
        else:
            continue
        path = paths.get(version)
        if path is None:
            continue
        # a container sees its own cgroup as the mount's root ("/" in a cgroup namespace)
        relative = os.path.relpath(path, mount_root) if path.startswith(mount_root) else "."
        mount = root / mount_point.lstrip("/")
        directory = (mount / relative) if relative != "." else mount
        found.append((directory, mount))
    return found


def _read_quota(directory: Path) -> float | None:
    """The quota set in ``directory`` in CPUs (v2 ``cpu.max`` or v1 CFS files), or None."""
    try:
        text = (directory / "cpu.max").read_text().split()
        if len(text) == 2 and text[0] != "max":
            return int(text[0]) / int(text[1])
        return None
    except (OSError, ValueError):
        pass
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None
