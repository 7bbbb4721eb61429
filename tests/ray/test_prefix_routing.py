"""``--routing prefix``: requests that share a prompt prefix go to the replica that holds it, a
popular prefix spreads before it overloads one replica, and the ranking is stable."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest
import pytest_asyncio
from support import http_endpoint

from stoic import EngineConfig
from stoic.ray import ReplicaOptions, run_replicas
from stoic.ray._routing import prefix_key, rank
from stoic.request import Request

REPLICAS = [f"replica-{i}" for i in range(4)]


def test_the_same_prefix_prefers_the_same_replica_and_keys_spread() -> None:
    """A prompt's key depends on its first KiB only; equal keys rank the replicas the same way;
    many keys spread over every replica; removing a replica moves only the keys it won."""
    long = "You are a careful assistant. " * 60
    a = prefix_key(Request(prompt=long + "What is 2+2?"))
    b = prefix_key(Request(prompt=long + "Name a colour."))
    assert a == b and a != prefix_key(Request(prompt="Another system prompt. " * 60))
    chat = [{"role": "system", "content": long}, {"role": "user", "content": "hi"}]
    assert prefix_key(Request(messages=chat)) == prefix_key(Request(messages=list(chat)))
    assert rank(a, REPLICAS, {}) == rank(a, list(reversed(REPLICAS)), {})
    keys = [prefix_key(Request(prompt=f"document {i} " * 10)) for i in range(200)]
    firsts = [rank(k, REPLICAS, {})[0] for k in keys]
    assert {r: firsts.count(r) for r in REPLICAS} == pytest.approx(
        dict.fromkeys(REPLICAS, 50), abs=25
    )
    fewer = REPLICAS[:3]
    for key, first in zip(keys, firsts, strict=True):
        if first != REPLICAS[3]:
            assert rank(key, fewer, {})[0] == first


def test_a_loaded_replica_goes_behind_the_others() -> None:
    """The preferred replica above (1 + epsilon) x (mean + 1) ongoing requests is tried last; a
    little busier than the rest, within the bound, it stays first."""
    key = prefix_key(Request(prompt="a popular system prompt " * 40))
    first, *rest = rank(key, REPLICAS, {})
    busy = {first: 9}  # mean 2.25: bound 1.25 x 3.25 = 4.06
    assert rank(key, REPLICAS, busy) == [*rest, first]
    even = {**dict.fromkeys(REPLICAS, 3), first: 5}  # mean 3.5: bound 5.6
    assert rank(key, REPLICAS, even)[0] == first


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def endpoint(tiny_model_dir: Path) -> AsyncIterator[str]:
    """Two replicas of the tiny model routed by prefix, behind stoic's HTTP app: its URL."""
    config = EngineConfig(
        model=str(tiny_model_dir),
        served_model_name="tiny",
        device="cpu",
        dtype="float32",
        num_kv_blocks=256,
        max_model_len=1024,
    )
    options = ReplicaOptions(replicas=2, num_cpus=1, threads=1, routing="prefix")
    ray_init = {"num_cpus": 2, "include_dashboard": False, "log_to_driver": False}
    async with (
        run_replicas(config, options, ray_init=ray_init) as engine,
        http_endpoint(engine) as url,
    ):
        yield url


@pytest.mark.asyncio(loop_scope="module")
async def test_requests_sharing_a_prefix_find_it_cached(endpoint: str) -> None:
    """Four long system prompts, three questions each, sent one at a time: every repeat of a
    prefix lands where its first request computed it and finds its whole prefix in that
    replica's cache (by load alone, each repeat has an even chance of the other replica)."""
    prefixes = [
        f"System prompt {i}: " + f"rule {i} applies to every answer. " * 40 for i in range(4)
    ]
    async with openai.AsyncOpenAI(
        base_url=f"{endpoint}/v1", api_key="unused", max_retries=0, timeout=120
    ) as client:
        cached: dict[int, list[int]] = {i: [] for i in range(4)}
        for question in ("What is 2+2?", "Name a colour.", "Say hello."):
            for i, prefix in enumerate(prefixes):
                done = await client.completions.create(
                    model="tiny", prompt=prefix + question, max_tokens=2, temperature=0
                )
                details = done.usage.prompt_tokens_details if done.usage else None
                cached[i].append((details.cached_tokens or 0) if details else 0)
                await asyncio.sleep(0)
    for hits in cached.values():
        assert hits[0] == 0 and min(hits[1:]) >= 200, cached
