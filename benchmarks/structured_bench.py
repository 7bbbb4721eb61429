"""Structured outputs: throughput with every request constrained by a JSON schema against
unconstrained, in the same run, and the grammar masks' cost per step.

    python benchmarks/structured_bench.py [--concurrency 32] [--requests 64] [--max-tokens 64]

Both modes run the same prompts through the Python API (thread executor, float32, greedy,
``ignore_eos``: a sequence ends at ``max_tokens`` or, constrained, when its grammar is
complete), alternating constrained and unconstrained rounds so the shared machine's noise falls
on both; throughput is generated tokens over wall time. The schema (an object with a free-text
field and a list of strings) lets the model write as long as an unconstrained one.

The mask measurement replays the constrained outputs through a fresh matcher table, timing
``GrammarStates.bitmask`` for a batch of ``--concurrency`` rows per step (the work the grammar
thread does while the forward runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.report import markdown, quantile

import stoic
from stoic.engine import Constraint
from stoic.request import GrammarVocab, SamplingParams, SeqChunk
from stoic.sampling import GrammarStates, LLGuidanceBackend

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "summary": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["title", "summary", "tags"],
    "additionalProperties": False,
}
TOPICS = ["the sea", "a cat", "winter", "bread", "a robot", "the moon", "tea", "trains"]


def _prompts(n: int) -> list[list[dict[str, str]]]:
    return [
        [{"role": "user", "content": f"Describe {TOPICS[i % 8]} (#{i}) as a JSON object."}]
        for i in range(n)
    ]


async def _round(
    engine: stoic.Engine, prompts: list[Any], params: stoic.SamplingParams, concurrency: int
) -> tuple[float, list[stoic.engine.CompletionResult]]:
    gate = asyncio.Semaphore(concurrency)

    async def one(messages: Any) -> stoic.engine.CompletionResult:
        async with gate:
            return await engine.complete(messages=messages, params=params)

    start = time.perf_counter()
    results = await asyncio.gather(*(one(m) for m in prompts))
    return time.perf_counter() - start, list(results)


def _mask_times(engine: stoic.Engine, outputs: list[list[int]], rows: int) -> list[float]:
    """Seconds per step to compute ``rows`` masks, replaying ``outputs`` token by token."""
    loaded = engine.loaded
    vocab = GrammarVocab.from_tokenizer(
        loaded.tokenizer, int(loaded.config.vocab_size), loaded.eos_token_ids
    )
    states = GrammarStates(LLGuidanceBackend(vocab))
    params = SamplingParams(constraint=Constraint("json_schema", json.dumps(SCHEMA)))
    outputs = outputs[:rows]
    times = []
    for step in range(max(len(o) for o in outputs)):
        chunks = [
            SeqChunk(i, (0,), 0, (0,), True, params, step, tuple(o[:step]))
            for i, o in enumerate(outputs)
            if step < len(o)
        ]
        states.bitmask(chunks)  # catch up (replay) outside the timing
        start = time.perf_counter()
        states.bitmask(chunks)
        times.append(time.perf_counter() - start)
    return times


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each mode")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    config = stoic.EngineConfig(
        model="default", dtype="float32", device=args.device, max_num_seqs=args.concurrency
    )
    prompts = _prompts(args.requests)
    constraint = Constraint("json_schema", json.dumps(SCHEMA))
    free = stoic.SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    constrained = stoic.SamplingParams(
        max_tokens=args.max_tokens, temperature=0, ignore_eos=True, constraint=constraint
    )
    totals: dict[str, list[tuple[float, int]]] = {"unconstrained": [], "json_schema": []}
    outputs: list[list[int]] = []
    finished = 0
    async with stoic.Engine.start(config) as engine:
        await _round(engine, prompts[:4], constrained, 4)  # warm up: compile, first steps
        await _round(engine, prompts[:4], free, 4)
        for _ in range(args.rounds):
            for name, params in (("unconstrained", free), ("json_schema", constrained)):
                seconds, results = await _round(engine, prompts, params, args.concurrency)
                tokens = sum(len(r.token_ids) for r in results)
                totals[name].append((seconds, tokens))
                print(f"round: {name} {tokens} tokens in {seconds:.1f} s", flush=True)
                if name == "json_schema":
                    for r in results:  # a finished one is valid JSON (or this raises)
                        if r.finish_reason == "stop":
                            json.loads(r.text)
                    outputs = [list(r.token_ids) for r in results]
                    finished = sum(r.finish_reason == "stop" for r in results)
        masks = _mask_times(engine, outputs, args.concurrency)
    rates = {}
    print(f"c={args.concurrency}, {args.requests} requests, max_tokens {args.max_tokens}, float32")
    rows = []
    for name, runs in totals.items():
        seconds = sum(s for s, _ in runs)
        tokens = sum(t for _, t in runs)
        rates[name] = tokens / seconds
        rows.append((name, tokens, f"{seconds:.1f}", f"{rates[name]:.1f}"))
    print(markdown(("mode", "tokens", "seconds", "tokens/s"), rows))
    print(
        f"\nconstrained requests whose grammar completed (last round): {finished}/{args.requests}"
    )
    print(
        f"json_schema / unconstrained throughput: {rates['json_schema'] / rates['unconstrained']:.1%}"
    )
    print(
        f"mask time per step ({args.concurrency} rows): median "
        f"{(quantile(masks, 0.5) or 0) * 1e3:.2f} ms, p90 {(quantile(masks, 0.9) or 0) * 1e3:.2f} ms, "
        f"max {max(masks) * 1e3:.2f} ms"
    )


if __name__ == "__main__":
    asyncio.run(main())
