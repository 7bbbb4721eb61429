"""Structured outputs through the engine: grammar state survives preemption and executor
restarts (thread and process), rebuilt from the generated tokens, so constrained seeded output
is exactly the undisturbed output; a grammar that allows nothing more ends the sequence.

float32 throughout: exact outputs.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from support import engine_config, wait_idle

import stoic
from stoic.engine import Constraint

pytestmark = [pytest.mark.model, pytest.mark.asyncio]

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "facts": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 3},
    },
    "required": ["city", "facts"],
    "additionalProperties": False,
}
CONSTRAINT = Constraint("json_schema", json.dumps(SCHEMA))
TOKENS = 32


def _requests() -> list[tuple[str, stoic.SamplingParams]]:
    cities = ["Paris", "Rome", "Oslo", "Lima", "Cairo", "Tokyo"]
    return [
        (
            f"Facts about {city} as JSON:",
            stoic.SamplingParams(
                max_tokens=TOKENS, temperature=1.0, seed=10 + i, constraint=CONSTRAINT
            ),
        )
        for i, city in enumerate(cities)
    ]


async def _run(engine: stoic.Engine, requests: list[Any]) -> list[tuple[str, str | None]]:
    results = await asyncio.gather(*(engine.complete(p, params) for p, params in requests))
    return [(r.text, r.finish_reason) for r in results]


async def _baseline(model_dir: Path) -> list[tuple[str, str | None]]:
    async with stoic.Engine.start(engine_config(model_dir)) as engine:
        return [
            (r.text, r.finish_reason)
            for r in [await engine.complete(p, params) for p, params in _requests()]
        ]


@pytest.fixture(scope="module")
def baseline(default_model_dir: Path) -> list[tuple[str, str | None]]:
    """Each request alone, undisturbed: its text validates; most finish with "stop"."""
    out = asyncio.run(_baseline(default_model_dir))
    for text, finish in out:
        if finish == "stop":
            jsonschema.validate(json.loads(text), SCHEMA)
    assert sum(finish == "stop" for _, finish in out) >= 4, out
    return out


async def test_preemption_keeps_constrained_outputs_exact(
    default_model_dir: Path, baseline: list[tuple[str, str | None]]
) -> None:
    """With a cache too small for all sequences (preemptions, recomputation), every constrained
    seeded output equals its undisturbed output."""
    async with stoic.Engine.start(engine_config(default_model_dir, num_kv_blocks=6)) as engine:
        together = await _run(engine, _requests())
        stats = await wait_idle(engine)
        assert stats.preemptions > 0, "the cache was not small enough to force preemption"
    assert together == baseline


@pytest.mark.parametrize("executor", ["thread", "process"])
async def test_executor_restarts_keep_constrained_outputs_exact(
    default_model_dir: Path, baseline: list[tuple[str, str | None]], executor: str
) -> None:
    """An executor failure mid-generation with ``recovery="resume"`` (a new worker process, with
    no grammar state, for the process executor): the matchers are rebuilt by replaying the
    generated tokens, so every output equals its undisturbed output."""
    config = engine_config(default_model_dir, executor=executor, recovery="resume")
    async with stoic.Engine.start(config) as engine:
        await engine.inject_fault(stoic.FaultSpec(kind="error", after_steps=6))
        run = asyncio.ensure_future(_run(engine, _requests()))
        outcomes = await asyncio.wait_for(run, 600)
        stats = await wait_idle(engine)
        assert stats.restarts >= 1 and stats.requests_resumed > 0
    assert outcomes == baseline


async def test_a_complete_grammar_ends_the_sequence_with_stop(default_model_dir: Path) -> None:
    """A choice that completes ends the sequence at once with finish_reason "stop" and exactly
    the choice's tokens (no EOS step), even when EOS is ignored."""
    async with stoic.Engine.start(engine_config(default_model_dir)) as engine:
        choice = Constraint("choice", json.dumps(["banana split"]))
        params = stoic.SamplingParams(
            max_tokens=16, temperature=0, ignore_eos=True, constraint=choice
        )
        result = await engine.complete("Dessert:", params)
        assert (result.text, result.finish_reason) == ("banana split", "stop")
        assert engine.tokenizer.decode(list(result.token_ids)) == "banana split"  # no EOS
