"""`stoic serve --executor process` end to end: kill -9 of the worker under streaming load, and
--exit-on-fatal after worker crashes (real processes, real sockets)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from stoic.http import EXIT_ENGINE_FAILED

pytestmark = [pytest.mark.model, pytest.mark.asyncio]


async def _read_until(stream: asyncio.StreamReader, event: str, limit: float) -> dict[str, Any]:
    async def scan() -> dict[str, Any]:
        while line := await stream.readline():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # progress bars and other non-JSON lines
            if record.get("event") == event:
                return dict(record)
        raise AssertionError(f"the server ended before {event!r}")

    return await asyncio.wait_for(scan(), limit)


async def _serve(model: Path, *extra: str) -> tuple[asyncio.subprocess.Process, str]:
    proc = await asyncio.create_subprocess_exec(
        *[sys.executable, "-m", "stoic", "serve", "--port", "0", "--dtype", "float32"],
        *["--model", str(model), "--num-kv-blocks", "256", "--log-format", "json"],
        *["--executor", "process", *extra],
        stderr=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.DEVNULL,
    )
    assert proc.stderr is not None
    url = (await _read_until(proc.stderr, "http.serving", 120))["url"]
    # keep reading the log so the server never blocks on a full pipe
    asyncio.get_running_loop().create_task(proc.stderr.read())
    return proc, str(url)


async def _stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.kill()
        await proc.wait()


def _body(i: int) -> dict[str, Any]:
    return {
        "model": "default",
        "prompt": f"Once upon a time, story number {i},",
        "max_tokens": 40,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }


async def _stream(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[Any]:
    """The SSE events of one streamed completion (``[DONE]`` kept as a string)."""
    events: list[Any] = []
    async with http.post(f"{url}/v1/completions", json=body) as r:
        assert r.status == 200
        async for raw in r.content:
            line = raw.decode().strip()
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def _text(events: list[Any]) -> str:
    return "".join(
        e["choices"][0]["text"] for e in events if isinstance(e, dict) and e.get("choices")
    )


async def _health(http: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, Any]]:
    async with http.get(f"{url}/health") as r:
        return r.status, await r.json()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def test_kill_9_of_the_worker_under_16_streams(
    tiny_model_dir: Path, http: aiohttp.ClientSession
) -> None:
    """kill -9 of the worker while 16 streams run: each stream ends either with its whole
    fault-free text or with an error event whose partial is a prefix of it, then [DONE]; /health
    reports the new worker's pid; the KV gauge returns to 0; the next answer is the same."""
    proc, url = await _serve(tiny_model_dir)
    try:
        reference = [_text(await _stream(http, url, _body(i))) for i in range(16)]
        status, health = await _health(http, url)
        assert status == 200
        pid = health["executor"]["pid"]
        assert pid not in (None, proc.pid)

        async def killer() -> None:
            while True:  # once tokens flow: kill the worker from outside
                async with http.get(f"{url}/metrics") as r:
                    text = await r.text()
                running = re.search(r"^stoic_sequences_running (\S+)", text, re.M)
                if running and float(running[1]) >= 8:
                    os.kill(pid, signal.SIGKILL)
                    return
                await asyncio.sleep(0.01)

        results = await asyncio.wait_for(
            asyncio.gather(killer(), *(_stream(http, url, _body(i)) for i in range(16))), 120
        )
        failed = 0
        for events, ref in zip(results[1:], reference, strict=True):
            assert events[-1] == "[DONE]"
            errors = [e for e in events if isinstance(e, dict) and "error" in e]
            if not errors:
                assert _text(events) == ref
                continue
            failed += 1
            error = errors[0]["error"]
            assert "SIGKILL" in error["message"]
            assert ref.startswith(error["partial"]["text"])
            assert _text(events) == error["partial"]["text"][: len(_text(events))]
        assert failed > 0
        while True:
            status, health = await _health(http, url)
            if status == 200 and health["executor"]["pid"] != pid:
                break
            await asyncio.sleep(0.05)
        assert health["executor"]["restarts"] == 1
        async with http.get(f"{url}/metrics") as r:
            metrics = await r.text()
        assert re.search(r'^stoic_executor_restarts_total\{kind="crash"\} 1\.0$', metrics, re.M)
        assert re.search(r"^stoic_kv_cache_blocks_used 0\.0$", metrics, re.M)
        assert _text(await _stream(http, url, _body(3))) == reference[3]
    finally:
        await _stop(proc)


