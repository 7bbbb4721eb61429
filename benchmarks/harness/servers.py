"""The servers a benchmark starts, drives and stops: ``stoic serve`` with any flags, llama.cpp's
``llama-server`` and ``transformers serve``, each an OpenAI-compatible :class:`System` whose
requests are greedy with EOS ignored."""

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

BIN = Path(sys.executable).parent
# stoic's defaults on a 2-core CPU, passed to every server a comparison starts, so that they hold
# the same KV capacity and take the same tokens per step
BLOCK_SIZE = 16
NUM_KV_BLOCKS = 2912  # 1 GiB of bfloat16 KV for SmolLM2-135M: 46,592 tokens
MAX_BATCHED_TOKENS = 256  # stoic's CPU default; transformers serve gets the same
MAX_NUM_SEQS = 64
#: request fields that make stoic and llama.cpp greedy with EOS ignored, usage in the last event
GREEDY: dict[str, Any] = {
    "temperature": 0,
    "ignore_eos": True,
    "stream_options": {"include_usage": True},
}


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
    env: dict[str, str] | None = None  # the environment to start it in (None: this one's)

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
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
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


def read_lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except OSError:
        return []


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
    return System("llama.cpp server", argv, port, "default", dict(GREEDY), work / "llama.log")


def model_file(name: str) -> Path:
    """A benchmark's ``--model``: a GGUF file, ``default`` the shipped one.

    :raises SystemExit: if the file does not exist.
    """
    from stoic.model import default_gguf_path

    path = default_gguf_path() if name == "default" else Path(name)
    if not path.is_file():
        raise SystemExit(f"--model: no such file: {path}")
    return path


def model_flags(gguf: Path) -> list[str]:
    """``stoic serve``'s flags for ``gguf``: none for the shipped model (its default)."""
    from stoic.model import default_gguf_path

    return [] if gguf == default_gguf_path() else ["--model", str(gguf)]


def stoic_server(
    work: Path,
    name: str,
    flags: Sequence[str] = (),
    *,
    log_level: str = "warning",
    tree: Path | None = None,
) -> System:
    """``stoic serve`` (this interpreter's) on a free port with its defaults and ``flags``; its log
    goes to ``work``. ``tree``: the ``stoic`` package imported from that source tree (a git
    worktree of another commit: a before/after in one run) instead of this environment's."""
    port = free_port()
    serve = ["serve", "--port", str(port), "--log-level", log_level, *flags]
    argv = [str(BIN / "stoic"), *serve]
    env = None
    if tree is not None:
        argv = [sys.executable, "-m", "stoic", *serve]
        env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    slug = "".join(c if c.isalnum() else "_" for c in name).strip("_")
    return System(name, argv, port, "default", dict(GREEDY), work / f"{slug}.log", env=env)


def open_log(path: Path) -> Any:
    return path.open("ab")
