"""What travels to a GPU machine that has torch but no network, and the command to run there.

A GPU lent for minutes (docs/operations.md, "GPUs") has Python 3.12 with torch, transformers,
aiohttp, anyio, numpy, prometheus-client, jinja2, pytest and more (:data:`DEVICE_HAS`, the
image's list; ``--device-packages FILE`` reads another: ``pip freeze`` there), and nothing can be
installed from an index. What stoic needs at run time beyond that (its base requirements and
what they need, in the versions installed here) travels as wheels in ``.whl/``, next to the
source tree; the model's shape and tokenizer are in ``shapes/`` (no weights: ``--load-format
dummy``)::

    python benchmarks/gpu_travel.py --dry-run   # what would travel and its size; no download
    python benchmarks/gpu_travel.py             # fetch the wheels into .whl/, print the command

The wheels are fetched for CPython 3.12 on manylinux x86-64 (``pip download --no-deps
--only-binary=:all:``); ``.whl/`` is ignored by git (``.git/info/exclude``), so it travels only
when named (the device tool's ``carry``). The source tree (tracked files) and the wheels must
stay under 64 MiB together: the run refuses otherwise (exit 1). The command printed for the
device is ``make gpu-check``, which installs the wheels into a folder on ``PYTHONPATH`` and runs
``benchmarks/gpu_check.py``.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".whl"
LIMIT = 64 * 2**20
#: the Python packages of the GPU machines' image ("cuda": torch 2.11, CUDA 13), the ones stoic's
#: requirements could need; everything else a requirement pulls in travels
DEVICE_HAS = frozenset(
    [
        "accelerate",
        "aiohappyeyeballs",
        "aiohttp",
        "aiosignal",
        "annotated-doc",
        "anyio",
        "attrs",
        "certifi",
        "charset-normalizer",
        "click",
        "filelock",
        "frozenlist",
        "fsspec",
        "h11",
        "hf-xet",
        "httpcore",
        "httpx",
        "huggingface-hub",
        "idna",
        "jinja2",
        "markdown-it-py",
        "markupsafe",
        "mdurl",
        "mpmath",
        "multidict",
        "networkx",
        "numpy",
        "packaging",
        "prometheus-client",
        "propcache",
        "psutil",
        "pygments",
        "pytest",
        "pyyaml",
        "regex",
        "requests",
        "rich",
        "safetensors",
        "sentencepiece",
        "setuptools",
        "shellingham",
        "sympy",
        "tokenizers",
        "torch",
        "tqdm",
        "transformers",
        "triton",
        "typer",
        "typing-extensions",
        "urllib3",
        "yarl",
    ]
)
#: pip matches a wheel's platform tag exactly: every glibc a wheel may ask for up to the image's
#: (Ubuntu 24.04: glibc 2.39; llguidance's wheels say manylinux_2_31)
PLATFORMS = (
    *(f"manylinux_2_{n}_x86_64" for n in range(17, 40)),
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)


def normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(dist: metadata.Distribution) -> list[str]:
    """The names ``dist`` requires unconditionally (no extras; markers for Linux and 3.12)."""
    names = []
    for line in dist.requires or ():
        name, _, marker = line.partition(";")
        if "extra" in marker or "win32" in marker or 'python_version < "3.1' in marker:
            continue
        match = re.match(r"[A-Za-z0-9_.-]+", name.strip())
        if match:
            names.append(match.group(0))
    return names


def travelling(device_has: frozenset[str]) -> dict[str, str]:
    """``{name: version}`` of what stoic needs at run time that the device lacks: stoic's base
    requirements missing there, and what they need that is missing too (installed versions)."""
    found: dict[str, str] = {}
    todo = [n for n in _requirements(metadata.distribution("stoic")) if normal(n) not in device_has]
    while todo:
        name = todo.pop()
        if normal(name) in found or normal(name) in device_has:
            continue
        dist = metadata.distribution(name)
        found[normal(name)] = dist.version
        todo += _requirements(dist)
    return dict(sorted(found.items()))


def installed_bytes(name: str) -> int:
    """The size of ``name``'s installed files (a wheel is this, compressed: an upper bound)."""
    dist = metadata.distribution(name)
    return sum(f.size or 0 for f in dist.files or ())


def tree_bytes() -> int:
    """What git tracks in this checkout (what travels besides the wheels)."""
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    return sum(
        (ROOT / f.decode()).stat().st_size for f in files if f and (ROOT / f.decode()).is_file()
    )


def download(packages: dict[str, str]) -> None:
    WHEELS.mkdir(exist_ok=True)
    exclude = ROOT / ".git" / "info" / "exclude"  # travels only when carried
    listed = exclude.read_text() if exclude.exists() else ""
    if exclude.parent.is_dir() and "/.whl/" not in listed.splitlines():
        with exclude.open("a") as f:
            f.write("/.whl/\n")
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    for name, version in packages.items():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--only-binary=:all:",
                "--python-version",
                "3.12",
                "--implementation",
                "cp",
                *platforms,
                "-d",
                str(WHEELS),
                f"{name}=={version}",
            ],
            check=True,
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="list, do not download")
    parser.add_argument("--device-packages", type=Path, help="pip freeze of the device")
    args = parser.parse_args()
    device_has = DEVICE_HAS
    if args.device_packages:
        lines = args.device_packages.read_text().splitlines()
        device_has = frozenset(normal(re.split(r"[=<> @]", x)[0]) for x in lines if x.strip())
    packages = travelling(device_has)
    tree = tree_bytes()
    if args.dry_run:
        sizes = {name: installed_bytes(name) for name in packages}
        how = "installed size, an upper bound"
    else:
        download(packages)
        wheels = list(WHEELS.glob("*.whl"))
        sizes = {w.name: w.stat().st_size for w in wheels}
        how = "wheels in .whl/"
    for name, size in sizes.items():
        version = packages.get(name, "")
        print(f"{name}{'==' + version if version else ''}\t{size / 2**20:.2f} MiB")
    total = tree + sum(sizes.values())
    print(f"source tree (git ls-files)\t{tree / 2**20:.2f} MiB")
    print(f"total\t{total / 2**20:.2f} MiB of {LIMIT / 2**20:.0f} ({how})")
    if total > LIMIT:
        print(f"gpu_travel: {total / 2**20:.1f} MiB would travel, over 64 MiB", file=sys.stderr)
        return 1
    print("on the device (carry .whl): make gpu-check")
    return 0


if __name__ == "__main__":
    sys.exit(main())
