"""One in-process measurement (the torch loop, transformers ``generate`` or stoic's ``Engine``)
in a fresh process: ``serving_bench.py --worker KIND --spec JSON``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import harness.workload as eb
from harness.servers import BLOCK_SIZE, MAX_BATCHED_TOKENS, MAX_NUM_SEQS, NUM_KV_BLOCKS


def worker_main(kind: str, spec: dict[str, Any]) -> None:
    """A measurement in this fresh process; prints ``RESULT <row as JSON>``.

    Every in-process torch measurement runs in its own process, its torch work on one thread:
    with libgomp (torch's CPU build), a second thread calling torch creates a second OpenMP team,
    and once there are more OpenMP threads than cores libgomp stops spin-waiting: the same
    ``generate`` loop measured 42 tokens/s before and 27 after one call from another thread here.
    """
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    variants: dict[str, float] = {}
    row: eb.Row
    if kind in ("loop", "generate"):
        from stoic.model import load_model

        ref = load_model(spec["model"], dtype=spec["dtype"])
        if kind == "loop":
            # the model's default attention (SDPA) and eager: the faster is the ceiling
            rows = {}
            for impl in ("sdpa", "eager"):
                ref.model.set_attn_implementation(impl)
                eb.torch_decode_loop(ref.model, 4, 16, 4)  # warm-up
                rows[impl] = eb.torch_decode_loop(
                    ref.model, spec["batch"], spec["prompt_len"], spec["new_tokens"]
                )
                variants[impl] = rows[impl].tokens_per_s
            row = max(rows.values(), key=lambda r: r.tokens_per_s)
        else:
            prompts = eb.mixed_prompts(spec["n"])
            eb.hf_one_at_a_time(ref.model, ref.tokenizer, prompts[:2], 4)  # warm-up
            row = eb.hf_one_at_a_time(ref.model, ref.tokenizer, prompts, spec["max_tokens"])
    else:
        row = asyncio.run(engine_worker(kind, spec))
    fields = ("system", "workload", "concurrency", "requests", "output_tokens", "seconds")
    out = {f: getattr(row, f) for f in (*fields, "ttft_p50", "ttft_p90")}
    print("RESULT " + json.dumps({**out, "variants": variants}), flush=True)


async def engine_worker(kind: str, spec: dict[str, Any]) -> eb.Row:
    import stoic

    config = stoic.EngineConfig(
        model=spec["model"],
        dtype="bfloat16",
        block_size=BLOCK_SIZE,
        num_kv_blocks=NUM_KV_BLOCKS,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        max_num_seqs=MAX_NUM_SEQS,
    )
    async with stoic.Engine.start(config) as engine:
        await eb.stoic_mixed(engine, eb.mixed_prompts(4, seed=99), 4, 8)  # warm-up
        if kind == "engine_c1":
            prompts = eb.mixed_prompts(spec["n"])
            row = await eb.stoic_mixed(engine, prompts, 1, spec["max_tokens"])
        else:
            row = await eb.stoic_steady(engine, 32, 128, 128)
    row.system = "stoic (Python API)"
    return row
