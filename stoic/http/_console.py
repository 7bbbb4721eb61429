"""``GET /console``: the operator's console, a page served by the server itself.

The page, its script and its style sheet are files inside the package (``stoic/http/console/``;
no CDN, no build step) and hold no data: they are open. The data comes over
``GET /console/stream``, a server-sent event stream of one :func:`~stoic.http._console_data.snapshot`
a second, guarded like the admin routes when an admin key is set (else by the API keys; access
class ``console``, :mod:`stoic.http._auth`). The stream ends when the client goes (the tab
closed) or the server drains. The fault buttons post to ``/admin/faults``, the same admin API.
"""

from __future__ import annotations

import asyncio
import json
from importlib import resources

from aiohttp import web

from .._logging import get_logger
from ._auth import route_access
from ._console_data import PERIOD, ConsoleSampler, snapshot
from ._state import STATE

__all__ = ["add_console_routes"]

_log = get_logger("stoic.http")
#: the console's files: name -> content type
_FILES = {
    "index.html": "text/html",
    "console.js": "text/javascript",
    "console.css": "text/css",
}
_SAMPLER = web.AppKey("stoic_console_sampler", ConsoleSampler)
_ADMIN = web.AppKey("stoic_console_admin", bool)


def _file(name: str) -> bytes:
    return resources.files("stoic.http").joinpath("console", name).read_bytes()


def _static(name: str) -> web.Response:
    return web.Response(
        body=_file(name),
        content_type=_FILES[name],
        charset="utf-8",
        headers={
            "Cache-Control": "no-cache",
            # the page runs only its own script and talks only to its own server
            "Content-Security-Policy": "default-src 'self'; img-src 'self' data:",
            "X-Content-Type-Options": "nosniff",
        },
    )


async def _page(request: web.Request) -> web.Response:
    return _static("index.html")


async def _asset(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name not in _FILES or name == "index.html":
        raise web.HTTPNotFound()
    return _static(name)


async def _stream(request: web.Request) -> web.StreamResponse:
    """One snapshot a second until the client goes or the server drains."""
    app = request.app
    state, sampler, admin = app[STATE], app[_SAMPLER], app[_ADMIN]
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        }
    )
    await response.prepare(request)
    _log.info("console.opened", remote=request.remote)
    try:
        while not state.draining:
            body = json.dumps(snapshot(state.engine, sampler.points, admin=admin))
            await response.write(f"data: {body}\n\n".encode())
            await asyncio.sleep(PERIOD)
    except ConnectionResetError:  # the tab closed while a snapshot was written
        pass
    finally:
        _log.info("console.closed", remote=request.remote)
    return response


def add_console_routes(app: web.Application, *, admin: bool) -> None:
    """``/console`` (open), its files (open) and ``/console/stream`` (access ``console``);
    the sampler behind the charts runs while the app does."""
    app[_SAMPLER] = sampler = ConsoleSampler(app[STATE].engine, app[STATE].metrics)
    app[_ADMIN] = admin
    app.cleanup_ctx.append(sampler.lifetime)
    router = app.router
    route_access(app, router.add_get("/console", _page), "open")
    route_access(app, router.add_get("/console/stream", _stream), "console")
    route_access(app, router.add_get("/console/{name}", _asset), "open")
