"""``stoic serve --replicas 1`` end to end: the command, a local Ray, the default model."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from support import free_port

pytest.importorskip("ray")

#: Ray's start and the model's load on a busy 2-core machine
READY_WITHIN = 300.0


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


#: seconds Ray may take to reap a stopped replica's process after the server exited
REAP_WITHIN = 30.0


def _replica_pids() -> set[int]:
    """The process ids of the Ray Serve replicas of stoic's deployment running now."""
    found = subprocess.run(
        ["pgrep", "-f", "ServeReplica:stoic:EngineReplica"], capture_output=True, check=False
    )
    return {int(pid) for pid in found.stdout.split()}


def test_stoic_serve_replicas_serves_the_default_model(
    default_model_dir: Path, tmp_path: Path
) -> None:
    """``stoic serve --replicas 1`` starts a local Ray and a replica of the default model,
    answers the official SDK, reports the replica on /health and /metrics, and exits 0 on
    SIGINT, leaving no replica process behind."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "stoic", "serve", "--replicas", "1", "--port", str(port)]
    cmd += ["--dtype", "float32", "--executor", "thread", "--replica-cpus", "1"]
    log = tmp_path / "stderr.log"
    # replicas an earlier test's Ray may still be shutting down are not this server's
    before = _replica_pids()
    with log.open("w") as stderr:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        started = time.monotonic()
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                status, body = _get(f"{url}/health")
                if status == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() - started < READY_WITHIN, "not serving in time"
            time.sleep(1.0)
        assert json.loads(body)["status"] == "ok"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        chat = client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=8,
            temperature=0,
        )
        assert chat.choices[0].message.content
        assert chat.usage is not None and 0 < chat.usage.completion_tokens <= 8
        _status, metrics = _get(f"{url}/metrics")
        assert 'stoic_replicas{state="serving"} 1.0' in metrics
        assert "stoic_replica_generated_tokens{replica=" in metrics
        assert "stoic_replica_prefix_cache_hit_tokens{replica=" in metrics
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 0, log.read_text()[-3000:]
    # Ray reaps a stopped replica's process a moment after the server exits (seconds on a
    # loaded machine): gone within the grace, not merely after the exit
    deadline = time.monotonic() + REAP_WITHIN
    while (left := _replica_pids() - before) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == set()
