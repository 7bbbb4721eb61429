"""Engine benchmark: stoic through the Python API next to transformers on the same requests.

Two workloads, measured in one run so machine noise hits all systems alike:

* **mixed**: a seeded prompt set of mixed lengths (chat-templated), ``max_tokens`` 64, at
  concurrency 1, 8 and 32; reports output tokens/s and time to first token, next to transformers
  ``generate`` serving the same requests one at a time (the baseline).
* **steady decode**: 32 sequences with equal ~128-token prompts and 128 output tokens each (EOS
  ignored); stoic's decode tokens/s once all 32 are decoding, next to a plain batched torch decode
  loop with a KV cache at batch 32 (the ceiling).

Usage: ``python benchmarks/engine_bench.py [--dtype auto|float32|bfloat16] [--requests 32]``
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

import stoic
from stoic.model import load_model
from stoic.model._loader import resolve_model_path

WORDS = [
    "river",
    "mountain",
    "lantern",
    "copper",
    "orbit",
    "maple",
    "quiet",
    "storm",
    "garden",
    "engine",
    "harbor",
    "violet",
    "signal",
    "marble",
    "thunder",
    "pocket",
    "window",
    "meadow",
    "silver",
    "compass",
]


@dataclass
class Row:
    system: str
    workload: str
    concurrency: int
    requests: int
    output_tokens: int
    seconds: float
    ttft_p50: float | None = None
    ttft_p90: float | None = None
    #: each request's time to first token, in request order (closed loop: the first
    #: ``concurrency`` were sent together)
    ttfts: tuple[float, ...] = ()

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0


def mixed_prompts(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = rng.choice([8, 24, 64, 160, 320])
        text = " ".join(rng.choice(WORDS) for _ in range(words))
        out.append([{"role": "user", "content": f"({i}) Summarise these words: {text}"}])
    return out


def tag_prompts(prompts: Sequence[Any], tag: str) -> list[Any]:
    """``prompts`` with ``tag`` in front of each user message.

    Give every measured pass its own tag, so that a prefix cache cannot reuse an earlier pass's
    prompts: it can share only what the requests of one pass have in common (the chat template's
    system prompt), as it would in production.
    """
    return [
        [{**m, "content": tag + m["content"]} if m["role"] == "user" else m for m in p]
        for p in prompts
    ]


async def stoic_mixed(engine: Any, prompts: list[Any], concurrency: int, max_tokens: int) -> Row:
    params = stoic.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    semaphore = asyncio.Semaphore(concurrency)
    by_index: dict[int, float] = {}
    tokens = 0

    async def one(index: int, messages: Any) -> None:
        nonlocal tokens
        async with semaphore:
            start = time.perf_counter()
            async for delta in engine.chat(messages, params):
                if index not in by_index and delta.token_ids:
                    by_index[index] = time.perf_counter() - start
                if delta.finish_reason is not None:
                    tokens += delta.completion_tokens

    start = time.perf_counter()
    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    seconds = time.perf_counter() - start
    ttfts = [by_index[i] for i in sorted(by_index)]
    q = statistics.quantiles(ttfts, n=10) if len(ttfts) > 1 else [ttfts[0]] * 9
    return Row(
        "stoic",
        "mixed",
        concurrency,
        len(prompts),
        tokens,
        seconds,
        statistics.median(ttfts),
        q[8],
        tuple(ttfts),
    )


def hf_one_at_a_time(model: Any, tokenizer: Any, prompts: list[Any], max_tokens: int) -> Row:
    tokens = 0
    ttfts = []
    start = time.perf_counter()
    with torch.inference_mode():
        for messages in prompts:
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            ids = tokenizer.encode(text, add_special_tokens=False, return_tensors="pt")
            t0 = time.perf_counter()
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
            )
            # time to first token of one-at-a-time serving = queueing + prefill; approximated by
            # the request's start offset plus its share of the generation
            ttfts.append(t0 - start + (time.perf_counter() - t0) / max_tokens)
            tokens += out.shape[1] - ids.shape[1]
    seconds = time.perf_counter() - start
    q = statistics.quantiles(ttfts, n=10)
    return Row(
        "transformers generate (one at a time)",
        "mixed",
        1,
        len(prompts),
        tokens,
        seconds,
        statistics.median(ttfts),
        q[8],
    )


def torch_decode_loop(model: Any, batch: int, prompt_len: int, new_tokens: int) -> Row:
    """Plain batched decode with transformers' DynamicCache: the ceiling for steady decode."""
    from transformers import DynamicCache

    ids = torch.randint(100, 40000, (batch, prompt_len))
    with torch.inference_mode():
        cache = DynamicCache()
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        start = time.perf_counter()
        for _ in range(new_tokens - 1):
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        seconds = time.perf_counter() - start
    return Row(
        "torch decode loop (ceiling)",
        "steady decode",
        batch,
        batch,
        batch * (new_tokens - 1),
        seconds,
    )


async def stoic_steady(engine: Any, batch: int, prompt_len: int, new_tokens: int) -> Row:
    """Decode tokens/s once all sequences are decoding (prefill excluded)."""
    rng = random.Random(1)
    params = stoic.SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    streams = [
        await engine.submit([rng.randrange(100, 40000) for _ in range(prompt_len)], params)
        for _ in range(batch)
    ]
    firsts = await asyncio.gather(*(s.__anext__() for s in streams))
    start = time.perf_counter()
    base = sum(d.completion_tokens for d in firsts)

    async def drain(s: Any) -> int:
        n = 0
        async for d in s:
            n = d.completion_tokens
        return n

    total = sum(await asyncio.gather(*(drain(s) for s in streams)))
    seconds = time.perf_counter() - start
    return Row("stoic", "steady decode", batch, batch, total - base, seconds)


def table(rows: list[Row]) -> str:
    lines = [
        "| system | workload | concurrency | requests | output tokens | seconds | tokens/s | TTFT p50 (s) | TTFT p90 (s) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        p50 = f"{r.ttft_p50:.3f}" if r.ttft_p50 is not None else "-"
        p90 = f"{r.ttft_p90:.3f}" if r.ttft_p90 is not None else "-"
        lines.append(
            f"| {r.system} | {r.workload} | {r.concurrency} | {r.requests} | {r.output_tokens} | "
            f"{r.seconds:.2f} | {r.tokens_per_s:.1f} | {p50} | {p90} |"
        )
    return "\n".join(lines)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--requests", type=int, default=32, help="mixed requests per concurrency")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--baseline-requests",
        type=int,
        default=8,
        help="requests served one at a time by transformers (scaled to tokens/s)",
    )
    args = parser.parse_args()

    _, path = resolve_model_path("default")
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
        rows.append(await stoic_steady(engine, 32, 128, 128))
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
    rows.append(torch_decode_loop(ref.model, 32, 128, 128))

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
    steady = next(r for r in rows if r.system == "stoic" and r.workload == "steady decode")
    ceiling = rows[-1].tokens_per_s
    print()
    print(f"mixed c=32 vs one-at-a-time generate: {mixed32.tokens_per_s / base:.2f}x")
    print(f"mixed c=1 vs one-at-a-time generate:  {mixed1.tokens_per_s / base:.2f}x")
    print(f"steady decode vs torch loop ceiling:  {steady.tokens_per_s / ceiling:.2%}")


if __name__ == "__main__":
    asyncio.run(main())
