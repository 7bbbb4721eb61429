"""The device check (benchmarks/gpu_check.py) cannot pass by accident: without a visible CUDA
device it exits non-zero with one line; its flow runs for real on the CPU (``--rehearse``); what
travels to a GPU machine (benchmarks/gpu_travel.py) fits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


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


@pytest.mark.model
def test_the_rehearsal_serves_kills_the_worker_and_measures_on_the_cpu(tmp_path: Path) -> None:
    """``--rehearse`` runs the device check's flow on the CPU for real (``stoic serve`` from the
    source tree on a shape with dummy weights, the sizing from /v1/models, a greedy answer, kill
    -9 of the worker and the same answer from a new one, throughput): PASS, exit 0, and the JSON
    says which parts needed CUDA (skipped, never passed)."""
    out = tmp_path / "results.json"
    ran = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--rehearse",
            "--model",
            str(ROOT / "shapes" / "smollm2-135m"),
            "--levels",
            "1",
            "3",
            "--tokens",
            "8",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    results = json.loads(out.read_text())
    assert results["passed"] is True and results["rehearse"] is True
    checks = {c["name"]: c for c in results["checks"]}
    assert list(checks) == [
        "ready",
        "sizing",
        "served",
        "oom",
        "kill -9",
        "device assert",
        "throughput x1",
        "throughput x3",
    ]
    assert checks["oom"]["passed"] is None and checks["device assert"]["passed"] is None
    assert checks["kill -9"]["passed"] is True and checks["kill -9"]["seconds"] > 0
    assert checks["sizing"]["figures"]["memory"]["profiled"] is True
    for level in (1, 3):
        figures = checks[f"throughput x{level}"]["figures"]
        assert figures["tokens_per_s"] > 0 and figures["failed"] == 0
    assert ran.stdout.strip().splitlines()[-1].startswith("PASS")


def test_the_travel_dry_run_lists_what_the_device_lacks_within_64_mib() -> None:
    """``gpu_travel.py --dry-run`` lists stoic's run-time requirements that the GPU image lacks
    (and theirs), none that it has, and a total under the 64 MiB a device run may carry."""
    ran = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_travel.py"), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr
    lines = ran.stdout.splitlines()
    names = {line.split("==")[0] for line in lines if "==" in line}
    assert {"structlog", "pydantic", "pydantic-core", "llguidance", "gguf", "setproctitle"} <= names
    assert not names & {"torch", "transformers", "aiohttp", "anyio", "numpy", "jinja2"}
    total = next(line for line in lines if line.startswith("total"))
    assert float(total.split()[1]) < 64
    assert lines[-1] == "on the device (carry .whl): make gpu-check"
