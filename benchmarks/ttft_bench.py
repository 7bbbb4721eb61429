"""Time to first token at concurrency 32: what a step costs, and how the step budget moves TTFT.

Two measurements, both through the Python API on the default model (bfloat16 unless --dtype):

* **step cost**: one step of ``--decodes`` decoding sequences (contexts of 47-423 tokens, as in
  the mixed workload) plus a prefill of P tokens in 160-token chunks, timed with the model runner
  directly (median of 7); the bare model's own prefill of 3 x 160 tokens for comparison;
* **budget sweep**: the mixed workload of ``serving_bench.py`` (the first 128 of
  ``engine_bench.mixed_prompts``, ``max_tokens`` 64, EOS ignored) from 32 closed-loop clients, once
  per ``max_num_batched_tokens`` value, the values alternating over ``--repeats`` rounds. TTFT is
  split into the *first wave* (the 32 requests sent at once at the start) and *the rest* (sent as
  earlier requests finish).

Usage: ``python benchmarks/ttft_bench.py [--budgets 256 512] [--repeats 2] [--no-steps]``
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import engine_bench as eb
import torch

import stoic
from stoic.model import ModelRunner, PagedKVCache, SamplingParams, SeqChunk, StepBatch, load_model
from stoic.model._loader import resolve_model_path

BLOCK = 16


def step_costs(path: str, dtype: str, decodes: int) -> list[tuple[str, float]]:
    loaded = load_model(path, dtype=dtype)
    runner = ModelRunner(loaded)
    cache = PagedKVCache(runner.kv_spec(4096, BLOCK))
    cache.zero_blocks(tuple(range(4096)))
    params = SamplingParams(max_tokens=64, temperature=0)
    rng = random.Random(0)
    next_block = 0

    def table(tokens: int) -> tuple[int, ...]:
        nonlocal next_block
        count = -(-tokens // BLOCK)
        next_block += count
        return tuple(range(next_block - count, next_block))

    dec = []
    for i in range(decodes):
        ctx = rng.choice([47, 64, 103, 199, 359]) + rng.randrange(64)
        dec.append(SeqChunk(i, (100,), ctx, table(ctx + 1), True, params))

    def timed(batch: StepBatch) -> float:
        runner.execute(batch, cache)
        runs = []
        for _ in range(7):
            start = time.perf_counter()
            runner.execute(batch, cache)
            runs.append(time.perf_counter() - start)
        return 1000 * statistics.median(runs)

    rows = []
    for prefill in (0, 64, 160, 320, 480, 960):
        chunks = []
        for j in range(-(-prefill // 160)):
            n = min(160, prefill - 160 * j)
            chunks.append(SeqChunk(1000 + j, tuple(range(200, 200 + n)), 0, table(n), True, params))
        label = f"{decodes} decodes + {prefill} prefill tokens"
        rows.append((label, timed(StepBatch((*dec, *chunks)))))
    bare = load_model(path, dtype=dtype).model  # the model's own attention, no paging
    with torch.inference_mode():
        ids = torch.randint(200, 40000, (3, 160))
        bare(input_ids=ids, use_cache=False, logits_to_keep=1)
        start = time.perf_counter()
        for _ in range(5):
            bare(input_ids=ids, use_cache=False, logits_to_keep=1)
        rows.append(
            ("bare model: prefill 3 x 160 tokens", 1000 * (time.perf_counter() - start) / 5)
        )
    return rows


def split_ttft(row: eb.Row) -> dict[str, float]:
    """Throughput and TTFT of a closed-loop run, the first wave (requests sent together at the
    start) apart from the rest (sent as earlier requests finished)."""
    first, rest = row.ttfts[: row.concurrency], row.ttfts[row.concurrency :]
    return {
        "tokens/s": row.tokens_per_s,
        "p50": statistics.median(row.ttfts),
        "p90": statistics.quantiles(row.ttfts, n=10)[8],
        "first wave p50": statistics.median(first),
        "rest p50": statistics.median(rest) if rest else float("nan"),
    }


async def sweep(
    path: str, dtype: str, budgets: list[int], repeats: int
) -> list[tuple[int, dict[str, float]]]:
    prompts = eb.mixed_prompts(128)
    out = []
    for round_ in range(repeats):
        order = budgets if round_ % 2 == 0 else budgets[::-1]
        for budget in order:
            config = stoic.EngineConfig(
                model=path, dtype=dtype, num_kv_blocks=2912, max_num_batched_tokens=budget
            )
            async with stoic.Engine.start(config) as engine:
                await eb.stoic_mixed(engine, eb.mixed_prompts(8, seed=99), 8, 8)  # warm-up
                row = split_ttft(await eb.stoic_mixed(engine, prompts, 32, 64))
            print(
                f"budget {budget}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True
            )
            out.append((budget, row))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--budgets", type=int, nargs="+", default=[128, 256, 512, 1024])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--decodes", type=int, default=30)
    parser.add_argument("--no-steps", action="store_true", help="skip the step-cost table")
    args = parser.parse_args()
    _, model = resolve_model_path("default")
    path = str(model)
    if not args.no_steps:
        print("| step | ms |\n|---|---:|")
        for label, ms in step_costs(path, args.dtype, args.decodes):
            print(f"| {label} | {ms:.1f} |")
        print()
    rows = asyncio.run(sweep(path, args.dtype, args.budgets, args.repeats))
    print(
        "\n| max_num_batched_tokens | runs | tokens/s | TTFT p50 (s) | TTFT p90 (s) | first wave p50 (s) | rest p50 (s) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for budget in args.budgets:
        runs = [r for b, r in rows if b == budget]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(
            f"| {budget} | {len(runs)} | {med['tokens/s']:.1f} | {med['p50']:.3f} | {med['p90']:.3f} | "
            f"{med['first wave p50']:.3f} | {med['rest p50']:.3f} |"
        )


if __name__ == "__main__":
    main()
