"""One flat error taxonomy shared by every layer of stoic.

Every error a caller of :class:`stoic.Engine` can see derives from :class:`StoicError`. Each class
carries the HTTP status the server maps it to and whether a client retry can help, so the HTTP
layer never guesses (see ``docs/architecture.md``, "Errors and HTTP").
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ContextLengthExceeded",
    "EngineFailed",
    "EngineStopped",
    "ExecutorFailed",
    "InvalidRequest",
    "ModelNotFound",
    "Overloaded",
    "PartialOutput",
    "StoicError",
]


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
    """Base of every error stoic raises to its callers."""

    #: HTTP status the server answers with
    status: int = 500
    #: OpenAI error ``type``
    error_type: str = "internal_error"
    #: whether retrying the same request may succeed (``x-should-retry``)
    retryable: bool = False

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequest(StoicError):
    """The request is malformed: schema, roles, chat template, sampling parameters."""

    status = 400
    error_type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    """Prompt plus ``max_tokens`` does not fit the model's context (or the KV cache)."""

    def __init__(self, message: str, *, param: str | None = "messages") -> None:
        super().__init__(message, param=param, code="context_length_exceeded")


class ModelNotFound(StoicError):
    """The request names a model this server does not serve."""

    status = 404
    error_type = "not_found_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, param="model", code="model_not_found")


class Overloaded(StoicError):
    """Admission limits are reached; retry later."""

    status = 429
    error_type = "rate_limit_error"
    retryable = True

    def __init__(self, message: str, *, retry_after: float = 1.0) -> None:
        super().__init__(message, code="overloaded")
        self.retry_after = retry_after


class EngineFailed(StoicError):
    """The engine exceeded its restart intensity (or hit an unrecoverable fault): it serves nothing."""

    status = 503
    error_type = "service_unavailable"
    retryable = False

    def __init__(self, message: str, *, partial: PartialOutput | None = None) -> None:
        super().__init__(message, code="engine_failed")
        self.partial = partial


class EngineStopped(StoicError):
    """The engine is shutting down or stopped; the request was not (or no longer) served."""

    status = 503
    error_type = "service_unavailable"
    retryable = True

    def __init__(
        self, message: str = "engine is stopping", *, partial: PartialOutput | None = None
    ) -> None:
        super().__init__(message, code="engine_stopped")
        self.partial = partial


class ExecutorFailed(StoicError):
    """The forward pass failed while this sequence was in flight; the engine recovered.

    ``partial`` carries what the sequence had generated before the failure. A retry may succeed,
    except when the failure was an out-of-memory error that this very request caused (``retryable``
    is then False for it).
    """

    status = 500
    error_type = "server_error"
    retryable = True

    def __init__(
        self,
        message: str,
        *,
        partial: PartialOutput,
        kind: str = "error",
        retryable: bool = True,
    ) -> None:
        super().__init__(message, code=f"executor_{kind}")
        self.partial = partial
        self.kind = kind
        self.retryable = retryable
