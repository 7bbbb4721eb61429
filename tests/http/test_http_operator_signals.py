"""What an operator of ``stoic serve`` sees: an expected executor failure is one log line (no
traceback), a signal at any moment stops the server and its workers without a traceback, and
health probes do not flood the log."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import structlog
from http_fakes import FakeEngine
from http_helpers import Server, completion_body

import stoic

pytestmark = pytest.mark.asyncio(loop_scope="session")

_URL = re.compile(r"\burl=(http://\S+)")


async def test_health_probes_log_at_debug(fake_server: object) -> None:
    """``GET /health`` is logged at debug level whatever it answers (503 while the model loads
    or the executor recovers, 200 when serving); other requests stay at info."""
    engine = FakeEngine(health_state=stoic.Health("starting", "loading the model"))
    server: Server = await fake_server(engine)  # type: ignore[operator]
    with structlog.testing.capture_logs() as logs:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{server.url}/health") as r:
                assert r.status == 503
            engine.health_state = stoic.Health("serving")
            async with http.get(f"{server.url}/health") as r:
                assert r.status == 200
            async with http.get(f"{server.url}/v1/models") as r:
                assert r.status == 200
    levels = [
        (e["path"], e["status"], e["log_level"]) for e in logs if e["event"] == "http.request"
    ]
    assert levels == [
        ("/health", 503, "debug"),
        ("/health", 200, "debug"),
        ("/v1/models", 200, "info"),
    ]


# -- a real `stoic serve` -------------------------------------------------------------------------


class _Serve:
    """``python -m stoic serve`` with the console log format (what an operator reads), in a
    session of its own, as a shell runs it: a Ctrl-C goes to its whole process group."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    async def until(self, event: str, within: float = 180) -> str:
        """Read the log up to the line of ``event``; that line."""
        assert self.proc.stderr is not None

        async def scan() -> str:
            while raw := await self.proc.stderr.readline():  # type: ignore[union-attr]
                line = raw.decode(errors="replace").rstrip()
                self.lines.append(line)
                if re.search(rf"\] {re.escape(event)}\s", line + " "):
                    return line
            raise AssertionError(f"the server ended before {event!r}:\n{self.text}")

        return await asyncio.wait_for(scan(), within)

    async def finish(self, within: float = 120) -> int:
        """Read the rest of the log; the exit status."""
        assert self.proc.stderr is not None
        rest = await asyncio.wait_for(self.proc.stderr.read(), within)
        self.lines += rest.decode(errors="replace").splitlines()
        return await asyncio.wait_for(self.proc.wait(), within)

    def children(self) -> list[int]:
        """The server's child processes (its executor workers)."""
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    stat = (entry / "stat").read_text()
                    if int(stat.rsplit(")", 1)[1].split()[1]) == self.proc.pid:
                        found.append(int(entry.name))
        return found


