"""Serving benchmark: stoic's HTTP server next to transformers serve (continuous batching) and a
plain batched torch decode loop (the ceiling), on the same requests, in one run.

A load generator drives any OpenAI-compatible ``/v1/chat/completions`` endpoint with C concurrent
*streaming* clients (aiohttp, SSE parsing) over a fixed, seeded prompt set of mixed lengths
(``engine_bench.mixed_prompts``), ``max_tokens`` 64 with EOS ignored, and reports output tokens/s,
requests/s, TTFT p50/p90/p99, inter-token latency p50/p99 (gaps between content events as the
client sees them), time per output token, end-to-end latency and errors.

The full run (``python benchmarks/serving_bench.py``, ~10-20 minutes on 2 CPU cores):

1. **mixed, over HTTP**, at concurrency 1, 8 and 32: ``stoic serve`` and ``transformers serve
   --continuous-batching`` (same model directory, bfloat16, CPU, same KV capacity and tokens per
   step) run side by side, idle when not measured; at each concurrency level every system is
   measured in turn (the order rotates per level) so drift hits all alike. The ceiling is the
   batched torch decode loop at batch = concurrency (decode only, no prefill, no HTTP; the faster
   of SDPA and eager attention). llama.cpp's ``llama-server`` joins when it is on PATH or given
   with ``--llama-server``.
2. **engine overhead** at concurrency 32: stoic runs under ``--timed-serve`` (``stoic.cli.main``
   with ``ModelRunner.execute`` timed), so every pass reports the exact share of wall time the
   executor spends inside steps; a second c=32 pass is sampled by ``py-spy record --threads
   --idle -f raw`` to break the time down by what the executor thread and the event loop run,
   next to the kernel's per-thread CPU accounting.
3. **through the Python API** (servers stopped): steady decode (32 sequences, 128-token prompts,
   128 new tokens) against the torch loop, and concurrency 1 against transformers ``generate`` one
   request at a time; plus a float32/bfloat16 check of the torch loop (why bfloat16). Each runs
   in a fresh process (see :func:`worker_main`).

Every measurement records the CPU other processes used meanwhile and is repeated (up to twice)
after waiting for quiet when that exceeds 15% of the machine.

It writes ``docs/benchmarks.md`` and ``docs/img/serving_bench.png`` (``--quick``: fewer requests,
written under ``$TMPDIR/stoic-serving-bench`` unless ``--docs-dir`` is given). Drive an endpoint
of your own with ``--url http://127.0.0.1:8000 --model NAME``.

Needs the ``bench`` extra: ``pip install -e '.[bench]'`` (transformers serve, matplotlib, py-spy).
"""

from __future__ import annotations

import os

# before anything imports transformers or huggingface_hub: never touch the network
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import argparse
import asyncio
import collections
import contextlib
import json
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_bench as eb

SCRIPT = Path(__file__).resolve()
ROOT = SCRIPT.parent.parent
BIN = Path(sys.executable).parent
CONCURRENCY = (1, 8, 32)
# stoic's defaults on this machine, passed to every server so they hold the same KV capacity
BLOCK_SIZE = 16
NUM_KV_BLOCKS = 2912  # 1 GiB of bfloat16 KV for SmolLM2-135M: 46,592 tokens
MAX_BATCHED_TOKENS = 512
MAX_NUM_SEQS = 64
# a measurement during which other processes used more of the machine's CPU is repeated
MAX_OTHER_CPU = 0.15
QUIET_CPU = 0.10
T = TypeVar("T")


# --------------------------------------------------------------------------------------------
# load generator


@dataclass
class RequestRecord:
    ok: bool
    start: float
    e2e: float
    ttft: float | None = None
    output_tokens: int = 0
    itls: list[float] = field(default_factory=list)
    error: str | None = None


@dataclass
class Result:
    system: str
    concurrency: int
    planned: int
    records: list[RequestRecord]
    seconds: float
    other_cpu: float | None = None  # share of the machine's CPU used by other processes
    note: str = ""
    # per server thread: (OS thread id, share of wall on a CPU, share runnable but waiting)
    sched: list[tuple[int, float, float]] = field(default_factory=list)
    steps: dict[str, Any] | None = None  # stoic's step timings (see timed_serve)
    steps_wall: float | None = None  # the window they cover (default: the whole pass)

    @property
    def execute_share(self) -> float | None:
        """Share of the wall time stoic's executor spent inside ``ModelRunner.execute``."""
        if not self.steps:
            return None
        wall = float(self.steps.get("window_s") or self.steps_wall or self.seconds)
        return float(self.steps["execute_s"]) / wall if wall else None

    @property
    def ok(self) -> list[RequestRecord]:
        return [r for r in self.records if r.ok]

    @property
    def errors(self) -> int:
        return len(self.records) - len(self.ok)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.ok)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0

    @property
    def requests_per_s(self) -> float:
        return len(self.ok) / self.seconds if self.seconds else 0.0

    def ttft(self, q: float) -> float | None:
        return quantile([r.ttft for r in self.ok if r.ttft is not None], q)

    def itl(self, q: float) -> float | None:
        return quantile([x for r in self.ok for x in r.itls], q)

    def tpot(self, q: float) -> float | None:
        values = [
            (r.e2e - r.ttft) / (r.output_tokens - 1)
            for r in self.ok
            if r.ttft is not None and r.output_tokens > 1
        ]
        return quantile(values, q)

    def e2e(self, q: float) -> float | None:
        return quantile([r.e2e for r in self.ok], q)

    def summary(self) -> dict[str, Any]:
        return {
            "system": self.system,
            "concurrency": self.concurrency,
            "requests": len(self.ok),
            "planned": self.planned,
            "errors": self.errors,
            "output_tokens": self.output_tokens,
            "seconds": round(self.seconds, 3),
            "tokens_per_s": round(self.tokens_per_s, 2),
            "requests_per_s": round(self.requests_per_s, 3),
            "ttft_p50": self.ttft(0.5),
            "ttft_p90": self.ttft(0.9),
            "ttft_p99": self.ttft(0.99),
            "itl_p50": self.itl(0.5),
            "itl_p99": self.itl(0.99),
            "tpot_p50": self.tpot(0.5),
            "e2e_p50": self.e2e(0.5),
            "e2e_p99": self.e2e(0.99),
            "other_cpu": self.other_cpu,
            "first_error": next((r.error for r in self.records if r.error), None),
            "note": self.note,
        }


def quantile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated quantile (``q`` in [0, 1]); ``None`` for no values."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


async def one_request(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], limit_s: float
) -> RequestRecord:
    start = time.perf_counter()
    rec = RequestRecord(ok=False, start=start, e2e=0.0)
    usage_tokens: int | None = None
    chunks = 0
    last = 0.0
    try:
        async with session.post(
            url, json=body, timeout=aiohttp.ClientTimeout(total=limit_s)
        ) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                rec.e2e = time.perf_counter() - start
                return rec
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                now = time.perf_counter()
                event = json.loads(data)
                if "error" in event:
                    rec.error = json.dumps(event["error"])[:200]
                    break
                usage = event.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
                for choice in event.get("choices") or ():
                    if (choice.get("delta") or {}).get("content"):
                        chunks += 1
                        if rec.ttft is None:
                            rec.ttft = now - start
                        else:
                            rec.itls.append(now - last)
                        last = now
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:200]
    rec.e2e = time.perf_counter() - start
    rec.output_tokens = usage_tokens if usage_tokens is not None else chunks
    rec.ok = rec.error is None and rec.output_tokens > 0
    return rec


