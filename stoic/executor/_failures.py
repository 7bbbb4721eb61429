"""How an executor failure is classified (see :data:`stoic.errors.FailureKind`).

The forms come from torch's sources and the errors operators report:

* **out of memory** (``"oom"``: the step budget backs off, the worker is kept): every allocation
  failure, whatever raised it. :class:`torch.OutOfMemoryError` (the caching allocator: "CUDA out
  of memory. Tried to allocate ...", "HIP out of memory", "XPU out of memory", and on recent
  torch "MPS backend out of memory"); a :class:`torch.AcceleratorError` or ``RuntimeError`` for
  ``cudaErrorMemoryAllocation`` ("CUDA error: out of memory", a ``cudaMalloc`` outside the
  allocator); the math libraries' own allocation failures, which torch raises as a plain
  ``RuntimeError`` ("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
  cuBLASLt's workspace, "cuDNN error: CUDNN_STATUS_ALLOC_FAILED", cuSOLVER, cuSPARSE, cuFFT,
  cuRAND, hipBLAS, MIOpen); the CPU allocator's ("DefaultCPUAllocator: can't allocate memory" /
  "not enough memory") and Python's :class:`MemoryError`.
* **a poisoned device** (``"fatal"``: the process's CUDA context cannot be used again, so the
  thread executor fails the engine and the process executor replaces its worker): the sticky
  CUDA errors (an illegal memory access or instruction, a misaligned address, an invalid
  program counter, an unspecified launch failure, a launch time-out, a device-side assert, a
  hardware stack error, an uncorrectable ECC or NVLink error, and a cuBLAS execution failure,
  which such a fault leaves behind), and every other :class:`torch.AcceleratorError` (since
  torch 2.8 each failed CUDA runtime call raises one) but those below.
* anything else is ``"error"``: the step failed, the device is fine. That includes the
  :class:`torch.AcceleratorError` of the CUDA errors that a call reports before any work runs
  and that leave the context usable (:data:`_CONTEXT_SURVIVES`: an invalid argument or launch
  configuration, a kernel asking for more resources than a launch has, no kernel image for the
  device, an unsupported operation): failing the engine for one of those (the thread executor
  shares the server's context) would turn a bad request's shape into an outage.
"""

from __future__ import annotations

import signal

import torch

from ..errors import FailureKind

__all__ = ["ExecutorFault", "classify_failure", "kv_survives"]

#: how a worker may end and leave its memory as its completed steps wrote it: killed from
#: outside (an operator's or the kernel OOM killer's SIGKILL, a watchdog's SIGTERM of a hang)
_CLEAN_KILLS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP})

#: lower-case parts of the messages of every allocation failure torch and its libraries raise
_OOM_MARKERS = (
    "out of memory",  # CUDA/HIP/XPU/MPS allocators, cudaErrorMemoryAllocation
    "_alloc_failed",  # CUBLAS_/CUDNN_/CUSOLVER_/CUSPARSE_/HIPBLAS_STATUS_ALLOC_FAILED, CUFFT_
    "allocation_failed",  # CURAND_STATUS_ALLOCATION_FAILED
    "statusallocfailed",  # miopenStatusAllocFailed
    "hiperroroutofmemory",
    "can't allocate memory",  # DefaultCPUAllocator (POSIX)
    "defaultcpuallocator: not enough memory",  # DefaultCPUAllocator (Windows)
)

#: lower-case parts of the messages of the errors after which the CUDA context cannot be
#: trusted: recovery in the same process is impossible
_FATAL_MARKERS = (
    "illegal memory access",  # cudaErrorIllegalAddress
    "illegal instruction",  # cudaErrorIllegalInstruction
    "misaligned address",  # cudaErrorMisalignedAddress
    "invalid program counter",  # cudaErrorInvalidPc
    "unspecified launch failure",  # cudaErrorLaunchFailure
    "launch timed out",  # cudaErrorLaunchTimeout
    "device-side assert triggered",  # cudaErrorAssert
    "hardware stack error",  # cudaErrorHardwareStackError
    "uncorrectable ecc error",  # cudaErrorECCUncorrectable
    "uncorrectable nvlink error",  # cudaErrorNvlinkUncorrectable
    "cublas_status_execution_failed",  # a kernel the context's fault took down
)

