"""One flat error taxonomy shared by every layer of stoic.

Every error a caller of :class:`stoic.Engine` can see derives from :class:`StoicError`. The
classes say *what* went wrong and whether a retry can help; how that is shown to an HTTP client
(status, OpenAI error ``type``) is decided in :mod:`stoic.http`, not here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "ContextLengthExceeded",
    "EngineFailed",
    "EngineStarting",
    "EngineStopped",
    "ExecutorFailed",
    "FailureKind",
    "InsufficientMemory",
    "InvalidRequest",
    "ModelNotFound",
    "ModelUnavailable",
    "NotFound",
    "Overloaded",
    "PartialOutput",
    "StoicError",
    "StorageFailed",
]

#: How an executor failure is classified: ``"oom"`` (an allocation failed, whatever raised it:
#: torch's OutOfMemoryError, cuBLAS/cuDNN ``*_ALLOC_FAILED``, the CPU allocator), ``"fatal"`` (the
#: device context is poisoned: an illegal memory access or instruction, an ECC error, a
#: device-side assert, any other ``torch.AcceleratorError``), ``"hang"`` (a
#: step outlived the step timeout), ``"crash"`` (the executor's worker process died: killed,
#: segfault, abort), ``"error"`` (any other exception in the step).
FailureKind = Literal["error", "oom", "fatal", "hang", "crash"]


@dataclass(frozen=True)
class PartialOutput:
    """What a sequence had generated when it ended early."""

    #: the text generated so far (stop strings not yet cut)
    text: str
    #: the token ids generated so far
    token_ids: tuple[int, ...]

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


class StoicError(Exception):
    """Base of every error stoic raises to its callers.

    ``partial`` is set when the error ended a request that had already generated output (an
    executor failure, the engine failing or stopping mid-generation); it is ``None`` for errors
    raised before admission.
    """

    #: whether retrying the same request may succeed (``x-should-retry`` over HTTP)
    retryable: bool = False

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        partial: PartialOutput | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.partial = partial


class InvalidRequest(StoicError):
    """The request is malformed: schema, roles, chat template, sampling parameters."""


class ContextLengthExceeded(InvalidRequest):
    """Prompt plus ``max_tokens`` does not fit the model's context (or the KV cache)."""

    def __init__(self, message: str, *, param: str | None = "messages") -> None:
        super().__init__(message, param=param, code="context_length_exceeded")


class ModelNotFound(StoicError):
    """The request names a model this server does not serve."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="model", code="model_not_found")


class NotFound(StoicError):
    """The request names a stored object (a response) that does not exist, or that the caller's
    API key may not see."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message, param=param, code="not_found")


class StorageFailed(StoicError):
    """The server's database failed (locked past its busy timeout, corrupt, unwritable):
    nothing was stored. ``partial`` carries the output a request had generated."""

    retryable = True

    def __init__(self, message: str, *, partial: PartialOutput | None = None) -> None:
        super().__init__(message, code="storage_failed", partial=partial)


class ModelUnavailable(StoicError):
    """The model cannot be loaded at start-up: no such file or directory, not a model, or the
    default model's wheel is not installed. Raised by :meth:`stoic.Engine.start`, never by a
    request."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="model_unavailable")


class InsufficientMemory(StoicError):
    """The device's memory cannot hold what the configuration asks for: the weights and a step's
    activations leave no room for the KV cache, or warm spare workers were asked for with no
    memory given for them. Raised by :meth:`stoic.Engine.start`, never by a request."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="insufficient_memory")


class Overloaded(StoicError):
    """Admission limits are reached; retry later."""

    retryable = True

    def __init__(self, message: str, *, retry_after: float = 1.0) -> None:
        super().__init__(message, code="overloaded")
        self.retry_after = retry_after


class EngineFailed(StoicError):
    """The engine exceeded its restart intensity (or hit an unrecoverable fault): it serves nothing."""

    def __init__(self, message: str, *, partial: PartialOutput | None = None) -> None:
        super().__init__(message, code="engine_failed", partial=partial)


class EngineStarting(StoicError):
    """The server is up but its model is still loading; retry after ``retry_after`` seconds."""

    retryable = True

    def __init__(self, message: str = "the model is loading", *, retry_after: float = 5.0) -> None:
        super().__init__(message, code="engine_starting")
        self.retry_after = retry_after


class EngineStopped(StoicError):
    """The engine is shutting down or stopped; the request was not (or no longer) served."""

    retryable = True

    def __init__(
        self, message: str = "engine is stopping", *, partial: PartialOutput | None = None
    ) -> None:
        super().__init__(message, code="engine_stopped", partial=partial)


class ExecutorFailed(StoicError):
    """The forward pass failed while this sequence was in flight; the engine recovered.

    ``partial`` carries what the sequence had generated before the failure. A retry may succeed,
    except when the failure was an out-of-memory error that this very request caused (``retryable``
    is then False for it).
    """

    retryable = True

    def __init__(
        self,
        message: str,
        *,
        partial: PartialOutput,
        kind: FailureKind = "error",
        retryable: bool = True,
    ) -> None:
        super().__init__(message, code=f"executor_{kind}", partial=partial)
        self.kind: FailureKind = kind
        self.retryable = retryable
