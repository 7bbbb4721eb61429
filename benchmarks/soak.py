"""Reliability soak: many requests against ``stoic serve`` under executor faults and
disconnecting clients; did anything get lost, hang, leak or drift?

It starts ``python -m stoic serve`` (the process executor with one spare, ``--recovery resume``,
float32, greedy), takes the fault-free text of every prompt, then arms one ``probability`` fault
per kind through ``POST /admin/faults`` (with the admin key; ``--fault-rate`` split over
``--kinds``, distinct seeds) and sends ``--requests`` streaming completions at
``--concurrency``. A share of the clients (``--disconnect``) hang up mid-stream after a few events.

Every request ends as one of: ``exact`` (finished, text equal to its fault-free text),
``different`` (finished, another text: a bug), ``partial`` (an ``error`` event whose partial text
is a prefix of the fault-free text), ``partial not prefix`` (a bug), ``disconnected`` (by the
client, on purpose), ``lost`` (the stream ended with no terminal event: a bug), ``hung`` (no
end within ``--request-timeout``: a bug), ``refused`` (a 4xx/5xx before streaming).

Sampled every ``--sample-every`` seconds: KV blocks used, running / waiting sequences, RSS and
open file descriptors of the server and of its executor worker. After the run, with faults
cleared and nothing in flight: KV blocks in use beyond the prefix cache's (leaked blocks), RSS
growth from the end of warm-up (the first ``--warmup`` of requests) to the end, fds likewise.

Writes ``<out>/soak.csv``, ``<out>/soak.png`` (with matplotlib) and prints a markdown table.

Usage::

    python benchmarks/soak.py --requests 10000 --concurrency 32 --out docs/img
    python benchmarks/soak.py --requests 300 --concurrency 16      # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import json
import math
import os
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import aiohttp
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.workload import PROMPTS

ADMIN_KEY = "soak-admin"
_TERMINAL = ("exact", "different", "partial", "partial not prefix")


@dataclass
class Sample:
    t: float
    done: int
    kv_used: float
    kv_cached: float
    running: float
    waiting: float
    server_rss_mib: float
    worker_rss_mib: float
    server_fds: int
    worker_fds: int


def model_path(name: str) -> str:
    """``tiny``: the tiny random model of :mod:`stoic.model.testing`, built in a temporary
    directory; anything else is passed to ``--model`` as it is."""
    if name != "tiny":
        return name
    from stoic.model.testing import build_tiny_model

    return str(build_tiny_model(Path(tempfile.mkdtemp(prefix="stoic-soak-")) / "tiny"))


async def start_server(args: argparse.Namespace) -> tuple[asyncio.subprocess.Process, str]:
    cmd = [sys.executable, "-m", "stoic", "serve", "--port", "0", "--dtype", "float32"]
    cmd += ["--model", model_path(args.model)]
    cmd += ["--device", "cpu", "--executor", args.executor, "--executor-spares", "1"]
    cmd += ["--recovery", "resume", "--max-resumes", str(args.max_resumes)]
    cmd += ["--max-restarts", "1000000", "--restart-window", "1", "--enable-fault-injection"]
    cmd += ["--admin-key", ADMIN_KEY, "--log-format", "json", "--max-num-seqs", "32"]
    proc = await asyncio.create_subprocess_exec(
        *cmd, stderr=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL
    )
    assert proc.stderr is not None
    while True:
        line = await asyncio.wait_for(proc.stderr.readline(), 300)
        if not line:
            raise RuntimeError("the server exited before it was ready")
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if event.get("event") == "stoic.ready":
                break
    out = open(args.log or os.devnull, "wb")  # noqa: ASYNC230, SIM115 (closed by _drain)
    asyncio.get_running_loop().create_task(_drain(proc.stderr, out))
    return proc, event["url"]


async def _drain(stream: asyncio.StreamReader, out: BinaryIO) -> None:
    """Keep reading the server's log (a full pipe would block it); keep the warnings."""
    with out:
        while line := await stream.readline():
            if b'"info"' not in line and b'"debug"' not in line:
                out.write(line)


