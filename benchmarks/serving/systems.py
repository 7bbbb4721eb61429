"""The servers the benchmark starts, drives and stops, and ``--timed-serve`` (``stoic serve``
with ``ModelRunner.execute`` timed)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from . import BIN, BLOCK_SIZE, MAX_BATCHED_TOKENS, MAX_NUM_SEQS, NUM_KV_BLOCKS, SCRIPT
from .load import quantile


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class System:
    """An OpenAI-compatible server the benchmark starts, drives and stops."""

    name: str
    argv: list[str]
    port: int
    model: str  # the ``model`` field of requests
    extra: dict[str, Any]  # request fields that make it greedy with EOS ignored
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    note: str = ""
    steps_file: Path | None = None  # stoic under timed_serve: step timings land here

    async def step_stats(self) -> dict[str, Any] | None:
        """Ask a timed stoic server for its step timings since the last call (and reset them)."""
        if self.steps_file is None or self.proc is None or self.proc.poll() is not None:
            return None
        seen = len(read_lines(self.steps_file))
        self.proc.send_signal(signal.SIGUSR1)
        for _ in range(100):
            await asyncio.sleep(0.02)
            lines = read_lines(self.steps_file)
            if len(lines) > seen:
                return dict(json.loads(lines[-1]))
        return None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def body(self, messages: Any, max_tokens: int) -> dict[str, Any]:
        return {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "stream": True,
            **self.extra,
        }

    def spawn(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )

    async def start(self, limit_s: float = 300.0) -> None:
        """Spawn the server and wait until ``GET /health`` answers 200."""
        self.spawn()
        assert self.proc is not None
        deadline = time.monotonic() + limit_s
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.name} exited with {self.proc.returncode}; log: {self.log}\n"
                        + self.log.read_text(errors="replace")[-2000:]
                    )
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with session.get(
                        self.url + "/health", timeout=aiohttp.ClientTimeout(total=2)
                    ) as resp:
                        if resp.status == 200:
                            return
                await asyncio.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name} not healthy after {limit_s:.0f} s; log: {self.log}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def stoic_system(work: Path) -> System:
    """``stoic serve`` through :func:`timed_serve`: the same ``stoic.cli.main``, with the time
    the executor spends in ``ModelRunner.execute`` recorded (SIGUSR1 dumps and resets it)."""
    port = free_port()
    argv = [sys.executable, str(SCRIPT), "--timed-serve", str(work / "stoic-steps.jsonl")]
    argv += ["serve", "--model", "default", "--dtype", "bfloat16"]
    argv += ["--port", str(port), "--log-level", "warning", "--block-size", str(BLOCK_SIZE)]
    argv += ["--num-kv-blocks", str(NUM_KV_BLOCKS)]
    argv += ["--max-num-batched-tokens", str(MAX_BATCHED_TOKENS)]
    argv += ["--max-num-seqs", str(MAX_NUM_SEQS)]
    extra = {"temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
    system = System("stoic serve", argv, port, "default", extra, work / "stoic.log")
    system.steps_file = work / "stoic-steps.jsonl"
    return system


def read_lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except OSError:
        return []


def timed_serve(stats_path: str, argv: Sequence[str]) -> int:
    """Run ``stoic serve`` (``stoic.cli.main``) timing every ``ModelRunner.execute`` call.

    On SIGUSR1 one JSON line goes to ``stats_path``: steps, seconds inside ``execute`` and the
    gaps between consecutive steps since the previous SIGUSR1; then the counters reset.
    """
    from stoic.cli import main as stoic_main
    from stoic.model import _runner

    original = _runner.ModelRunner.execute
    fresh: dict[str, Any] = {"busy": 0.0, "steps": 0, "last": None, "gaps": []}
    stats: dict[str, Any] = {**fresh, "gaps": [], "since": time.perf_counter(), "current": None}

    def execute(self: Any, batch: Any, cache: Any) -> Any:
        t0 = stats["current"] = time.perf_counter()
        try:
            return original(self, batch, cache)
        finally:
            t1 = time.perf_counter()
            stats["current"] = None
            if stats["last"] is not None:
                stats["gaps"].append(t0 - stats["last"])
            stats["busy"] += t1 - max(t0, stats["since"])  # a window may start mid-step
            stats["steps"] += 1
            stats["last"] = t1

    def dump(*_: Any) -> None:
        now = time.perf_counter()
        busy, current, gaps = stats["busy"], stats["current"], stats["gaps"]
        if current is not None:  # a step in flight: count its part inside the window
            busy += now - max(current, stats["since"])
        line = {
            "window_s": now - stats["since"],
            "steps": stats["steps"],
            "execute_s": busy,
            "gaps_s": sum(gaps),
            "gap_p50_ms": 1000 * (quantile(gaps, 0.5) or 0.0),
            "gap_p90_ms": 1000 * (quantile(gaps, 0.9) or 0.0),
            "gap_max_ms": 1000 * max(gaps, default=0.0),
        }
        with open(stats_path, "a") as out:
            out.write(json.dumps(line) + "\n")
        stats.update(fresh, gaps=[], since=now)

    _runner.ModelRunner.execute = execute  # type: ignore[method-assign]
    signal.signal(signal.SIGUSR1, dump)
    return stoic_main(list(argv))


def transformers_system(work: Path, model_dir: Path, max_tokens: int, cb: bool) -> System:
    port = free_port()
    argv = [str(BIN / "transformers"), "serve", str(model_dir), "--dtype", "bfloat16"]
    argv += ["--device", "cpu", "--host", "127.0.0.1", "--port", str(port)]
    if cb:
        argv += ["--continuous-batching", "--cb-block-size", str(BLOCK_SIZE)]
        argv += ["--cb-num-blocks", str(NUM_KV_BLOCKS)]
        argv += ["--cb-max-batch-tokens", str(MAX_BATCHED_TOKENS)]
    # transformers serve has no ignore_eos; a per-request generation config with eos_token_id
    # -1 (disabled) does the same; it rejects stream_options and always sends usage
    gen = {"max_new_tokens": max_tokens, "do_sample": False, "eos_token_id": -1}
    extra = {"generation_config": json.dumps(gen)}
    name = "transformers serve CB" if cb else "transformers serve (no CB)"
    return System(name, argv, port, str(model_dir), extra, work / f"transformers-{int(cb)}.log")


def _has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " amx_int8" in line for line in f)
    except OSError:
        return False


def llama_system(work: Path, binary: str, gguf: Path, slots: int) -> System:
    port = free_port()
    threads = str(os.cpu_count() or 1)
    argv = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--parallel", str(slots), "--ctx-size", str(slots * 1024), "--threads", threads]
    if _has_amx():
        # llama.cpp's AMX weight buffers (built in by GGML_NATIVE on a CPU with AMX) crash this
        # build at the first product (SIGSEGV in ggml_backend_amx_mul_mat, llama-cpp-python
        # 0.3.36's vendored llama.cpp); --no-repack keeps ggml's plain blocks, run by its
        # AVX-512/VNNI dot products
        argv.append("--no-repack")
    extra = {"temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
    return System("llama.cpp server", argv, port, "default", extra, work / "llama.log")


def open_log(path: Path) -> Any:
    return path.open("ab")
