"""``serve()`` (graceful drain, exit on fatal) and ``python -m stoic serve`` end to end."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
from typing import Any

import aiohttp
import pytest
from http_fakes import FakeEngine
from http_helpers import completion_body, read_sse, serving
from support import wait_idle

import stoic
from stoic.http import EXIT_ENGINE_FAILED

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_stop_drains_running_requests(engine: stoic.Engine) -> None:
    """On stop, a running stream finishes normally within the drain timeout; meanwhile the
    server still accepts connections and answers /health 503 "stopping" and a new generation
    503 (retryable); once drained, connections are refused and serve() returns 0."""
    async with (
        serving(engine, drain_timeout=20) as (url, stop, task),
        aiohttp.ClientSession() as http,
    ):
        body = completion_body(max_tokens=12, ignore_eos=True, stream=True)
        response = await http.post(f"{url}/v1/completions", json=body)
        await response.content.readline()
        stop.set()
        async with aiohttp.ClientSession() as other:  # a new connection during the drain
            async with other.get(f"{url}/health") as r:
                assert (r.status, (await r.json())["status"]) == (503, "stopping")
            async with other.post(f"{url}/v1/completions", json=completion_body()) as r:
                assert r.status == 503 and r.headers["x-should-retry"] == "true"
        events = await read_sse(response)
        assert events[-1] == "[DONE]"
        assert all("error" not in e for e in events[:-1])
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert await asyncio.wait_for(task, 10) == 0
        with pytest.raises(aiohttp.ClientConnectionError):
            await http.get(f"{url}/health")


async def test_drain_timeout_ends_requests_with_error(engine: stoic.Engine) -> None:
    """Requests still running when the drain timeout expires end with an error event (engine
    stopping, with the partial output) and [DONE]; their blocks are freed."""
    async with (
        serving(engine, drain_timeout=0.3) as (url, stop, task),
        aiohttp.ClientSession() as http,
    ):
        body = completion_body(max_tokens=500, ignore_eos=True, stream=True)
        response = await http.post(f"{url}/v1/completions", json=body)
        await response.content.readline()
        stop.set()
        events = await asyncio.wait_for(read_sse(response), 10)
        assert events[-1] == "[DONE]"
        error = events[-2]["error"]
        assert error["code"] == "engine_stopped"
        assert 0 < error["partial"]["completion_tokens"] < 500
        assert await asyncio.wait_for(task, 10) == 0
    await wait_idle(engine, 10.0, serving=True)


async def test_non_streaming_disconnect_aborts(engine: stoic.Engine) -> None:
    """Under serve() (handler cancellation on), a non-streaming request whose client goes away
    is aborted at once."""
    async with serving(engine) as (url, _stop, _task):
        async with aiohttp.ClientSession() as http:
            body = completion_body(max_tokens=500, ignore_eos=True)
            request = asyncio.create_task(http.post(f"{url}/v1/completions", json=body))
            for _ in range(500):
                await asyncio.sleep(0.02)
                if engine.stats().running:
                    break
            assert engine.stats().running == 1
            request.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await request
        await wait_idle(engine, 10.0, serving=True)


async def test_exit_on_fatal() -> None:
    """With exit_on_fatal, serve() returns 70 as soon as the engine is failed."""
    fake = FakeEngine()
    async with serving(fake, exit_on_fatal=True) as (_url, _stop, task):
        fake.failed.set()
        assert await asyncio.wait_for(task, 10) == EXIT_ENGINE_FAILED


async def _read_until(stream: asyncio.StreamReader, event: str, within: float) -> dict[str, Any]:
    async def scan() -> dict[str, Any]:
        while line := await stream.readline():
            record: dict[str, Any] = json.loads(line)  # --log-format json: JSON lines only
            if record.get("event") == event:
                return record
        raise AssertionError(f"no {event!r} event before EOF")

    return await asyncio.wait_for(scan(), within)


@pytest.mark.model
async def test_python_m_stoic_serve_end_to_end() -> None:
    """`python -m stoic serve --log-format json` writes only JSON lines; it listens before the
    model loads (/health 503 "starting", a generation 503 with Retry-After meanwhile), then a
    ready line with the URL; it serves, and exits 0 on SIGTERM after draining. STOIC_API_KEY
    protects the API from the first second (a request without it is a 401 while starting too),
    /health stays open."""
    proc = await asyncio.create_subprocess_exec(
        *[sys.executable, "-m", "stoic", "serve", "--port", "0", "--dtype", "float32"],
        *["--num-kv-blocks", "64", "--log-format", "json", "--device", "cpu"],
        stderr=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.DEVNULL,
        env={**os.environ, "STOIC_API_KEY": "sk-e2e"},
    )
    auth = {"Authorization": "Bearer sk-e2e"}
    assert proc.stderr is not None
    try:
        listening = await _read_until(proc.stderr, "http.listening", 120)
        async with aiohttp.ClientSession() as http:  # the model loads for seconds yet
            async with http.get(f"{listening['url']}/health") as r:
                assert (r.status, (await r.json())["status"]) == (503, "starting")
            body = completion_body(max_tokens=2)
            async with http.post(f"{listening['url']}/v1/completions", json=body) as r:
                assert r.status == 401
            async with http.post(
                f"{listening['url']}/v1/completions", json=body, headers=auth
            ) as r:
                assert r.status == 503 and int(r.headers["Retry-After"]) >= 1
                assert (await r.json())["error"]["code"] == "engine_starting"
        ready = await _read_until(proc.stderr, "stoic.ready", 120)
        assert ready["url"] == listening["url"]
        assert ready["device"] == "cpu" and ready["dtype"] == "float32"
        assert ready["kv_blocks"] == 64
        url = ready["url"]
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{url}/health") as r:
                assert r.status == 200
            body = completion_body(max_tokens=2)
            async with http.post(f"{url}/v1/completions", json=body, headers=auth) as r:
                assert r.status == 200
            async with http.post(f"{url}/v1/completions", json=body) as r:
                assert r.status == 401
        proc.send_signal(signal.SIGTERM)
        drained = await _read_until(proc.stderr, "http.drained", 30)
        assert drained["complete"] is True
        rest = await asyncio.wait_for(proc.stderr.read(), 30)
        assert all(json.loads(line) for line in rest.splitlines())
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.model
async def test_exit_on_fatal_end_to_end() -> None:
    """`stoic serve --exit-on-fatal` exits 70 once failures exceed the restart intensity."""
    proc = await asyncio.create_subprocess_exec(
        *[sys.executable, "-m", "stoic", "serve", "--port", "0", "--dtype", "float32"],
        *["--num-kv-blocks", "64", "--log-format", "json", "--exit-on-fatal"],
        # the thread executor: this is about the HTTP server's exit; tests/http/test_http_process.py
        # covers --exit-on-fatal with the (default) process executor
        *["--executor", "thread"],
        "--enable-fault-injection",
        *["--max-restarts", "0", "--fault", '{"kind": "error", "after_steps": 1}'],
        stderr=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.DEVNULL,
    )
    assert proc.stderr is not None
    try:
        url = (await _read_until(proc.stderr, "http.serving", 120))["url"]
        async with aiohttp.ClientSession() as http:
            body = completion_body(max_tokens=2)
            async with http.post(f"{url}/v1/completions", json=body) as r:
                assert r.status >= 500
        await _read_until(proc.stderr, "http.engine_failed_exiting", 30)
        await asyncio.wait_for(proc.stderr.read(), 30)
        assert await asyncio.wait_for(proc.wait(), 30) == EXIT_ENGINE_FAILED
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _read_to_done_and_hang_up(url: str, body: dict[str, Any]) -> bytes:
    """POST ``body`` over a raw socket, read until ``data: [DONE]``, then reset the connection
    at once (as a client that closes the moment it has its answer)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    payload = json.dumps(body).encode()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    received = b""
    while b"data: [DONE]" not in received:
        chunk = await reader.read(65536)
        assert chunk, "the server closed before [DONE]"
        received += chunk
    writer.transport.abort()
    return received


