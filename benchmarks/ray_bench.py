"""Scale-out on Ray Serve: throughput of ``stoic serve`` with one engine in the process, with
``--replicas 1`` and with ``--replicas 2`` on this machine, and the time from a replica's kill -9
to its replacement serving (docs/scale-out.md).

Each system runs in turn as a subprocess (``python -m stoic serve``, the default model, float32,
the thread executor), is warmed up, then driven by C closed-loop streaming chat clients over the
same seeded mixed prompts (``max_tokens`` 64, EOS ignored) for a fixed number of requests.
With ``--kill``, the 2-replica system then runs the load again and one replica's process is
killed mid-load: the report counts the requests that failed (migration should leave none) and
the seconds until two replicas serve again (read from ``/metrics``: the killed replica's series
gone, two replicas ``serving``).

    python benchmarks/ray_bench.py --requests 32 --concurrency 8 --kill

Needs the ``ray`` extra and ``psutil`` (``bench`` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.load import Result, run_load
from harness.servers import System, stoic_server
from harness.workload import mixed_prompts, tag_prompts

_REPLICA_RE = re.compile(r'stoic_replica_sequences_running\{replica="([^"]+)"\}')
_SERVING_RE = re.compile(r'stoic_replicas\{state="serving"\} ([0-9.]+)')


async def replicas(url: str) -> tuple[set[str], float]:
    """The replica ids on ``/metrics`` and how many serve."""
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as r:
        text = await r.text()
    serving = _SERVING_RE.search(text)
    return set(_REPLICA_RE.findall(text)), float(serving.group(1)) if serving else 0.0


def replica_pids() -> list[int]:
    return sorted(
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if any("ServeReplica:stoic:EngineReplica" in part for part in p.info["cmdline"] or ())
    )


async def kill_one_and_time(url: str, after: float) -> dict[str, Any]:
    """Kill one replica ``after`` seconds into the load; seconds until two serve again."""
    await asyncio.sleep(after)
    before, _ = await replicas(url)
    pid = replica_pids()[0]
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    while True:
        await asyncio.sleep(0.25)
        ids, serving = await replicas(url)
        if len(ids) == 2 and serving == 2 and len(ids - before) == 1:
            return {"killed_pid": pid, "back_s": round(time.monotonic() - killed_at, 1)}


def summary(result: Result) -> dict[str, Any]:
    return {
        "system": result.system,
        "requests": len(result.records),
        "errors": result.errors,
        "seconds": round(result.seconds, 1),
        "output_tok_s": round(result.tokens_per_s, 1),
    }


async def load(system: System, args: argparse.Namespace, tag: str) -> Result:
    """The measured pass: ``--requests`` seeded mixed prompts at ``--concurrency``."""
    prompts = tag_prompts(mixed_prompts(args.requests, seed=1), tag)
    bodies = [system.body(m, args.max_tokens) for m in prompts]
    url = f"{system.url}/v1/chat/completions"
    records, seconds = await run_load(url, bodies, args.concurrency, budget=3600)
    return Result(tag.strip(), args.concurrency, len(bodies), records, seconds)


async def measure(
    args: argparse.Namespace, work: Path, name: str, replicas_n: int | None
) -> dict[str, Any]:
    flags = ["--dtype", "float32", "--executor", "thread"]
    if replicas_n is not None:
        flags += ["--replicas", str(replicas_n)]
    system = stoic_server(work, name, flags)
    started = time.monotonic()
    await system.start()
    try:
        ready = time.monotonic() - started
        warm = [system.body(m, args.max_tokens) for m in tag_prompts(mixed_prompts(4), "warm ")]
        await run_load(f"{system.url}/v1/chat/completions", warm, 4, budget=600)
        row = summary(await load(system, args, f"{name} ")) | {"ready_s": round(ready, 1)}
        if args.kill and replicas_n == 2:  # a second pass, with a replica killed mid-load
            killer = asyncio.create_task(kill_one_and_time(system.url, args.kill_after))
            kill = summary(await load(system, args, f"{name}, one killed "))
            row["kill_pass"] = kill | await asyncio.wait_for(killer, 300)
        return row
    finally:
        system.stop()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--kill", action="store_true", help="kill a replica mid-load (2 replicas)")
    parser.add_argument("--kill-after", type=float, default=10.0)
    parser.add_argument("--only", choices=["single", "1", "2"], action="append")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="stoic-ray-bench-"))
    systems = {"single": None, "1": 1, "2": 2}
    for key in args.only or list(systems):
        name = "stoic serve" if key == "single" else f"--replicas {key}"
        print(await measure(args, work, name, systems[key]), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
