"""What ``--dtype auto``'s bfloat16 products cost in output, against float32: greedy agreement.

    python benchmarks/precision_bench.py [--prompts 32] [--tokens 64]

The model runner alone (no server) on the default model, ``engine_bench.mixed_prompts`` through
the chat template, greedy, EOS ignored. Three precisions: float32 throughout (the reference:
its greedy output equals transformers' ``generate``), float32 activations with bfloat16 dense
products (what ``--dtype auto`` gives a GGUF Llama model on a CPU with AMX), and a bfloat16
model. Each runs the prompts one at a time (decode on the C layers where they apply) and all
together (decode steps of every sequence at once: the dense path above
``DENSE_KERNEL_ROWS``). Reported: prompts whose tokens equal float32's, and the mean share of
tokens before the first difference.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_bench as eb

from stoic.model import (
    ModelRunner,
    PagedKVCache,
    SamplingParams,
    SeqChunk,
    StepBatch,
    apply_chat_template,
    load_model,
)

BLOCK = 16
PRECISIONS = {
    "float32": {"dtype": "float32"},
    "float32 + bfloat16 dense (auto on AMX)": {"dtype": "float32", "dense_dtype": "bfloat16"},
    "bfloat16": {"dtype": "bfloat16"},
}


def greedy(runner: ModelRunner, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Greedy continuations of ``prompts``, all decoded together."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    per_seq = -(-(max(map(len, prompts)) + tokens + 1) // BLOCK)
    cache = PagedKVCache(runner.kv_spec(num_blocks=len(prompts) * per_seq, block_size=BLOCK))
    cache.zero_blocks(tuple(range(len(prompts) * per_seq)))
    tables = [tuple(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    out: list[list[int]] = [[] for _ in prompts]
    for i, p in enumerate(prompts):  # prefill one prompt a step, as the scheduler would
        done = runner.execute(
            StepBatch((SeqChunk(i, tuple(p), 0, tables[i], True, params),)), cache
        )
        out[i].append(done.sampled[i].token_id)
    for n in range(1, tokens):
        chunks = tuple(
            SeqChunk(i, (out[i][-1],), len(p) + n - 1, tables[i], True, params, num_generated=n)
            for i, p in enumerate(prompts)
        )
        done = runner.execute(StepBatch(chunks), cache)
        for i in range(len(prompts)):
            out[i].append(done.sampled[i].token_id)
    return out


def agreement(got: list[list[int]], want: list[list[int]]) -> tuple[int, float]:
    """(outputs equal to the reference, mean share of tokens before the first difference)."""
    shares = []
    for g, w in zip(got, want, strict=True):
        same = next((k for k, (a, b) in enumerate(zip(g, w, strict=True)) if a != b), len(w))
        shares.append(same / len(w))
    return sum(s == 1.0 for s in shares), statistics.mean(shares)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    rows: list[tuple[str, str, Any]] = []
    reference: dict[str, list[list[int]]] = {}
    for name, kwargs in PRECISIONS.items():
        loaded = load_model("default", device="cpu", **kwargs)
        runner = ModelRunner(loaded)
        prompts = [
            list(apply_chat_template(loaded.tokenizer, m, add_generation_prompt=True))
            for m in eb.mixed_prompts(args.prompts)
        ]
        for mode in ("one at a time", "all together"):
            started = time.perf_counter()
            if mode == "one at a time":
                outs = [greedy(runner, [p], args.tokens)[0] for p in prompts]
            else:
                outs = greedy(runner, prompts, args.tokens)
            seconds = time.perf_counter() - started
            if name == "float32":
                reference[mode] = outs
            equal, share = agreement(outs, reference[mode])
            rows.append((name, mode, (equal, share, seconds)))
            print(
                f"{name:40s} {mode:14s} equal {equal}/{len(prompts)} prefix {share:.1%}", flush=True
            )
    print(f"\n{args.prompts} prompts, {args.tokens} greedy tokens each, against float32:\n")
    print(
        "| precision | decoded | outputs equal to float32 | tokens before the first difference | seconds |"
    )
    print("|---|---|---:|---:|---:|")
    for name, mode, (equal, share, seconds) in rows:
        print(f"| {name} | {mode} | {equal}/{args.prompts} | {share:.1%} | {seconds:.1f} |")


if __name__ == "__main__":
    main()
