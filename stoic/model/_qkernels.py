"""Building and calling stoic's quantised-weight matrix products (``_qkernels.c``).

The C source is compiled once per (source, compiler, flags) into the cache directory with the
machine's C compiler, and loaded with :mod:`ctypes` (a call releases the GIL). Why C through
``ctypes`` and not a torch extension: the source is ~150 lines with no torch headers, so it
compiles in about a second where a ``torch.utils.cpp_extension`` build takes a minute and needs
ninja; and why our own kernel at all: torch's weight-only int8/int4 CPU kernels were measured 8x
*slower* than the float32 product on an AVX2 CPU (docs/benchmarks.md, "Single-stream speed").

Where the kernels cannot run (not x86-64, no AVX2/FMA/F16C, no C compiler, a failed build)
:func:`load_kernels` says why and the model runs on its de-quantised float weights, as before.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.resources
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .._logging import get_logger

__all__ = ["GGML_TYPES", "Kernels", "KernelsUnavailable", "load_kernels"]

#: GGML type ids the kernels compute on, with their block size in bytes (32 weights a block)
GGML_TYPES: dict[str, tuple[int, int]] = {"Q4_0": (2, 18), "Q4_1": (3, 20), "Q8_0": (8, 34)}
#: the repacked layout (``_qkernels.c``) the products read for each GGML type
_LAYOUTS = {"Q4_0": 102, "Q4_1": 101, "Q8_0": 100}
_FLAGS = (
    "-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared",
    "-Wall", "-Werror",
)  # fmt: skip
_CPU_FLAGS = ("avx2", "fma", "f16c")
_COMPILE_TIMEOUT_S = 120.0
_log = get_logger("stoic.model")
get_threads = torch.get_num_threads


class KernelsUnavailable(RuntimeError):
    """The quantised kernels cannot run here; the message says why (one line)."""


@dataclass(frozen=True)
class Kernels:
    """The loaded library. Thread-safe: calls share nothing but their arguments."""

    path: Path
    _qmm: Callable[..., int]
    _dequantize: Callable[..., int]
    _repack: Callable[..., int]
    _packed_bytes: Callable[[int], int]

    def mm(
        self, kind: str, x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x @ W.T (+ bias)`` for ``x`` ``[M, K]`` float32 contiguous and ``W`` held as
        ``blocks`` (uint8 ``[N, K / 32 * block_bytes]`` of GGML type ``kind``); float32
        ``[M, N]``. Repacks the blocks on every call: a step uses :meth:`bind`.

        :raises ValueError: if the shapes or dtypes do not fit (nothing is computed).
        """
        return self.bind(kind, blocks, bias)(x)

    def bind(
        self, kind: str, blocks: torch.Tensor, bias: torch.Tensor | None
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """:meth:`mm` by these blocks and bias: the blocks are checked and repacked into the
        products' layout once (float32 scales, nibbles reordered: 0.625-1.125 bytes a weight),
        so a decode step pays a ctypes call and an output allocation.

        :raises ValueError: if the blocks or the bias do not fit (here), or when called with an
            ``x`` of another width, dtype or layout.
        """
        type_id, block_bytes = GGML_TYPES[kind]
        n, row_bytes = blocks.shape
        cols = row_bytes // block_bytes * 32
        if blocks.dtype != torch.uint8 or not blocks.is_contiguous() or row_bytes % block_bytes:
            raise ValueError(f"not {kind} blocks: {blocks.dtype} {tuple(blocks.shape)}")
        if bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,)):
            raise ValueError(f"a bias of {tuple(bias.shape)} for {n} outputs")
        packed = torch.empty(n, cols // 32 * self._packed_bytes(type_id), dtype=torch.uint8)
        if self._repack(type_id, blocks.data_ptr(), n, cols, packed.data_ptr()) != 0:
            raise ValueError(f"cannot repack {kind} blocks {tuple(blocks.shape)}")
        bias = None if bias is None else bias.contiguous()
        qmm, w_ptr, layout = self._qmm, packed.data_ptr(), _LAYOUTS[kind]
        b_ptr = None if bias is None else bias.data_ptr()
        f32 = torch.float32

        def product(x: torch.Tensor, _keep: tuple[object, ...] = (packed, bias)) -> torch.Tensor:
            if x.dtype != f32 or x.dim() != 2 or x.shape[1] != cols or not x.is_contiguous():
                raise ValueError(f"cannot multiply x {tuple(x.shape)} by {kind} {(n, cols)}")
            m = x.shape[0]
            y = torch.empty(m, n, dtype=f32)
            qmm(layout, x.data_ptr(), m, cols, w_ptr, n, b_ptr, y.data_ptr(), get_threads())
            return y

        return product

    def dequantize(self, kind: str, blocks: torch.Tensor, cols: int) -> torch.Tensor:
        """The float32 ``[N, cols]`` matrix ``blocks`` holds, as :meth:`mm` sees it."""
        type_id, block_bytes = GGML_TYPES[kind]
        if cols % 32 or blocks.shape[1] != cols // 32 * block_bytes or not blocks.is_contiguous():
            raise ValueError(f"{kind} blocks {tuple(blocks.shape)} do not hold {cols} columns")
        out = torch.empty(blocks.shape[0], cols, dtype=torch.float32)
        self._dequantize(type_id, blocks.data_ptr(), blocks.shape[0], cols, out.data_ptr())
        return out


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc)
    return shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _source() -> bytes:
    return importlib.resources.files(__package__).joinpath("_qkernels.c").read_bytes()


