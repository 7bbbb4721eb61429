"""The ingress side: an :class:`~stoic.http.EngineLike` whose requests run on Serve replicas, so
that stoic's own HTTP application (one code path) serves a Ray deployment.

Requests go to the replicas through a streaming deployment handle (Serve routes them: power of
two choices on ongoing requests). When the replica holding a stream dies or its engine fails,
the stream *migrates*: the request is sent again, to whichever replica Serve picks, with the
tokens generated so far as its :attr:`~stoic.Request.generated` (the replica continues after them
as after its own ``--recovery resume``: same budget, same random stream, same penalties), and the
client sees a pause (:class:`MigratingStream`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from .._logging import get_logger
from ..config import EngineConfig, FaultSpec
from ..engine import Delta, EngineStats, Health, Request, TokenCodec
from ..errors import EngineFailed, EngineStopped, Overloaded, PartialOutput, StoicError
from ._redecode import Continuation
from ._stats import ReplicaView
from ._wire import Admitted, Failure, unpack_error

__all__ = ["MigratingStream", "RayEngine"]

_log = get_logger("stoic.ray")

#: errors of a replica (not of the request) after which a request is sent to another replica
_MIGRATE_ON: tuple[type[StoicError], ...] = (EngineFailed, EngineStopped)


def _backpressure(exc: BaseException) -> bool:
    """Whether ``exc`` is Serve refusing a request because its queue is full
    (``max_queued_requests``)."""
    from ray.serve.exceptions import BackPressureError

    return isinstance(exc, BackPressureError)


def _replica_lost(exc: BaseException) -> bool:
    """Whether ``exc`` says the replica is gone (its actor died or cannot be reached)."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import DeploymentUnavailableError

    return isinstance(exc, RayActorError | DeploymentUnavailableError)


class RayEngine:
    """Serves requests on the engine replicas behind ``handle`` (a Serve deployment handle to
    :class:`~stoic.ray.EngineReplica`).

    :param codec: the model's tokenizer (``/tokenize``, ``/detokenize``, and the prompt of a
        migrated request).
    :param max_migrations: times one request may move to another replica; then it fails with
        :class:`~stoic.errors.EngineFailed` carrying its partial output.
    :param admission_timeout: how long a request is tried again while the replicas Serve
        routes it to are gone or failed (their replacements starting).
    :param retry_delay: the first pause between those tries (doubling, at most 2 s).
    :param view: the replicas' statistics and health (from their board).
    """

    def __init__(
        self,
        handle: Any,
        config: EngineConfig,
        codec: TokenCodec,
        *,
        model_name: str,
        max_model_len: int,
        view: ReplicaView,
        max_migrations: int = 3,
        admission_timeout: float = 30.0,
        retry_delay: float = 0.25,
    ) -> None:
        self._handle = handle
        self._config = config
        self._codec = codec
        self._model_name = model_name
        self._max_model_len = max_model_len
        self.view = view
        self.max_migrations = max_migrations
        self.admission_timeout = admission_timeout
        self.retry_delay = retry_delay
        self._stream_handle = handle.options(stream=True)
        self._never = asyncio.get_running_loop().create_future()

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def config(self) -> EngineConfig:
        return self._config

    @property
    def routing(self) -> str:
        """How Serve picks a replica for a request (``--routing``)."""
        return self.view.routing

    @property
    def kv_sizing(self) -> None:
        """Each replica sized its own cache: /metrics has their blocks."""
        return None

    @property
    def codec(self) -> TokenCodec:
        return self._codec

    @property
    def chat_template(self) -> str | dict[str, str] | None:
        return self._codec.chat_template

    def call(self, request: Request) -> Any:
        """Start ``request`` on a replica Serve picks: a ``DeploymentResponseGenerator``."""
        return self._stream_handle.generate.remote(request)

    async def submit(self, request: Request) -> MigratingStream:
        """Admit ``request`` on a replica; the same contract as :meth:`stoic.Engine.submit`.

        A replica that is gone or failed before admitting it is tried again elsewhere (for up to
        ``admission_timeout`` seconds).

        :raises ~stoic.errors.StoicError: the replica's refusal (InvalidRequest,
            ContextLengthExceeded, Overloaded...), or EngineFailed when no replica admitted it.
        """
        stream = MigratingStream(self, request)
        await stream.open()
        return stream

    def tokenize(self, request: Request) -> list[int]:
        return self._codec.tokenize(request)

    def detokenize(self, token_ids: list[int]) -> str:
        return self._codec.detokenize(token_ids)

    def stats(self) -> EngineStats:
        """The replicas' statistics summed (see :class:`~stoic.ray._stats.ReplicaView`)."""
        return self.view.total()

    def health(self) -> Health:
        """Serving while any replica serves."""
        return self.view.health()

    def replicas(self) -> list[Any]:
        """The replicas' latest postings (:class:`~stoic.ray._board.Posting`: id, pid, stats,
        health), one per replica alive: the console's replica rows."""
        return list(self.view.postings)

    def metric_collectors(self) -> list[Any]:
        """Per-replica metrics, for :class:`stoic.http` to add to ``/metrics``."""
        return [self.view.collector()]

    async def inject_fault(self, spec: FaultSpec) -> None:
        """Arm ``spec`` on one replica (the one Serve picks).

        :raises ~stoic.errors.InvalidRequest: fault injection is disabled, or the fault needs
            the process executor.
        """
        await self.inject_fault_on_replica(spec)

    async def inject_fault_on_replica(self, spec: FaultSpec) -> str:
        """:meth:`inject_fault`, returning the id of the replica that armed it."""
        return _replica_or_raise(await self._handle.inject_fault.remote(spec))

    async def clear_faults(self) -> None:
        """Disarm the faults of one replica (the one Serve picks)."""
        _replica_or_raise(await self._handle.clear_faults.remote())

    async def wait_failed(self) -> EngineFailed:
        """Never returns: Serve replaces a failed replica (``--exit-on-fatal`` has nothing to do)."""
        await asyncio.shield(self._never)
        raise AssertionError("unreachable")  # pragma: no cover


