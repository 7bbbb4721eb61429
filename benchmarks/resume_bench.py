"""Resume benchmark: what ``recovery="resume"`` costs a client, and whether it holds under chaos.

``stall`` (the default): ``--concurrency`` greedy streams (float32, ``ignore_eos``, ``--tokens``
64) run twice per round in one engine: fault-free, then with one fault (``--kind``) injected into
the next step once every stream is generating. For each stream: its largest gap between
consecutive deltas from that moment on, in both runs; the difference is the stall a resume adds.
Every faulted stream must end with its fault-free text (float32 greedy is deterministic here);
mismatches and errors are counted.

``chaos``: ``--requests`` requests at ``--concurrency``, cycling through 20 prompts,
``max_tokens`` 32, under a ``probability`` fault (``--probability`` per step; ``--kinds`` split
into one spec per kind with p/len(kinds) each and distinct seeds). ``max_resumes`` defaults to
50, not 3: at p=0.05 per step a 32-token request is in ~1.6 failed steps on average, and with 16
in a batch every failure hits all of them, so a small budget would fail requests by design, not by
a bug. ``max_restarts`` 10000 in 1 s windows keeps the supervisor from failing the engine. The
fault-free texts come from the same engine before the faults are armed.

On a shared, loaded machine set ``OMP_NUM_THREADS=1``: with other processes on the cores, torch's
OpenMP threads stop spin-waiting and a decode step took 4 s instead of 0.15 s.

Usage::

    python benchmarks/resume_bench.py [stall] [--kind error] [--concurrency 16] [--rounds 5]
    python benchmarks/resume_bench.py stall --executor process --spares 1 --kind crash
    python benchmarks/resume_bench.py chaos [--requests 200] [--probability 0.05] [--seed 1]
    python benchmarks/resume_bench.py chaos --executor process --spares 1 --kinds error,oom,crash
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import statistics
import time
from collections import Counter
from dataclasses import dataclass

import structlog

import stoic
from stoic.errors import StoicError

PROMPTS = [
    "Tell me about the sea.",
    "Write a short poem about autumn leaves.",
    "Explain how a bicycle stays upright.",
    "What is the capital of France, and why is it famous?",
    "Give three tips for learning a new language.",
    "Describe a thunderstorm to someone who has never seen one.",
    "How do bees make honey?",
    "Summarise the plot of a detective story in a few sentences.",
    "List some uses of a paperclip.",
    "Why is the sky blue?",
    "Write a recipe for a simple tomato soup.",
    "Explain recursion to a ten-year-old.",
    "What happens when water freezes?",
    "Describe your ideal weekend.",
    "How does a compass work?",
    "Write a letter thanking a teacher.",
    "What are the planets of the solar system?",
    "Give advice to someone starting to run.",
    "Explain what a prime number is.",
    "Describe the smell of fresh bread.",
]


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


async def wait_idle(engine: stoic.Engine) -> stoic.EngineStats:
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats.running == 0 and stats.waiting == 0:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)  # block frees are one message hop behind the last stream
    return engine.stats()


def ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:.0f} / {max(values) * 1000:.0f}"


async def stall(engine: stoic.Engine, args: argparse.Namespace) -> None:
    params = stoic.SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    rows: list[str] = []
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
        rows.append(f"| {r + 1} | {restarts} | {ms(cg)} | {ms(fg)} | {ms(added)} | {problems} |")
    stats = await wait_idle(engine)
    print(
        f"\nstall: {args.executor} executor, kind {args.kind}, spares {args.spares}, "
        f"concurrency {args.concurrency}, {args.tokens} tokens, {args.rounds} rounds; "
        f"restarts {stats.restarts}, resumed {stats.requests_resumed}, "
        f"isolated {stats.requests_isolated}, exhausted {stats.resumes_exhausted}, "
        f"blocks used after {stats.kv_blocks_used}\n"
    )
    print(
        "| round | restarts | fault-free max gap, median / worst (ms) | faulted max gap, "
        "median / worst (ms) | stall added, median / worst (ms) | mismatches, errors |"
    )
    print("|---:|---:|---:|---:|---:|---|")
    print("\n".join(rows))
    problems = ", ".join(f"{k}: {v}" for k, v in bad_total.items()) or "none"
    print(
        f"| all | {stats.restarts} | {ms(clean_all)} | {ms(fault_all)} | {ms(added_all)} "
        f"| {problems} |"
    )


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
    print("| measure | value |")
    print("|---|---:|")
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
    for name, value in table:
        print(f"| {name} | {value} |")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", choices=["stall", "chaos"], default="stall")
    parser.add_argument("--executor", choices=["thread", "process"], default="thread")
    parser.add_argument("--spares", type=int, default=0, help="executor_spares (process only)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tokens", type=int, help="max_tokens (default: stall 64, chaos 32)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kind", choices=["error", "oom", "crash"], default="error")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--settle", type=float, default=15.0, help="process: s between rounds")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--probability", type=float, default=0.05)
    parser.add_argument("--kinds", default="error", help="chaos: comma-separated fault kinds")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-resumes", type=int, default=50)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    args = parser.parse_args()
    if args.tokens is None:
        args.tokens = 64 if args.mode == "stall" else 32
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    config = stoic.EngineConfig(
        model="default",
        dtype=args.dtype,
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


if __name__ == "__main__":
    asyncio.run(main())
