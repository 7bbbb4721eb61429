"""Per-app state shared by the handlers, and per-request bookkeeping."""

from __future__ import annotations

import asyncio
import contextvars
import time
import uuid
from dataclasses import dataclass, field

from aiohttp import web

from ._engine import EngineLike
from ._limits import ServerLimits
from ._metrics import Metrics, Outcome

__all__ = ["RECORD", "REQUEST_ID", "STATE", "AppState", "RequestRecord"]


@dataclass
class RequestRecord:
    """One generation request's bookkeeping for metrics and logs."""

    endpoint: str
    request_id: str
    started: float = field(default_factory=time.monotonic)
    outcome: Outcome = "success"
    #: the whole response was handed to the client (a hang-up after it is not an abort)
    delivered: bool = False


@dataclass
class AppState:
    engine: EngineLike
    metrics: Metrics
    limits: ServerLimits = field(default_factory=ServerLimits)
    #: the server is stopping: new generation requests get 503, ``/health`` says so
    draining: bool = False
    #: set when the drain timeout expires: running requests end with an error
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    #: generation requests being handled
    inflight: int = 0
    #: set whenever ``inflight`` is 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    created: int = field(default_factory=lambda: int(time.time()))
    #: engine request ids in use (a client may send the same ``x-request-id`` twice)
    engine_ids: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.idle.set()

    def claim_id(self, wanted: str) -> str:
        """A unique engine request id: ``wanted``, suffixed if it is already in use."""
        engine_id = wanted
        while engine_id in self.engine_ids:
            engine_id = f"{wanted}-{uuid.uuid4().hex[:8]}"
        self.engine_ids.add(engine_id)
        return engine_id

    def release_id(self, engine_id: str) -> None:
        self.engine_ids.discard(engine_id)

    def enter(self) -> None:
        self.inflight += 1
        self.idle.clear()

    def leave(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self.idle.set()


STATE = web.AppKey("stoic_state", AppState)
#: the generation request's :class:`RequestRecord`, on the aiohttp request
RECORD = web.RequestKey("stoic_record", RequestRecord)
#: the current request's id (set by the request-context middleware for the handler's context)
REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("stoic_request_id")
