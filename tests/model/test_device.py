"""``--device``: a CUDA device this torch cannot use is one line (exit 2 from ``stoic serve``),
never a traceback from the first tensor moved there; ``auto`` on a machine with an NVIDIA GPU
torch cannot see says so once instead of falling back to the CPU in silence."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import structlog
import torch

from stoic.errors import ModelUnavailable
from stoic.model import _loader, resolve_device


def _no_cuda(monkeypatch: pytest.MonkeyPatch, count: int = 0) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.mark.parametrize(("device", "count"), [("cuda", 0), ("cuda:0", 0), ("cuda:1", 1)])
def test_a_cuda_device_torch_cannot_use_is_one_clear_error(
    monkeypatch: pytest.MonkeyPatch, device: str, count: int
) -> None:
    _no_cuda(monkeypatch, count)
    with pytest.raises(ModelUnavailable) as raised:
        resolve_device(device)
    message = raised.value.message
    assert f"--device {device}" in message and f"sees {count} CUDA device(s)" in message
    assert "--device cpu" in message and "\n" not in message


def test_auto_says_once_that_it_falls_back_where_a_gpu_is_unseen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A machine with an NVIDIA device node and a torch that sees none: ``auto`` is the CPU,
    with one ``model.device_fallback`` warning however often it is resolved; without a GPU,
    nothing is said."""
    _no_cuda(monkeypatch)
    _loader._warn_cpu_fallback.cache_clear()
    monkeypatch.setattr(_loader, "_nvidia_gpu_present", lambda: False)
    with structlog.testing.capture_logs() as quiet:
        assert resolve_device("auto") == torch.device("cpu")
    monkeypatch.setattr(_loader, "_nvidia_gpu_present", lambda: True)
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            assert resolve_device(None) == torch.device("cpu")
    _loader._warn_cpu_fallback.cache_clear()
    assert not [e for e in quiet if e["event"] == "model.device_fallback"]
    (warned,) = [e for e in logs if e["event"] == "model.device_fallback"]
    assert warned["log_level"] == "warning" and "cannot use it" in warned["reason"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine's torch sees a GPU")
def test_serve_on_a_cuda_device_torch_cannot_see_exits_2_on_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "STOIC_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-m", "stoic", "serve", "--device", "cuda", "--port", "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.splitlines()
    assert "stoic.start_failed" in line and "sees 0 CUDA device(s)" in line
    assert done.stdout == ""