async def run_load(
    url: str,
    bodies: Sequence[dict[str, Any]],
    concurrency: int,
    *,
    budget: float,
    request_timeout: float = 300.0,
) -> tuple[list[RequestRecord], float]:
    """C closed-loop clients over ``bodies`` in order; no new request starts after ``budget`` s.

    Returns the records and the wall time from the first request to the last response.
    """
    queue = collections.deque(bodies)
    records: list[RequestRecord] = []
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()

        async def client() -> None:
            while queue and time.perf_counter() - start < budget:
                body = queue.popleft()
                records.append(await one_request(session, url, body, request_timeout))

        await asyncio.gather(*(client() for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    return records, seconds


# --------------------------------------------------------------------------------------------
# servers


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
    fresh = {"busy": 0.0, "steps": 0, "last": None, "gaps": []}
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


def llama_system(work: Path, binary: str, gguf: Path, slots: int) -> System:
    port = free_port()
    threads = str(os.cpu_count() or 1)
    argv = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--parallel", str(slots), "--ctx-size", str(slots * 1024), "--threads", threads]
    extra = {"temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
    return System("llama.cpp server", argv, port, "default", extra, work / "llama.log")


def open_log(path: Path) -> Any:
    return path.open("ab")


def spawn_logged(argv: Sequence[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)


# --------------------------------------------------------------------------------------------
# CPU used by other processes during a measurement (the machine is shared)


def _jiffies(pid: int, children: bool = False) -> int:
    """CPU ticks of ``pid`` (utime + stime), plus its reaped children's with ``children``."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        ticks = int(fields[11]) + int(fields[12])
        return ticks + (int(fields[13]) + int(fields[14]) if children else 0)
    except (OSError, IndexError, ValueError):
        return 0


def all_jiffies() -> dict[int, int]:
    out: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError):
            out[int(stat.parent.name)] = _jiffies(int(stat.parent.name))
    return out


def top_processes(before: dict[int, int], after: dict[int, int], ours: set[int]) -> str:
    """The two processes (not ours) that used the most CPU between the snapshots."""
    deltas = sorted(
        ((after[p] - before.get(p, 0), p) for p in after if p not in ours), reverse=True
    )[:2]
    parts = []
    for delta, pid in deltas:
        if delta <= 0:
            continue
        with contextlib.suppress(OSError):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:60]
            parts.append(f"{pid} {cmd.strip()}")
    return "; ".join(parts) or "short-lived processes"


def schedstat(pid: int) -> dict[int, tuple[int, int]]:
    """Per OS thread of ``pid``: (ns on a CPU, ns runnable but waiting for a CPU)."""
    out: dict[int, tuple[int, int]] = {}
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, ValueError):
                run, wait, _ = (task / "schedstat").read_text().split()
                out[int(task.name)] = (int(run), int(wait))
    return out


def sched_delta(
    before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]], wall: float
) -> list[tuple[int, float, float]]:
    """Threads that ran or waited >= 1% of ``wall``: (tid, on-CPU share, waiting share)."""
    rows = []
    for tid, (run1, wait1) in after.items():
        run0, wait0 = before.get(tid, (0, 0))
        run, waited = (run1 - run0) / 1e9 / wall, (wait1 - wait0) / 1e9 / wall
        if run >= 0.01 or waited >= 0.01:
            rows.append((tid, run, waited))
    return sorted(rows, key=lambda r: -r[1])


def _cpu_total() -> tuple[int, int]:
    try:
        values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    except (OSError, ValueError):
        return 0, 0
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


class CpuWatch:
    """Share of the machine's CPU that processes other than ours used between start and stop."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids = list(pids)
        self.busy0, self.total0 = _cpu_total()
        self.ours0 = self._ours()

    def _ours(self) -> int:
        # this process, its finished worker processes, and the servers
        return _jiffies(os.getpid(), children=True) + sum(_jiffies(p) for p in self.pids)

    def stop(self) -> float | None:
        busy, total = _cpu_total()
        ours = self._ours()
        if total <= self.total0:
            return None
        return max(0.0, (busy - self.busy0) - (ours - self.ours0)) / (total - self.total0)


# --------------------------------------------------------------------------------------------
# py-spy profile of the stoic server


EXECUTOR_CATS = ("forward", "sampling", "step inputs", "hand-off / other", "idle")
LOOP_CATS = (
    "scheduling",
    "detokenising",
    "messaging (actors, streams)",
    "HTTP (aiohttp, stoic.http, JSON)",
    "logging / metrics",
    "asyncio loop",
    "other",
    "idle",
)
IDLE_LEAVES = (
    "EpollSelector.select",
    "Condition.wait",
    "Event.wait",
    "StepWorker._loop",  # its only C call is the blocking queue.get()
    "Thread.join",
    "_worker",
)


def _frame_key(frame: str) -> str:
    return re.sub(r":\d+\)$", ")", frame)


def _func(frame: str) -> str:
    return frame.split(" (", 1)[0]


def _file(frame: str) -> str:
    return frame.rpartition(" (")[2].rstrip(")").rsplit(":", 1)[0]


def classify_executor(frames: Sequence[str]) -> str:
    funcs = [_func(f) for f in frames]
    if "ModelRunner.execute" in funcs:
        files = [_file(f) for f in frames]
        if "_build_inputs" in funcs or "PagedKVCache.zero_blocks" in funcs:
            return "step inputs"
        if any(
            fn == "sample" and fl.endswith("_sampling.py")
            for fn, fl in zip(funcs, files, strict=True)
        ):
            return "sampling"
        return "forward"
    if funcs and funcs[-1].endswith(IDLE_LEAVES):
        return "idle"
    return "hand-off / other"


def _loop_category(frame: str) -> str | None:
    fn, fl = _func(frame), _file(frame)
    if (
        "detokeni" in fn
        or fn.endswith(("_token_text", "_apply_stop_strings"))
        or fl.startswith("tokenizers/")
        or "tokenization_utils" in fl
    ):
        return "detokenising"
    if fl.startswith(("stoic/http/", "aiohttp/", "json/", "multidict/", "yarl/", "pydantic/")):
        return "HTTP (aiohttp, stoic.http, JSON)"
    if fl.startswith(("structlog/", "logging/", "prometheus_client/")):
        return "logging / metrics"
    if fl.startswith("stoic/actors/engine/") and not fl.endswith(("_stream.py", "_messages.py")):
        return "scheduling"
    if fl.startswith(("stoic/actors/", "stoic/engine.py", "asyncio/queues.py", "anyio/")):
        return "messaging (actors, streams)"
    return None


def classify_loop(frames: Sequence[str]) -> str:
    if frames and _func(frames[-1]).endswith(IDLE_LEAVES):
        return "idle"
    for frame in reversed(frames):  # the innermost recognised frame decides
        cat = _loop_category(frame)
        if cat is not None:
            return cat
    if any(_file(f).startswith("asyncio/") for f in frames):
        return "asyncio loop"
    return "other"


@dataclass
class Profile:
    seconds: float
    rate: int
    command: str
    executor: dict[str, float]  # category -> share of wall
    loop: dict[str, float]
    samples: dict[str, int]  # thread -> samples
    top_executor: list[tuple[str, float]]  # self time
    top_loop_self: list[tuple[str, float]]
    top_loop_incl: list[tuple[str, float]]
    other_threads_busy: float
    tids: dict[int, str] = field(default_factory=dict)  # OS thread id -> Python thread name
    profiler_cpu: float = 0.0  # py-spy's own CPU, in cores
    client_cpu: float = 0.0  # the load generator's CPU, in cores

    @property
    def overhead(self) -> float:
        return 1.0 - self.executor.get("forward", 0.0) - self.executor.get("sampling", 0.0)


def parse_profile(path: Path, seconds: float, rate: int, command: str) -> Profile:
    threads: dict[str, collections.Counter[tuple[str, ...]]] = collections.defaultdict(
        collections.Counter
    )
    tids: dict[int, str] = {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        head = frames[0]
        name = head.split("): ", 1)[1] if "): " in head else head
        tid = re.match(r"thread \((\d+)\)", head)
        if tid:
            tids[int(tid.group(1))] = name
        threads[name][tuple(frames[1:])] += int(count)

    def shares(stacks: collections.Counter[tuple[str, ...]], classify: Any, cats: Sequence[str]):
        total = sum(stacks.values()) or 1
        out = dict.fromkeys(cats, 0.0)
        for frames, n in stacks.items():
            out[classify(frames)] += n / total
        return out

    def top_self(stacks: collections.Counter[tuple[str, ...]], skip_idle: bool, n: int):
        total = sum(stacks.values()) or 1
        c: collections.Counter[str] = collections.Counter()
        for frames, k in stacks.items():
            if frames and not (skip_idle and _func(frames[-1]).endswith(IDLE_LEAVES)):
                c[_frame_key(frames[-1])] += k
        return [(f, k / total) for f, k in c.most_common(n)]

    def top_incl(stacks: collections.Counter[tuple[str, ...]], n: int):
        total = sum(stacks.values()) or 1
        c: collections.Counter[str] = collections.Counter()
        for frames, k in stacks.items():
            if frames and _func(frames[-1]).endswith(IDLE_LEAVES):
                continue
            keys = {
                _frame_key(f)
                for f in frames
                if _file(f).startswith(("stoic/", "aiohttp/"))
                and not _file(f).startswith(("stoic/__main__.py", "stoic/cli.py"))
            }
            for key in keys:
                c[key] += k
        return [(f, k / total) for f, k in c.most_common(n)]

    exe_name = next((t for t in threads if t.startswith("stoic-executor")), None)
    exe = threads.get(exe_name or "", collections.Counter())
    loop = threads.get("MainThread", collections.Counter())
    others = [s for t, s in threads.items() if t not in (exe_name, "MainThread")]
    busy_other = sum(
        k for s in others for f, k in s.items() if f and not _func(f[-1]).endswith(IDLE_LEAVES)
    )
    ticks = max(sum(loop.values()), 1)
    return Profile(
        seconds=seconds,
        rate=rate,
        command=command,
        executor=shares(exe, classify_executor, EXECUTOR_CATS),
        loop=shares(loop, classify_loop, LOOP_CATS),
        samples={t: sum(s.values()) for t, s in threads.items()},
        top_executor=top_self(exe, True, 10),
        top_loop_self=top_self(loop, True, 12),
        top_loop_incl=top_incl(loop, 14),
        other_threads_busy=busy_other / ticks,
        tids=tids,
    )


# --------------------------------------------------------------------------------------------
# the run


@dataclass
class Settings:
    quick: bool
    requests: dict[int, int]
    api_requests: int
    max_tokens: int
    budget: float
    docs: Path
    work: Path
    llama_server: str | None
    profile: bool
    rate: int
    retries: int
    wait_quiet: float


class Bench:
    def __init__(self, settings: Settings) -> None:
        self.s = settings
        self.results: list[Result] = []
        self.api_rows: list[eb.Row] = []
        self.api_other: list[float | None] = []
        self.disturbed: list[str] = []
        self.dtype_rows: list[tuple[str, int, float]] = []
        # torch loop: tokens/s with each attention implementation (of the kept runs)
        self.variants: list[tuple[str, dict[str, Any], dict[str, float]]] = []
        self.pending_variants: dict[int, tuple[str, dict[str, Any], dict[str, float]]] = {}
        self.profile: Profile | None = None
        self.profiled_pass: Result | None = None
        self.notes: list[str] = []
        self.started = time.time()
        self.load_before = Path("/proc/loadavg").read_text().split()[:3]
        self.load_after: list[str] = []
        self.model_dir = Path()
        self.prompt_len = 0
        self.prompt_range = (0, 0)

    def log(self, text: str) -> None:
        print(f"[{time.time() - self.started:7.1f}s] {text}", flush=True)

    async def guarded(
        self, label: str, run: Callable[[], Awaitable[T]], pids: Sequence[int]
    ) -> tuple[T, float | None]:
        """Run one measurement; when other processes took more than ``MAX_OTHER_CPU`` of the
        machine meanwhile, wait for quiet and repeat it, keeping the least disturbed run."""
        best: tuple[T, float | None] | None = None
        for attempt in range(1 + self.s.retries):
            if attempt:
                await self.wait_quiet(pids, 180.0)
            watch = CpuWatch(pids)
            value = await run()
            other = watch.stop()
            if best is None or (other or 0.0) < (best[1] or 0.0):
                best = (value, other)
            if other is None or other <= MAX_OTHER_CPU:
                break
            self.log(f"{label}: other processes used {other:.0%} of the CPU")
            self.disturbed.append(f"{label} ({other:.0%})")
        assert best is not None
        kept = self.pending_variants.pop(id(best[0]), None)
        if kept is not None:
            self.variants.append(kept)
        self.pending_variants.clear()
        return best

    async def wait_quiet(self, pids: Sequence[int], limit_s: float) -> bool:
        """Wait (at most ``limit_s``) for a 5 s window where others use < QUIET_CPU."""
        deadline = time.monotonic() + limit_s
        while True:
            watch = CpuWatch(pids)
            before = all_jiffies()
            await asyncio.sleep(5.0)
            other = watch.stop()
            if other is None or other < QUIET_CPU:
                return True
            busiest = top_processes(before, all_jiffies(), {os.getpid(), *pids})
            if time.monotonic() > deadline:
                self.log(f"machine still busy ({other:.0%} used by others: {busiest}); going on")
                return False
            self.log(f"waiting for quiet: others use {other:.0%} of the CPU ({busiest})")

    async def measure(
        self, system: System, prompts: Sequence[Any], concurrency: int, pids: Sequence[int]
    ) -> Result:
        bodies = [system.body(p, self.s.max_tokens) for p in prompts]
        url = system.url + "/v1/chat/completions"
        pid = system.proc.pid if system.proc else 0

        async def run() -> tuple[list[RequestRecord], float, Any, Any]:
            await system.step_stats()  # reset
            before = schedstat(pid)
            records, seconds = await run_load(url, bodies, concurrency, budget=self.s.budget)
            sched = sched_delta(before, schedstat(pid), seconds)
            return records, seconds, sched, await system.step_stats()

        (records, seconds, sched, steps), other = await self.guarded(
            f"{system.name} c={concurrency}", run, pids
        )
        result = Result(system.name, concurrency, len(prompts), records, seconds, other)
        result.sched = sched
        result.steps = steps
        if len(records) < len(prompts):
            result.note = f"stopped after the {self.s.budget:.0f} s budget"
            self.notes.append(f"{system.name} c={concurrency}: {result.note}.")
        self.log(
            f"{system.name:28s} c={concurrency:<3d} {result.tokens_per_s:7.1f} tok/s  "
            f"TTFT p50 {fmt_s(result.ttft(0.5))}  errors {result.errors}  "
            f"({len(records)}/{len(prompts)} requests, {seconds:.1f} s, other CPU "
            f"{fmt_pct(result.other_cpu)})"
            + (
                ""
                if result.execute_share is None
                else f"; executor in steps {result.execute_share:.1%} of wall"
            )
        )
        return result

    async def warm(self, system: System) -> Result:
        prompts = eb.mixed_prompts(8, seed=99)
        bodies = [system.body(p, 8) for p in prompts]
        records, seconds = await run_load(
            system.url + "/v1/chat/completions", bodies, 8, budget=120.0
        )
        return Result(system.name, 8, len(bodies), records, seconds)

    async def start_transformers(self, model_dir: Path) -> System:
        tserve = transformers_system(self.s.work, model_dir, self.s.max_tokens, cb=True)
        try:
            await tserve.start()
            warm = await self.warm(tserve)
            if warm.errors == 0:
                return tserve
            reason = warm.summary()["first_error"]
        except RuntimeError as exc:
            reason = str(exc).splitlines()[0]
        tserve.stop()
        self.notes.append(
            f"transformers serve --continuous-batching failed on CPU ({reason}); it was measured "
            "without continuous batching."
        )
        self.log(self.notes[-1])
        tserve = transformers_system(self.s.work, model_dir, self.s.max_tokens, cb=False)
        await tserve.start()
        await self.warm(tserve)
        return tserve

    async def http_phase(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        from stoic.model._loader import default_gguf_path

        systems: list[System] = []
        try:
            stoic_srv = stoic_system(self.s.work)
            self.log(f"starting {stoic_srv.name}: {' '.join(stoic_srv.argv)}")
            await stoic_srv.start()
            await self.warm(stoic_srv)
            systems.append(stoic_srv)
            self.log("starting transformers serve")
            try:
                tserve = await self.start_transformers(model_dir)
            except RuntimeError as exc:
                self.notes.append(f"transformers serve could not start: {exc}")
                self.log(self.notes[-1])
            else:
                self.log(f"{tserve.name}: {' '.join(tserve.argv)}")
                systems.append(tserve)
            if self.s.llama_server:
                llama = llama_system(
                    self.s.work, self.s.llama_server, default_gguf_path(), max(CONCURRENCY)
                )
                self.log(f"starting {llama.name}: {' '.join(llama.argv)}")
                await llama.start()
                await self.warm(llama)
                systems.append(llama)
            pids = [s.proc.pid for s in systems if s.proc is not None]

            prompts_all = eb.mixed_prompts(max(self.s.requests.values()))
            tok = AutoTokenizer.from_pretrained(str(model_dir))
            lengths = [
                len(
                    tok.encode(
                        tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True),
                        add_special_tokens=False,
                    )
                )
                for p in prompts_all
            ]
            self.prompt_len = round(statistics.mean(lengths))
            self.prompt_range = (min(lengths), max(lengths))
            self.log(f"prompt tokens: mean {self.prompt_len}, range {self.prompt_range}")

            order: list[Any] = [*systems, "ceiling"]
            for i, c in enumerate(CONCURRENCY):
                prompts = prompts_all[: self.s.requests[c]]
                rotated = order[i % len(order) :] + order[: i % len(order)]
                for system in rotated:
                    if system == "ceiling":
                        spec = {
                            "model": str(model_dir),
                            "dtype": "bfloat16",
                            "batch": c,
                            "prompt_len": self.prompt_len,
                            "new_tokens": self.s.max_tokens,
                        }
                        row, other = await self.guarded(
                            f"ceiling c={c}",
                            lambda spec=spec: self.worker("loop", spec),
                            pids,
                        )
                        res = Result("torch decode loop (ceiling)", c, c, [], row.seconds, other)
                        res.records = [
                            RequestRecord(True, 0.0, row.seconds, None, row.output_tokens // c)
                            for _ in range(c)
                        ]
                        self.log(f"{res.system:28s} c={c:<3d} {res.tokens_per_s:7.1f} tok/s")
                        self.results.append(res)
                    else:
                        self.results.append(await self.measure(system, prompts, c, pids))
                if c == max(CONCURRENCY) and self.s.profile:
                    await self.profile_pass(stoic_srv, prompts, c, pids)
        finally:
            for system in systems:
                system.stop()
            for note in (s.note for s in systems if s.note):
                self.notes.append(note)

    async def profile_pass(
        self, system: System, prompts: Sequence[Any], c: int, pids: Sequence[int]
    ) -> None:
        """A second c=32 pass; py-spy samples its steady middle (from 2 s in to ~2 s before the
        end the measured pass took), with the step timer and the kernel read over the same
        window, so the three views can be compared."""
        pyspy = shutil.which("py-spy", path=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
        if pyspy is None or system.proc is None:
            self.notes.append("py-spy not found: no engine-overhead profile (pip install py-spy).")
            return
        measured = find(self.results, "stoic serve", c)
        window = max(2, int((measured.seconds if measured else 10.0) - 4.0))
        out = self.s.work / "stoic-c32.pyspy.txt"
        argv = [pyspy, "record", "--threads", "--idle", "--nonblocking", "-r", str(self.s.rate)]
        argv += ["-d", str(window), "-f", "raw", "-p", str(system.proc.pid), "-o", str(out)]
        bodies = [system.body(p, self.s.max_tokens) for p in prompts]
        url = system.url + "/v1/chat/completions"
        pid = system.proc.pid
        watch = CpuWatch(pids)
        load = asyncio.create_task(run_load(url, bodies, c, budget=self.s.budget))
        await asyncio.sleep(2.0)
        self.log(f"profiling for {window} s: {' '.join(argv)}")
        await system.step_stats()  # reset: the window starts
        sched0, me0 = schedstat(pid), _jiffies(os.getpid())
        kids0 = _jiffies(os.getpid(), children=True) - me0
        started = time.perf_counter()
        err = open_log(self.s.work / "py-spy.log")
        try:
            spy = await asyncio.create_subprocess_exec(*argv, stdout=err, stderr=err)
            try:
                await asyncio.wait_for(spy.wait(), window + 60)
            except TimeoutError:
                spy.kill()
                await spy.wait()
        finally:
            err.close()
        steps = await system.step_stats()
        wall = time.perf_counter() - started
        tick = os.sysconf("SC_CLK_TCK")
        me1 = _jiffies(os.getpid())
        spy_cpu = (_jiffies(os.getpid(), children=True) - me1 - kids0) / tick / wall  # reaped
        client_cpu = (me1 - me0) / tick / wall
        sched = sched_delta(sched0, schedstat(pid), wall)
        records, seconds = await load
        result = Result("stoic serve (under py-spy)", c, len(prompts), records, seconds)
        result.other_cpu = watch.stop()
        result.sched, result.steps, result.steps_wall = sched, steps, wall
        self.profiled_pass = result
        self.log(
            f"profiled pass: {result.tokens_per_s:.1f} tok/s; window {wall:.1f} s, executor in "
            f"steps {fmt_pct(result.execute_share)} of it"
        )
        if not out.exists():
            self.notes.append(f"py-spy wrote no profile; see {self.s.work / 'py-spy.log'}")
            return
        command = (
            f"py-spy record --threads --idle --nonblocking -r {self.s.rate} -d {window} -f raw "
            f"-p <stoic serve pid> -o stoic-c32.pyspy.txt"
        )
        self.profile = parse_profile(out, wall, self.s.rate, command)
        self.profile.profiler_cpu = spy_cpu
        self.profile.client_cpu = client_cpu
        self.log(
            f"py-spy: executor outside forward+sampling {self.profile.overhead:.1%} of samples; "
            f"raw profile: {out}"
        )

    async def worker(self, kind: str, spec: dict[str, Any]) -> eb.Row:
        """One in-process measurement in a fresh Python process (see :func:`worker_main`)."""
        argv = [sys.executable, str(SCRIPT), "--worker", kind]
        argv += ["--spec", json.dumps(spec)]
        err = open_log(self.s.work / f"worker-{kind}.log")
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdout=asyncio.subprocess.PIPE, stderr=err
            )
            try:
                out, _ = await asyncio.wait_for(proc.communicate(), 900)
            except TimeoutError:
                proc.kill()
                await proc.wait()
                raise
        finally:
            err.close()
        for line in out.decode().splitlines():
            if line.startswith("RESULT "):
                data = json.loads(line[len("RESULT ") :])
                variants = data.pop("variants", {})
                row = eb.Row(**data)
                if variants:
                    self.pending_variants[id(row)] = (kind, spec, variants)
                return row
        raise RuntimeError(f"worker {kind} failed ({proc.returncode}); see {err.name}")

    async def api_phase(self, model_dir: Path) -> None:
        base = {"model": str(model_dir), "max_tokens": self.s.max_tokens}
        c1 = {**base, "n": self.s.api_requests, "dtype": "bfloat16"}

        async def api(label: str, kind: str, spec: dict[str, Any]) -> eb.Row:
            row, other = await self.guarded(label, lambda: self.worker(kind, spec), [])
            self.api_rows.append(row)
            self.api_other.append(other)
            self.log(f"{label}: {row.tokens_per_s:.1f} tok/s (other CPU {fmt_pct(other)})")
            return row

        steady = {**base, "dtype": "bfloat16", "batch": 32, "prompt_len": 128, "new_tokens": 128}
        await api("API c=1 stoic", "engine_c1", c1)
        await api("API c=1 transformers generate", "generate", c1)
        await api("steady decode torch loop", "loop", steady)
        await api("steady decode stoic", "engine_steady", base)
        # why bfloat16: the bare loop in both dtypes, batch 1 and 32
        for batch in (1, 32):
            for dtype in ("bfloat16", "float32"):
                spec = {**base, "dtype": dtype, "batch": batch, "prompt_len": 128, "new_tokens": 32}
                r, _ = await self.guarded(
                    f"dtype check {dtype} batch {batch}", lambda s=spec: self.worker("loop", s), []
                )
                self.dtype_rows.append((dtype, batch, r.tokens_per_s))
                self.log(f"dtype check {dtype} batch {batch}: {r.tokens_per_s:.1f} tok/s")

    async def run(self) -> None:
        from stoic.model._loader import resolve_model_path

        _, model_dir = resolve_model_path("default")
        self.model_dir = model_dir
        if self.s.wait_quiet > 0:
            await self.wait_quiet([], self.s.wait_quiet)
        self.log(f"model directory: {model_dir}; work directory: {self.s.work}")
        if self.s.llama_server is None:
            self.notes.append(
                "llama.cpp: no `llama-server` on PATH and no --llama-server given: skipped."
            )
        await self.http_phase(model_dir)
        await self.api_phase(model_dir)


# --------------------------------------------------------------------------------------------
# report


def fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def fmt_ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_flags() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
                return ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in wanted)
    return "?"


def mem_gib() -> str:
    with contextlib.suppress(OSError, ValueError):
        kib = int(Path("/proc/meminfo").read_text().split()[1])
        return f"{kib / 2**20:.0f} GiB"
    return "?"


def versions() -> str:
    import importlib.metadata as md

    import torch
    import transformers

    parts = [
        f"python {platform.python_version()}",
        f"torch {torch.__version__}",
        f"transformers {transformers.__version__}",
    ]
    for dist in ("stoic", "aiohttp", "fastapi", "uvicorn", "py-spy"):
        with contextlib.suppress(md.PackageNotFoundError):
            parts.append(f"{dist} {md.version(dist)}")
    return ", ".join(parts)


def results_table(results: Sequence[Result]) -> str:
    head = (
        "| system | c | requests | errors | output tokens | seconds | tokens/s | requests/s | "
        "TTFT p50 (s) | TTFT p90 (s) | TTFT p99 (s) | ITL p50 (ms) | ITL p99 (ms) | "
        "TPOT p50 (ms) | E2E p50 (s) | E2E p99 (s) | other CPU |"
    )
    lines = [head, "|---|---:" + "|---:" * 15 + "|"]
    for r in sorted(results, key=lambda r: (r.concurrency, system_rank(r.system))):
        ceiling = r.system.startswith("torch")
        lines.append(
            f"| {r.system} | {r.concurrency} | "
            f"{'-' if ceiling else f'{len(r.ok)}/{r.planned}'} | "
            f"{'-' if ceiling else r.errors} | {r.output_tokens} | {r.seconds:.1f} | "
            f"{r.tokens_per_s:.1f} | {'-' if ceiling else f'{r.requests_per_s:.2f}'} | "
            f"{fmt_s(r.ttft(0.5))} | {fmt_s(r.ttft(0.9))} | {fmt_s(r.ttft(0.99))} | "
            f"{fmt_ms(r.itl(0.5))} | {fmt_ms(r.itl(0.99))} | {fmt_ms(r.tpot(0.5))} | "
            f"{'-' if ceiling else fmt_s(r.e2e(0.5))} | {'-' if ceiling else fmt_s(r.e2e(0.99))} | "
            f"{fmt_pct(r.other_cpu)} |"
        )
    return "\n".join(lines)


def system_rank(name: str) -> int:
    for i, prefix in enumerate(("stoic serve", "transformers", "llama", "torch")):
        if name.startswith(prefix):
            return i
    return 9


def find(results: Sequence[Result], prefix: str, c: int) -> Result | None:
    return next((r for r in results if r.system.startswith(prefix) and r.concurrency == c), None)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def targets(bench: Bench) -> list[tuple[str, str, str, str]]:
    """(measure, target, measured, verdict) rows."""
    rows: list[tuple[str, str, str, str]] = []

    def add(name: str, target: str, value: float | None, ok: bool | None, fmt: str) -> None:
        shown = "-" if value is None else format(value, fmt)
        verdict = "n/a" if ok is None else ("met" if ok else "**missed**")
        rows.append((name, target, shown, verdict))

    top = max(CONCURRENCY)
    s32, t32 = find(bench.results, "stoic serve", top), find(bench.results, "transformers", top)
    tp = ratio(s32.tokens_per_s if s32 else None, t32.tokens_per_s if t32 else None)
    add(
        f"mixed c={top}: stoic / transformers serve tokens/s",
        ">= 1.8x",
        tp,
        None if tp is None else tp >= 1.8,
        ".2f",
    )
    tt = ratio(s32.ttft(0.5) if s32 else None, t32.ttft(0.5) if t32 else None)
    add(
        f"mixed c={top}: stoic / transformers serve TTFT p50",
        "<= 0.33x",
        tt,
        None if tt is None else tt <= 1 / 3,
        ".3f",
    )
    api = {(r.system, r.workload): r for r in bench.api_rows}
    steady = api.get(("stoic (Python API)", "steady decode"))
    loop = api.get(("torch decode loop (ceiling)", "steady decode"))
    sd = ratio(steady.tokens_per_s if steady else None, loop.tokens_per_s if loop else None)
    add(
        "steady decode: stoic / bare torch loop",
        ">= 80%",
        sd,
        None if sd is None else sd >= 0.8,
        ".1%",
    )
    c1 = api.get(("stoic (Python API)", "mixed"))
    gen = api.get(("transformers generate (one at a time)", "mixed"))
    r1 = ratio(c1.tokens_per_s if c1 else None, gen.tokens_per_s if gen else None)
    add(
        "c=1 (Python API): stoic / transformers generate tokens/s",
        ">= 0.90x",
        r1,
        None if r1 is None else r1 >= 0.9,
        ".2f",
    )
    h1 = find(bench.results, "stoic serve", 1)
    rh = ratio(h1.tokens_per_s if h1 else None, gen.tokens_per_s if gen else None)
    add("c=1 (HTTP): stoic serve / transformers generate tokens/s", "(info)", rh, None, ".2f")
    share = s32.execute_share if s32 else None
    add(
        f"engine overhead at c={top}: wall time the executor is not inside a step (timed)",
        "< 5%",
        None if share is None else 1 - share,
        None if share is None else 1 - share < 0.05,
        ".1%",
    )
    if bench.profile:
        inputs = bench.profile.executor["step inputs"] + bench.profile.executor["sampling"]
        add(
            f"  ... plus step inputs and sampling inside the step (py-spy, c={top})",
            "(info)",
            inputs,
            None,
            ".1%",
        )
    exe = next((m for name, m, _ in kernel_view(bench) if name.startswith("stoic-executor")), None)
    add(
        f"engine overhead at c={top}: executor thread off a CPU (kernel)",
        "(info)",
        None if exe is None else 1 - exe[0],
        None,
        ".1%",
    )
    ov = bench.profile.overhead if bench.profile else None
    add(
        f"engine overhead at c={top}: py-spy samples outside forward+sampling",
        "(info)",
        ov,
        None,
        ".1%",
    )
    ceil32 = find(bench.results, "torch", top)
    rc = ratio(s32.tokens_per_s if s32 else None, ceil32.tokens_per_s if ceil32 else None)
    add(f"mixed c={top}: stoic serve / decode-only ceiling", "(info)", rc, None, ".1%")
    return rows


def plot(bench: Bench, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    names = sorted({r.system for r in bench.results}, key=system_rank)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in names:
        rows = sorted((r for r in bench.results if r.system == name), key=lambda r: r.concurrency)
        xs = [r.concurrency for r in rows]
        style = "--" if name.startswith("torch") else "-"
        ax1.plot(xs, [r.tokens_per_s for r in rows], style, marker="o", label=name)
        if not name.startswith("torch"):
            ax2.plot(xs, [r.ttft(0.5) or float("nan") for r in rows], marker="o", label=name)
    for ax, title in ((ax1, "output tokens/s"), (ax2, "TTFT p50 (s, log)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(CONCURRENCY), [str(c) for c in CONCURRENCY])
        ax.set_xlabel("concurrent streaming clients")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    ax2.set_yscale("log")
    ax2.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%.2g"))
    ax2.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax1.legend(fontsize=8)
    fig.suptitle(
        f"SmolLM2-135M-Instruct, bfloat16, {os.cpu_count()} CPU cores: mixed prompts, "
        f"max_tokens {bench.s.max_tokens}",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def api_table(rows: Sequence[eb.Row], other: Sequence[float | None]) -> str:
    lines = [
        "| system | workload | concurrency | requests | output tokens | seconds | tokens/s | "
        "other CPU |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r, o in zip(rows, other, strict=True):
        lines.append(
            f"| {r.system} | {r.workload} | {r.concurrency} | {r.requests} | {r.output_tokens} | "
            f"{r.seconds:.2f} | {r.tokens_per_s:.1f} | {fmt_pct(o)} |"
        )
    return "\n".join(lines)


def steps_table(bench: Bench) -> list[str]:
    """Exact step accounting of every stoic HTTP pass (from :func:`timed_serve`)."""
    lines = [
        "| pass | wall (s) | steps | inside steps | between steps | mean step (ms) | "
        "gap p50 (ms) | gap p90 (ms) | gap max (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    passes = [r for r in bench.results if r.system == "stoic serve"]
    passes += [bench.profiled_pass] if bench.profiled_pass else []
    for r in sorted(passes, key=lambda r: r.concurrency):
        st, share = r.steps, r.execute_share
        if not st or share is None:
            continue
        name = f"c={r.concurrency}" + (" under py-spy" if "py-spy" in r.system else "")
        mean = 1000 * st["execute_s"] / max(st["steps"], 1)
        lines.append(
            f"| {name} | {st.get('window_s') or r.seconds:.1f} | {st['steps']} | {share:.1%} | "
            f"{1 - share:.1%} | "
            f"{mean:.1f} | {st['gap_p50_ms']:.2f} | {st['gap_p90_ms']:.2f} | "
            f"{st['gap_max_ms']:.1f} |"
        )
    return lines


def profile_section(bench: Bench) -> str:
    top = max(CONCURRENCY)
    measured = find(bench.results, "stoic serve", top)
    share = measured.execute_share if measured else None
    lines = [
        "**Exact step accounting.** `stoic serve` runs under a thin wrapper "
        "(`serving_bench.py --timed-serve`: the same `stoic.cli.main`, with "
        "`ModelRunner.execute` timed; a SIGUSR1 between passes collects the numbers). *Inside "
        "steps* is the executor thread inside `ModelRunner.execute` (building step inputs, "
        "forward, sampling), as % of the pass's wall time; *between steps* is everything else "
        "(the result travelling to the scheduler, planning and allocating the next step, the "
        "hand-off back to the executor thread, and the ramp at the start and end of the pass):",
        "",
        *steps_table(bench),
    ]
    if share is not None:
        lines += [
            "",
            f"**Engine overhead at c={top}: {1 - share:.1%} of wall** is spent between steps "
            "(target < 5%).",
        ]
    p = bench.profile
    if p is None:
        lines += [
            "",
            "No py-spy profile (" + ("--no-profile" if not bench.s.profile else "see notes") + ").",
        ]
        return "\n".join(lines)
    pp = bench.profiled_pass
    lines += [
        "",
        f"**Where the time goes (py-spy).** A second stoic c={top} pass"
        + (f" ({pp.tokens_per_s:.1f} tokens/s under the profiler)" if pp else "")
        + f" was recorded with py-spy at {p.rate} Hz:",
        "",
        "```",
        p.command,
        "```",
        "",
        "`--idle` keeps the samples of waiting threads, so each thread's samples add up to the "
        "wall time; `--nonblocking` keeps py-spy from pausing the server (py-spy itself used "
        f"{p.profiler_cpu:.2f} of a core, the load generator {p.client_cpu:.2f}). Shares are of "
        "wall time, per thread (the two threads run in parallel).",
        "",
        "| thread | what it runs | % of wall (py-spy samples) |",
        "|---|---|---:|",
    ]
    for cat in EXECUTOR_CATS:
        lines.append(f"| executor (`stoic-executor-0`) | {cat} | {p.executor.get(cat, 0):.1%} |")
    for cat in LOOP_CATS:
        lines.append(f"| event loop (`MainThread`) | {cat} | {p.loop.get(cat, 0):.1%} |")
    lines.append(f"| other threads (busy, sum) | - | {p.other_threads_busy:.1%} |")
    pp_share = pp.execute_share if pp else None
    lines += [
        "",
        "Executor categories: *forward* = `ModelRunner.execute` minus the rest (transformers "
        "layers, paged attention, LM head); *sampling* = `stoic/model/_sampling.py:sample`; *step "
        "inputs* = `_build_inputs` and KV block zeroing; *idle* = blocked on the step queue. Event "
        "loop: each sample goes to the innermost frame it recognises (detokenising: "
        "`Sequence.detokenize` and tokenizer calls; HTTP: `stoic/http`, aiohttp, JSON, pydantic; "
        "scheduling: `stoic/actors/engine/*` except streams; messaging: `stoic/actors/*`, "
        "`stoic/engine.py`, result streams); *idle* = blocked in `epoll`. A thread waiting for "
        "the GIL is sampled where it stands, so GIL contention shows up inside its category.",
        "",
        f"Cross-check over the same window: py-spy puts the executor outside forward+sampling "
        f"for {p.overhead:.1%} of its samples (idle {p.executor['idle']:.1%})"
        + (
            f"; the step timer measured {1 - pp_share:.1%} of the window between steps"
            if pp_share is not None
            else ""
        )
        + ". Sampling at 100 Hz puts about ±1 point of noise on a 20 s window.",
        "",
        "The kernel's view of the server's threads (`/proc/<pid>/task/*/schedstat`): share of "
        "wall on a CPU, runnable but waiting for a CPU, and blocked (the rest), in the measured "
        f"c={top} pass and in the profiled one:",
        "",
        "| thread | on CPU | waiting for a CPU | blocked | on CPU (profiled) | waiting (profiled) "
        "| blocked (profiled) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, a, b in kernel_view(bench):
        cells = []
        for v in (a, b):
            cells += ["-"] * 3 if v is None else [f"{v[0]:.1%}", f"{v[1]:.1%}", f"{v[2]:.1%}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Top frames, executor (self time, % of wall):",
        "",
        "| frame | % |",
        "|---|---:|",
    ]
    lines += [f"| `{f}` | {v:.1%} |" for f, v in p.top_executor]
    lines += [
        "",
        "Top frames, event loop (self time, % of wall):",
        "",
        "| frame | % |",
        "|---|---:|",
    ]
    lines += [f"| `{f}` | {v:.1%} |" for f, v in p.top_loop_self]
    lines += [
        "",
        "Event loop, inclusive time of stoic and aiohttp frames (% of wall):",
        "",
        "| frame | % |",
        "|---|---:|",
    ]
    lines += [f"| `{f}` | {v:.1%} |" for f, v in p.top_loop_incl]
    return "\n".join(lines)


def kernel_view(
    bench: Bench,
) -> list[tuple[str, tuple[float, float, float] | None, tuple[float, float, float] | None]]:
    """Per stoic server thread: (on CPU, waiting for a CPU, blocked) in the measured and the
    profiled c=32 pass."""
    measured = find(bench.results, "stoic serve", max(CONCURRENCY))
    profiled = bench.profiled_pass
    names = bench.profile.tids if bench.profile else {}

    def table(r: Result | None) -> dict[int, tuple[float, float, float]]:
        if r is None:
            return {}
        return {tid: (run, wait, max(0.0, 1 - run - wait)) for tid, run, wait in r.sched}

    a, b = table(measured), table(profiled)
    order = sorted(set(a) | set(b), key=lambda t: -max(a.get(t, (0,))[0], b.get(t, (0,))[0]))
    rows = []
    for tid in order:
        default = "native thread (torch OpenMP worker)" if tid not in names else ""
        rows.append((f"{names.get(tid, default)} [{tid}]", a.get(tid), b.get(tid)))
    return rows


def variants_table(bench: Bench) -> list[str]:
    lines = [
        "| measurement | batch | prompt tokens | new tokens | dtype | SDPA (tokens/s) | "
        "eager (tokens/s) |",
        "|---|---:|---:|---:|---|---:|---:|",
    ]
    for kind, spec, v in bench.variants:
        what = "ceiling (HTTP phase)" if spec.get("new_tokens") == bench.s.max_tokens else kind
        if spec.get("prompt_len") == 128 and spec.get("new_tokens") == 128:
            what = "steady decode"
        elif spec.get("new_tokens") == 32:
            what = "dtype check"
        lines.append(
            f"| {what} | {spec['batch']} | {spec['prompt_len']} | {spec['new_tokens']} | "
            f"{spec['dtype']} | {v.get('sdpa', 0):.1f} | {v.get('eager', 0):.1f} |"
        )
    return lines


def report(bench: Bench, command: str, png: Path, docs: Path) -> str:
    top = max(CONCURRENCY)
    tserve = find(bench.results, "transformers", top)
    tname = tserve.system if tserve else "transformers serve (not measured)"
    rows = targets(bench)
    target_lines = ["| measure | target | measured | verdict |", "|---|---|---:|---|"]
    target_lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    dtype_lines = ["| dtype | batch | tokens/s |", "|---|---:|---:|"]
    dtype_lines += [f"| {d} | {b} | {t:.1f} |" for d, b, t in bench.dtype_rows]
    ratio_bf16 = {
        b: ratio(
            next((t for d, bb, t in bench.dtype_rows if d == "bfloat16" and bb == b), None),
            next((t for d, bb, t in bench.dtype_rows if d == "float32" and bb == b), None),
        )
        for b in (1, 32)
    }
    bf16_text = ", ".join(
        f"{v:.2f}x float32 at batch {b}" for b, v in ratio_bf16.items() if v is not None
    )
    elapsed = time.time() - bench.started
    all_notes = list(bench.notes)
    if bench.disturbed:
        all_notes.append(
            f"Measurements during which other processes took over {MAX_OTHER_CPU:.0%} of the CPU "
            "were repeated after waiting for quiet (the least disturbed run is kept): "
            + "; ".join(bench.disturbed)
            + "."
        )
    notes = "\n".join(f"- {n}" for n in all_notes)
    rel_png = os.path.relpath(png, docs)
    per_level = ", ".join(f"{bench.s.requests[c]} at c={c}" for c in CONCURRENCY)
    generated = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return f"""{SECTION_TITLE}

Generated by `benchmarks/serving_bench.py` in one run of {elapsed / 60:.1f} minutes ({generated}):

```
{command}
```

`--quick` runs fewer requests (a smoke test; it writes under `$TMPDIR/stoic-serving-bench` unless
`--docs-dir` is given); `--url http://host:port --model NAME` drives any OpenAI-compatible
endpoint on its own; `--llama-server PATH` adds llama.cpp's server. The tools it needs come with
`pip install -e '.[bench]'` (transformers serve's FastAPI/uvicorn, matplotlib, py-spy).
The sections below this one, measured with `benchmarks/engine_bench.py` and
`benchmarks/recovery_bench.py`, are not generated by this script.

### Machine and software

- CPU: {cpu_model()}, {os.cpu_count()} cores ({cpu_flags()}); {mem_gib()} of memory; no GPU.
- {versions()}.
- Model: the default SmolLM2-135M-Instruct (the GGUF file de-quantised once into
  `{bench.model_dir}`), **bfloat16** for every system. Why bfloat16: on this CPU (AVX512-BF16, no
  AMX) the bare decode loop runs {bf16_text} (dtype table below), which is also why stoic's
  `--dtype auto` picks bfloat16 on CPUs with native bf16 instructions.
- Load average before / after the run: {" ".join(bench.load_before)} /
  {" ".join(bench.load_after)}. The machine is shared: every measurement records `other CPU`, the
  share of the machine's CPU that processes other than the benchmark and its servers used
  meanwhile; above {MAX_OTHER_CPU:.0%} the measurement is repeated once it is quiet again.

### Targets

{chr(10).join(target_lines)}

### Mixed prompts over HTTP

{per_level} requests: the first N of `engine_bench.mixed_prompts(seed=0)` (chat messages of 8-320
random words; {bench.prompt_range[0]}-{bench.prompt_range[1]} prompt tokens, mean
{bench.prompt_len}), streamed (`/v1/chat/completions`, SSE), greedy, `max_tokens`
{bench.s.max_tokens} with EOS ignored (stoic: `ignore_eos`; transformers serve: a per-request
`generation_config` with `eos_token_id: -1`), from C closed-loop clients. The servers, both up for
the whole phase and idle when not measured; at each level every system is measured in turn, the
order rotating from level to level:

- `stoic serve --model default --dtype bfloat16 --block-size {BLOCK_SIZE} --num-kv-blocks
  {NUM_KV_BLOCKS} --max-num-batched-tokens {MAX_BATCHED_TOKENS} --max-num-seqs {MAX_NUM_SEQS}`
  (its defaults on this machine, spelled out), run through the `--timed-serve` wrapper described
  under engine overhead;
- `transformers serve <that model directory> --continuous-batching --dtype bfloat16 --device cpu
  --cb-block-size {BLOCK_SIZE} --cb-num-blocks {NUM_KV_BLOCKS} --cb-max-batch-tokens
  {MAX_BATCHED_TOKENS}`: the same KV capacity (46,592 tokens) and tokens per step, offline
  (`HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1`); measured as **{tname}**;
- the ceiling: `engine_bench.torch_decode_loop` (batched decode with a `DynamicCache`) at batch =
  C, {bench.prompt_len}-token prompts, {bench.s.max_tokens} new tokens, in a fresh process; the
  faster of the model's default attention (SDPA) and eager attention. It is decode only (no
  prefill, no HTTP, no scheduling), but it is not an upper bound for stoic: transformers' SDPA
  path for grouped-query decode in bfloat16 is slow on CPU, and even eager attention re-reads a
  concatenated cache, while stoic decodes with its own paged attention (see the attention table).

TTFT: request sent to first content event. ITL: gaps between successive content events as the
client receives them (events that arrive in one read count as ~0). TPOT: (E2E - TTFT) / (tokens -
1) per request. Tokens: the server's `usage.completion_tokens`. Requests: completed / planned.

{results_table(bench.results)}

![output tokens/s and TTFT p50 against concurrency]({rel_png})

### Through the Python API

Servers stopped; each measurement in a fresh process (see the notes). Steady decode: 32
sequences, 128-token prompts, 128 new tokens, tokens/s once all 32 decode
(`engine_bench.stoic_steady`, stoic's `Engine` with the settings above), next to the bare torch
decode loop at batch 32 (`engine_bench.torch_decode_loop`, the faster attention). Concurrency 1:
the first {bench.s.api_requests} mixed requests one at a time, `max_tokens` {bench.s.max_tokens},
EOS ignored, next to transformers `generate` one request at a time
(`engine_bench.hf_one_at_a_time`); both include prefill.

{api_table(bench.api_rows, bench.api_other)}

The bare torch decode loop by attention implementation (each in a fresh process):

{chr(10).join(variants_table(bench))}

dtype check, the bare loop (faster attention; 128-token prompts, 32 new tokens):

{chr(10).join(dtype_lines)}

### Engine overhead at concurrency {top}

{profile_section(bench)}

### Notes

{notes}
- Every in-process torch measurement (ceiling, `generate`, stoic's `Engine`) runs in a fresh
  process with its torch work on one thread. torch's CPU build uses libgomp: each thread that
  calls torch gets its own OpenMP team, and once a process has more OpenMP threads than cores,
  libgomp stops spin-waiting between parallel regions. On this 2-core machine `generate` fell from
  42 to 27 tokens/s after a single call from a second thread, for the rest of the process
  (`OMP_WAIT_POLICY=PASSIVE`: 26 throughout). Both servers keep torch on one thread; anything that
  calls torch from a second thread of the server would pay this.
- On 2 cores, torch's two intra-op threads already fill the machine, so any other runnable thread
  (the event loop, the load generator, a profiler, another process) takes time from the forward
  pass: that is why the measurements are guarded by `other CPU`.
"""


SECTION_TITLE = "## Serving over HTTP, steady decode and engine overhead (`serving_bench.py`)"
BEGIN = "<!-- serving_bench.py: begin (generated; edits between these markers are overwritten) -->"
END = "<!-- serving_bench.py: end -->"


def write_doc(path: Path, section: str) -> None:
    """Put ``section`` between the markers in ``path``, leaving the rest of the file alone
    (without markers: before the first ``##`` section, or into a new file)."""
    block = f"{BEGIN}\n{section.strip()}\n{END}\n"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1].lstrip("\n")
        text = head + block + ("\n" + tail if tail else "")
    elif "\n## " in text:
        i = text.index("\n## ") + 1
        text = text[:i] + block + "\n" + text[i:]
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def print_summary(bench: Bench) -> None:
    print()
    print(results_table(bench.results))
    print()
    print(api_table(bench.api_rows, bench.api_other))
    print()
    for a, b, c, d in targets(bench):
        print(f"{a:70s} {b:>9s} {c:>8s}  {d}")
    if bench.profile:
        p = bench.profile
        print("\nexecutor:", {k: f"{v:.1%}" for k, v in p.executor.items()})
        print("event loop:", {k: f"{v:.1%}" for k, v in p.loop.items()})


async def drive_endpoint(args: argparse.Namespace) -> None:
    """``--url``: drive one endpoint at each concurrency and print the table."""
    extra: dict[str, Any] = json.loads(args.extra_body) if args.extra_body else {}
    system = System("endpoint", [], 0, args.model, extra, Path(os.devnull))
    results = []
    for c in CONCURRENCY:
        n = (args.requests or {1: 16, 8: 64, 32: 128}[c]) if not args.quick else max(4, c)
        bodies = [system.body(p, args.max_tokens) for p in eb.mixed_prompts(n)]
        records, seconds = await run_load(
            args.url.rstrip("/") + "/v1/chat/completions", bodies, c, budget=args.budget
        )
        results.append(Result(args.url, c, n, records, seconds))
    print(results_table(results))


def worker_main(kind: str, spec: dict[str, Any]) -> None:
    """A measurement in this fresh process; prints ``RESULT <row as JSON>``.

    Every in-process torch measurement runs in its own process, its torch work on one thread:
    with libgomp (torch's CPU build), a second thread calling torch creates a second OpenMP team,
    and once there are more OpenMP threads than cores libgomp stops spin-waiting: the same
    ``generate`` loop measured 42 tokens/s before and 27 after one call from another thread here.
    """
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    variants: dict[str, float] = {}
    row: eb.Row
    if kind in ("loop", "generate"):
        from stoic.model import load_model

        ref = load_model(spec["model"], dtype=spec["dtype"])
        if kind == "loop":
            # the model's default attention (SDPA) and eager: the faster is the ceiling
            rows = {}
            for impl in ("sdpa", "eager"):
                ref.model.set_attn_implementation(impl)
                eb.torch_decode_loop(ref.model, 4, 16, 4)  # warm-up
                rows[impl] = eb.torch_decode_loop(
                    ref.model, spec["batch"], spec["prompt_len"], spec["new_tokens"]
                )
                variants[impl] = rows[impl].tokens_per_s
            row = max(rows.values(), key=lambda r: r.tokens_per_s)
        else:
            prompts = eb.mixed_prompts(spec["n"])
            eb.hf_one_at_a_time(ref.model, ref.tokenizer, prompts[:2], 4)  # warm-up
            row = eb.hf_one_at_a_time(ref.model, ref.tokenizer, prompts, spec["max_tokens"])
    else:
        row = asyncio.run(engine_worker(kind, spec))
    fields = ("system", "workload", "concurrency", "requests", "output_tokens", "seconds")
    out = {f: getattr(row, f) for f in (*fields, "ttft_p50", "ttft_p90")}
    print("RESULT " + json.dumps({**out, "variants": variants}), flush=True)


async def engine_worker(kind: str, spec: dict[str, Any]) -> eb.Row:
    import stoic

    config = stoic.EngineConfig(
        model=spec["model"],
        dtype="bfloat16",
        block_size=BLOCK_SIZE,
        num_kv_blocks=NUM_KV_BLOCKS,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        max_num_seqs=MAX_NUM_SEQS,
    )
    async with stoic.Engine.start(config) as engine:
        await eb.stoic_mixed(engine, eb.mixed_prompts(4, seed=99), 4, 8)  # warm-up
        if kind == "engine_c1":
            prompts = eb.mixed_prompts(spec["n"])
            row = await eb.stoic_mixed(engine, prompts, 1, spec["max_tokens"])
        else:
            row = await eb.stoic_steady(engine, 32, 128, 128)
    row.system = "stoic (Python API)"
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few requests: a smoke test")
    parser.add_argument("--requests", type=int, help="requests per concurrency level")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--budget", type=float, help="seconds per system and level before no new request starts"
    )
    parser.add_argument("--llama-server", help="path to llama.cpp's llama-server")
    parser.add_argument("--no-profile", action="store_true", help="skip the py-spy pass")
    parser.add_argument(
        "--wait-quiet",
        type=float,
        help="seconds to wait for other processes to leave the CPU first (900; --quick: 0)",
    )
    parser.add_argument("--profile-rate", type=int, default=100, help="py-spy samples/s")
    parser.add_argument("--docs-dir", type=Path, help="where benchmarks.md and img/ go")
    parser.add_argument("--url", help="only drive this OpenAI-compatible endpoint")
    parser.add_argument("--model", default="default", help="with --url: the model field")
    parser.add_argument("--extra-body", help="with --url: JSON merged into every request")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--timed-serve", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        worker_main(args.worker, json.loads(args.spec))
        return
    if args.timed_serve:
        sys.exit(timed_serve(args.timed_serve[0], args.timed_serve[1:]))

    if args.url:
        args.budget = args.budget or 600.0
        asyncio.run(drive_endpoint(args))
        return

    if args.quick:
        requests = {c: args.requests or max(4, c) for c in CONCURRENCY}
        docs = args.docs_dir or Path(tempfile.gettempdir()) / "stoic-serving-bench"
        if not args.docs_dir:  # a smoke test starts from an empty document
            (docs / "benchmarks.md").unlink(missing_ok=True)
    else:
        requests = {c: args.requests or {1: 16, 8: 64, 32: 128}[c] for c in CONCURRENCY}
        docs = args.docs_dir or ROOT / "docs"
    llama = args.llama_server or shutil.which("llama-server")
    work = Path(tempfile.mkdtemp(prefix="stoic-serving-bench-"))
    settings = Settings(
        quick=args.quick,
        requests=requests,
        api_requests=4 if args.quick else 16,
        max_tokens=args.max_tokens,
        budget=args.budget or (60.0 if args.quick else 240.0),
        docs=docs,
        work=work,
        llama_server=llama,
        profile=not args.no_profile,
        rate=args.profile_rate,
        retries=0 if args.quick else 2,
        wait_quiet=args.wait_quiet if args.wait_quiet is not None else (0 if args.quick else 900),
    )
    # a SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so no server is left behind
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    bench = Bench(settings)
    bench.log(f"load average: {' '.join(bench.load_before)}")
    try:
        asyncio.run(bench.run())
        bench.load_after = Path("/proc/loadavg").read_text().split()[:3]
    finally:
        # never leave a server behind, whatever happened
        for child in _children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
    png = docs / "img" / "serving_bench.png"
    plot(bench, png)
    command = "python benchmarks/serving_bench.py" + (" " + " ".join(sys.argv[1:])).rstrip()
    write_doc(docs / "benchmarks.md", report(bench, command, png, docs))
    print_summary(bench)
    bench.log(f"wrote {docs / 'benchmarks.md'} and {png}; logs and raw profile in {work}")


def _children() -> Iterator[int]:
    """Our direct child processes still alive (servers, py-spy)."""
    me = str(os.getpid())
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError):
            fields = stat.read_text().rpartition(")")[2].split()
            if fields[1] == me and fields[0] != "Z":
                yield int(stat.parent.name)


if __name__ == "__main__":
    main()