def _build(cc: str, source: bytes, target: Path) -> None:
    """Compile ``source`` into ``target`` (atomically: a concurrent build of the same key is
    harmless, the last rename wins with identical bytes)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / "qkernels.c"
        src.write_bytes(source)
        out = Path(tmp) / target.name
        proc = subprocess.run(
            [cc, *_FLAGS, "-o", str(out), str(src)],
            capture_output=True,
            text=True,
            timeout=_COMPILE_TIMEOUT_S,
            check=False,
        )
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise KernelsUnavailable(f"{cc} failed to build the kernels: {last}")
        os.replace(out, target)


def load_kernels(cache_root: Path) -> Kernels:
    """Build (once) and load the kernels, under ``cache_root / "kernels"``.

    :raises KernelsUnavailable: if this machine cannot run them (one line: why).
    """
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise KernelsUnavailable(f"the kernels are for x86-64 CPUs, not {platform.machine()}")
    missing = [f for f in _CPU_FLAGS if f not in _cpu_flags()]
    if missing:
        raise KernelsUnavailable(f"this CPU lacks {', '.join(missing)}")
    cc = _compiler()
    if cc is None:
        raise KernelsUnavailable("no C compiler (cc, gcc or clang; or $CC) on PATH")
    source = _source()
    try:
        version = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout.splitlines()[:1]
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelsUnavailable(f"cannot run {cc}: {e}") from e
    key = hashlib.sha256(
        b"\0".join([source, cc.encode(), *(v.encode() for v in version), *map(str.encode, _FLAGS)])
    ).hexdigest()[:16]
    target = cache_root / "kernels" / key / "libstoic_qkernels.so"
    if not target.exists():
        started = time.monotonic()
        _log.info("model.kernels.building", compiler=cc, target=str(target))
        try:
            _build(cc, source, target)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise KernelsUnavailable(f"cannot build the kernels with {cc}: {e}") from e
        _log.info("model.kernels.built", seconds=round(time.monotonic() - started, 2))
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as e:
        raise KernelsUnavailable(f"cannot load {target}: {e}") from e
    qmm, deq, repack, size = (
        lib.stoic_qmm,
        lib.stoic_dequantize,
        lib.stoic_repack,
        lib.stoic_repacked_bytes,
    )
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    qmm.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr, ptr, ctypes.c_int]
    deq.argtypes = [ctypes.c_int, ptr, i64, i64, ptr]
    repack.argtypes = [ctypes.c_int, ptr, i64, i64, ptr]
    size.argtypes = [ctypes.c_int]
    qmm.restype = deq.restype = repack.restype = ctypes.c_int
    size.restype = i64
    return Kernels(target, qmm, deq, repack, size)
