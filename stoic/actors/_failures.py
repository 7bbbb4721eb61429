"""How an executor failure is classified (see :data:`stoic.errors.FailureKind`)."""

from __future__ import annotations

import torch

from ..errors import FailureKind

__all__ = ["ExecutorFault", "classify_failure"]

# errors after which the CUDA context cannot be trusted: recovery in the same process is impossible
_FATAL_MARKERS = (
    "illegal memory access",
    "device-side assert",
    "unspecified launch failure",
    "cuda error: misaligned",
)


class ExecutorFault(RuntimeError):
    """A step failed in the worker process, or the worker died or hung; ``kind`` says which."""

    def __init__(self, message: str, kind: FailureKind) -> None:
        super().__init__(message)
        self.kind: FailureKind = kind


def classify_failure(error: BaseException) -> FailureKind:
    """``"oom"``, ``"fatal"`` (poisoned device context), ``"crash"`` / ``"hang"`` (the worker
    process died or was killed for hanging), or ``"error"``."""
    if isinstance(error, ExecutorFault):
        return error.kind
    if isinstance(error, torch.OutOfMemoryError):
        return "oom"
    text = str(error).lower()
    if any(marker in text for marker in _FATAL_MARKERS):
        return "fatal"
    return "error"
