"""Support code shared by the tests of every directory: engine configs, waits, prompts, ports.

Imported as ``from support import ...`` from any test module: ``tests/conftest.py`` has no
package above it, so pytest puts ``tests/`` on ``sys.path`` before it collects a test (the same
rule that makes ``from http_helpers import ...`` work inside ``tests/http``). Code used by one
directory only stays in that directory's helpers (``tests/http/http_helpers.py``,
``tests/http/http_fakes.py``, ``tests/model/gguf_fakes.py``, ``tests/runtime/helpers.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

import stoic

#: three short prompts with different continuations (the stop-path and watchdog tests)
PROMPTS = ("Write about the sea.", "Write about a cat.", "Write about winter.")


def engine_config(model_dir: Path, **overrides: Any) -> stoic.EngineConfig:
    """float32 (exact outputs), 256 KV blocks, fault injection on; ``overrides`` on top."""
    base: dict[str, Any] = {
        "model": str(model_dir),
        "dtype": "float32",
        "num_kv_blocks": 256,
        "enable_fault_injection": True,
    }
    base.update(overrides)
    return stoic.EngineConfig(**base)


async def until(check: Callable[[], bool], limit: float = 5.0, what: str = "condition") -> None:
    """Poll ``check`` until it is true.

    :raises AssertionError: if it is not within ``limit`` seconds (a hang, not a slow machine).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while not check():
        assert loop.time() < deadline, f"{what}: not within {limit}s"
        await asyncio.sleep(0.005)


async def wait_idle(
    engine: stoic.Engine, limit: float = 5.0, *, serving: bool = False
) -> stoic.EngineStats:
    """Wait until no sequence runs or waits and every KV block is free (with ``serving``: and
    the engine serves, not mid-recovery); return the stats.

    Freeing is one message hop behind a stream's end (the scheduler tells the cache manager), so
    a test must not expect ``kv_blocks_used == 0`` in the same instant a stream finishes.

    :raises AssertionError: if the engine is not idle within ``limit`` seconds (a leak).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while True:
        stats = engine.stats()
        idle = stats.running == 0 and stats.waiting == 0 and stats.kv_blocks_used == 0
        if idle and (not serving or engine.health().ok):
            return stats
        if loop.time() > deadline:
            raise AssertionError(f"engine not idle after {limit}s: {stats}")
        await asyncio.sleep(0.005)


async def wait_restarts(engine: stoic.Engine, n: int, limit: float = 60.0) -> None:
    """Wait until the engine has restarted its executor ``n`` times.

    :raises AssertionError: if it has not within ``limit`` seconds.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while engine.stats().restarts < n:
        assert loop.time() < deadline, f"fewer than {n} restarts: {engine.stats()}"
        await asyncio.sleep(0.005)


async def wait_replaced(
    engine: stoic.Engine, old_pid: int | None, *, restarts: int = 0, limit: float = 60.0
) -> None:
    """Wait until the engine serves (healthy) from an executor worker other than ``old_pid``,
    after at least ``restarts`` restarts.

    :raises AssertionError: if it does not within ``limit`` seconds.
    """

    def serving() -> bool:
        stats = engine.stats()
        return (
            engine.health().ok
            and stats.executor_pid not in (None, old_pid)
            and stats.restarts >= restarts
        )

    await until(serving, limit, f"serving from a new worker ({engine.health()})")


async def collect(stream: Any) -> tuple[str, BaseException | None]:
    """Read a request stream to its end: the text received, and the error that ended it."""
    text = ""
    try:
        async for delta in stream:
            text += delta.text
    except stoic.errors.StoicError as exc:
        return text, exc
    return text, None


def compiler_rejecting(flag: str, into: Path) -> Path:
    """A C compiler (a script in ``into`` before the real ``cc``) that fails, as an old one
    would, on any command with ``flag`` in it: for the kernel build's retries without it.
    Skips the test where there is no C compiler."""
    import shutil

    real = shutil.which("cc") or shutil.which("gcc")
    if real is None:
        pytest.skip("no C compiler")
    old_cc = into / "old-cc"
    old_cc.write_text(
        f'#!/bin/sh\ncase "$*" in *{flag}*) echo "unrecognized option" >&2; exit 1;; esac\n'
        f'exec {real} "$@"\n'
    )
    old_cc.chmod(0o755)
    return old_cc


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a server started as a process)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def record_intake_requests(monkeypatch: pytest.MonkeyPatch) -> list[stoic.Request]:
    """The requests the engine's intake reads from now on (it tokenises every request it is
    given through ``TokenCodec.tokenize``; the patch ends with the test)."""
    from stoic.engine import TokenCodec

    seen: list[stoic.Request] = []
    tokenize = TokenCodec.tokenize

    def spy(codec: TokenCodec, request: stoic.Request) -> list[int]:
        seen.append(request)
        return tokenize(codec, request)

    monkeypatch.setattr(TokenCodec, "tokenize", spy)
    return seen


def greedy_reference(
    model: Any, prompts: Sequence[Sequence[int]], steps: int
) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy ``generate`` of each prompt alone, exactly ``steps`` new tokens (no
    early EOS): the tokens and their logprobs, from the raw logits (before the processors, as
    ``min_new_tokens`` hides the EOS from the processed ones)."""
    import torch

    out = []
    with torch.inference_mode():
        for prompt in prompts:
            got = model.generate(
                torch.tensor([list(prompt)]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=steps,
                min_new_tokens=steps,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            tokens = got.sequences[0, len(prompt) :].tolist()
            logprobs = [
                float(torch.log_softmax(step[0].float(), -1)[t])
                for step, t in zip(got.logits, tokens, strict=True)
            ]
            out.append((tokens, logprobs))
    return out


@contextlib.asynccontextmanager
async def http_endpoint(engine: Any) -> AsyncIterator[str]:
    """stoic's HTTP app over ``engine`` on a free port of 127.0.0.1: its base URL, while open."""
    from aiohttp import web

    from stoic.http import create_app

    runner = web.AppRunner(create_app(engine), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()
