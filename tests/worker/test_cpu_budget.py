"""The CPU budget: affinity and cgroup quotas (v1 and v2), read from laid-out file systems."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stoic.worker import CpuBudget, cpu_budget


def _lay(proc: Path, cgroup: str, mountinfo: str) -> None:
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    (proc / "self" / "mountinfo").write_text(mountinfo)


def _write(path: Path, text: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for name, value in (line.split("=", 1) for line in text.split(";")):
        (path / name).write_text(value)


V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
V1_MOUNT = (
    "31 23 0:28 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
    "32 23 0:29 /kubepods/pod1 /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
)


def test_a_v2_quota_caps_the_threads_rounded_down(tmp_path: Path) -> None:
    """``cpu.max`` 150000/100000 is 1.5 CPUs: one thread (a second would be throttled)."""
    proc, root = tmp_path / "proc", tmp_path / "root"
    _lay(proc, "0::/system.slice/stoic.service\n", V2_MOUNT)
    _write(root / "sys/fs/cgroup/system.slice/stoic.service", "cpu.max=150000 100000")
    budget = cpu_budget(proc=proc, root=root)
    assert budget.quota == 1.5
    assert budget.quota_source == "/sys/fs/cgroup/system.slice/stoic.service"
    assert budget.threads == 1
    assert budget.describe()["cpu_quota"] == 1.5


def test_the_tightest_quota_on_the_path_up_binds(tmp_path: Path) -> None:
    """A parent's quota limits its children: the smallest on the way to the mount point wins."""
    proc, root = tmp_path / "proc", tmp_path / "root"
    _lay(proc, "0::/a/b\n", V2_MOUNT)
    _write(root / "sys/fs/cgroup/a", "cpu.max=200000 100000")
    _write(root / "sys/fs/cgroup/a/b", "cpu.max=max 100000")
    budget = cpu_budget(proc=proc, root=root)
    assert budget.quota == 2.0
    assert budget.quota_source == "/sys/fs/cgroup/a"


def test_a_v1_quota_is_read_under_a_container_mount_root(tmp_path: Path) -> None:
    """In a container the cgroup path is relative to the mount's root (``/kubepods/pod1``)."""
    proc, root = tmp_path / "proc", tmp_path / "root"
    _lay(proc, "5:memory:/kubepods/pod1/c\n4:cpu,cpuacct:/kubepods/pod1/c\n", V1_MOUNT)
    _write(
        root / "sys/fs/cgroup/cpu,cpuacct/c",
        "cpu.cfs_quota_us=50000;cpu.cfs_period_us=100000",
    )
    budget = cpu_budget(proc=proc, root=root)
    assert budget.quota == 0.5
    assert budget.threads == 1  # never fewer than one


def test_no_quota_leaves_the_affinity(tmp_path: Path) -> None:
    """``-1`` (v1) and ``max`` (v2) are no quota; a missing cgroup file system is none either."""
    proc, root = tmp_path / "proc", tmp_path / "root"
    _lay(proc, "0::/x\n4:cpu:/\n", V2_MOUNT + V1_MOUNT)
    _write(root / "sys/fs/cgroup/x", "cpu.max=max 100000")
    budget = cpu_budget(proc=proc, root=root)
    assert budget.quota is None
    assert budget.threads == len(os.sched_getaffinity(0))
    assert cpu_budget(proc=tmp_path / "nothing", root=root).quota is None


@pytest.mark.parametrize(
    ("cpus", "quota", "threads"), [(4, None, 4), (4, 2.5, 2), (2, 8.0, 2), (1, 0.2, 1)]
)
def test_threads_are_the_affinity_capped_by_the_quota(
    cpus: int, quota: float | None, threads: int
) -> None:
    assert CpuBudget(tuple(range(cpus)), quota).threads == threads


def test_this_machine_has_a_budget() -> None:
    """Read from the real /proc: at least one thread, no more than the affinity's CPUs."""
    budget = cpu_budget()
    assert 1 <= budget.threads <= budget.cpus == len(os.sched_getaffinity(0))
