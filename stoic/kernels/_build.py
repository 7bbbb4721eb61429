"""Building stoic's C kernels into one shared library (:func:`build_library`): the compiler, the
flags for this CPU, the sources, the cache directory, the compile and the link.

Every ``.c`` file of this package is its own translation unit, including the headers it needs
(``stoic_kernels.h``, the library's interface; ``_common.h`` and ``_blocks.h``, what the files
share), as ggml's are. Each is compiled to an object, in parallel (one compiler process a file,
at most one a CPU), and the objects are linked into ``libstoic_qkernels.so``, once per
(sources, compiler, flags) under ``cache_root / "kernels"``: a change to any source or header,
to the compiler or to the flags builds anew, and a cache directory shared by different CPUs
keeps a build for each. Why C through :mod:`ctypes` and not a torch extension: the sources need
no torch headers, so they compile in seconds where a ``torch.utils.cpp_extension`` build takes
a minute and needs ninja.

The flags: AVX2, FMA and F16C always (the CPU must have them); ``-mavx512f`` on a CPU with
AVX-512F (16-lane products, attention and operators); ``-mavx512bw -mavx512vl -mavx512vnni`` with
AVX512_VNNI too (int8 activations, ``_int8rows.c`` and ``_gemm8.c``); ``-mavx512bf16`` with
AVX512_BF16 (``--deterministic``'s bfloat16 products, ``_bf16fixed.c``). A compiler too old for
the last two builds without them (the float paths serve). Nothing here loads the library
(:func:`stoic.kernels.load_kernels` does).
"""

from __future__ import annotations

import hashlib
import importlib.resources
import os
import platform
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .._logging import get_logger

__all__ = [
    "AVX512_FLAGS",
    "BF16_FLAGS",
    "GFNI_FLAGS",
    "LIBRARY",
    "VNNI_CPU_FLAGS",
    "VNNI_FLAGS",
    "KernelsUnavailable",
    "build",
    "build_library",
    "cache_key",
    "compiler",
    "cpu_flags",
    "flags",
    "sources",
]

#: the library's file name in its cache directory
LIBRARY = "libstoic_qkernels.so"
_BASE_FLAGS = (
    "-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-fPIC",
    # a missing declaration is an error (the library would load and fail at its first call);
    # other warnings are not: they differ between compiler versions
    "-Wall", "-Werror=implicit-function-declaration",
)  # fmt: skip
#: added to the flags for the link (which takes them all: ``-fopenmp`` links libgomp)
_LINK_FLAGS = ("-shared",)
_CPU_FLAGS = ("avx2", "fma", "f16c")
#: with AVX-512F the products use 16-lane registers (``HAVE_AVX512``, ``_common.h``); the flag
#: is part of the build's key, so a cache directory shared by other CPUs keeps a build each
AVX512_FLAGS = ("-mavx512f",)
#: with AVX-512F and AVX512_BF16 too, ``--deterministic``'s products are bfloat16 dot products
#: (``_bf16fixed.c``); without, they stay FIXED_ORDER's float32 tiles
BF16_FLAGS = ("-mavx512bf16",)
#: with AVX-512F and AVX512_VNNI (and BW, VL), products of up to eight rows of a model in a
#: fast dtype take int8 activations (``_int8rows.c``), and batched ones too (``_gemm8.c``)
VNNI_FLAGS = ("-mavx512bw", "-mavx512vl", "-mavx512vnni")
VNNI_CPU_FLAGS = ("avx512bw", "avx512vl", "avx512_vnni")
#: with the int8 products and GFNI too, G6's tiles rebuild its six-bit values with affine byte
#: transforms (``_gemm8.c``, ``g6_values``): fewer operations, the same integers
GFNI_FLAGS = ("-mgfni",)
#: the whole build's limit (the compiles and the link), as one compile's was
_COMPILE_TIMEOUT_S = 120.0
_log = get_logger("stoic.model")


class KernelsUnavailable(RuntimeError):
    """The quantised kernels cannot run here; the message says why (one line)."""