def _replica_or_raise(answer: str | Failure) -> str:
    if isinstance(answer, Failure):
        raise unpack_error(answer)
    return answer


class MigratingStream:
    """One request's deltas, whichever replicas produce them (a
    :class:`~stoic.http.RequestStreamLike`).

    Iteration raises what a :class:`stoic.RequestStream` raises. When the replica dies or its
    engine fails mid-stream, the request continues on another replica after the tokens generated
    so far (sent as its ``generated``: they count toward ``max_tokens`` and ``min_tokens``, the
    penalties see them, a ``seed``'s random stream goes on at their count). Its output is then
    the uninterrupted one wherever the replicas compute the same logits: in float32, or with
    ``deterministic`` (greedy and seeded alike). A constrained request (``response_format``,
    tools with a grammar) moves too: the new replica's grammar matcher replays the tokens
    generated so far before its first step, so it goes on in the grammar's state.
    The client's usage is the ingress's own count: the first admission's prompt tokens, every
    token generated once. :meth:`aclose` cancels the call on the replica, which aborts the
    request there and frees its KV blocks.
    """

    def __init__(self, engine: RayEngine, request: Request) -> None:
        self._engine = engine
        self._request = request
        self.request_id = request.request_id
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.migrations = 0
        #: replicas that held the request, in order
        self.replicas: list[str] = []
        self._call: Any = None
        self._done = False
        self._ids: list[int] = []
        self._text: list[str] = []
        self._continuation: Continuation | None = None
        self._prompt_ids: list[int] | None = None
        #: tokens generated before the current replica took the request
        self._base = 0

    # -- admission ------------------------------------------------------------------------------
    async def open(self) -> None:
        """Admit the request on a replica (see :meth:`RayEngine.submit`)."""
        await self._start(self._request)

    async def _start(self, request: Request) -> None:
        """Start ``request`` on a replica. While the replica Serve picks is gone or failed
        (Serve's router learns of a death at once, of a failed engine after its health checks,
        seconds), try again, backing off, for up to the engine's ``admission_timeout``.

        :raises ~stoic.errors.StoicError: the replica's refusal of the request itself.
        :raises ~stoic.errors.EngineFailed: no replica admitted it in time.
        """
        deadline = time.monotonic() + self._engine.admission_timeout
        tries = 0
        while True:
            call = self._engine.call(request)
            try:
                first = await call.__anext__()
            except BaseException as exc:
                call.cancel()
                if _backpressure(exc):  # Serve's queue is full: the single server's 429
                    raise Overloaded(
                        "every replica is busy and the queue is full; retry later"
                    ) from exc
                if not _replica_lost(exc):
                    raise
                why = f"replica lost: {type(exc).__name__}"
            else:
                if isinstance(first, Admitted):
                    self._call = call
                    self.replicas.append(first.replica)
                    self.prompt_tokens = self.prompt_tokens or first.prompt_tokens
                    return
                error = unpack_error(first) if isinstance(first, Failure) else None
                if error is None or not isinstance(error, _MIGRATE_ON):
                    raise error or EngineFailed(f"unexpected answer from a replica: {first!r}")
                why = f"replica refused: {error.message}"
            tries += 1
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineFailed(
                    f"no replica admitted the request within "
                    f"{self._engine.admission_timeout:g} s (last: {why})",
                    partial=self._partial() if self._ids else None,
                )
            _log.info("ray.admission_retry", request_id=self.request_id, reason=why, tries=tries)
            await asyncio.sleep(min(self._engine.retry_delay * 2 ** (tries - 1), 2.0, left))

    # -- migration ------------------------------------------------------------------------------
    async def _migrate(self, why: str) -> None:
        """Continue on another replica from the tokens generated so far.

        :raises ~stoic.errors.EngineFailed: the request moved ``max_migrations`` times already,
            carrying its partial output.
        """
        with contextlib.suppress(Exception):
            self._call.cancel()
        self._call = None
        if self.migrations >= self._engine.max_migrations:
            raise EngineFailed(
                f"the request's replica was lost ({why}) and it cannot move again "
                f"(moved {self.migrations} times)",
                partial=self._partial(),
            )
        self.migrations += 1
        self._engine.view.migrated += 1
        _log.warning(
            "ray.request_migrating",
            request_id=self.request_id,
            reason=why,
            migration=self.migrations,
            generated=len(self._ids),
        )
        await self._start(self._continuation_request())

    def _continuation_request(self) -> Request:
        """The request that continues this one on another replica: its prompt's token ids, its
        own budget (``max_tokens``, ``min_tokens``) and the tokens generated so far as
        ``generated``; stop strings are left to the ingress (a stop string may span the
        migration: :class:`~stoic.ray._redecode.Continuation` cuts them)."""
        original = self._request
        params = original.params
        if self._prompt_ids is None:
            self._prompt_ids = self._original_prompt_ids()
        self._base = len(self._ids)
        self._continuation = Continuation(
            self._engine.codec.tokenizer.backend_tokenizer, params, self._ids, "".join(self._text)
        )
        return Request(
            tuple(self._prompt_ids),
            dataclasses.replace(params, stop=()),
            request_id=f"{original.request_id}~m{self.migrations}",
            generated=tuple(self._ids),
            # the same tenant and priority; the timeout starts over on the new replica (its
            # deadline is the replica's clock's: a migration is rare, and late by one start)
            tenant=original.tenant,
            priority=original.priority,
            timeout=original.timeout,
        )

    def _original_prompt_ids(self) -> list[int]:
        """The prompt's token ids, exactly as the first replica's intake computed them."""
        return self._engine.codec.tokenize(self._request)

    def _partial(self) -> PartialOutput:
        return PartialOutput(text="".join(self._text), token_ids=tuple(self._ids))

    # -- the stream -----------------------------------------------------------------------------
    def __aiter__(self) -> AsyncIterator[Delta]:
        return self

    async def __anext__(self) -> Delta:
        while True:
            if self._done or self._call is None:
                raise StopAsyncIteration
            try:
                item = await self._call.__anext__()
            except StopAsyncIteration:
                await self._migrate("the replica ended the stream early")
                continue
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                if not _replica_lost(exc):
                    raise
                await self._migrate(f"replica lost: {type(exc).__name__}")
                continue
            if isinstance(item, Failure):
                await self._failed(unpack_error(item))
                continue
            return self._take(item)

    async def _failed(self, error: StoicError) -> None:
        """The replica ended the stream with ``error``: migrate, or raise it (with the partial
        output of the whole request)."""
        if isinstance(error, _MIGRATE_ON):
            await self._migrate(f"{type(error).__name__}: {error.message}")
            return
        self._done = True
        if error.partial is not None and self.migrations:
            # the continuation's partial output starts at the migration: prepend what came before
            ids = (*self._ids[: self._base], *error.partial.token_ids)
            text = self._engine.codec.tokenizer.decode(
                list(ids), skip_special_tokens=self._request.params.skip_special_tokens
            )
            error.partial = PartialOutput(text=text, token_ids=ids)
        raise error

    def _take(self, delta: Delta) -> Delta:
        text, stop = delta.text, delta.stop_reason
        finish = delta.finish_reason
        if self._continuation is not None:
            text, matched = self._continuation.take(delta)
            if matched is not None:
                finish, stop = "stop", matched
        self._ids.extend(delta.token_ids)
        self._text.append(text)
        if delta.cached_tokens and not self.migrations:
            self.cached_tokens = delta.cached_tokens
        if finish is not None:
            self._done = True
            if delta.finish_reason is None:  # a stop string the ingress cut: end it there
                self._call.cancel()
        return Delta(
            self.request_id,
            text,
            delta.token_ids,
            delta.logprobs,
            finish,
            self.prompt_tokens,
            len(self._ids),
            stop,
            self.cached_tokens,
        )

    @property
    def done(self) -> bool:
        return self._done

    async def aclose(self) -> None:
        """Abort the request on the replica that holds it (idempotent)."""
        if not self._done and self._call is not None:
            self._done = True
            self._call.cancel()
        self._done = True

    async def __aenter__(self) -> MigratingStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
