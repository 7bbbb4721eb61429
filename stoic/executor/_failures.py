"""How an executor failure is classified (see :data:`stoic.errors.FailureKind`)."""

from __future__ import annotations

import signal

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