async def test_exit_on_fatal_after_worker_crashes(tiny_model_dir: Path) -> None:
    """With the process executor, crashes beyond the restart intensity still fail the engine,
    and --exit-on-fatal still exits 70."""
    proc, url = await _serve(
        tiny_model_dir,
        "--exit-on-fatal",
        "--enable-fault-injection",
        *["--max-restarts", "0", "--fault", '{"kind": "crash", "after_steps": 1}'],
    )
    try:
        async with aiohttp.ClientSession() as http:
            body = {**_body(0), "stream": False, "max_tokens": 2}
            async with http.post(f"{url}/v1/completions", json=body) as r:
                assert r.status >= 500
        assert await asyncio.wait_for(proc.wait(), 60) == EXIT_ENGINE_FAILED
    finally:
        await _stop(proc)


async def _killer(http: aiohttp.ClientSession, url: str, pid: int, running: int) -> None:
    """kill -9 ``pid`` from outside once ``running`` sequences decode."""
    while True:
        async with http.get(f"{url}/metrics") as r:
            text = await r.text()
        now = re.search(r"^stoic_sequences_running (\S+)", text, re.M)
        if now and float(now[1]) >= running:
            os.kill(pid, signal.SIGKILL)
            return
        await asyncio.sleep(0.01)


async def _complete(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Any:
    async with http.post(f"{url}/v1/completions", json={**body, "stream": False}) as r:
        return r.status, r.headers.get("x-should-retry"), await r.json()


async def test_resume_kill_9_and_a_poison_request_clients_do_not_notice(
    default_model_dir: Path, http: aiohttp.ClientSession
) -> None:
    """``stoic serve --recovery resume``: kill -9 of the worker under 6 streams and 2
    non-streamed requests: every one completes with exactly its fault-free text (float32), no
    error event, usage unchanged. A poison request (``--fault '{"match": ...}'``) gets a 500
    that says not to retry, while the request batched with it completes. /metrics counts the
    resumes and the isolation; every KV block is free after."""
    poison = '{"kind": "error", "match": "XYZZY"}'
    proc, url = await _serve(
        default_model_dir, "--recovery", "resume", "--enable-fault-injection", "--fault", poison
    )
    try:
        bodies = [{**_body(i), "max_tokens": 32} for i in range(8)]
        reference = await asyncio.gather(*(_complete(http, url, b) for b in bodies))
        assert all(status == 200 for status, _, _ in reference)
        status, health = await _health(http, url)
        pid = health["executor"]["pid"]
        killer = asyncio.ensure_future(_killer(http, url, pid, 6))
        results = await asyncio.wait_for(
            asyncio.gather(
                *(_stream(http, url, b) for b in bodies[:6]),
                *(_complete(http, url, b) for b in bodies[6:]),
            ),
            180,
        )
        assert killer.done(), "the requests finished before the worker was killed"
        killer.cancel()
        await asyncio.gather(killer, return_exceptions=True)
        for events, (_, _, ref) in zip(results[:6], reference, strict=False):
            assert events[-1] == "[DONE]"
            assert not [e for e in events if isinstance(e, dict) and "error" in e]
            assert _text(events) == ref["choices"][0]["text"]
        for (status, _, body), (_, _, ref) in zip(results[6:], reference[6:], strict=True):
            assert status == 200
            assert body["choices"][0]["text"] == ref["choices"][0]["text"]
            assert body["usage"] == ref["usage"]

        bad = {**_body(0), "prompt": "Once upon a time XYZZY", "max_tokens": 8}
        (status, retry, error), (ok_status, _, ok) = await asyncio.gather(
            _complete(http, url, bad), _complete(http, url, bodies[0])
        )
        assert (status, retry) == (500, "false") and "isolated" in error["error"]["message"]
        assert ok_status == 200
        assert ok["choices"][0]["text"] == reference[0][2]["choices"][0]["text"]
        async with http.get(f"{url}/metrics") as r:
            metrics = await r.text()
        resumed = re.search(r"^stoic_requests_resumed_total (\S+)$", metrics, re.M)
        assert resumed and float(resumed[1]) >= 8
        assert re.search(r"^stoic_requests_isolated_total 1\.0$", metrics, re.M)
        # its two failures alone were charged to it, not to the restart intensity
        assert re.search(r"^stoic_isolation_failures_total 2\.0$", metrics, re.M)
        assert re.search(r"^stoic_requests_resume_exhausted_total 0\.0$", metrics, re.M)
        assert re.search(r"^stoic_scheduler_token_budget 256\.0$", metrics, re.M)
        assert re.search(r"^stoic_kv_cache_blocks_used 0\.0$", metrics, re.M)
    finally:
        await _stop(proc)
