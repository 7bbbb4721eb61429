"""``recovery="resume"``: streams that survive executor failures with exactly their fault-free
text, a spent resume budget, a poison request isolated, the out-of-memory back-off.

float32 throughout: resumed text must equal the fault-free text token for token.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from support import collect, engine_config, wait_idle, wait_restarts

import stoic
from stoic.errors import ExecutorFailed

pytestmark = [pytest.mark.model, pytest.mark.asyncio]

TOKENS = 24


def _config(model_dir: Path, **overrides: Any) -> stoic.EngineConfig:
    return engine_config(model_dir, **{"recovery": "resume", **overrides})


def _requests() -> list[tuple[str, stoic.SamplingParams]]:
    """16 greedy and 4 seeded requests."""
    topics = ["the sea", "a cat", "winter", "bread", "a robot", "the moon", "tea", "trains"]
    greedy = stoic.SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    out = [(f"Write one sentence about {topics[i % 8]} (#{i}).", greedy) for i in range(16)]
    for i in range(4):
        seeded = stoic.SamplingParams(
            max_tokens=TOKENS, temperature=0.9, top_p=0.95, seed=100 + i, ignore_eos=True
        )
        out.append((f"Tell a short story about {topics[i]}.", seeded))
    return out


async def _fault_free(engine: stoic.Engine, requests: list[Any]) -> list[str]:
    results = await asyncio.gather(*(engine.complete(p, params) for p, params in requests))
    return [r.text for r in results]


async def _complete(engine: stoic.Engine, prompt: str, params: stoic.SamplingParams) -> Any:
    """A non-streaming request, as ``(result, None)`` or ``(None, error)``."""
    try:
        return await engine.complete(prompt, params), None
    except stoic.errors.StoicError as exc:
        return None, exc


async def _three_failures(engine: stoic.Engine, requests: list[Any], kinds: list[str]) -> list[Any]:
    """Submit every request (the first ten streamed, the rest not), then inject one fault of
    each kind in turn while they generate."""
    readers = [
        asyncio.ensure_future(collect(await engine.submit(p, params)))
        if i < 10
        else asyncio.ensure_future(_complete(engine, p, params))
        for i, (p, params) in enumerate(requests)
    ]
    for n, kind in enumerate(kinds, start=1):
        await engine.inject_fault(stoic.FaultSpec(kind=kind, after_steps=3))  # type: ignore[arg-type]
        await wait_restarts(engine, n, limit=30.0)
    return await asyncio.wait_for(asyncio.gather(*readers), 120)


@pytest.mark.parametrize(
    ("executor", "kinds"),
    [("thread", ["error", "oom", "error"]), ("process", ["error", "oom", "crash"])],
)
async def test_streams_resume_with_exactly_their_fault_free_text(
    default_model_dir: Path, executor: str, kinds: list[str]
) -> None:
    """16 greedy and 4 seeded streams through three executor failures of three kinds (a kill -9
    of the worker with the process executor): every stream completes with exactly its fault-free
    text and no error; a non-streamed one returns normally, its usage counting the original
    prompt and every token once; every KV block is free after."""
    requests = _requests()
    async with stoic.Engine.start(_config(default_model_dir, executor=executor)) as engine:
        baseline = await asyncio.gather(*(engine.complete(p, params) for p, params in requests))
        outcomes = await _three_failures(engine, requests, kinds)
        for i, (outcome, error) in enumerate(outcomes):
            assert error is None, error
            want = baseline[i]
            if i < 10:
                assert outcome == want.text
            else:
                assert (outcome.text, outcome.finish_reason) == (want.text, "length")
                assert (outcome.prompt_tokens, outcome.completion_tokens) == (
                    want.prompt_tokens,
                    TOKENS,
                )
        stats = await wait_idle(engine, 5.0)
        assert stats.restarts == 3 and stats.failed_sequences == 0
        assert stats.requests_resumed >= 20  # every request was running at the first failure


async def test_a_spent_resume_budget_fails_the_request_with_its_partial(
    tiny_model_dir: Path,
) -> None:
    """With ``max_resumes=1`` the second failure ends a stream as under ``"fail"``: the error
    carries the partial output, a prefix of the fault-free text."""
    params = stoic.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    async with stoic.Engine.start(_config(tiny_model_dir, max_resumes=1)) as engine:
        (want,) = await _fault_free(engine, [("hello there", params)])
        stream = await engine.submit("hello there", params)
        reader = asyncio.ensure_future(collect(stream))
        for n in (1, 2):
            await engine.inject_fault(stoic.FaultSpec(kind="error", after_steps=4))
            await wait_restarts(engine, n, limit=30.0)
        text, error = await asyncio.wait_for(reader, 30)
        assert isinstance(error, ExecutorFailed) and error.partial is not None
        assert want.startswith(error.partial.text) and error.partial.completion_tokens >= 4
        assert want.startswith(text)
        stats = await wait_idle(engine)
        assert stats.resumes_exhausted == 1 and stats.requests_resumed == 1


async def test_a_poison_request_is_isolated_and_the_others_complete(
    default_model_dir: Path,
) -> None:
    """A fault that fires on every step holding one prompt: that request ends alone with the
    error (not retryable); the seven batched with it complete with their fault-free text; the
    engine stays up (within its restart intensity) and every block is free after."""
    params = stoic.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = [f"Name a colour (#{i})." for i in range(7)]
    prompts.insert(3, "Name a colour XYZZY.")
    async with stoic.Engine.start(_config(default_model_dir)) as engine:
        expected = await _fault_free(engine, [(p, params) for p in prompts])
        await engine.inject_fault(stoic.FaultSpec(kind="error", match="XYZZY"))
        streams = [await engine.submit(p, params) for p in prompts]
        outcomes = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 60)
        for prompt, (text, error), want in zip(prompts, outcomes, expected, strict=True):
            if "XYZZY" in prompt:
                assert isinstance(error, ExecutorFailed) and not error.retryable
                assert "isolated" in str(error)
            else:
                assert (text, error) == (want, None)
        stats = await wait_idle(engine)
        assert stats.requests_isolated == 1 and stats.failed_sequences == 1
        assert engine.health().ok
        await engine.clear_faults()
        again = await engine.complete(prompts[3], params)
        assert again.text == expected[3]


async def test_an_oom_halves_the_token_budget_and_clean_steps_restore_it(
    tiny_model_dir: Path,
) -> None:
    """After an out-of-memory failure the step token budget is halved (the gauge shows it), and
    it doubles back to the configured value after clean steps; KV blocks are all free after."""
    # one token a step (no drafts): the budget doubles back after 64 clean steps
    config = _config(tiny_model_dir, max_num_seqs=4, max_num_batched_tokens=64, speculative="off")
    params = stoic.SamplingParams(max_tokens=150, temperature=0, ignore_eos=True)
    async with stoic.Engine.start(config) as engine:
        assert engine.stats().token_budget == 64
        stream = await engine.submit("the quick brown fox", params)
        await engine.inject_fault(stoic.FaultSpec(kind="oom", after_steps=2))
        await wait_restarts(engine, 1, limit=30.0)
        assert engine.stats().token_budget == 32
        text, error = await asyncio.wait_for(collect(stream), 60)
        assert error is None and text
        stats = await wait_idle(engine)
        assert stats.token_budget == 64  # 150 clean steps: doubled back after 64
