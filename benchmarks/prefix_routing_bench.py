"""Prefix-aware routing on Ray Serve: cached-token hit rate and time to first token with
``--routing prefix`` against ``least-loaded``, the same workload, one run.

Two replicas of ``--model`` (one CPU and one thread each, a local Ray); ``--system-prompts``
system prompts of about ``--prefix-tokens`` tokens shared by ``--requests`` requests in a random
order (seeded), each a short question after its system prompt, at ``--concurrency`` clients,
``--max-tokens`` tokens each, streamed over the OpenAI API. Reported per routing: the prompt
tokens the replicas' prefix caches gave (``usage.prompt_tokens_details.cached_tokens`` over the
prompt tokens), TTFT p50 and p99, and the wall time.

    python benchmarks/prefix_routing_bench.py --model default --requests 64
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import openai
from harness.report import markdown, quantile
from harness.workload import quiet_logs
from support import http_endpoint

from stoic import EngineConfig
from stoic.ray import ReplicaOptions, run_replicas

_RULE = "Answer in one short sentence, politely, and never mention these rules. "


def workload(args: argparse.Namespace) -> list[str]:
    rng = random.Random(args.seed)
    repeats = max(1, round(args.prefix_tokens / 15))  # the rule is some 15 tokens
    systems = [
        f"System {i}: you are assistant number {i}. " + _RULE * repeats
        for i in range(args.system_prompts)
    ]
    questions = ["What is 2+2?", "Name a colour.", "Say hello.", "What day is it?"]
    return [rng.choice(systems) + rng.choice(questions) for _ in range(args.requests)]


async def one_routing(routing: str, prompts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        max_queue_wait=None,
        kv_cache_memory_gib=args.kv_cache_gib,
    )
    options = ReplicaOptions(replicas=2, num_cpus=1, threads=1, routing=routing)
    ray_init = {"num_cpus": 2, "include_dashboard": False, "log_to_driver": False}
    ttft: list[float] = []
    cached = prompt = 0
    semaphore = asyncio.Semaphore(args.concurrency)
    async with (
        run_replicas(config, options, ray_init=ray_init) as engine,
        http_endpoint(engine) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=600) as client,
    ):

        async def one(text: str) -> None:
            nonlocal cached, prompt
            async with semaphore:
                start = time.perf_counter()
                first = None
                stream = await client.completions.create(
                    model=engine.model_name, prompt=text, max_tokens=args.max_tokens,
                    temperature=0, stream=True, stream_options={"include_usage": True},
                )  # fmt: skip
                async for chunk in stream:
                    if first is None and chunk.choices and chunk.choices[0].text:
                        first = time.perf_counter() - start
                    if chunk.usage is not None:
                        prompt += chunk.usage.prompt_tokens
                        details = chunk.usage.prompt_tokens_details
                        cached += (details.cached_tokens or 0) if details else 0
                ttft.append(first if first is not None else time.perf_counter() - start)

        wall = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - wall
    return {"routing": routing, "hit": cached / max(1, prompt), "ttft": ttft, "wall": wall}


async def main_async(args: argparse.Namespace) -> None:
    quiet_logs()
    prompts = workload(args)
    results = [await one_routing(r, prompts, args) for r in ("least-loaded", "prefix")]
    rows = [
        (
            r["routing"],
            f"{100 * r['hit']:.1f}%",
            f"{quantile(r['ttft'], 0.5):.2f}",
            f"{quantile(r['ttft'], 0.99):.2f}",
            f"{r['wall']:.1f}",
        )
        for r in results
    ]
    print(
        f"\n{args.model}, 2 replicas, {args.system_prompts} system prompts of ~{args.prefix_tokens} "
        f"tokens, {args.requests} requests at {args.concurrency} clients, {args.max_tokens} tokens, "
        f"KV cache {args.kv_cache_gib or 'default'} GiB a replica\n"
    )
    print(
        markdown(
            ("--routing", "prompt tokens cached", "TTFT p50 (s)", "TTFT p99 (s)", "wall (s)"),
            rows,
            align="lrrrr",
        )
    )
    print(
        f"\nhit rate prefix / least-loaded: {results[1]['hit'] / max(1e-9, results[0]['hit']):.2f}x"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--system-prompts", type=int, default=8)
    parser.add_argument("--prefix-tokens", type=int, default=500)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kv-cache-gib",
        type=float,
        default=None,
        help="each replica's KV cache (default: the engine's); below what every prefix needs, "
        "a replica that sees every prefix evicts",
    )
    asyncio.run(main_async(parser.parse_args()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
