"""Two Ray nodes on loopback (a head and a worker, each its own ``ray start`` with one CPU) and
``stoic serve --replicas 2 --ray-address``: a replica on each node; the worker node lost mid-stream
(its raylet and every process on it killed) loses no request; the replica is placed again when a
node comes back (docs/scale-out.md, "Two nodes")."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import free_port

pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

RAY = Path(sys.executable).parent / "ray"
#: the GCS declares a silent node dead after 4 missed checks of 0.5 s (default: 5 of 3 s)
FAST_HEALTH = {
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "4",
}
#: every process of this loopback cluster without Ray's token authentication (which `ray start
#: --head` turns on by default: the token would have to be in ~/.ray for every process)
RAY_ENV = {**os.environ, **FAST_HEALTH, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
PROMPTS = [f"Write a short story about the number {n}." for n in range(16)]
TOKENS = 48


def _start_node(log: Path, *args: str) -> subprocess.Popen[bytes]:
    """``ray start ... --block`` in a session of its own: the node's processes (raylet, its
    workers) are its descendants, so the test can kill exactly that node."""
    command = [str(RAY), "start", "--block", "--num-cpus", "1", "--node-ip-address", "127.0.0.1"]
    command += ["--object-store-memory", str(100 * 2**20), *args]
    with log.open("ab") as out:
        return subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=RAY_ENV,
        )


def _node_pids(node: subprocess.Popen[bytes]) -> set[int]:
    try:
        return {p.pid for p in psutil.Process(node.pid).children(recursive=True)} | {node.pid}
    except psutil.NoSuchProcess:
        return set()


def _kill_node(node: subprocess.Popen[bytes]) -> None:
    """SIGKILL to the node's raylet and every process under it (its replicas), at once."""
    for pid in _node_pids(node):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    node.wait(30)


def _replica_pids() -> set[int]:
    found = subprocess.run(
        ["pgrep", "-f", "ServeReplica:stoic:EngineReplica"], capture_output=True, check=False
    )
    return {int(pid) for pid in found.stdout.split()}


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, str(exc)


def _until(check: object, limit: float, what: str) -> None:
    deadline = time.monotonic() + limit
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what}: not within {limit:.0f} s"
        time.sleep(0.5)


def _serving(url: str, replicas: int) -> bool:
    status, metrics = _get(f"{url}/metrics")
    return status == 200 and f'stoic_replicas{{state="serving"}} {float(replicas)}' in metrics


def _complete(url: str, prompt: str) -> str:
    body = {"model": "default", "prompt": prompt, "max_tokens": TOKENS, "temperature": 0}
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps({**body, "ignore_eos": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return str(json.loads(response.read())["choices"][0]["text"])


def _stream(url: str, prompt: str, started: threading.Event, out: dict[str, str]) -> None:
    """A streamed completion; ``started`` once its first token arrives; its text in ``out``
    (or the error it met, marked)."""
    body = {"model": "default", "prompt": prompt, "max_tokens": TOKENS, "temperature": 0}
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps({**body, "ignore_eos": True, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    text = []
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    out[prompt] = f"<error: {event['error']}>"
                    return
                text.append(event["choices"][0]["text"])
                started.set()
    except OSError as exc:
        out[prompt] = f"<error: {exc}>"
        return
    finally:
        started.set()
    out[prompt] = "".join(text)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes], Path]]:
    """A head node (its GCS on a free port) and one worker node; yields (address, worker node,
    log folder); every node the test started is killed afterwards."""
    address = f"127.0.0.1:{free_port()}"
    nodes: list[subprocess.Popen[bytes]] = []
    head = _start_node(
        tmp_path / "head.log",
        "--head",
        "--port",
        address.split(":")[1],
        "--include-dashboard=false",
    )
    nodes.append(head)
    try:
        _until(
            lambda: (
                subprocess.run(
                    [str(RAY), "health-check", "--address", address],
                    capture_output=True,
                    env=RAY_ENV,
                ).returncode
                == 0
            ),
            120,
            "the head node",
        )
        worker = _start_node(tmp_path / "worker.log", "--address", address)
        nodes.append(worker)
        yield address, worker, tmp_path
    finally:
        for node in nodes:
            _kill_node(node)
        subprocess.run([str(RAY), "stop", "--force"], capture_output=True, check=False)


def test_losing_the_worker_node_mid_stream_loses_no_request_and_the_replica_comes_back(
    cluster: tuple[str, subprocess.Popen[bytes], Path], tiny_model_dir: Path
) -> None:
    """``stoic serve --replicas 2 --ray-address`` on a head and a worker node of one CPU each
    (one replica a node: each needs a CPU). 16 greedy float32 streams run across both; the
    worker node is killed whole (raylet and replica) once every stream has a token: all 16
    complete with exactly their fault-free text (the ones on the lost node migrate to the
    head's replica). A new worker node joins and Serve places the lost replica on it."""
    address, worker, logs = cluster
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "stoic", "serve", "--replicas", "2", "--port", str(port)]
    command += ["--ray-address", address, "--model", str(tiny_model_dir), "--dtype", "float32"]
    command += ["--executor", "thread", "--replica-cpus", "1"]
    with (logs / "serve.log").open("w") as log:
        server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, env=RAY_ENV)
    try:
        _until(lambda: server.poll() is None and _serving(url, 2), 300, "two replicas serving")
        on_worker = _replica_pids() & _node_pids(worker)
        assert len(on_worker) == 1, "one replica on the worker node, one on the head"
        expected = {p: _complete(url, p) for p in PROMPTS}
        got: dict[str, str] = {}
        started = [threading.Event() for _ in PROMPTS]
        threads = [
            threading.Thread(target=_stream, args=(url, p, e, got))
            for p, e in zip(PROMPTS, started, strict=True)
        ]
        for thread in threads:
            thread.start()
        for event in started:
            assert event.wait(120)
        _kill_node(worker)
        for thread in threads:
            thread.join(300)
        assert got == expected
        _, metrics = _get(f"{url}/metrics")
        migrated = [x for x in metrics.splitlines() if x.startswith("stoic_requests_migrated")]
        assert migrated and float(migrated[0].split()[-1]) > 0, migrated
        # a node comes back: Serve places the lost replica on it
        back = _start_node(logs / "worker2.log", "--address", address)
        try:
            _until(
                lambda: _serving(url, 2) and _replica_pids() & _node_pids(back),
                240,
                "the replica placed on the new node",
            )
            assert _complete(url, PROMPTS[0]) == expected[PROMPTS[0]]
        finally:
            _kill_node(back)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(90)
        except subprocess.TimeoutExpired:
            server.kill()
