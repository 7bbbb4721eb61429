"""Result streams: the producer never blocks, a slow consumer gets coalesced deltas."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import stoic
from stoic.actors import ResultStream
from stoic.errors import ExecutorFailed, PartialOutput


async def test_pushes_while_nobody_reads_are_coalesced_into_one_delta() -> None:
    """Many pushes before a read come out as one delta carrying all text and tokens."""
    stream = ResultStream("r", prompt_tokens=3)
    for i in range(100):
        stream.push(f"{i},", [i])
    stream.finish("length")
    delta = await stream.__anext__()
    assert delta.text == "".join(f"{i}," for i in range(100))
    assert delta.token_ids == tuple(range(100))
    assert delta.completion_tokens == 100
    assert delta.finish_reason == "length"
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()


async def test_exactly_one_terminal_outcome() -> None:
    """After finish, a later fail (or another finish) changes nothing, and vice versa."""
    stream = ResultStream("r", prompt_tokens=1)
    stream.push("a", [1])
    stream.finish("stop")
    stream.fail(ExecutorFailed("late", partial=PartialOutput("a", (1,))))
    deltas = [d async for d in stream]
    assert [d.finish_reason for d in deltas] == ["stop"]

    failed = ResultStream("f", prompt_tokens=1)
    failed.fail(ExecutorFailed("boom", partial=PartialOutput("", ())))
    failed.finish("stop")
    with pytest.raises(ExecutorFailed):
        await failed.__anext__()
    with pytest.raises(StopAsyncIteration):
        await failed.__anext__()


async def test_on_close_runs_once_on_the_terminal_outcome() -> None:
    """The close callback (intake's admission counter) runs exactly once."""
    calls: list[str] = []
    stream = ResultStream("r", prompt_tokens=1, on_close=lambda s: calls.append(s.request_id))
    stream.finish("stop")
    stream.finish("length")
    stream.fail(ExecutorFailed("x", partial=PartialOutput("", ())))
    assert calls == ["r"]


@pytest.mark.asyncio(loop_scope="function")
async def test_a_slow_consumer_does_not_stall_the_batch(tiny_model_dir: Path) -> None:
    """One stream nobody reads while others run to completion; it then yields all its tokens."""
    config = stoic.EngineConfig(model=str(tiny_model_dir), dtype="float32")
    async with stoic.Engine.start(config) as engine:
        params = stoic.SamplingParams(max_tokens=40, ignore_eos=True)
        slow = await engine.submit("slow reader", params)
        fast = await asyncio.gather(*(engine.complete(f"fast {i}", params) for i in range(4)))
        assert all(r.completion_tokens == 40 for r in fast)
        deltas = [d async for d in slow]
        assert deltas[-1].completion_tokens == 40
        assert sum(len(d.token_ids) for d in deltas) == 40
        assert len(deltas) < 40, "nothing was coalesced"
