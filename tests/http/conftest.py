"""One real engine (the default model) and one app on a real socket, shared by every HTTP test.

Every test module here runs on the session event loop (``loop_scope="session"``), so the
engine starts once. The app runs under a plain ``AppRunner`` (no handler cancellation), the way
a host application would mount it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import openai
import pytest_asyncio
from aiohttp import web
from http_helpers import Server, run_app
from support import wait_idle

import stoic
from stoic.http import EngineLike, create_app

ALTERNATING_TEMPLATE = (
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


async def _peer(request: web.Request) -> web.Response:
    """Test-only route: the client's address as the server sees it (identifies a connection)."""
    peer = request.transport.get_extra_info("peername") if request.transport else None
    return web.json_response({"peer": list(peer) if peer else None})


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def engine() -> AsyncIterator[stoic.Engine]:
    config = stoic.EngineConfig(
        model="default",
        dtype="float32",
        num_kv_blocks=512,
        max_restarts=1000,
        enable_fault_injection=True,
        drain_timeout=5.0,
    )
    async with stoic.Engine.start(config) as engine:
        yield engine


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def server(engine: stoic.Engine) -> AsyncIterator[Server]:
    app = create_app(engine)
    app.router.add_get("/_test/peer", _peer)
    async with run_app(app) as server:
        yield server


@pytest_asyncio.fixture(loop_scope="session")
async def fault_cleanup(server: Server, engine: stoic.Engine) -> AsyncIterator[None]:
    """Clear injected faults after the test; wait for the engine to be idle."""
    yield
    async with aiohttp.ClientSession() as http, http.delete(f"{server.url}/admin/faults") as r:
        assert r.status == 200
    await wait_idle(engine, 10.0, serving=True)


@pytest_asyncio.fixture(loop_scope="session")
async def client(server: Server) -> AsyncIterator[openai.AsyncOpenAI]:
    async with server.client() as client:
        yield client


@pytest_asyncio.fixture(loop_scope="session")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """A raw client holding at most one connection (so consecutive requests share it)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
        yield session


@pytest_asyncio.fixture(loop_scope="session")
async def set_chat_template(engine: stoic.Engine) -> AsyncIterator[Callable[[str], None]]:
    """Factory: install a chat template on the model's tokenizer; the original is restored."""
    tokenizer = engine.tokenizer
    original = tokenizer.chat_template

    def install(template: str) -> None:
        tokenizer.chat_template = template

    try:
        yield install
    finally:
        tokenizer.chat_template = original


@pytest_asyncio.fixture(loop_scope="session")
async def alternating_template(set_chat_template: Callable[[str], None]) -> None:
    """A chat template that raises on non-alternating roles (restored after the test)."""
    set_chat_template(ALTERNATING_TEMPLATE)


@pytest_asyncio.fixture(loop_scope="session")
async def fake_server() -> AsyncIterator[Callable[..., Any]]:
    """Factory: serve an engine stand-in (``http_fakes.FakeEngine``; closed at the end of the test)."""
    stack = contextlib.AsyncExitStack()

    async def start(engine: EngineLike, **kwargs: Any) -> Server:
        return await stack.enter_async_context(run_app(create_app(engine), **kwargs))

    async with stack:
        yield start
