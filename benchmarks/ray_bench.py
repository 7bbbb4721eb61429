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
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_bench import mixed_prompts, tag_prompts
from serving.load import RequestRecord, run_load

_REPLICA_RE = re.compile(r'stoic_replica_sequences_running\{replica="([^"]+)"\}')
_SERVING_RE = re.compile(r'stoic_replicas\{state="serving"\} ([0-9.]+)')


def start(port: int, replicas: int | None) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "stoic", "serve", "--port", str(port), "--dtype", "float32"]
    cmd += ["--executor", "thread", "--log-level", "warning"]
    if replicas is not None:
        cmd += ["--replicas", str(replicas)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def wait_healthy(url: str, proc: subprocess.Popen[bytes], within: float = 300.0) -> float:
    started = time.monotonic()
    async with aiohttp.ClientSession() as http:
        while time.monotonic() - started < within:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}")
            try:
                async with http.get(f"{url}/health") as r:
                    if r.status == 200:
                        return time.monotonic() - started
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError("the server did not become healthy")


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


def summary(name: str, records: list[RequestRecord], seconds: float) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    return {
        "system": name,
        "requests": len(records),
        "errors": len(records) - len(ok),
        "seconds": round(seconds, 1),
        "output_tok_s": round(tokens / seconds, 1),
    }


async def measure(args: argparse.Namespace, name: str, replicas_n: int | None) -> dict[str, Any]:
    port = args.port
    url = f"http://127.0.0.1:{port}"
    proc = start(port, replicas_n)
    try:
        ready = await wait_healthy(url, proc)
        body = {"model": "default", "max_tokens": args.max_tokens, "stream": True}
        body |= {"ignore_eos": True, "temperature": 0}
        warm = [{**body, "messages": m} for m in tag_prompts(mixed_prompts(4), "warm ")]
        await run_load(f"{url}/v1/chat/completions", warm, 4, budget=600)
        prompts = tag_prompts(mixed_prompts(args.requests, seed=1), f"{name} ")
        bodies = [{**body, "messages": m} for m in prompts]
        records, seconds = await run_load(
            f"{url}/v1/chat/completions", bodies, args.concurrency, budget=3600
        )
        row = summary(name, records, seconds) | {"ready_s": round(ready, 1)}
        if args.kill and replicas_n == 2:  # a second pass, with a replica killed mid-load
            killer = asyncio.create_task(kill_one_and_time(url, args.kill_after))
            prompts = tag_prompts(mixed_prompts(args.requests, seed=1), f"{name} kill ")
            bodies = [{**body, "messages": m} for m in prompts]
            records, seconds = await run_load(
                f"{url}/v1/chat/completions", bodies, args.concurrency, budget=3600
            )
            kill = summary(f"{name}, one killed", records, seconds)
            row["kill_pass"] = kill | await asyncio.wait_for(killer, 300)
        return row
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--kill", action="store_true", help="kill a replica mid-load (2 replicas)")
    parser.add_argument("--kill-after", type=float, default=10.0)
    parser.add_argument("--only", choices=["single", "1", "2"], action="append")
    args = parser.parse_args()
    systems = {"single": None, "1": 1, "2": 2}
    for key in args.only or list(systems):
        name = "stoic serve" if key == "single" else f"--replicas {key}"
        print(await measure(args, name, systems[key]), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
