"""The errors a sequence ends with when the executor fails under it."""

from __future__ import annotations

from ..errors import ExecutorFailed, FailureKind
from ._sequence import Seq

__all__ = ["exhausted_error", "failed_error", "isolated_error"]


def isolated_error(seq: Seq, error: BaseException, kind: FailureKind) -> ExecutorFailed:
    return ExecutorFailed(
        f"the model executor failed ({kind}) whenever this request ran, alone too: it was "
        f"isolated as the cause and ended: {error}",
        partial=seq.partial(),
        kind=kind,
        retryable=False,
    )


def exhausted_error(seq: Seq, error: BaseException, kind: FailureKind) -> ExecutorFailed:
    return ExecutorFailed(
        f"the model executor failed ({kind}): {error}; the request had been resumed "
        f"{seq.resumes} times (the most allowed)",
        partial=seq.partial(),
        kind=kind,
        retryable=False,
    )


def failed_error(
    seq: Seq, error: BaseException, kind: FailureKind, prefilling: bool
) -> ExecutorFailed:
    # an OOM while this very sequence was prefilling will likely recur: no retry
    return ExecutorFailed(
        f"the model executor failed ({kind}): {error}; the engine recovered",
        partial=seq.partial(),
        kind=kind,
        retryable=not (kind == "oom" and prefilling),
    )
