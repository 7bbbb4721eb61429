"""``make install``'s torch step (scripts/install_torch.py) with a fake ``nvidia-smi`` on PATH, a
fake pip that records its command (and "installs" by leaving a mark), and a fake python whose
torch answers as a CPU build, a CUDA build that sees the GPU, or none. Nothing is installed."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "install_torch.py"

H200 = "GPU 0: NVIDIA H200 (UUID: GPU-5d2f0c1e-8a3b-4c7d-9e6f-0a1b2c3d4e5f)"
CPU_TORCH = {"version": "2.13.0+cpu", "cuda": None, "devices": 0}
CUDA_TORCH = {"version": "2.13.0+cu128", "cuda": "12.8", "devices": 1}


def _executable(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


class Machine:
    """A PATH with (or without) nvidia-smi, a pip that records, a python whose torch is given."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.bin = root / "bin"
        self.bin.mkdir()
        self.log = root / "pip.log"
        self.installed = root / "installed.json"  # what torch is "installed" now

    def gpu(self, listing: str = H200, cuda: str = "12.8", status: int = 0) -> None:
        """nvidia-smi: ``-L`` prints ``listing`` (exit ``status``); plain, the header."""
        header = f"| NVIDIA-SMI 570.124.06   Driver Version: 570.124.06   CUDA Version: {cuda} |"
        _executable(
            self.bin / "nvidia-smi",
            f'if [ "$1" = "-L" ]; then echo {shlex.quote(listing)}; exit {status}; fi\n'
            f"echo {shlex.quote(header)}\n",
        )

    def torch(self, answer: dict[str, object] | None) -> None:
        if answer is None:
            self.installed.unlink(missing_ok=True)
        else:
            self.installed.write_text(json.dumps(answer))

    def run(
        self, *, after_pip: dict[str, object] | None = None, **env: str
    ) -> tuple[int, str, str]:
        """Run the script; pip records its arguments and then leaves ``after_pip`` installed
        (unchanged when None)."""
        mark = (
            f"echo {shlex.quote(json.dumps(after_pip))} > {self.installed}\n" if after_pip else ""
        )
        pip = _executable(self.root / "pip", f'echo "$@" >> {self.log}\n{mark}')
        python = _executable(
            self.root / "python",
            f'[ -f {self.installed} ] || {{ echo "No module named torch" >&2; exit 1; }}\n'
            f"cat {self.installed}\n",
        )
        ran = subprocess.run(
            [sys.executable, str(SCRIPT), "--pip", str(pip), "--python", str(python)],
            capture_output=True,
            text=True,
            env={"PATH": f"{self.bin}:/usr/bin:/bin", **env},
            timeout=60,
        )
        return ran.returncode, ran.stdout, ran.stderr

    def pip_calls(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []


@pytest.fixture
def machine(tmp_path: Path) -> Machine:
    if any(Path(d, "nvidia-smi").exists() for d in ("/usr/bin", "/bin")):
        pytest.skip("a real nvidia-smi on the fake machine's PATH would answer")
    return Machine(tmp_path)


def test_without_a_gpu_a_torch_that_imports_is_kept(machine: Machine) -> None:
    machine.torch(CPU_TORCH)
    status, out, _err = machine.run()
    assert status == 0 and "torch already installed: 2.13.0+cpu" in out
    assert machine.pip_calls() == []


def test_without_a_gpu_the_pinned_cpu_build_is_installed(machine: Machine) -> None:
    machine.torch(None)
    status, _out, _err = machine.run()
    assert status == 0
    assert machine.pip_calls() == ["install torch==2.13.0"]


def test_an_nvidia_smi_that_cannot_reach_a_driver_is_no_gpu(machine: Machine) -> None:
    """``nvidia-smi -L`` failing (no driver loaded) leaves the CPU behaviour unchanged."""
    machine.gpu(
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", status=9
    )
    machine.torch(None)
    status, _out, _err = machine.run()
    assert status == 0 and machine.pip_calls() == ["install torch==2.13.0"]


def test_with_a_gpu_a_cpu_build_is_replaced_by_pypis_own_cuda_build(machine: Machine) -> None:
    """A CPU build imports but sees no GPU: it is uninstalled (``torch==2.13.0`` is satisfied
    by ``2.13.0+cpu``) and the pinned version installed from pip's own index, where PyPI's
    Linux torch is the CUDA build: no index outside PyPI. Once it sees the GPU, the step
    succeeds."""
    machine.gpu()
    machine.torch(CPU_TORCH)
    status, out, err = machine.run(after_pip=CUDA_TORCH)
    assert status == 0, err
    assert machine.pip_calls() == ["uninstall -y torch", "install torch==2.13.0"]
    assert "replacing it" in out and "sees 1 CUDA device(s)" in out


def test_with_a_gpu_and_no_torch_pypis_build_unless_torch_cuda_names_one(
    machine: Machine,
) -> None:
    """No torch: PyPI's own build; TORCH_CUDA asks for that variant from PyTorch's index."""
    machine.gpu(cuda="13.0")
    machine.torch(None)
    assert machine.run(after_pip=CUDA_TORCH)[0] == 0
    machine.torch(None)
    assert machine.run(after_pip=CUDA_TORCH, TORCH_CUDA="cu126")[0] == 0
    assert machine.pip_calls() == [
        "install torch==2.13.0",
        "install --index-url https://download.pytorch.org/whl/cu126 torch==2.13.0+cu126",
    ]


def test_with_a_gpu_a_torch_that_sees_it_is_kept(machine: Machine) -> None:
    machine.gpu()
    machine.torch(CUDA_TORCH)
    status, out, _err = machine.run()
    assert status == 0 and "sees 1 CUDA device(s)" in out
    assert machine.pip_calls() == []


def test_a_torch_that_still_cannot_see_the_gpu_fails_with_one_line(machine: Machine) -> None:
    """After the install the torch there is still blind to the GPU (here: pip left the CPU
    build): exit 1 with one line on stderr that says so and what to check."""
    machine.gpu()
    machine.torch(CPU_TORCH)
    status, _out, err = machine.run()
    assert status == 1
    (line,) = err.strip().splitlines()
    assert (
        "nvidia-smi lists 1 GPU(s) but torch 2.13.0+cpu (a CPU-only build) cannot see any" in line
    )
    assert "TORCH_CUDA" in line


@pytest.mark.skipif(
    shutil.which("nvidia-smi") is not None, reason="this machine has a GPU: its torch may see it"
)
def test_hidden_gpus_are_named_as_the_reason(machine: Machine) -> None:
    """A CUDA build that cannot see the GPU because CUDA_VISIBLE_DEVICES hides it: the one
    line says so rather than blaming the driver."""
    machine.gpu()
    machine.torch({**CUDA_TORCH, "devices": 0})
    status, _out, err = machine.run(CUDA_VISIBLE_DEVICES="")
    assert status == 1
    (line,) = err.strip().splitlines()
    assert line.endswith("cannot see any: CUDA_VISIBLE_DEVICES='' hides them")


def test_the_real_cpu_torch_here_is_replaced_and_then_refused(machine: Machine) -> None:
    """With this machine's own python (torch 2.13.0+cpu, really imported) and a GPU on PATH:
    PyPI's build is asked for, and since nothing was really installed, the check after fails."""
    machine.gpu()
    pip = _executable(machine.root / "pip", f'echo "$@" >> {machine.log}\n')
    ran = subprocess.run(
        [sys.executable, str(SCRIPT), "--pip", str(pip), "--python", sys.executable],
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": f"{machine.bin}:{os.environ.get('PATH', '')}"},
        timeout=120,
    )
    assert ran.returncode == 1
    assert machine.pip_calls() == ["uninstall -y torch", "install torch==2.13.0"]
    assert "cannot see any" in ran.stderr and len(ran.stderr.strip().splitlines()) == 1
