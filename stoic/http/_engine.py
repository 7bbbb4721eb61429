"""The part of :class:`stoic.Engine` the HTTP layer uses, as structural types.

The application only talks to the engine through these protocols, so any object with the same
surface (the real engine, or a fake in tests) can be served. What it is asked to generate is the
engine's own value object, :class:`~stoic.Request`; its statistics and health are the engine's own
records, :class:`~stoic.EngineStats` and :class:`~stoic.Health`: no protocol restates their fields.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from ..config import EngineConfig, FaultSpec
from ..engine import Delta, EngineStats, Health, Request
from ..errors import EngineFailed
from ..worker import CacheSizing

__all__ = ["EngineLike", "RequestStreamLike"]


class RequestStreamLike(Protocol):
    """One admitted request's output: an async iterator of :class:`~stoic.Delta`."""

    @property
    def request_id(self) -> str: ...

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def cached_tokens(self) -> int: ...

    def __aiter__(self) -> AsyncIterator[Delta]: ...

    async def aclose(self) -> None:
        """Abort the request if it has not finished (frees its KV blocks); idempotent."""


class EngineLike(Protocol):
    """What :func:`stoic.http.create_app` needs from the engine it serves."""

    @property
    def model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def config(self) -> EngineConfig: ...

    @property
    def kv_sizing(self) -> CacheSizing | None:
        """How the KV cache was sized (None where no one process sized it: replicas on Ray).

        :raises ~stoic.errors.EngineStarting: while the model loads.
        """
        ...

    @property
    def chat_template(self) -> str | dict[str, str] | None:
        """The model's chat template (how tool calls are written depends on it).

        :raises ~stoic.errors.EngineStarting: while the model loads.
        """
        ...

    async def submit(self, request: Request) -> RequestStreamLike:
        """Validate, tokenise and admit ``request``.

        :raises ~stoic.errors.StoicError: (InvalidRequest, ContextLengthExceeded, Overloaded,
            EngineFailed, EngineStopped) before anything is generated.
        """
        ...

    def tokenize(self, request: Request) -> list[int]:
        """The token ids ``submit`` would feed the model for ``request``.

        :raises ~stoic.errors.InvalidRequest: neither prompt nor messages or both, or the chat
            template fails.
        """
        ...

    def detokenize(self, token_ids: list[int]) -> str:
        """The text of ``token_ids``.

        :raises ~stoic.errors.InvalidRequest: an id outside the vocabulary.
        """
        ...

    def stats(self) -> EngineStats:
        """The engine's counters now (an idle record, :meth:`EngineStats.idle`, while nothing
        has run: a fake engine in tests overrides fields of one)."""
        ...

    def health(self) -> Health: ...

    async def inject_fault(self, spec: FaultSpec) -> None: ...

    async def clear_faults(self) -> None: ...

    async def wait_failed(self) -> EngineFailed:
        """Return once the engine is failed (restart intensity exceeded)."""
        ...
