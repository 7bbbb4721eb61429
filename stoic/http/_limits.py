"""Server limits: request size, body and header read deadlines, keep-alive, connections.

The per-request limits (body size, body read deadline) are the application's, so they hold
when the app is mounted in a host application too. The connection limits need the listening
socket, so only :func:`stoic.http.serve` applies them, through :class:`GuardedSite`.

The limits inside a request body (messages, stop strings, ``n``, ``top_logprobs``, tools) are
constants of the request schemas (:mod:`stoic.http._schemas`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from aiohttp import web

from .._logging import get_logger
from ._errors import dumps

__all__ = ["GuardedSite", "ServerLimits", "head_done", "head_expected"]

_log = get_logger("stoic.http")


@dataclass(frozen=True)
class ServerLimits:
    """What one client may hold of the server.

    :raises ValueError: if a value is not positive.
    """

    #: largest request body (a 413 with error JSON above it); 32 MiB fits a 128k-token prompt
    #: sent as a JSON list of token ids
    max_request_bytes: int = 32 * 1024 * 1024
    #: seconds a client has to send a request's body once its head arrived (else 408)
    body_timeout: float = 60.0
    #: seconds a client has to send a complete request head once it sent its first byte
    header_timeout: float = 10.0
    #: seconds an idle keep-alive connection (no request in progress) stays open
    keepalive_timeout: float = 75.0
    #: open connections at most; one more is answered 503 and closed
    max_connections: int = 1024

    def __post_init__(self) -> None:
        for name in (
            "max_request_bytes",
            "body_timeout",
            "header_timeout",
            "keepalive_timeout",
            "max_connections",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")


_REFUSED_BODY = dumps(
    {
        "error": {
            "message": "too many open connections; retry later",
            "type": "service_unavailable",
            "param": None,
            "code": "too_many_connections",
        }
    }
).encode()
_REFUSED = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Connection: close\r\nRetry-After: 1\r\nx-should-retry: true\r\n"
    + f"Content-Length: {len(_REFUSED_BODY)}\r\n\r\n".encode()
    + _REFUSED_BODY
)


class _Guard(asyncio.Protocol):
    """Wraps aiohttp's per-connection protocol: the header deadline and the connection cap.

    A connection that starts a request (sends a byte while no request is being handled) must
    complete its head within ``header_timeout`` or it is closed: a slowloris client holds a
    connection for seconds, not forever. aiohttp's own keep-alive timeout closes connections
    that send nothing at all.
    """

    def __init__(self, site: GuardedSite, inner: asyncio.Protocol) -> None:
        self._site, self._inner = site, inner
        self._transport: asyncio.Transport | None = None
        self._deadline: asyncio.TimerHandle | None = None
        #: a request's head arrived and its handler has not finished
        self.busy = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream transport, though not an asyncio.Transport instance under uvloop (which Ray
        # Serve's replicas run: stoic.ray's HttpIngress)
        transport = cast(asyncio.Transport, transport)
        self._transport = transport
        site = self._site
        if len(site.connections) >= site.limits.max_connections:
            site.on_refuse("too_many_connections")
            _log.warning("http.connection_refused", open=len(site.connections))
            transport.write(_REFUSED)
            transport.close()
            return
        site.connections.add(self)
        _GUARDS[transport] = self
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self not in self._site.connections:  # refused: closing, nothing reaches aiohttp
            return
        if not self.busy and self._deadline is None and self._site.limits.header_timeout:
            loop = asyncio.get_running_loop()
            self._deadline = loop.call_later(self._site.limits.header_timeout, self._expire)
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self not in self._site.connections:
            return None
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        if self in self._site.connections:
            self._site.connections.discard(self)
            self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def head_arrived(self) -> None:
        self.busy = True
        self._cancel_deadline()

    def handled(self) -> None:
        self.busy = False

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if self.busy or self._transport is None:
            return
        self._site.on_refuse("header_timeout")
        peer = self._transport.get_extra_info("peername")
        _log.warning(
            "http.header_timeout", peer=str(peer), seconds=self._site.limits.header_timeout
        )
        self._transport.close()


#: the guard of each transport (weak: nothing here keeps a closed connection alive)
_GUARDS: weakref.WeakKeyDictionary[asyncio.BaseTransport, _Guard] = weakref.WeakKeyDictionary()


def head_expected(request: web.BaseRequest) -> None:
    """The handler of ``request`` finished: the connection may start its next request."""
    guard = _GUARDS.get(request.transport) if request.transport is not None else None
    if guard is not None:
        guard.handled()


def head_done(request: web.BaseRequest) -> None:
    """``request``'s head arrived: stop its connection's header deadline."""
    guard = _GUARDS.get(request.transport) if request.transport is not None else None
    if guard is not None:
        guard.head_arrived()


class GuardedSite(web.BaseSite):
    """A TCP site applying :class:`ServerLimits`' connection limits.

    Like :class:`aiohttp.web.TCPSite`, with every connection's protocol wrapped in a guard.
    """

    __slots__ = (
        "_host",
        "_port",
        "connections",
        "limits",
        "on_refuse",
    )

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        limits: ServerLimits,
        on_refuse: Callable[[str], None] = lambda reason: None,
    ) -> None:
        super().__init__(runner, backlog=1024)
        self._host, self._port = host, port
        self.limits = limits
        #: called with the reason of each refused or cut-off connection (for the metrics)
        self.on_refuse = on_refuse
        self.connections: set[_Guard] = set()

    @property
    def name(self) -> str:
        host = self._host
        if ":" in host and ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
        return f"http://{host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        factory = server  # aiohttp's per-connection protocol factory

        def guarded() -> asyncio.Protocol:
            return _Guard(self, factory())

        # aiohttp's BaseSite.stop closes ``_server``; runner.addresses reads its sockets
        self._server = await loop.create_server(
            guarded, self._host, self._port, backlog=self._backlog, reuse_address=True
        )
