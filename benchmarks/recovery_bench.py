"""Recovery benchmark: time from an injected executor failure to the next request being served.

For each of N rounds: a request is generating; the failure happens (``--failure oom``: an
out-of-memory error injected into the next step; ``--failure kill``: ``kill -9`` of the worker
process, with ``--executor process``); the failing stream observes
:class:`~stoic.errors.ExecutorFailed`; right away a new request is submitted. Reported per round:

* ``to_error``: failure -> the in-flight stream receives its error;
* ``to_served``: the error -> the next request's first token (the number that matters: a client
  that retries at once is served as soon as the executor is back).

Usage::

    python benchmarks/recovery_bench.py [--rounds 50] [--dtype auto]
    python benchmarks/recovery_bench.py --executor process --failure kill --rounds 10 [--spares 1]
        [--settle 15]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import time

import structlog

import stoic
from stoic.errors import ExecutorFailed


async def one_round(engine: stoic.Engine, failure: str) -> tuple[float, float]:
    long = stoic.SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    stream = await engine.submit("Tell me about the sea.", long)
    await stream.__anext__()
    armed = time.perf_counter()
    if failure == "kill":
        pid = engine.stats().executor_pid
        assert pid is not None and pid != os.getpid(), "--failure kill needs --executor process"
        os.kill(pid, signal.SIGKILL)
    else:
        await engine.inject_fault(stoic.FaultSpec(kind="oom", after_steps=1))
    try:
        async for _ in stream:
            pass
    except ExecutorFailed:
        pass
    else:  # pragma: no cover - the fault always fires within 200 tokens
        raise RuntimeError("the injected fault did not fire")
    failed = time.perf_counter()
    nxt = await engine.submit("Hi", stoic.SamplingParams(max_tokens=1, temperature=0))
    await nxt.__anext__()
    served = time.perf_counter()
    assert engine.health().ok
    async for _ in nxt:
        pass
    return failed - armed, served - failed


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--executor", choices=["thread", "process"], default="thread")
    parser.add_argument("--spares", type=int, default=0, help="--executor-spares")
    parser.add_argument("--failure", choices=["oom", "kill"], default="oom")
    parser.add_argument("--quantization", choices=["auto", "gguf", "none"], default="auto")
    parser.add_argument(
        "--settle",
        type=float,
        default=15.0,
        help="with --executor process: seconds between rounds (0: back-to-back failures)",
    )
    args = parser.parse_args()
    # as `stoic serve` does: one line per event, plain tracebacks (rich ones take ~0.1 s to render)
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ]
    )
    config = stoic.EngineConfig(
        dtype=args.dtype,
        enable_fault_injection=True,
        max_restarts=args.rounds + 10,
        restart_window=1.0,
        executor=args.executor,
        executor_spares=args.spares,
        quantization=args.quantization,
    )
    rows: list[tuple[float, float]] = []
    async with stoic.Engine.start(config) as engine:
        for _ in range(args.rounds):
            if args.executor == "process":
                # a fair round: the spare (or the pre-started interpreter) used last time has
                # been replaced and is ready again, as after any failure that is not back to back
                await asyncio.sleep(args.settle)
            rows.append(await one_round(engine, args.failure))
        await asyncio.sleep(0.1)  # block frees are one message hop behind the last stream
        stats = engine.stats()
    print(
        f"\n{args.executor} executor, failure {args.failure}, spares {args.spares}, "
        f"quantization {args.quantization}; "
        f"rounds: {args.rounds}; restarts: {stats.restarts}; "
        f"blocks used after: {stats.kv_blocks_used}\n"
    )
    print("| measure | median (ms) | p90 (ms) | worst (ms) |")
    print("|---|---:|---:|---:|")
    for i, name in enumerate(("failure -> stream error", "error -> next request served")):
        values = sorted(r[i] * 1000 for r in rows)
        p90 = statistics.quantiles(values, n=10)[8] if len(values) > 1 else values[0]
        print(f"| {name} | {statistics.median(values):.1f} | {p90:.1f} | {values[-1]:.1f} |")


if __name__ == "__main__":
    asyncio.run(main())
