"""Recovery benchmark: time from an injected executor failure to the next request being served.

For each of N rounds: a request is generating; an out-of-memory error is injected into the next
step; the failing stream observes :class:`~stoic.errors.ExecutorFailed`; right away a new request
is submitted. Reported per round:

* ``to_error``: fault armed -> the in-flight stream receives its error;
* ``to_served``: the error -> the next request's first token (the number that matters: a client
  that retries at once is served as soon as the executor is back).

Usage: ``python benchmarks/recovery_bench.py [--rounds 50] [--dtype auto]``
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import structlog

import stoic
from stoic.errors import ExecutorFailed


async def one_round(engine: stoic.Engine) -> tuple[float, float]:
    long = stoic.SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    stream = await engine.submit("Tell me about the sea.", long)
    await stream.__anext__()
    armed = time.perf_counter()
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
    )
    rows: list[tuple[float, float]] = []
    async with stoic.Engine.start(config) as engine:
        for _ in range(args.rounds):
            rows.append(await one_round(engine))
        await asyncio.sleep(0.1)  # block frees are one message hop behind the last stream
        stats = engine.stats()
    print(
        f"\nrounds: {args.rounds}; restarts: {stats.restarts}; blocks used after: {stats.kv_blocks_used}\n"
    )
    print("| measure | median (ms) | p90 (ms) | worst (ms) |")
    print("|---|---:|---:|---:|")
    for i, name in enumerate(("fault armed -> stream error", "error -> next request served")):
        values = sorted(r[i] * 1000 for r in rows)
        p90 = statistics.quantiles(values, n=10)[8] if len(values) > 1 else values[0]
        print(f"| {name} | {statistics.median(values):.1f} | {p90:.1f} | {values[-1]:.1f} |")


if __name__ == "__main__":
    asyncio.run(main())
