"""Resume after ``kill -9`` of the worker, with the KV cache kept (``--kv-outlives-worker``) and
without: the longest gap any stream sees, and whether every stream's text is exact.

For each mode (``on``, then ``off``, ``--rounds`` times, alternating so that neither always
runs second), one engine (process executor, ``recovery="resume"``, float32 by default so the
texts can be compared): ``--streams`` greedy streams with distinct prompts of about
``--prompt-tokens`` tokens run fault-free, then again, and once every stream has generated
``--kill-after`` tokens the worker is killed with SIGKILL. Per stream: the gap from the kill to
its next token (its pause), and whether its text equals the fault-free one. Reported: the
pauses' median and worst, the replacement worker's start (kill -> ``executor.ready``, from the
health state), the tokens reused and recomputed (the engine's counters), the texts exact.

The kill comes after the streams' prompts are all computed: with the cache kept each stream
recomputes its one decode token, without it its whole context (prompt and generated tokens).

Usage::

    python benchmarks/kv_resume_bench.py                       # default model, 16 x ~1,000 tokens
    python benchmarks/kv_resume_bench.py --model shapes/qwen2.5-1.5b --load-format dummy \\
        --streams 8 --prompt-tokens 500 --tokens 64 --kill-after 16
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.report import markdown, quantile
from harness.workload import quiet_logs

import stoic
from stoic.errors import StoicError

#: a paragraph of some 65 tokens, repeated to make a prompt of the size asked for
_PARAGRAPH = (
    "The harbour town wakes before the sun. Fishing boats slide out past the breakwater, their "
    "lamps swinging, while the bakers on the hill pull the first loaves from stone ovens. By "
    "seven the market square fills with crates of mackerel, baskets of apples and the shouting "
    "of traders who have known each other for forty years. "
)


def prompts(n: int, tokens: int) -> list[str]:
    """``n`` prompts of about ``tokens`` tokens, distinct from their first words (no prefix is
    shared: each stream's context is its own)."""
    repeats = max(1, round(tokens / 65))  # the paragraph is some 65 tokens
    return [
        f"Story {i}: " + _PARAGRAPH * repeats + f"Now continue story {i} in your own words."
        for i in range(n)
    ]


@dataclass
class Run:
    pauses: list[float]
    exact: int
    errors: int
    restart: float
    reused: int
    recomputed: int


async def faulted(
    engine: stoic.Engine, texts: list[str], expected: list[str], args: argparse.Namespace
) -> Run:
    params = stoic.SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    counts = [0] * len(texts)
    killed: list[float] = []
    resumed: list[float | None] = [None] * len(texts)
    outputs: list[str | None] = [None] * len(texts)
    ready = asyncio.Event()

    async def one(i: int) -> None:
        out = []
        try:
            async for delta in await engine.submit(texts[i], params):
                counts[i] += len(delta.token_ids)
                out.append(delta.text)
                if killed and resumed[i] is None:
                    resumed[i] = time.perf_counter() - killed[0]
                if all(c >= args.kill_after for c in counts):
                    ready.set()
        except StoicError as exc:
            print(f"stream {i}: {type(exc).__name__}: {exc}", file=sys.stderr)
            ready.set()  # the run is spoilt: do not wait for the kill forever
            return
        outputs[i] = "".join(out)

    tasks = [asyncio.create_task(one(i)) for i in range(len(texts))]
    await ready.wait()
    restarts = engine.stats().restarts
    before = engine.stats()
    victim = before.executor_pid
    assert victim is not None and victim != os.getpid()
    killed.append(time.perf_counter())
    os.kill(victim, signal.SIGKILL)
    # the engine's stats are polled (no event to wait on): 5 ms is well below a restart
    while engine.stats().restarts == restarts or not engine.health().ok:  # noqa: ASYNC110
        await asyncio.sleep(0.005)
    restart = time.perf_counter() - killed[0]
    await asyncio.gather(*tasks)
    after = engine.stats()
    return Run(
        pauses=[p for p in resumed if p is not None],
        exact=sum(o == e for o, e in zip(outputs, expected, strict=True)),
        errors=sum(o is None for o in outputs),
        restart=restart,
        reused=after.resume_reused_tokens - before.resume_reused_tokens,
        recomputed=after.resume_recomputed_tokens - before.resume_recomputed_tokens,
    )


async def one_mode(keep: bool, args: argparse.Namespace) -> Run:
    config = stoic.EngineConfig(
        model=args.model,
        dtype=args.dtype,
        load_format=args.load_format,
        executor="process",
        executor_spares=args.spares,
        recovery="resume",
        kv_outlives_worker=keep,
        max_restarts=100,
        # the streams are admitted whatever the wait: this measures recovery, not admission
        max_queue_wait=None,
        kv_cache_memory_gib=args.kv_cache_gib,
    )
    texts = prompts(args.streams, args.prompt_tokens)
    params = stoic.SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    async with stoic.Engine.start(config) as engine:
        results = await asyncio.gather(*(engine.complete(t, params) for t in texts))
        args.prompt_len = sum(r.prompt_tokens for r in results) // len(results)
        if args.spares:
            await asyncio.sleep(args.settle)  # the spares have loaded
        # the faulted run's prompts hit the prefix cache the fault-free run filled: the kill
        # comes after they are computed either way, and a dropped cache holds none of them
        return await faulted(engine, texts, [r.text for r in results], args)


async def main_async(args: argparse.Namespace) -> None:
    quiet_logs()
    runs: dict[bool, list[Run]] = {True: [], False: []}
    for r in range(args.rounds):
        for keep in (True, False) if r % 2 == 0 else (False, True):
            run = await one_mode(keep, args)
            runs[keep].append(run)
            print(
                f"round {r + 1}, kv_outlives_worker={keep}: worst pause {max(run.pauses):.2f} s, "
                f"restart {run.restart:.2f} s, exact {run.exact}/{args.streams}",
                file=sys.stderr,
            )
    rows = []
    for keep in (True, False):
        pauses = [p for run in runs[keep] for p in run.pauses]
        restart = [run.restart for run in runs[keep]]
        rows.append(
            (
                "on (kept)" if keep else "off (recomputed)",
                f"{quantile(pauses, 0.5):.2f} / {max(pauses):.2f}",
                f"{quantile(restart, 0.5):.2f}",
                sum(run.reused for run in runs[keep]) // len(runs[keep]),
                sum(run.recomputed for run in runs[keep]) // len(runs[keep]),
                f"{sum(run.exact for run in runs[keep])} of {args.streams * len(runs[keep])}",
                sum(run.errors for run in runs[keep]),
            )
        )
    worst = {keep: max(p for run in runs[keep] for p in run.pauses) for keep in (True, False)}
    print(
        f"\n{args.model} ({args.load_format}), {args.dtype}, spares {args.spares}, "
        f"{args.streams} streams of ~{args.prompt_len} "
        f"prompt tokens, {args.tokens} tokens each, kill -9 after {args.kill_after}; "
        f"{args.rounds} round(s) each\n"
    )
    head = (
        "--kv-outlives-worker",
        "pause after the kill, median / worst (s)",
        "kill -> new worker serving (s)",
        "tokens reused",
        "tokens recomputed",
        "texts exact",
        "errors",
    )
    print(markdown(head, rows, align="lrrrrrr"))
    print(f"\nworst pause, off / on: {worst[False] / worst[True]:.1f}x")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default")
    parser.add_argument("--load-format", choices=["auto", "dummy"], default="auto")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=128, help="max_tokens of each stream")
    parser.add_argument("--kill-after", type=int, default=32, help="tokens every stream has first")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--kv-cache-gib", type=float, default=2.0)
    parser.add_argument("--spares", type=int, default=0, help="--executor-spares")
    parser.add_argument(
        "--settle", type=float, default=10.0, help="with --spares: seconds for them to load"
    )
    args = parser.parse_args()
    asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
