"""Engine benchmark: stoic through the Python API next to transformers on the same requests.

Two workloads, measured in one run so machine noise hits all systems alike:

* **mixed**: a seeded prompt set of mixed lengths (chat-templated), ``max_tokens`` 64, at
  concurrency 1, 8 and 32; reports output tokens/s and time to first token, next to transformers
  ``generate`` serving the same requests one at a time (the baseline).
* **steady decode**: 32 sequences with equal ~128-token prompts and 128 output tokens each (EOS
  ignored); stoic's decode tokens/s once all 32 are decoding, next to a plain batched torch decode
  loop with a KV cache at batch 32 (the ceiling).

Usage: ``python benchmarks/engine_bench.py [--dtype auto|float32|bfloat16] [--requests 32]``
(``make bench ARGS=...`` runs it; a smoke run: ``--requests 4 --max-tokens 4 --baseline-requests 2
--steady-batch 2 --steady-tokens 8``)
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from harness.report import fmt_s, markdown
from harness.workload import (
    Row,
    default_model_dir,
    hf_one_at_a_time,
    mixed_prompts,
    stoic_mixed,
    stoic_steady,
    tag_prompts,
    torch_decode_loop,
)

import stoic
from stoic.model import load_model


def table(rows: list[Row]) -> str:
    head = ("system", "workload", "concurrency", "requests", "output tokens", "seconds")
    head += ("tokens/s", "TTFT p50 (s)", "TTFT p90 (s)")
    return markdown(
        head,
        (
            (
                r.system,
                r.workload,
                r.concurrency,
                r.requests,
                r.output_tokens,
                f"{r.seconds:.2f}",
                f"{r.tokens_per_s:.1f}",
                fmt_s(r.ttft_p50),
                fmt_s(r.ttft_p90),
            )
            for r in rows
        ),
        align="llrrrrrrr",
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--requests", type=int, default=32, help="mixed requests per concurrency")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--steady-batch", type=int, default=32, help="steady decode: sequences")
    parser.add_argument(
        "--steady-tokens", type=int, default=128, help="steady decode: prompt and output tokens"
    )
    parser.add_argument(
        "--baseline-requests",
        type=int,
        default=8,
        help="requests served one at a time by transformers (scaled to tokens/s)",
    )
    args = parser.parse_args()

    path = default_model_dir()
    prompts = mixed_prompts(args.requests)
    config = stoic.EngineConfig(model=str(path), dtype=args.dtype)
    rows: list[Row] = []
    async with stoic.Engine.start(config) as engine:
        dtype = engine.loaded.dtype if engine.loaded else None
        await stoic_mixed(engine, prompts[:4], 4, 8)  # warm-up
        for concurrency in (1, 8, 32):
            work = prompts if concurrency > 1 else prompts[: max(4, args.requests // 4)]
            work = tag_prompts(work, f"[c={concurrency}] ")
            rows.append(await stoic_mixed(engine, work, concurrency, args.max_tokens))
        steady = (args.steady_batch, args.steady_tokens, args.steady_tokens)
        rows.append(await stoic_steady(engine, *steady))
        stats = engine.stats()
    ref = load_model(str(path), dtype=args.dtype)
    rows.insert(
        0,
        hf_one_at_a_time(
            ref.model,
            ref.tokenizer,
            tag_prompts(prompts[: args.baseline_requests], "[c=1] "),
            args.max_tokens,
        ),
    )
    rows.append(torch_decode_loop(ref.model, *steady))

    print(
        f"\nmachine: {platform.machine()}, {torch.get_num_threads()} torch threads; "
        f"torch {torch.__version__}; dtype {dtype}; max batch seen {stats.max_batch_size}\n"
    )
    print(table(rows))
    base = rows[0].tokens_per_s
    mixed32 = next(
        r for r in rows if r.system == "stoic" and r.concurrency == 32 and r.workload == "mixed"
    )
    mixed1 = next(r for r in rows if r.system == "stoic" and r.concurrency == 1)
    decode = next(r for r in rows if r.system == "stoic" and r.workload == "steady decode")
    ceiling = rows[-1].tokens_per_s
    print()
    print(f"mixed c=32 vs one-at-a-time generate: {mixed32.tokens_per_s / base:.2f}x")
    print(f"mixed c=1 vs one-at-a-time generate:  {mixed1.tokens_per_s / base:.2f}x")
    print(f"steady decode vs torch loop ceiling:  {decode.tokens_per_s / ceiling:.2%}")


if __name__ == "__main__":
    asyncio.run(main())