async def test_a_client_hanging_up_right_after_done_is_counted_a_success(
    engine: stoic.Engine,
) -> None:
    """Under CPU load, 12 clients that reset the connection the moment they read [DONE]: each
    response counts as delivered (outcome success), none as aborted; the server logs no
    cancellation for them and every block is free after."""
    burners = [
        await asyncio.create_subprocess_exec(sys.executable, "-c", "while True: pass")
        for _ in range(2)
    ]
    try:
        async with serving(engine) as (url, _stop, _task):
            body = completion_body(max_tokens=4, ignore_eos=True, stream=True)
            answers = await asyncio.wait_for(
                asyncio.gather(*(_read_to_done_and_hang_up(url, body) for _ in range(12))), 120
            )
            assert all(b'"finish_reason":"length"' in a for a in answers)
            await wait_idle(engine, 10.0, serving=True)
            await asyncio.sleep(0.2)  # the handlers' last steps after the hang-ups
            async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as r:
                text = await r.text()
        assert 'stoic_requests_total{endpoint="completions",outcome="success"} 12.0' in text
        assert 'outcome="aborted"' not in text
    finally:
        for burner in burners:
            burner.kill()
            await burner.wait()


async def test_a_taken_port_fails_before_the_model_loads() -> None:
    """`stoic serve` on a port that is taken exits at once with one error line naming the
    address, without loading the model."""
    with contextlib.closing(socket.socket()) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = await asyncio.create_subprocess_exec(
            *[sys.executable, "-m", "stoic", "serve", "--port", str(port), "--log-format", "json"],
            stderr=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.DEVNULL,
        )
        _, err = await asyncio.wait_for(proc.communicate(), 120)
    events = [json.loads(line) for line in err.splitlines()]
    assert proc.returncode == 1
    failed = [e for e in events if e["event"] == "stoic.start_failed"]
    assert len(failed) == 1 and str(port) in failed[0]["message"]
    assert not [e for e in events if e["event"].startswith(("model.", "engine."))]


@pytest.mark.model
async def test_sigterm_while_the_model_loads_stops_at_once() -> None:
    """SIGTERM while the model is still loading stops the load: the server exits 0 without ever
    being ready."""
    proc = await asyncio.create_subprocess_exec(
        *[sys.executable, "-m", "stoic", "serve", "--port", "0", "--log-format", "json"],
        *["--device", "cpu", "--executor", "thread"],
        stderr=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.DEVNULL,
    )
    assert proc.stderr is not None
    try:
        await _read_until(proc.stderr, "http.listening", 120)
        proc.send_signal(signal.SIGTERM)
        rest = await asyncio.wait_for(proc.stderr.read(), 60)
        events = [json.loads(line)["event"] for line in rest.splitlines()]
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        assert "http.stopped_while_starting" in events and "stoic.ready" not in events
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