#: the CUDA error codes (``torch.AcceleratorError.error_code``) of failures that leave the
#: context usable: reported by the call itself, before any work ran. The CUDA runtime's
#: documentation marks the sticky errors ("the process is left in an inconsistent state");
#: none of these is one
_CONTEXT_SURVIVES = frozenset(
    {
        1,  # cudaErrorInvalidValue ("invalid argument")
        9,  # cudaErrorInvalidConfiguration ("invalid configuration argument")
        98,  # cudaErrorInvalidDeviceFunction
        209,  # cudaErrorNoKernelImageForDevice
        701,  # cudaErrorLaunchOutOfResources ("too many resources requested for launch")
        801,  # cudaErrorNotSupported
    }
)

#: ``torch.AcceleratorError`` where this torch has it (2.8 and later)
_ACCELERATOR_ERROR: type[BaseException] | None = getattr(torch, "AcceleratorError", None)


class ExecutorFault(RuntimeError):
    """A step failed in the worker process, or the worker died or hung; ``kind`` says which.

    ``pid`` is the worker process's when known, and ``exitcode`` how it ended once it has
    (:attr:`subprocess.Popen.returncode`: ``-N`` for signal N).
    """

    def __init__(
        self,
        message: str,
        kind: FailureKind,
        *,
        pid: int | None = None,
        exitcode: int | None = None,
    ) -> None:
        super().__init__(message)
        self.kind: FailureKind = kind
        self.pid = pid
        self.exitcode = exitcode

    def exit_fields(self) -> dict[str, object]:
        """``pid``, and ``signal`` (its name) or ``exit_code``, for a log event: those known."""
        fields: dict[str, object] = {}
        if self.pid is not None:
            fields["pid"] = self.pid
        if self.exitcode is not None and self.exitcode < 0:
            try:
                fields["signal"] = signal.Signals(-self.exitcode).name
            except ValueError:
                fields["signal"] = -self.exitcode
        elif self.exitcode is not None:
            fields["exit_code"] = self.exitcode
        return fields


def classify_failure(error: BaseException) -> FailureKind:
    """``"oom"`` (any allocation failure), ``"fatal"`` (a poisoned device context), ``"crash"`` /
    ``"hang"`` (the worker process died or was killed for hanging), or ``"error"``."""
    if isinstance(error, ExecutorFault):
        return error.kind
    text = str(error).lower()
    if isinstance(error, torch.OutOfMemoryError | MemoryError) or any(
        marker in text for marker in _OOM_MARKERS
    ):
        return "oom"
    if any(marker in text for marker in _FATAL_MARKERS):
        return "fatal"
    if _ACCELERATOR_ERROR is not None and isinstance(error, _ACCELERATOR_ERROR):
        return "error" if getattr(error, "error_code", None) in _CONTEXT_SURVIVES else "fatal"
    return "error"


def kv_survives(error: BaseException, kind: FailureKind) -> bool:
    """Whether KV pools that outlive the worker may be trusted after it failed with ``error``.

    Kept (what completed steps wrote is intact; the failed step wrote only positions no
    completed step committed): a step that raised (``error``), a worker killed for hanging
    (``hang``), and a worker that died from a signal sent from outside (SIGKILL: an operator,
    the kernel's OOM killer; SIGTERM, SIGINT, SIGHUP) or exited with a status (a Python-level
    exit). Dropped: an out-of-memory failure (the seed's semantics: drop, and back the budget
    off; the memory is given back), a poisoned device (``fatal``), and a worker that died from
    a fault of its own (SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT: memory corruption is possible)
    or in a way not known.
    """
    if kind in ("error", "hang"):
        return True
    if kind != "crash":
        return False
    code = error.exitcode if isinstance(error, ExecutorFault) else None
    if code is None:
        return False
    if code >= 0:
        return True
    try:
        return signal.Signals(-code) in _CLEAN_KILLS
    except ValueError:
        return False
