"""Workloads every benchmark draws on: the seeded mixed chat prompts, a pass's prompt tags, the
fixed prompt list of the recovery and soak runs, and the in-process measurements (stoic's
``Engine``, transformers ``generate`` one request at a time, the bare batched torch decode loop)
with the row they report."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import stoic

from .report import quantile

#: twenty short, different chat prompts (the recovery and soak runs cycle through them)
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
    return Row(
        "stoic",
        "mixed",
        concurrency,
        len(prompts),
        tokens,
        seconds,
        quantile(ttfts, 0.5),
        quantile(ttfts, 0.9),
        tuple(ttfts),
    )


def hf_one_at_a_time(model: Any, tokenizer: Any, prompts: list[Any], max_tokens: int) -> Row:
    """transformers ``generate`` serving ``prompts`` one at a time (the baseline at c=1)."""
    import torch

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
    return Row(
        "transformers generate (one at a time)",
        "mixed",
        1,
        len(prompts),
        tokens,
        seconds,
        quantile(ttfts, 0.5),
        quantile(ttfts, 0.9),
    )


def torch_decode_loop(model: Any, batch: int, prompt_len: int, new_tokens: int) -> Row:
    """Plain batched decode with transformers' DynamicCache: the ceiling for steady decode."""
    import torch
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


def quiet_logs(level: int = logging.WARNING) -> None:
    """Keep stoic's log events below ``level`` out of a benchmark's output."""
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(level))


def default_model_dir() -> Path:
    """The default model as a model directory (its GGUF file de-quantised once, cached)."""
    from stoic.model.testing import dequantized_model_dir

    return dequantized_model_dir()


async def wait_idle(engine: stoic.Engine, limit: float = 60.0) -> stoic.EngineStats:
    """Wait (at most ``limit`` s) until no sequence runs or waits, then one message hop more
    (blocks are freed just behind a stream's end); the stats then, leaked blocks included."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats.running == 0 and stats.waiting == 0:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)
    return engine.stats()
