"""Prefix caching on the real default model: shared prompt prefixes are computed once, and
reusing them changes no output."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from support import until, wait_idle

import stoic

pytestmark = [pytest.mark.model, pytest.mark.asyncio(loop_scope="module")]

GREEDY = stoic.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
BLOCK = 16


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 20000) for _ in range(n)]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines(default_model_dir: Path) -> AsyncIterator[tuple[stoic.Engine, stoic.Engine]]:
    """The same model with prefix caching (small cache, to exercise eviction) and without."""
    common = {"model": str(default_model_dir), "dtype": "float32", "block_size": BLOCK}
    cached = stoic.EngineConfig(**common, num_kv_blocks=48)  # type: ignore[arg-type]
    plain = stoic.EngineConfig(**common, num_kv_blocks=256, enable_prefix_caching=False)  # type: ignore[arg-type]
    async with stoic.Engine.start(cached) as a, stoic.Engine.start(plain) as b:
        yield a, b


async def _tokens(engine: stoic.Engine, prompt: list[int]) -> tuple[int, ...]:
    return (await engine.complete(prompt, GREEDY)).token_ids


async def test_a_repeated_prefix_is_not_computed_again(
    engines: tuple[stoic.Engine, stoic.Engine],
) -> None:
    """The second request with a 100-token prompt reuses its 6 full blocks (96 tokens; the last
    token is always computed) and both give the tokens of an engine without prefix caching; a
    prompt sharing only the first 40 tokens reuses 2 blocks."""
    cached, plain = engines
    prompt = _ids(1, 100)
    want = await _tokens(plain, prompt)
    before = (await wait_idle(cached)).prefix_cached_tokens
    assert await _tokens(cached, prompt) == want
    first = (await wait_idle(cached)).prefix_cached_tokens
    assert first == before, "a prompt never seen before cannot hit the cache"
    assert await _tokens(cached, prompt) == want
    second = (await wait_idle(cached)).prefix_cached_tokens
    assert second - first == 96
    other = prompt[:40] + _ids(2, 30)
    assert await _tokens(cached, other) == await _tokens(plain, other)
    assert (await wait_idle(cached)).prefix_cached_tokens - second == 32
    assert plain.stats().prefix_cached_tokens == 0 and plain.stats().kv_blocks_cached == 0


@pytest.mark.timeout(600)  # 16 generations of 48 tokens: slow on a loaded CPU
async def test_concurrent_requests_sharing_a_prefix_match_uncached_outputs(
    engines: tuple[stoic.Engine, stoic.Engine],
) -> None:
    """A 64-token prefix (4 full blocks) seen for the first time: the first request over it hits
    nothing and leaves its full blocks cached; a second one, alone, reuses exactly the prefix's
    4 blocks (64 tokens). Then eight concurrent requests over it with different tails, more than
    the cache holds at once (forcing preemptions, and recomputation from cached blocks): every
    output equals the uncached engine's, they hit the cache, and no block stays in use."""
    cached, plain = engines
    prefix = _ids(3, 64)
    prompts = [prefix + _ids(10 + i, 20 + 9 * i) for i in range(8)]
    params = stoic.SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    want = [(await plain.complete(p, params)).token_ids for p in prompts]
    probe = stoic.SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    start = await wait_idle(cached)
    assert (await cached.complete(prompts[0], probe)).token_ids == want[0][:2]
    first = await wait_idle(cached)
    assert first.prefix_cached_tokens == start.prefix_cached_tokens, "a new prefix cannot hit"
    # 84 prompt tokens and 1 generated token computed: 5 full blocks, none cached before
    assert first.kv_blocks_cached - start.kv_blocks_cached == 85 // BLOCK
    assert (await cached.complete(prompts[1], probe)).token_ids == want[1][:2]
    second = await wait_idle(cached)
    assert second.prefix_cached_tokens - first.prefix_cached_tokens == len(prefix)
    got = await asyncio.gather(*(cached.complete(p, params) for p in prompts))
    assert [r.token_ids for r in got] == want
    stats = await wait_idle(cached)
    hits = stats.prefix_cached_tokens - second.prefix_cached_tokens
    assert hits >= len(prefix) and hits % BLOCK == 0, hits
    assert stats.preemptions > second.preemptions


async def test_a_multi_turn_chat_reuses_the_earlier_turns(
    engines: tuple[stoic.Engine, stoic.Engine],
) -> None:
    """The second turn of a chat re-sends the first turn: its blocks come from the cache."""
    cached, _ = engines
    turn = [{"role": "user", "content": "List three rivers of Europe and one fact about each."}]
    params = stoic.SamplingParams(max_tokens=40, temperature=0)
    answer = ""
    async for delta in cached.chat(turn, params):
        answer += delta.text
    before = (await wait_idle(cached)).prefix_cached_tokens
    follow = [*turn, {"role": "assistant", "content": answer}, {"role": "user", "content": "And?"}]
    async for _ in cached.chat(follow, params):
        pass
    assert (await wait_idle(cached)).prefix_cached_tokens - before >= 2 * BLOCK


async def test_recovery_drops_the_prefix_cache(default_model_dir: Path) -> None:
    """An executor failure drops every KV block, the cached ones too: the next request with the
    same prompt computes it all again and still gives the same tokens."""
    config = stoic.EngineConfig(
        model=str(default_model_dir), dtype="float32", enable_fault_injection=True
    )
    prompt = _ids(4, 80)
    async with stoic.Engine.start(config) as engine:
        want = await _tokens(engine, prompt)
        stats = await wait_idle(engine)
        assert stats.kv_blocks_cached >= 5
        await engine.inject_fault(stoic.FaultSpec(kind="error", after_steps=1))
        with pytest.raises(stoic.errors.ExecutorFailed):
            await _tokens(engine, _ids(5, 10))
        await until(lambda: engine.health().state == "serving", 5.0, "serving again")
        assert engine.stats().kv_blocks_cached == 0
        hits = engine.stats().prefix_cached_tokens
        assert await _tokens(engine, prompt) == want
        assert (await wait_idle(engine)).prefix_cached_tokens == hits
