"""Executor faults mid chunked prefill, and prompts at the context limit (float32, the real
default model)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from support import collect, engine_config, wait_idle, wait_restarts

import stoic
from stoic.errors import ContextLengthExceeded, ExecutorFailed

pytestmark = [pytest.mark.model, pytest.mark.asyncio]

#: several hundred tokens: with a 64-token step budget, a prefill of several chunks
LONG_PROMPT = "Here is a list of facts about rivers, mountains and old towns. " + " ".join(
    f"Fact {i}: the river number {i} flows past the mountain called peak {i}." for i in range(16)
)


async def test_an_oom_mid_chunked_prefill_fails_the_request_not_retryable(
    default_model_dir: Path,
) -> None:
    """``recovery="fail"``: an OOM while the only request is still in its chunked prefill ends it
    with ExecutorFailed(kind="oom"), not retryable (it caused the OOM), nothing generated."""
    config = engine_config(default_model_dir, recovery="fail", max_num_batched_tokens=64)
    params = stoic.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    async with stoic.Engine.start(config) as engine:
        stream = await engine.submit(LONG_PROMPT, params)
        assert stream.prompt_tokens >= 4 * 64  # at least four chunks: the fault lands in them
        await engine.inject_fault(stoic.FaultSpec(kind="oom", after_steps=2))
        text, error = await asyncio.wait_for(collect(stream), 300)
        assert text == ""
        assert isinstance(error, ExecutorFailed), error
        assert error.kind == "oom"
        assert error.retryable is False
        assert error.partial is not None
        assert (error.partial.text, error.partial.completion_tokens) == ("", 0)
        await wait_idle(engine, 60.0)


@pytest.mark.timeout(900)
async def test_an_oom_mid_chunked_prefill_resumes_with_the_fault_free_text(
    default_model_dir: Path,
) -> None:
    """``recovery="resume"``: the same OOM mid prefill; the request completes with exactly its
    fault-free text, and the step token budget was halved (64 -> 32)."""
    config = engine_config(default_model_dir, recovery="resume", max_num_batched_tokens=64)
    params = stoic.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    async with stoic.Engine.start(config) as engine:
        want = (await engine.complete(LONG_PROMPT, params)).text
        await wait_idle(engine, 60.0)
        assert engine.stats().token_budget == 64
        stream = await engine.submit(LONG_PROMPT, params)
        assert stream.prompt_tokens >= 4 * 64
        await engine.inject_fault(stoic.FaultSpec(kind="oom", after_steps=2))
        reader = asyncio.ensure_future(collect(stream))
        await wait_restarts(engine, 1, limit=120.0)
        # restored only after 64 clean steps: the request has far fewer left
        assert engine.stats().token_budget == 32
        text, error = await asyncio.wait_for(reader, 300)
        assert (text, error) == (want, None)
        stats = await wait_idle(engine, 60.0)
        assert stats.restarts == 1 and stats.restarts_by_kind == (("oom", 1),)
        assert stats.requests_resumed == 1 and stats.failed_sequences == 0


MAX_LEN = 64


def _ids(tokenizer: Any, n: int) -> list[int]:
    ids: list[int] = tokenizer.encode(LONG_PROMPT, add_special_tokens=False)[:n]
    assert len(ids) == n
    return ids


async def test_prompts_at_the_context_limit_match_generate_and_one_more_is_refused(
    default_model_dir: Path,
) -> None:
    """``max_model_len=64``: a 63-token prompt with 1 new token, and a 60-token one with 4, give
    transformers' greedy ``generate`` tokens; one token more of either is ContextLengthExceeded
    at submit."""
    import torch

    from stoic.model import load_model

    loaded = load_model(str(default_model_dir), dtype="float32", device="cpu")
    cases = [(_ids(loaded.tokenizer, 63), 1), (_ids(loaded.tokenizer, 60), 4)]
    reference = []
    with torch.inference_mode():
        for ids, new in cases:
            out = loaded.model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
            )
            reference.append(out[0, len(ids) :].tolist())
    config = engine_config(default_model_dir, max_model_len=MAX_LEN)
    async with stoic.Engine.start(config) as engine:
        for (ids, new), want in zip(cases, reference, strict=True):
            assert len(ids) + new == MAX_LEN
            params = stoic.SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
            result = await engine.complete(ids, params)
            assert list(result.token_ids) == want
            assert result.finish_reason == "length"
            with pytest.raises(ContextLengthExceeded):
                await engine.submit(ids, stoic.SamplingParams(max_tokens=new + 1, temperature=0))
            with pytest.raises(ContextLengthExceeded):
                await engine.submit([*ids, ids[-1]], params)
        await wait_idle(engine, 60.0)
