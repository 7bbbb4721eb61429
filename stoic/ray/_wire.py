"""What travels between the ingress and an engine replica (pickled by Ray).

A replica's ``generate`` takes the engine's own :class:`~stoic.Request` (plain picklable data) and
yields one :class:`Admitted` (or one :class:`Failure`: the request was
refused), then the request's :class:`~stoic.Delta` items, and a :class:`Failure` if generation
ends early. Errors travel as data, not as raised exceptions: stoic's errors have keyword-only
constructor arguments that Ray's exception pickling would lose, and a refusal must reach the
client exactly as a single server would answer it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .. import errors
from ..errors import StoicError

__all__ = ["Admitted", "Failure", "pack_error", "unpack_error"]


@dataclass(frozen=True, slots=True)
class Admitted:
    """The replica admitted the request."""

    request_id: str
    prompt_tokens: int
    #: the replica's id (Serve's unique replica tag)
    replica: str


@dataclass(frozen=True, slots=True)
class Failure:
    """A :class:`~stoic.errors.StoicError`, as data."""

    name: str
    message: str
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def error_type(self) -> type[StoicError]:
        cls = getattr(errors, self.name, None)
        return cls if isinstance(cls, type) and issubclass(cls, StoicError) else StoicError


def pack_error(exc: StoicError) -> Failure:
    """``exc`` as data (its class must be one of :mod:`stoic.errors`)."""
    return Failure(type(exc).__name__, exc.message, dict(vars(exc)))


def unpack_error(failure: Failure) -> StoicError:
    """The error :func:`pack_error` packed: same class, message and attributes (``partial``,
    ``param``, ``code``, ``retry_after``, ``kind``...)."""
    cls = failure.error_type
    exc = cls.__new__(cls)
    Exception.__init__(exc, failure.message)
    vars(exc).update(failure.attrs)
    return exc
