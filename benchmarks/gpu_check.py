"""GPU check of the process executor: a real CUDA out-of-memory error and a real device-side
assert, each followed by the worker being replaced and the next request served.

    python benchmarks/gpu_check.py [--model default] [--memory-limit-mib 640]

1. **CUDA OOM.** The worker's CUDA allocator is capped (``STOIC_WORKER_CUDA_MEMORY_LIMIT_MIB``, a
   test hook read by the worker process) and a prompt whose prefill cannot fit is submitted in
   one step: it must fail with ``ExecutorFailed(kind="oom", retryable=False)``, the worker must
   survive (same pid: an OOM does not poison the context), and a short request must then be
   served.
2. **Device-side assert.** The ``device_assert`` fault indexes a CUDA tensor out of range inside
   the step: the context is poisoned ("device-side assert triggered"), the failure is classified
   ``fatal``, the worker is killed and replaced (a new pid), and the next request is served with
   the same greedy text as before.

It prints a table (what happened, seconds to recover) and exits non-zero if a check fails; with
no CUDA device it says so and exits 0 without checking anything.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import torch

import stoic
from stoic.errors import ExecutorFailed


async def _served_again(engine: stoic.Engine, params: stoic.SamplingParams) -> tuple[str, float]:
    started = time.perf_counter()
    # submitted at once: a request that arrives during the restart waits for it
    result = await engine.complete("The capital of France is", params)
    return result.text, time.perf_counter() - started


async def main(args: argparse.Namespace) -> int:
    os.environ["STOIC_WORKER_CUDA_MEMORY_LIMIT_MIB"] = str(args.memory_limit_mib)
    config = stoic.EngineConfig(
        model=args.model,
        device="cuda",
        executor="process",
        enable_fault_injection=True,
        num_kv_blocks=args.kv_blocks,
        max_num_batched_tokens=args.prefill_tokens,
        max_num_seqs=64,
    )
    greedy = stoic.SamplingParams(max_tokens=16, temperature=0)
    rows: list[tuple[str, str, float]] = []
    ok = True
    async with stoic.Engine.start(config) as engine:
        before, _ = await _served_again(engine, greedy)
        pid = engine.stats().executor_pid

        # 1. a real CUDA OOM: one prefill step far beyond the capped allocator
        long_prompt = list(range(100, 100 + args.prefill_tokens - 1))
        try:
            await engine.complete(long_prompt, stoic.SamplingParams(max_tokens=1))
            rows.append(("cuda oom", "NOT RAISED", 0.0))
            ok = False
        except ExecutorFailed as exc:
            text, seconds = await _served_again(engine, greedy)
            same = engine.stats().executor_pid == pid
            good = exc.kind == "oom" and not exc.retryable and text == before and same
            ok &= good
            outcome = f"kind={exc.kind} retryable={exc.retryable} same pid={same}"
            rows.append(("cuda oom", outcome, seconds))

        # 2. a real device-side assert: the worker's context is poisoned and must be replaced
        pid = engine.stats().executor_pid
        await engine.inject_fault(stoic.FaultSpec(kind="device_assert", after_steps=1))
        try:
            await engine.complete("Hello", greedy)
            rows.append(("device-side assert", "NOT RAISED", 0.0))
            ok = False
        except ExecutorFailed as exc:
            text, seconds = await _served_again(engine, greedy)
            new_pid = engine.stats().executor_pid
            good = exc.kind == "fatal" and new_pid != pid and text == before
            ok &= good
            outcome = f"kind={exc.kind} new pid={new_pid != pid}"
            rows.append(("device-side assert", outcome, seconds))
    print("| check | outcome | error -> served again (s) |")
    print("| --- | --- | ---: |")
    for name, outcome, seconds in rows:
        print(f"| {name} | {outcome} | {seconds:.2f} |")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument(
        "--memory-limit-mib",
        type=int,
        default=640,
        help="the worker's CUDA allocator cap: the weights and KV fit, a long prefill does not",
    )
    parser.add_argument("--kv-blocks", type=int, default=512)
    parser.add_argument("--prefill-tokens", type=int, default=8192)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing checked")
        sys.exit(0)
    sys.exit(asyncio.run(main(args)))
