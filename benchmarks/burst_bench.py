"""A burst through the Python API: 32 mixed prompts submitted at once, per executor.

What the first wave of a 32-client run looks like to the engine, without HTTP: every request
arrives in the same instant, so the whole burst's prefill is queued at once and the last prompt's
time to first token is the time to prefill all of them. Reports, per executor and round, the
burst's wall time, TTFT p50 and max, and output tokens/s; rounds alternate the executors, each
engine started fresh (stoic's defaults otherwise: ``--dtype auto``, ``--quantization auto``).

Usage: ``python benchmarks/burst_bench.py [--executors thread process] [--rounds 2]
[--requests 32] [--max-tokens 64]``
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import engine_bench as eb

import stoic


async def burst(engine: stoic.Engine, tag: str, requests: int, max_tokens: int) -> dict[str, float]:
    """One burst of ``requests`` prompts sent together; TTFT from the moment they were sent."""
    params = stoic.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    prompts = eb.tag_prompts(eb.mixed_prompts(requests), tag)
    ttfts: list[float] = []
    tokens = 0
    start = time.perf_counter()

    async def one(messages: list[dict[str, str]]) -> None:
        nonlocal tokens
        first = True
        async for delta in engine.chat(messages, params):
            if first:
                ttfts.append(time.perf_counter() - start)
                first = False
            tokens += len(delta.token_ids)

    await asyncio.gather(*(one(m) for m in prompts))
    wall = time.perf_counter() - start
    return {
        "wall s": wall,
        "TTFT p50 s": statistics.median(ttfts),
        "TTFT max s": max(ttfts),
        "tokens/s": tokens / wall,
    }


async def run(executors: list[str], rounds: int, requests: int, max_tokens: int) -> None:
    print(
        "| round | executor | "
        + " | ".join(["wall s", "TTFT p50 s", "TTFT max s", "tokens/s"])
        + " |"
    )
    print("|---:|---|---:|---:|---:|---:|")
    for round_ in range(rounds):
        order = executors if round_ % 2 == 0 else executors[::-1]
        for executor in order:
            async with stoic.Engine.start(stoic.EngineConfig(executor=executor)) as engine:
                await burst(engine, f"[warm {executor}{round_}] ", 4, 8)
                row = await burst(engine, f"[{executor}{round_}] ", requests, max_tokens)
            cells = " | ".join(
                f"{v:.2f}" if k != "tokens/s" else f"{v:.1f}" for k, v in row.items()
            )
            print(f"| {round_} | {executor} | {cells} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--executors", nargs="+", default=["thread", "process"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    asyncio.run(run(args.executors, args.rounds, args.requests, args.max_tokens))


if __name__ == "__main__":
    main()