@contextlib.asynccontextmanager
async def _serve(model: Path, *extra: str) -> AsyncIterator[_Serve]:
    proc = await asyncio.create_subprocess_exec(
        *[sys.executable, "-m", "stoic", "serve", "--port", "0", "--dtype", "float32"],
        *["--model", str(model), "--num-kv-blocks", "64", "--executor", "process", *extra],
        stderr=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        yield _Serve(proc)
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()


async def _wait_serving(http: aiohttp.ClientSession, url: str, within: float = 120) -> None:
    async def poll() -> None:
        while True:
            async with http.get(f"{url}/health") as r:
                if r.status == 200:
                    return
            await asyncio.sleep(0.2)

    await asyncio.wait_for(poll(), within)


#: injected faults of several kinds: an error raised by the step, out of memory, a signal that
#: kills the worker, a hang the step timeout ends
_FAULTS = ("error", "oom", "segfault", "hang")


@pytest.mark.model
async def test_each_expected_failure_is_one_line_without_a_traceback(
    tiny_model_dir: Path,
) -> None:
    """Four injected faults of different kinds: each is one ``recovery.executor_failed`` line
    with its kind, the worker's pid, the signal that killed it and what became of the streams;
    with what recovery logs besides (a new worker starting and ready, the budget halving after
    an OOM, the hung step), at most five lines a failure, and not one traceback."""
    async with _serve(
        tiny_model_dir,
        *["--enable-fault-injection", "--max-restarts", "20", "--step-timeout", "3"],
    ) as server:
        match = _URL.search(await server.until("stoic.ready"))
        assert match, server.text
        url = match.group(1)
        async with aiohttp.ClientSession() as http:
            for kind in _FAULTS:
                fault = {"kind": kind, "after_steps": 1, "seconds": 60.0}
                async with http.post(f"{url}/admin/faults", json=fault) as r:
                    assert r.status == 200, await r.text()
                body = completion_body(max_tokens=4)
                async with http.post(f"{url}/v1/completions", json=body) as r:
                    assert r.status >= 500
                await _wait_serving(http, url)
        server.proc.send_signal(signal.SIGINT)
        assert await server.finish() == 0
    text = server.text
    assert "Traceback" not in text
    failures = [line for line in server.lines if "recovery.executor_failed" in line]
    assert len(failures) == len(_FAULTS), text
    for kind, line in zip(_FAULTS, failures, strict=True):
        expected_kind = "crash" if kind == "segfault" else kind
        assert f"kind={expected_kind} " in line, line
        assert re.search(r"\bpid=\d+", line) and "sequences_failed=1" in line, line
        assert "sequences_resumed=0" in line and "isolated=0" in line, line
    assert "signal=SIGSEGV" in failures[2]
    # the lines of each failure: from its injection to the next one (or the shutdown), but the
    # HTTP layer's (per request, not per failure)
    segments: list[list[str]] = []
    for line in server.lines:
        if "faults.armed" in line:
            segments.append([])
        elif "http.signal" in line:
            break
        elif segments and "[stoic.http]" not in line:
            segments[-1].append(line)
    assert len(segments) == len(_FAULTS)
    for segment in segments:
        assert 1 <= len(segment) <= 5, "\n".join(segment)


@pytest.mark.model
@pytest.mark.parametrize(
    ("signum", "moment"),
    [
        (signal.SIGINT, "importing"),
        (signal.SIGINT, "importing torch"),
        (signal.SIGTERM, "starting"),
        (signal.SIGINT, "loading"),
        (signal.SIGINT, "spares"),
        (signal.SIGTERM, "spares"),
        (signal.SIGTERM, "serving"),
    ],
)
async def test_a_signal_at_any_moment_stops_everything_without_a_traceback(
    tiny_model_dir: Path, signum: signal.Signals, moment: str
) -> None:
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) or SIGTERM to the server:
    while Python imports the command's modules or torch, while the port is bound, while the
    model loads, while a spare and the pre-started interpreter start, or while serving, the
    server exits 0 (``stoic serve``'s documented status for a signal), no process prints a
    traceback, and every worker is gone."""
    async with _serve(tiny_model_dir, "--executor-spares", "1") as server:
        if moment.startswith("importing"):  # the moment a library is loaded, however slowly
            library = "libtorch" if moment == "importing torch" else "_pydantic_core"
            await asyncio.to_thread(_until_mapped, server.proc.pid, library, 120.0)
        elif moment == "starting":  # the event loop runs, the port is being bound
            await server.until("stoic.starting")
        elif moment == "loading":
            await server.until("http.listening")
        else:
            match = _URL.search(await server.until("stoic.ready"))
            assert match, server.text
            if moment == "serving":
                async with aiohttp.ClientSession() as http:
                    body = completion_body(max_tokens=2)
                    async with http.post(f"{match.group(1)}/v1/completions", json=body) as r:
                        assert r.status == 200
        workers = server.children()
        if moment == "spares":
            assert len(workers) == 3  # serving, spare, pre-started
        if signum == signal.SIGINT:
            os.killpg(server.proc.pid, signum)
        else:
            server.proc.send_signal(signum)
        assert await server.finish() == 0, server.text
        assert "Traceback" not in server.text, server.text
        assert "KeyboardInterrupt" not in server.text, server.text
    # a worker the server did not stop dies with it (its parent-death signal): give it a moment
    assert await asyncio.to_thread(_still_running, workers, 5.0) == []


@pytest.mark.model
async def test_the_first_worker_imports_torch_while_the_server_does(tiny_model_dir: Path) -> None:
    """``stoic serve`` starts its worker's interpreter as soon as its arguments are checked:
    that process already runs when the server itself maps torch, and it is the one that loads
    the model (``executor.worker_starting ... early=True``), says how its start goes (its
    ``model.load.done``, with its pid) and serves."""
    async with _serve(tiny_model_dir) as server:
        await asyncio.to_thread(_until_mapped, server.proc.pid, "libtorch", 120.0)
        running = server.children()
        assert len(running) == 1, running
        line = await server.until("executor.worker_starting")
        assert f"pid={running[0]}" in line and "early=True" in line, line
        # the worker's own start events, relayed with its pid, before it is ready
        loaded = await server.until("model.load.done")
        assert f"pid={running[0]}" in loaded, loaded
        await server.until("executor.worker_ready")
        match = _URL.search(await server.until("stoic.ready"))
        assert match, server.text
        async with aiohttp.ClientSession() as http:
            body = completion_body(max_tokens=2)
            async with http.post(f"{match.group(1)}/v1/completions", json=body) as r:
                assert r.status == 200
        server.proc.send_signal(signal.SIGTERM)
        assert await server.finish() == 0, server.text
    assert "Traceback" not in server.text


def _until_mapped(pid: int, library: str, within: float) -> None:
    """Wait until process ``pid`` has loaded a shared library whose name has ``library``
    (an import of the Python package that ships it is under way)."""
    deadline = time.monotonic() + within
    maps = Path(f"/proc/{pid}/maps")
    while library not in maps.read_text():
        assert time.monotonic() < deadline, f"{library} never loaded"
        time.sleep(0.002)


def _still_running(pids: list[int], within: float) -> list[int]:
    """Those of ``pids`` still running after ``within`` seconds (a zombie counts as gone)."""
    deadline = time.monotonic() + within
    while (left := [pid for pid in pids if not _gone(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _gone(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    return "\nState:\tZ" in status


@pytest.mark.model
async def test_a_worker_killed_while_loading_is_one_line_and_status_1(
    tiny_model_dir: Path,
) -> None:
    """The first worker process killed while it loads the weights (the OOM killer, say): the
    server exits 1 with one ``stoic.start_failed`` line that says so, no traceback."""
    async with _serve(tiny_model_dir) as server:
        await server.until("executor.worker_starting")
        killed = await asyncio.to_thread(_kill_loading, server, 60.0)
        assert await server.finish() == 1, server.text
    assert "Traceback" not in server.text, server.text
    (failed,) = [line for line in server.lines if "stoic.start_failed" in line]
    assert "error=EngineFailed" in failed and "killed by SIGKILL" in failed, failed
    assert killed > 0


def _kill_loading(server: _Serve, within: float) -> int:
    """SIGKILL the server's worker whose title says it loads the model; its pid."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        for pid in server.children():
            with contextlib.suppress(OSError):
                if b"(loading)" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)
                    return pid
        time.sleep(0.02)
    raise AssertionError("no worker loading")
