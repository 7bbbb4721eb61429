"""An aiohttp application of your own that serves stoic's OpenAI-compatible API under ``/llm``.

    python examples/aiohttp_host.py --port 8080
    curl http://127.0.0.1:8080/                      # the host's own route
    curl http://127.0.0.1:8080/llm/v1/models         # stoic's routes, mounted under /llm
    curl http://127.0.0.1:8080/llm/v1/chat/completions -H 'content-type: application/json' \\
        -d '{"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}'

The engine is started by the host's ``cleanup_ctx`` (on startup) and drained and stopped by it
(on cleanup). ``create_app`` needs the object it serves when the sub-application is mounted,
which is before startup, so the host mounts it over a small stand-in (:class:`EngineSlot`) that
forwards to the engine once startup has started it. Requests reach the application only after
startup, so they always find the engine.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import AsyncIterator, Sequence
from typing import Any

from aiohttp import web

import stoic
from stoic.cli import configure_logging
from stoic.http import create_app, drain


class EngineSlot:
    """Stands in for the :class:`stoic.Engine` until the host's startup has started it.

    ``config`` is known up front (``create_app`` reads it to decide on the admin routes);
    every other attribute is the running engine's.
    """

    def __init__(self, config: stoic.EngineConfig) -> None:
        self.config = config
        self.engine: stoic.Engine | None = None

    def __getattr__(self, name: str) -> Any:
        if self.engine is None:
            raise stoic.errors.EngineStopped("the engine is not running")
        return getattr(self.engine, name)


ENGINE = web.AppKey("engine", EngineSlot)
LLM_APP = web.AppKey("llm_app", web.Application)


async def engine_ctx(app: web.Application) -> AsyncIterator[None]:
    """Start the engine on startup; drain and stop it on cleanup."""
    slot = app[ENGINE]
    async with stoic.Engine.start(slot.config) as engine:
        slot.engine = engine
        yield
        slot.engine = None
    # leaving Engine.start() let the requests still running finish (drain_timeout), then stopped


async def stop_llm_requests(app: web.Application) -> None:
    """On shutdown (the socket is closed already): new generation requests get 503 and the
    running ones have a few seconds to finish before they end with an error."""
    await drain(app[LLM_APP], grace=5.0)


async def index(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    stats = engine.stats()
    return web.json_response(
        {
            "service": "my host application",
            "llm": {"model": engine.model_name, "health": engine.health().state},
            "kv_cache_usage": round(stats.kv_cache_usage, 3),
        }
    )


def build_app(config: stoic.EngineConfig | None = None) -> web.Application:
    slot = EngineSlot(config or stoic.EngineConfig(model="default"))
    host = web.Application()
    host[ENGINE] = slot
    host.router.add_get("/", index)
    llm = create_app(slot)  # stoic's routes are relative: mount them under any prefix
    host[LLM_APP] = llm
    host.add_subapp("/llm", llm)
    host.cleanup_ctx.append(engine_ctx)
    host.on_shutdown.append(stop_llm_requests)
    return host


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="An aiohttp host app serving stoic under /llm.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--model", default="default")
    args = parser.parse_args(argv)
    configure_logging("console", "info")
    web.run_app(
        build_app(stoic.EngineConfig(model=args.model)),
        host=args.host,
        port=args.port,
        # abort an engine request as soon as its client disconnects, even before any output
        handler_cancellation=True,
        access_log=None,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
