"""Install the torch build this machine can use (``make install`` / ``make serve`` run it first).

Without an NVIDIA GPU (``nvidia-smi -L`` missing or failing): a torch that already imports is
kept; otherwise ``pip install torch==PIN`` (the CPU build this machine's pip finds).

With one: a torch that already sees a CUDA device is kept. Otherwise (none installed, a CPU build,
or a CUDA build that cannot see the GPU) the torch there is uninstalled and ``torch==PIN`` is
installed from pip's own index: on Linux x86-64, PyPI's torch *is* the CUDA build (with its CUDA
libraries as ``nvidia-*`` wheels), so a machine that reaches PyPI alone gets it. (Uninstalling
first: ``torch==PIN`` is satisfied by ``PIN+cpu``, and pip would keep it.) ``TORCH_CUDA=cu126``
(say) asks for that variant from PyTorch's own index instead,
``https://download.pytorch.org/whl/<variant>`` (``torch==PIN+<variant>``), for a driver too old
for PyPI's build. Afterwards, torch must see the GPU: if it cannot, this exits 1 with one line
saying why.

Standard library only: it runs before anything else is installed.

    python scripts/install_torch.py [--pin 2.13.0] [--pip "python -m pip"] [--python python]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys

#: PyTorch's index of CUDA builds, one folder per variant
CUDA_INDEX = "https://download.pytorch.org/whl/{variant}"

#: what the probe prints: torch's version, the CUDA it was built for, the devices it sees
_PROBE = (
    "import json, torch; print(json.dumps({'version': torch.__version__, "
    "'cuda': torch.version.cuda, "
    "'devices': torch.cuda.device_count() if torch.cuda.is_available() else 0}))"
)


def nvidia_gpus() -> list[str]:
    """The GPUs ``nvidia-smi -L`` lists (none: no nvidia-smi, or it cannot reach a driver)."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        listed = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    if listed.returncode != 0:
        return []
    return [line for line in listed.stdout.splitlines() if line.startswith("GPU ")]


def cuda_variant() -> str | None:
    """``$TORCH_CUDA`` (a build from PyTorch's own index), or None: PyPI's own build."""
    return os.environ.get("TORCH_CUDA") or None


def probe(python: list[str]) -> dict[str, object] | None:
    """What ``python``'s torch is (version, CUDA build, devices seen); None if it does not
    import."""
    ran = subprocess.run([*python, "-c", _PROBE], capture_output=True, text=True, check=False)
    if ran.returncode != 0:
        return None
    try:
        answer = json.loads(ran.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None
    return answer if isinstance(answer, dict) else None


def describe(torch: dict[str, object] | None) -> str:
    if torch is None:
        return "no torch"
    build = f"CUDA {torch['cuda']}" if torch.get("cuda") else "a CPU-only build"
    return f"torch {torch['version']} ({build})"


def pip_uninstall(pip: list[str], package: str) -> int:
    command = [*pip, "uninstall", "-y", package]
    print("+ " + shlex.join(command), flush=True)
    return subprocess.run(command, check=False).returncode


def pip_install(pip: list[str], *args: str) -> int:
    command = [*pip, "install", *args]
    print("+ " + shlex.join(command), flush=True)
    return subprocess.run(command, check=False).returncode


def install(pin: str, pip: list[str], python: list[str]) -> int:
    """Install (or keep) torch as the module docstring says; the exit status."""
    gpus = nvidia_gpus()
    torch = probe(python)
    if not gpus:
        if torch is not None:
            print(f"torch already installed: {torch['version']}")
            return 0
        return pip_install(pip, f"torch=={pin}")
    if torch is not None and int(str(torch.get("devices") or 0)) > 0:
        print(f"{describe(torch)} sees {torch['devices']} CUDA device(s)")
        return 0
    variant = cuda_variant()
    if variant is None:  # PyPI's own torch is the CUDA build; a +cpu build of PIN satisfies
        # torch==PIN, so it goes first
        wanted, args = f"torch=={pin}", [f"torch=={pin}"]
    else:
        wanted = f"torch=={pin}+{variant}"
        args = ["--index-url", CUDA_INDEX.format(variant=variant), wanted]
    if torch is not None:
        print(f"{describe(torch)} sees no GPU of the {len(gpus)} nvidia-smi lists: replacing it")
        if variant is None and (status := pip_uninstall(pip, "torch")) != 0:
            return status
    status = pip_install(pip, *args)
    if status != 0:
        print(
            f"install_torch: pip could not install {wanted} (exit {status}); "
            "TORCH_CUDA=cu126 (or another variant) installs a build from PyTorch's index",
            file=sys.stderr,
        )
        return status
    after = probe(python)
    if after is None or int(str(after.get("devices") or 0)) == 0:
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
        why = (
            f"CUDA_VISIBLE_DEVICES={hidden!r} hides them"
            if hidden is not None
            else f"check the driver (nvidia-smi) supports {wanted}'s CUDA, or set TORCH_CUDA to "
            "a variant it supports (a build from PyTorch's index)"
        )
        print(
            f"install_torch: nvidia-smi lists {len(gpus)} GPU(s) but {describe(after)} cannot "
            f"see any: {why}",
            file=sys.stderr,
        )
        return 1
    print(f"{describe(after)} sees {after['devices']} CUDA device(s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pin", default="2.13.0", help="torch's version (default %(default)s)")
    parser.add_argument(
        "--pip", default=f"{shlex.quote(sys.executable)} -m pip", help="the pip command"
    )
    parser.add_argument(
        "--python", default=shlex.quote(sys.executable), help="the python whose torch is checked"
    )
    args = parser.parse_args(argv)
    return install(args.pin, shlex.split(args.pip), shlex.split(args.python))


if __name__ == "__main__":
    sys.exit(main())
