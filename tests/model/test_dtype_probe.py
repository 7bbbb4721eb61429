"""``--dtype auto`` on a CPU: chosen by measuring (and cached), not from CPU flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stoic.model import resolve_dtype
from stoic.model._dtype_probe import probe_cpu_dtype, time_matmuls


def _fake(fp32: float, bf16: float) -> tuple[list[torch.dtype], object]:
    calls: list[torch.dtype] = []

    def measure(dtype: torch.dtype) -> float:
        calls.append(dtype)
        return fp32 if dtype == torch.float32 else bf16

    return calls, measure


@pytest.mark.parametrize(
    ("fp32", "bf16", "expected"),
    [
        (1.0, 0.5, torch.bfloat16),  # bf16 twice as fast (AMX)
        (1.0, 0.9, torch.bfloat16),  # just enough
        (1.0, 0.95, torch.float32),  # not 10% faster: float32 stays
        (383e-6, 546e-6, torch.float32),  # AVX512-BF16 without AMX, as measured on a Xeon
    ],
)
def test_the_faster_dtype_is_chosen_with_a_margin_for_float32(
    tmp_path: Path, fp32: float, bf16: float, expected: torch.dtype
) -> None:
    """bfloat16 is chosen only when the probe measures it at least 10% faster."""
    _, measure = _fake(fp32, bf16)
    assert probe_cpu_dtype(tmp_path, measure=measure) == expected  # type: ignore[arg-type]


def test_the_answer_is_cached_per_cpu_and_torch_version(tmp_path: Path) -> None:
    """The second resolution reads the cache file and measures nothing; a corrupt cache file is
    measured again, not an error."""
    calls, measure = _fake(1.0, 0.5)
    assert probe_cpu_dtype(tmp_path, measure=measure) == torch.bfloat16  # type: ignore[arg-type]
    assert len(calls) == 2
    assert probe_cpu_dtype(tmp_path, measure=measure) == torch.bfloat16  # type: ignore[arg-type]
    assert len(calls) == 2
    (entry,) = json.loads((tmp_path / "dtype-probe.json").read_text()).items()
    assert torch.__version__ in entry[0] and entry[1]["dtype"] == "bfloat16"
    (tmp_path / "dtype-probe.json").write_text("{not json")
    assert probe_cpu_dtype(tmp_path, measure=measure) == torch.bfloat16  # type: ignore[arg-type]
    assert len(calls) == 4


def test_the_cached_answer_does_not_follow_torch_s_thread_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The thread governor changes torch's thread count while engines run; an engine started
    later in the same process (or a restarted one) reads the same cached answer instead of
    probing again under another key and perhaps choosing the other dtype."""
    calls, measure = _fake(1.0, 0.5)
    assert probe_cpu_dtype(tmp_path, measure=measure) == torch.bfloat16  # type: ignore[arg-type]
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)
    slower, other = _fake(0.5, 1.0)
    assert probe_cpu_dtype(tmp_path, measure=other) == torch.bfloat16  # type: ignore[arg-type]
    assert slower == [] and len(calls) == 2


def test_auto_on_this_cpu_measures_and_explicit_names_do_not(tmp_path: Path) -> None:
    """``auto`` on a CPU resolves through a real probe (timings positive, choice cached);
    an explicit dtype is taken as given; an unknown name is a ValueError."""
    cpu = torch.device("cpu")
    chosen = resolve_dtype("auto", cpu, tmp_path)
    assert chosen in (torch.float32, torch.bfloat16)
    (entry,) = json.loads((tmp_path / "dtype-probe.json").read_text()).values()
    assert entry["float32_us"] > 0 and entry["bfloat16_us"] > 0
    assert entry["dtype"] == str(chosen).removeprefix("torch.")
    assert resolve_dtype("float32", cpu, tmp_path) == torch.float32
    assert resolve_dtype("bf16", cpu, tmp_path) == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("float8", cpu, tmp_path)
    assert time_matmuls(torch.float32) > 0


def test_processes_that_probe_at_once_take_turns_and_agree(tmp_path: Path) -> None:
    """While another process holds the probe's lock (measuring), a probe waits; it then reads
    the answer that process wrote instead of measuring its own, which could come out the other
    way (the first answer is every process's)."""
    import fcntl
    import threading

    from stoic.model import _dtype_probe

    calls, measure = _fake(1.0, 0.5)  # this process would measure bfloat16
    results: list[torch.dtype] = []
    with open(tmp_path / "dtype-probe.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other process is measuring
        waiting = threading.Thread(
            target=lambda: results.append(probe_cpu_dtype(tmp_path, measure=measure))  # type: ignore[arg-type]
        )
        waiting.start()
        waiting.join(0.5)
        assert waiting.is_alive() and results == []  # it waits for the lock
        answer = {"dtype": "float32", "float32_us": 1.0, "bfloat16_us": 1.0}
        (tmp_path / "dtype-probe.json").write_text(json.dumps({_dtype_probe._probe_key(): answer}))
    waiting.join(10)
    assert results == [torch.float32] and calls == []