async def stream_one(
    http: aiohttp.ClientSession, url: str, prompt: str, args: argparse.Namespace, hang_up: int
) -> tuple[str, str]:
    """(outcome, text) of one streamed completion; ``hang_up`` > 0: close after that many
    events."""
    body = {
        "model": "default",
        "prompt": prompt,
        "max_tokens": args.tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    text: list[str] = []
    async with http.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            return f"refused {r.status}", ""
        events = finished = 0
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                return ("finished" if finished else "lost"), "".join(text)
            event = json.loads(data)
            if "error" in event:
                return "error", event["error"].get("partial", {}).get("text", "".join(text))
            choice = event["choices"][0]
            text.append(choice["text"])
            finished |= choice.get("finish_reason") is not None
            events += 1
            if hang_up and events >= hang_up:
                return "disconnected", "".join(text)
    return "lost", "".join(text)


def classify(kind: str, text: str, reference: str) -> str:
    if kind == "finished":
        return "exact" if text == reference else "different"
    if kind == "error":
        return "partial" if reference.startswith(text) else "partial not prefix"
    return kind


async def metrics(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(f"{url}/metrics") as r:
        text = await r.text()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def process_stats(pid: int | None) -> tuple[float, int]:
    if pid is None:
        return 0.0, 0
    try:
        p = psutil.Process(pid)
        return p.memory_info().rss / 2**20, p.num_fds()
    except psutil.Error:
        return 0.0, 0


async def sampler(
    http: aiohttp.ClientSession,
    url: str,
    server: int,
    progress: Counter[str],
    samples: list[Sample],
    every: float,
) -> None:
    start = time.monotonic()
    while True:
        m = await metrics(http, url)
        worker = int(m.get("stoic_executor_pid", 0)) or None
        s_rss, s_fds = process_stats(server)
        w_rss, w_fds = process_stats(worker)
        done = sum(progress.values())
        samples.append(
            Sample(
                round(time.monotonic() - start, 1),
                done,
                m.get("stoic_kv_cache_blocks_used", 0),
                m.get("stoic_kv_cache_blocks_cached", 0),
                m.get("stoic_sequences_running", 0),
                m.get("stoic_sequences_waiting", 0),
                round(s_rss, 1),
                round(w_rss, 1),
                s_fds,
                w_fds,
            )
        )
        print(
            f"[{samples[-1].t:7.0f}s] {done} done {dict(progress)} kv {samples[-1].kv_used:.0f} "
            f"rss {s_rss:.0f}/{w_rss:.0f} MiB fds {s_fds}/{w_fds}",
            file=sys.stderr,
            flush=True,
        )
        await asyncio.sleep(every)


async def arm_faults(http: aiohttp.ClientSession, url: str, args: argparse.Namespace) -> None:
    kinds = args.kinds.split(",")
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    for i, kind in enumerate(kinds):
        spec = {"kind": kind, "probability": args.fault_rate / len(kinds), "seed": args.seed + i}
        async with http.post(f"{url}/admin/faults", json=spec, headers=headers) as r:
            assert r.status == 200, await r.text()
    # a request without the admin key must not reach the admin routes
    async with http.delete(f"{url}/admin/faults") as r:
        assert r.status == 401


async def run(args: argparse.Namespace) -> None:
    proc, url = await start_server(args)
    samples: list[Sample] = []
    progress: Counter[str] = Counter()
    rng = random.Random(args.seed)
    connector = aiohttp.TCPConnector(limit=args.concurrency + 4)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=args.request_timeout)
    try:
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
            refs = await asyncio.gather(*(stream_one(http, url, p, args, 0) for p in PROMPTS))
            assert all(kind == "finished" for kind, _ in refs), refs
            reference = [text for _, text in refs]
            await arm_faults(http, url, args)
            sampling = asyncio.create_task(
                sampler(http, url, proc.pid, progress, samples, args.sample_every)
            )
            semaphore = asyncio.Semaphore(args.concurrency)

            async def one(i: int) -> None:
                hang_up = rng.randint(1, args.tokens - 1) if rng.random() < args.disconnect else 0
                async with semaphore:
                    try:
                        kind, text = await asyncio.wait_for(
                            stream_one(http, url, PROMPTS[i % len(PROMPTS)], args, hang_up),
                            args.request_timeout,
                        )
                    except TimeoutError:
                        kind, text = "hung", ""
                    except aiohttp.ClientError as exc:
                        kind, text = f"client error {type(exc).__name__}", ""
                progress[classify(kind, text, reference[i % len(PROMPTS)])] += 1

            started = time.monotonic()
            await asyncio.gather(*(one(i) for i in range(args.requests)))
            wall = time.monotonic() - started
            headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
            async with http.delete(f"{url}/admin/faults", headers=headers) as r:
                assert r.status == 200
            await asyncio.sleep(2.0)  # blocks return one message hop after the last stream
            final = await metrics(http, url)
            sampling.cancel()
            report(args, progress, samples, final, wall)
    finally:
        proc.terminate()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), 60)
        if proc.returncode is None:
            proc.kill()


def _growth(samples: list[Sample], field: str, warm: int) -> str:
    """From the first sample after warm-up to the last; samples taken while the worker was
    being replaced (no process: 0) are skipped."""
    seen = [s for s in samples if getattr(s, field)]
    after = [s for s in seen if s.done >= warm] or seen
    if not after:
        return "-"
    first, last = getattr(after[0], field), getattr(after[-1], field)
    return f"{first} -> {last} ({(last - first) / first * 100:+.1f}%)" if first else "-"