def cpu_flags() -> set[str]:
    """The CPU's feature flags (``/proc/cpuinfo``'s first ``flags`` line; none if unreadable)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def flags() -> tuple[str, ...]:
    """The compiler flags for this CPU (:func:`cpu_flags`), in a fixed order."""
    cpu = cpu_flags()
    if "avx512f" not in cpu:
        return _BASE_FLAGS
    vnni = VNNI_FLAGS if all(f in cpu for f in VNNI_CPU_FLAGS) else ()
    gfni = GFNI_FLAGS if vnni and "gfni" in cpu else ()
    bf16 = BF16_FLAGS if "avx512_bf16" in cpu else ()
    return _BASE_FLAGS + AVX512_FLAGS + vnni + gfni + bf16


def compiler() -> str | None:
    """The C compiler: ``$CC`` if set (None if it is not on PATH), else cc, gcc or clang."""
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc)
    return shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def sources() -> dict[str, bytes]:
    """The library's sources by file name: every ``.c`` and ``.h`` file of this package (the
    package data ``pyproject.toml`` ships), each ``.c`` file a translation unit."""
    files = importlib.resources.files(__package__)
    return {
        entry.name: entry.read_bytes()
        for entry in sorted(files.iterdir(), key=lambda e: e.name)
        if entry.name.endswith((".c", ".h"))
    }


def build(cc: str, files: dict[str, bytes], target: Path, flags: tuple[str, ...]) -> None:
    """Compile each ``.c`` file of ``files`` (name -> bytes, the headers with them) to an object
    with ``flags``, in parallel, and link the objects into ``target``, atomically: a concurrent
    build of the same key is harmless, the last rename wins with identical bytes. The compiles
    and the link share one time limit (:data:`_COMPILE_TIMEOUT_S`).

    :raises KernelsUnavailable: if the compiler fails (the last line of its errors).
    :raises subprocess.TimeoutExpired: if the build runs out of time.
    :raises OSError: if the compiler cannot run or the files cannot be written.
    """
    deadline = time.monotonic() + _COMPILE_TIMEOUT_S
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        root = Path(tmp)
        for name, data in files.items():
            (root / name).write_bytes(data)
        # the largest first: the longest compiles start first, the short ones fill in after
        units = sorted((n for n in files if n.endswith(".c")), key=lambda n: (-len(files[n]), n))
        objects = [str(root / f"{Path(name).stem}.o") for name in units]
        compiles = [
            [cc, *flags, "-c", "-o", obj, str(root / name)]
            for name, obj in zip(units, objects, strict=True)
        ]
        _run_all(cc, compiles, deadline)
        out = root / target.name
        _run(cc, [cc, *flags, *_LINK_FLAGS, "-o", str(out), *objects, "-lm"], deadline)
        os.replace(out, target)


def _run_all(cc: str, commands: list[list[str]], deadline: float) -> None:
    """Run ``commands``, at most one a CPU at a time; the first that fails (in their order)
    raises as :func:`_run` does, after the ones running finish (the rest do not start)."""
    workers = max(1, min(len(commands), _cpus()))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="stoic-cc") as pool:
        futures = [pool.submit(_run, cc, command, deadline) for command in commands]
        try:
            for future in futures:
                future.result()
        finally:
            for future in futures:
                future.cancel()


def _run(cc: str, command: list[str], deadline: float) -> None:
    """Run one compiler command within what is left of ``deadline``.

    :raises KernelsUnavailable: if it fails. :raises subprocess.TimeoutExpired: past the
        deadline. :raises OSError: if it cannot run.
    """
    proc = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=max(deadline - time.monotonic(), 1.0),
        check=False,
    )
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise KernelsUnavailable(f"{cc} failed to build the kernels: {last}")


def _cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cache_key(cc: str, files: dict[str, bytes], version: list[str], flags: tuple[str, ...]) -> str:
    """The build's directory name: a digest of every file's name and bytes (sources and
    headers), the compiler, its version (``--version``'s first line) and the flags, so that a
    change to any of them builds anew."""
    parts = [name.encode() + b"\0" + data for name, data in sorted(files.items())]
    return hashlib.sha256(
        b"\0".join([*parts, cc.encode(), *(v.encode() for v in version), *map(str.encode, flags)])
    ).hexdigest()[:16]


def _built(
    cc: str,
    files: dict[str, bytes],
    version: list[str],
    flags: tuple[str, ...],
    cache_root: Path,
) -> Path:
    """The library built from ``files`` with ``flags`` (once: under :func:`cache_key`).

    :raises KernelsUnavailable: if it cannot be built.
    """
    target = cache_root / "kernels" / cache_key(cc, files, version, flags) / LIBRARY
    if not target.exists():
        started = time.monotonic()
        _log.info("model.kernels.building", compiler=cc, target=str(target))
        try:
            build(cc, files, target, flags)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise KernelsUnavailable(f"cannot build the kernels with {cc}: {e}") from e
        _log.info("model.kernels.built", seconds=round(time.monotonic() - started, 2))
    return target


def build_library(cache_root: Path) -> Path:
    """The kernels' library for this machine under ``cache_root / "kernels"``, built if it is
    not there yet (once per sources, compiler and flags; see the module's docstring).

    :raises KernelsUnavailable: if this machine cannot build or run them (one line: why): not
        x86-64, a CPU without AVX2, FMA or F16C, no C compiler, a failed build.
    """
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise KernelsUnavailable(f"the kernels are for x86-64 CPUs, not {platform.machine()}")
    missing = [f for f in _CPU_FLAGS if f not in cpu_flags()]
    if missing:
        raise KernelsUnavailable(f"this CPU lacks {', '.join(missing)}")
    cc = compiler()
    if cc is None:
        raise KernelsUnavailable("no C compiler (cc, gcc or clang; or $CC) on PATH")
    files = sources()
    try:
        version = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout.splitlines()[:1]
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelsUnavailable(f"cannot run {cc}: {e}") from e
    chosen = flags()
    # a compiler too old for AVX512_BF16 (GCC < 10): the float32 fixed order serves; too old for
    # GFNI (G6's shifts serve) or AVX512_VNNI too (GCC < 8): one-row products stay float32
    optional = [
        (dropped, event)
        for dropped, event in (
            (BF16_FLAGS, "model.kernels.no_bf16"),
            (GFNI_FLAGS, "model.kernels.no_gfni"),
            (VNNI_FLAGS, "model.kernels.no_vnni"),
        )
        if set(dropped) <= set(chosen)
    ]
    while True:
        try:
            return _built(cc, files, version, chosen, cache_root)
        except KernelsUnavailable as e:
            if not optional:
                raise
            dropped, event = optional.pop(0)
            _log.warning(event, reason=str(e))
            chosen = tuple(f for f in chosen if f not in dropped)
