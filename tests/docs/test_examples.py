"""The programs in examples/ run as documented: each as its own process, on the default model."""

from __future__ import annotations

import importlib.util
import json
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from support import free_port

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
#: generous: the machine may be busy; a healthy run takes a few seconds
TIMEOUT = 120.0


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )


def _import(path: Path) -> ModuleType:
    name = f"_example_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.py")), ids=lambda p: p.name)
def test_example_imports_without_running(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Importing an example defines ``main`` and a module docstring, and runs nothing."""
    module = _import(path)
    assert callable(module.main)
    assert module.__doc__ and str(path.relative_to(ROOT)) in module.__doc__
    assert capsys.readouterr().out == ""


def test_supervised_counter_crashes_restarts_and_escalates() -> None:
    """The counter loses its state on a restart but keeps its reference and the messages queued
    meanwhile; a third crash within the window makes the supervisor give up."""
    done = _run("examples/supervised_counter.py")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "value: 3" in out
    assert "on_failure: incarnation 0 died of RuntimeError('bad input')" in out
    assert "value after the restart: 10" in out
    assert "the supervisor gave up after 3 failures in the window" in out
    assert "the counter is alive: False" in out
    assert "leaving the system re-raised it: SupervisorEscalation" in out


@pytest.mark.model
@pytest.mark.parametrize("executor", ["thread", "process"])
def test_stream_chat_streams_at_most_max_tokens(executor: str) -> None:
    """stream_chat.py prints the streamed reply, then its finish reason and token counts; it
    never generates more than --max-tokens (with the model in a thread or a worker process)."""
    done = _run(
        "examples/stream_chat.py", "--max-tokens", "4", "--executor", executor, "Say hello."
    )
    assert done.returncode == 0, done.stderr
    summary = done.stdout.strip().splitlines()[-1]
    match = re.fullmatch(
        r"\[(stop|length): (\d+) prompt tokens, (\d+) completion tokens\]", summary
    )
    assert match, done.stdout
    assert int(match[2]) > 0 and 1 <= int(match[3]) <= 4


def _request(url: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"content-type": "application/json"} if body is not None else {}
    request = urllib.request.Request(url, data=data, headers=headers)
    with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
        return response.status, json.loads(response.read())


def _wait_until_serving(url: str, proc: subprocess.Popen[str]) -> Any:
    deadline = time.monotonic() + TIMEOUT
    while True:
        assert proc.poll() is None, f"the host exited early with status {proc.returncode}"
        try:
            return _request(url)[1]
        except (urllib.error.URLError, ConnectionError):
            assert time.monotonic() < deadline, f"{url} did not answer within {TIMEOUT}s"
            time.sleep(0.2)


@pytest.mark.model
def test_aiohttp_host_serves_its_routes_and_stoic_under_llm() -> None:
    """aiohttp_host.py starts the engine on startup, answers its own route and stoic's routes
    under /llm (models, one chat completion), and stops cleanly on SIGTERM."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "examples/aiohttp_host.py", "--port", str(port)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        index = _wait_until_serving(f"{base}/", proc)
        assert index["llm"]["health"] == "serving"
        status, models = _request(f"{base}/llm/v1/models")
        assert status == 200 and models["data"][0]["id"] == index["llm"]["model"]
        body = {
            "model": "default",
            "messages": [{"role": "user", "content": "Say hi."}],
            "max_tokens": 3,
        }
        status, reply = _request(f"{base}/llm/v1/chat/completions", body)
        assert status == 200
        assert reply["object"] == "chat.completion"
        assert 1 <= reply["usage"]["completion_tokens"] <= 3
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == 0, err
        assert "engine.stopped" in err  # the cleanup_ctx stopped the engine
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
