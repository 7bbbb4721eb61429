"""Recovery: what an executor failure costs a client, and whether every request survives.

Modes (the first argument):

* ``restart`` (the default): for each of ``--rounds`` rounds a request is generating, the failure
  happens (``--failure oom``: an out-of-memory error injected into the next step; ``--failure
  kill``: ``kill -9`` of the worker process, with ``--executor process``), the stream observes
  :class:`~stoic.errors.ExecutorFailed`, and a new request is submitted at once. Reported: failure
  -> the stream's error, and the error -> the next request's first token (a client that retries
  at once is served as soon as the executor is back).
* ``stall`` (``recovery="resume"``): ``--concurrency`` greedy streams (float32, ``ignore_eos``)
  run twice per round: fault-free, then with one fault (``--kind``) injected once every stream
  is generating. Per stream, the largest gap between deltas from that moment on, in both runs;
  the difference is the stall a resume adds. Every faulted stream must end with its fault-free
  text; mismatches and errors are counted.
* ``chaos`` (``recovery="resume"``): ``--requests`` requests at ``--concurrency`` cycling through
  20 prompts, ``max_tokens`` 32, every step failing with ``--probability`` (split over
  ``--kinds``, distinct seeds). ``max_resumes`` 50 and 10,000 restarts in 1 s windows keep the
  budgets out of the way: the run counts requests that did not end with their fault-free text.
The GPU checks (a real CUDA out-of-memory error, a real device-side assert) are
``benchmarks/gpu_check.py``.

On a shared, loaded machine set ``OMP_NUM_THREADS=1``: with other processes on the cores, torch's
OpenMP threads stop spin-waiting and a decode step took 4 s instead of 0.15 s.

Usage::

    python benchmarks/recovery_bench.py [restart] [--rounds 50] [--dtype auto]
    python benchmarks/recovery_bench.py restart --executor process --failure kill --rounds 10
    python benchmarks/recovery_bench.py stall --executor process --spares 1 --kind crash
    python benchmarks/recovery_bench.py chaos --executor process --spares 1 --kinds error,oom,crash
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import os
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import structlog
from harness.report import markdown, median_worst_ms, quantile
from harness.workload import PROMPTS, quiet_logs, wait_idle

import stoic
from stoic.errors import ExecutorFailed, StoicError


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


@dataclass
class StreamRun:
    text: str
    max_gap: float  # seconds, from the fault (or the same moment in the clean run) on
    error: str | None


async def timed_streams(
    engine: stoic.Engine, params: stoic.SamplingParams, c: int, fault: stoic.FaultSpec | None
) -> list[StreamRun]:
    started = [asyncio.Event() for _ in range(c)]

    async def one(i: int) -> tuple[str, list[float], str | None]:
        stamps: list[float] = []
        text: list[str] = []
        error = None
        try:
            async for delta in await engine.submit(PROMPTS[i % len(PROMPTS)], params):
                stamps.append(time.perf_counter())
                text.append(delta.text)
                started[i].set()
        except StoicError as exc:
            error = type(exc).__name__
        finally:
            started[i].set()
        return "".join(text), stamps, error

    tasks = [asyncio.create_task(one(i)) for i in range(c)]
    await asyncio.gather(*(e.wait() for e in started))
    mark = time.perf_counter()
    if fault is not None:
        await engine.inject_fault(fault)
    runs = []
    for text, stamps, error in await asyncio.gather(*tasks):
        after = [mark, *(s for s in stamps if s > mark)]
        gap = max((b - a for a, b in itertools.pairwise(after)), default=0.0)
        runs.append(StreamRun(text, gap, error))
    return runs


async def stall(engine: stoic.Engine, args: argparse.Namespace) -> None:
    params = stoic.SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    rows: list[tuple[object, ...]] = []
    clean_all: list[float] = []
    fault_all: list[float] = []
    added_all: list[float] = []
    bad_total = Counter[str]()
    warm = stoic.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    await timed_streams(engine, warm, args.concurrency, None)  # first steps' costs, not measured
    for r in range(args.rounds):
        if args.executor == "process":
            await asyncio.sleep(args.settle)  # the spare used last round is replaced and ready
        clean = await timed_streams(engine, params, args.concurrency, None)
        before = engine.stats().restarts
        fault = stoic.FaultSpec(kind=args.kind, after_steps=1)
        faulted = await timed_streams(engine, params, args.concurrency, fault)
        restarts = engine.stats().restarts - before
        bad = Counter[str]()
        for a, b in zip(clean, faulted, strict=True):
            if a.error or b.error:
                bad[f"error {a.error or b.error}"] += 1
            elif a.text != b.text:
                bad["mismatch"] += 1
        bad_total.update(bad)
        cg, fg = [s.max_gap for s in clean], [s.max_gap for s in faulted]
        added = [f - c for c, f in zip(cg, fg, strict=True)]
        clean_all += cg
        fault_all += fg
        added_all += added
        problems = ", ".join(f"{k}: {v}" for k, v in bad.items()) or "none"
        rows.append((r + 1, restarts, *map(median_worst_ms, (cg, fg, added)), problems))
    stats = await wait_idle(engine)
    print(
        f"\nstall: {args.executor} executor, kind {args.kind}, spares {args.spares}, "
        f"concurrency {args.concurrency}, {args.tokens} tokens, {args.rounds} rounds; "
        f"restarts {stats.restarts}, resumed {stats.requests_resumed}, "
        f"isolated {stats.requests_isolated}, exhausted {stats.resumes_exhausted}, "
        f"blocks used after {stats.kv_blocks_used}\n"
    )
    problems = ", ".join(f"{k}: {v}" for k, v in bad_total.items()) or "none"
    gaps = map(median_worst_ms, (clean_all, fault_all, added_all))
    rows.append(("all", stats.restarts, *gaps, problems))
    head = ("round", "restarts", "fault-free max gap, median / worst (ms)")
    head += ("faulted max gap, median / worst (ms)", "stall added, median / worst (ms)")
    print(markdown((*head, "mismatches, errors"), rows, align="rrrrrl"))


async def chaos(engine: stoic.Engine, args: argparse.Namespace) -> None:
    params = stoic.SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    semaphore = asyncio.Semaphore(args.concurrency)

    async def complete(prompt: str) -> str:
        async with semaphore:
            result = await asyncio.wait_for(engine.complete(prompt, params), args.request_timeout)
            return result.text

    reference = await asyncio.gather(*(complete(p) for p in PROMPTS))
    kinds = args.kinds.split(",")
    for i, kind in enumerate(kinds):
        p = args.probability / len(kinds)
        await engine.inject_fault(stoic.FaultSpec(kind=kind, probability=p, seed=args.seed + i))

    async def one(i: int) -> str:
        try:
            text = await complete(PROMPTS[i % len(PROMPTS)])
        except StoicError as exc:
            return f"failed: {type(exc).__name__}"
        except TimeoutError:
            return "failed: timeout"
        if text != reference[i % len(PROMPTS)]:
            print(f"mismatch, request {i}: {reference[i % len(PROMPTS)]!r} -> {text!r}")
            return "different text"
        return "same text"

    start = time.perf_counter()
    outcomes = Counter(await asyncio.gather(*(one(i) for i in range(args.requests))))
    wall = time.perf_counter() - start
    await engine.clear_faults()
    stats = await wait_idle(engine)
    by_kind = ", ".join(f"{k} {n}" for k, n in stats.restarts_by_kind) or "-"
    failed = {k: v for k, v in outcomes.items() if k.startswith("failed")}
    print(
        f"\nchaos: {args.executor} executor, spares {args.spares}, kinds {args.kinds}, "
        f"p={args.probability} per step, seed {args.seed}, concurrency {args.concurrency}, "
        f"{args.tokens} tokens, max_resumes {args.max_resumes}\n"
    )
    table = [
        ("requests", args.requests),
        ("succeeded, fault-free text", outcomes["same text"]),
        ("succeeded, different text", outcomes["different text"]),
        ("failed", sum(failed.values())),
        *((f"  {k}", v) for k, v in sorted(failed.items())),
        ("restarts", f"{stats.restarts} ({by_kind})"),
        ("faults injected", stats.faults_injected),
        ("requests resumed", stats.requests_resumed),
        ("requests isolated", stats.requests_isolated),
        ("resumes exhausted", stats.resumes_exhausted),
        ("failed sequences", stats.failed_sequences),
        ("wall time (s)", f"{wall:.1f}"),
        ("KV blocks used after (idle)", stats.kv_blocks_used),
        ("engine state", stats.state),
    ]
    print(markdown(("measure", "value"), table))


async def restart(args: argparse.Namespace) -> None:
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
        dtype=args.dtype or "auto",
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
    table = []
    for i, name in enumerate(("failure -> stream error", "error -> next request served")):
        values = [r[i] * 1000 for r in rows]
        median, p90 = quantile(values, 0.5), quantile(values, 0.9)
        table.append((name, f"{median:.1f}", f"{p90:.1f}", f"{max(values):.1f}"))
    print(markdown(("measure", "median (ms)", "p90 (ms)", "worst (ms)"), table))


async def resume(args: argparse.Namespace) -> None:
    quiet_logs(logging.CRITICAL)
    config = stoic.EngineConfig(
        model="default",
        dtype=args.dtype or "float32",
        enable_fault_injection=True,
        recovery="resume",
        max_resumes=args.max_resumes,
        max_restarts=10_000,
        restart_window=1.0,
        executor=args.executor,
        executor_spares=args.spares,
    )
    async with stoic.Engine.start(config) as engine:
        await (stall if args.mode == "stall" else chaos)(engine, args)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("mode", nargs="?", choices=["restart", "stall", "chaos"], default="restart")
    parser.add_argument("--executor", choices=["thread", "process"], default="thread")
    parser.add_argument("--spares", type=int, default=0, help="--executor-spares (process only)")
    parser.add_argument("--dtype", help="default: restart auto, stall and chaos float32")
    parser.add_argument("--rounds", type=int, help="restart: 50; stall: 5")
    parser.add_argument(
        "--settle",
        type=float,
        default=15.0,
        help="with --executor process: seconds between rounds (0: back-to-back failures)",
    )
    restart_ = parser.add_argument_group("restart")
    restart_.add_argument("--failure", choices=["oom", "kill"], default="oom")
    restart_.add_argument("--quantization", choices=["auto", "gguf", "none"], default="auto")
    resume_ = parser.add_argument_group("stall and chaos")
    resume_.add_argument("--concurrency", type=int, default=16)
    resume_.add_argument("--tokens", type=int, help="max_tokens (stall 64, chaos 32)")
    resume_.add_argument("--kind", choices=["error", "oom", "crash"], default="error")
    resume_.add_argument("--requests", type=int, default=200)
    resume_.add_argument("--probability", type=float, default=0.05)
    resume_.add_argument("--kinds", default="error", help="chaos: comma-separated fault kinds")
    resume_.add_argument("--seed", type=int, default=1)
    resume_.add_argument("--max-resumes", type=int, default=50)
    resume_.add_argument("--request-timeout", type=float, default=600.0)
    args = parser.parse_args()
    if args.rounds is None:
        args.rounds = 50 if args.mode == "restart" else 5
    if args.tokens is None:
        args.tokens = 64 if args.mode == "stall" else 32
    asyncio.run(restart(args) if args.mode == "restart" else resume(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
