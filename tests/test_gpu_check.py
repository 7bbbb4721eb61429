"""benchmarks/gpu_check.py cannot pass by accident: without a visible CUDA device it exits
non-zero with one line (it used to print "nothing checked" and exit 0)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


@pytest.mark.parametrize("hidden", [None, ""], ids=["as-is", "all-hidden"])
def test_without_a_visible_cuda_device_the_check_fails_with_one_line(hidden: str | None) -> None:
    """On this machine (no GPU), and with every GPU hidden (``CUDA_VISIBLE_DEVICES=""``, which
    hides a real one too): exit 1, one line on stderr naming the torch build, nothing on
    stdout (no check ran, so no PASS)."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    if hidden is not None:
        env["CUDA_VISIBLE_DEVICES"] = hidden
    else:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has a CUDA device: the check would run")
    ran = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=120
    )
    assert ran.returncode == 1
    assert ran.stdout == ""
    (line,) = ran.stderr.strip().splitlines()
    assert line.startswith("gpu_check: no CUDA device visible (torch ")
    assert "nothing checked" in line
    if hidden is not None:
        assert "CUDA_VISIBLE_DEVICES=''" in line
