"""``--dtype auto`` on a CPU: chosen by measuring, not from CPU flags.

A CPU that reports bf16 instructions (AVX512-BF16) without bf16 matrix units (AMX) runs a bf16
linear slower than a float32 one (measured on an Intel Xeon: 546 us against 383 us for 32x576 by
576x1536, 2.5x slower at one row), so flags mislead. The probe times float32 and bfloat16 matrix
products of a decode step's shapes (one row, and a batch of 32; 576 by 1536 is the default
model's MLP) and picks bfloat16 only when it is at least 10% faster: float32 is the safe default
(exact greedy outputs do not change with the batch), so bf16 must earn its place.

The result is cached per CPU model, torch version and the CPUs this process may run on (its
affinity, not torch's current thread count, which the thread governor lowers and raises at run
time: keyed by that, two engines started in one process a minute apart could resolve ``auto``
differently and give different tokens) in ``<cache dir>/dtype-probe.json``: the probe (tens of
milliseconds) runs once per machine, and a restarted executor reuses the answer. The server
resolves the dtype once and hands the worker processes the resolved name, so they never
disagree.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from .._logging import get_logger
from ..gguf import default_cache_dir

__all__ = ["probe_cpu_dtype"]

_log = get_logger("stoic.model")
#: (rows, inner, outer): one decode row, and a batch of 32 rows
_SHAPES = ((1, 576, 1536), (32, 576, 1536))
_REPEATS = 15
#: bfloat16 must take at most this share of float32's time
_MARGIN = 0.9
_FILE = "dtype-probe.json"
_LOCK = "dtype-probe.lock"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _probe_key() -> str:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        cpus = os.cpu_count() or 1
    return f"{_cpu_model()} | torch {torch.__version__} | {cpus} cpus"


def time_matmuls(dtype: torch.dtype) -> float:
    """Seconds for one product of each probe shape in ``dtype`` (median of several runs)."""
    generator = torch.Generator().manual_seed(0)
    total = 0.0
    for rows, inner, outer in _SHAPES:
        a = torch.randn(rows, inner, generator=generator).to(dtype)
        b = torch.randn(inner, outer, generator=generator).to(dtype)
        for _ in range(3):  # warm-up: first calls pay for allocation and kernel selection
            a @ b
        runs = []
        for _ in range(_REPEATS):
            start = time.perf_counter()
            a @ b
            runs.append(time.perf_counter() - start)
        total += statistics.median(runs)
    return total


def _read(path: Path) -> dict[str, dict[str, object]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def probe_cpu_dtype(
    cache_root: Path | None = None,
    *,
    measure: Callable[[torch.dtype], float] = time_matmuls,
) -> torch.dtype:
    """float32 or bfloat16, whichever this CPU runs faster (cached; see the module docstring).

    Processes that resolve ``auto`` at the same moment (two servers, the test suite's workers)
    take turns (a lock file beside the cache): the first measures, the others read its answer,
    so none runs with the other dtype because its own measurement came out the other way. A
    cache that cannot be written only costs a probe at the next start.
    """
    root = cache_root if cache_root is not None else default_cache_dir()
    with _probe_lock(root):
        return _probe(root, measure)


@contextlib.contextmanager
def _probe_lock(root: Path) -> Iterator[None]:
    """Held while this process reads, measures and writes the cache (none where the lock file
    cannot be made: a read-only cache directory)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = open(root / _LOCK, "a")  # noqa: SIM115  # held across the block
    except OSError:
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _probe(root: Path, measure: Callable[[torch.dtype], float]) -> torch.dtype:
    path = root / _FILE
    key = _probe_key()
    known = _read(path)
    entry = known.get(key)
    if isinstance(entry, dict) and entry.get("dtype") in ("float32", "bfloat16"):
        return torch.bfloat16 if entry["dtype"] == "bfloat16" else torch.float32
    fp32, bf16 = measure(torch.float32), measure(torch.bfloat16)
    choice = torch.bfloat16 if bf16 <= _MARGIN * fp32 else torch.float32
    name = str(choice).removeprefix("torch.")
    _log.info(
        "model.dtype_probe",
        cpu=key,
        float32_us=round(fp32 * 1e6, 1),
        bfloat16_us=round(bf16 * 1e6, 1),
        chosen=name,
    )
    known[key] = {
        "dtype": name,
        "float32_us": round(fp32 * 1e6, 1),
        "bfloat16_us": round(bf16 * 1e6, 1),
    }
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1))
        tmp.replace(path)  # atomic: a concurrent reader sees the old file or the new one
    except OSError as exc:
        _log.warning("model.dtype_probe_not_cached", path=str(path), error=str(exc))
    return choice
