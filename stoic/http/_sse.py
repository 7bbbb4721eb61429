"""Server-sent events, the OpenAI way: ``data: {json}\\n\\n`` per event, ``data: [DONE]`` last
(the Responses API names each event, ``event: <type>``, and sends no ``[DONE]``)."""

from __future__ import annotations

import contextlib
from typing import Any

from aiohttp import web

from ._errors import dumps

__all__ = ["SSEWriter"]


class SSEWriter:
    """Writes one streaming response.

    Nothing is sent until :meth:`start`; so every error found before it can still be answered
    with a proper status. Writes raise :class:`ConnectionResetError` once the client is gone.
    """

    def __init__(self, request: web.Request, headers: dict[str, str]) -> None:
        self._request = request
        #: ``data: [DONE]`` was written: the response is delivered, whatever happens next
        self.finished = False
        self.response = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
                **headers,
            },
        )

    async def start(self) -> None:
        await self.response.prepare(self._request)

    async def send(self, event: dict[str, Any], *, name: str | None = None) -> None:
        """Write ``event`` (``name``: with an ``event:`` line)."""
        head = b"event: " + name.encode() + b"\n" if name is not None else b""
        await self.response.write(head + b"data: " + dumps(event).encode() + b"\n\n")

    async def done(self, *, marker: bool = True) -> None:
        """Write ``data: [DONE]`` (unless not ``marker``) and end the response. A client that
        hangs up the moment it reads the end had its answer: a reset while ending the response
        is not an error."""
        if marker:
            await self.response.write(b"data: [DONE]\n\n")
        self.finished = True
        with contextlib.suppress(ConnectionResetError):
            await self.response.write_eof()