def report(
    args: argparse.Namespace,
    progress: Counter[str],
    samples: list[Sample],
    final: dict[str, float],
    wall: float,
) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "soak.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(Sample.__dataclass_fields__)
        writer.writerows([list(vars(s).values()) for s in samples])
    plot(samples, out / "soak.png")
    warm = int(args.requests * args.warmup)
    # "used" counts blocks held by sequences (an idle engine's evictable prefix-cache blocks
    # are not in it): anything above 0 with nothing in flight is a leak
    leaked = final.get("stoic_kv_cache_blocks_used", 0)
    restarts = {
        k.split('kind="')[1].rstrip('"}'): int(v)
        for k, v in final.items()
        if k.startswith("stoic_executor_restarts_total{")
    }
    print(
        f"\nsoak: {args.requests} requests at c={args.concurrency}, {args.tokens} tokens, "
        f"faults {args.kinds} at {args.fault_rate:.1%} of steps, {args.disconnect:.0%} of clients "
        f"hang up, {args.executor} executor, resume (max {args.max_resumes}), float32 greedy, "
        f"model {args.model}\n"
    )
    rows = [
        ("requests", args.requests),
        *((k, progress[k]) for k in (*_TERMINAL, "disconnected", "lost", "hung")),
        *(
            (k, v)
            for k, v in sorted(progress.items())
            if k not in (*_TERMINAL, "disconnected", "lost", "hung")
        ),
        ("executor restarts by kind", ", ".join(f"{k} {v}" for k, v in restarts.items()) or "-"),
        ("requests resumed", int(final.get("stoic_requests_resumed_total", 0))),
        ("requests failed by the engine", int(final.get("stoic_failed_sequences_total", 0))),
        ("KV blocks held after (leaked)", int(leaked)),
        ("server RSS MiB after warm-up -> end", _growth(samples, "server_rss_mib", warm)),
        ("worker RSS MiB after warm-up -> end", _growth(samples, "worker_rss_mib", warm)),
        ("server open fds after warm-up -> end", _growth(samples, "server_fds", warm)),
        ("worker open fds after warm-up -> end", _growth(samples, "worker_fds", warm)),
        ("wall time (s)", f"{wall:.0f}"),
    ]
    print("| measure | value |\n|---|---:|")
    for name, value in rows:
        print(f"| {name} | {value} |")


def plot(samples: list[Sample], png: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no matplotlib: no plot)", file=sys.stderr)
        return
    t = [s.t / 60 for s in samples]

    def worker(value: float) -> float:  # no worker while one is being replaced: a gap
        return value or math.nan

    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    axes[0].plot(t, [s.server_rss_mib for s in samples], label="server RSS (MiB)")
    axes[0].plot(t, [worker(s.worker_rss_mib) for s in samples], label="worker RSS (MiB)")
    axes[0].set_ylim(bottom=0)
    axes[1].plot(t, [s.server_fds for s in samples], label="server open fds")
    axes[1].plot(t, [worker(s.worker_fds) for s in samples], label="worker open fds")
    axes[1].set_ylim(bottom=0)
    axes[2].plot(t, [s.kv_used for s in samples], label="KV blocks used")
    axes[2].plot(t, [s.running for s in samples], label="running")
    axes[2].plot(t, [s.waiting for s in samples], label="waiting")
    axes[2].set_xlabel("minutes")
    for ax in axes:
        ax.legend(loc="upper right", fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle("stoic soak: memory, descriptors and KV blocks over time")
    fig.tight_layout()
    fig.savefig(png, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default="default",
        help="default, tiny (a 2-layer random model: the server, not the model, is measured) "
        "or a model directory",
    )
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=16, help="max_tokens (EOS ignored)")
    parser.add_argument("--fault-rate", type=float, default=0.02, help="share of steps faulted")
    parser.add_argument("--kinds", default="error,oom,crash,segfault")
    parser.add_argument("--executor", choices=["process", "thread"], default="process")
    parser.add_argument("--disconnect", type=float, default=0.10)
    parser.add_argument("--max-resumes", type=int, default=50)
    parser.add_argument("--warmup", type=float, default=0.1, help="share of requests")
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--sample-every", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="soak-out")
    parser.add_argument("--log", type=Path, help="keep the server's warnings and errors here")
    parser.add_argument("--replot", type=Path, metavar="CSV", help="only redraw a run's plot")
    args = parser.parse_args()
    if args.replot:
        with open(args.replot) as f:
            rows = list(csv.DictReader(f))
        samples = [Sample(**{k: float(v) for k, v in r.items()}) for r in rows]  # type: ignore[arg-type]
        plot(samples, Path(args.out) / "soak.png")
        return
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
