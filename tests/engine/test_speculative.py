"""Speculative decoding by prompt lookup (``--speculative``): the output is the output without
drafts, token for token (float32), greedy, seeded and penalised, alone and batched, with the
drafts' keys and values of refused tokens overwritten; drafts are counted, and kept ones
save steps."""

from __future__ import annotations

import asyncio
import dataclasses
import re
from pathlib import Path

import pytest
from support import engine_config, wait_idle

import stoic
from stoic.request import Constraint

pytestmark = [pytest.mark.model]

#: a prompt whose continuation copies from it (the tiny random model repeats itself too)
PROMPTS = (
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
    "The cat sat on the mat. The cat sat on the",
    "one two three four five one two three four five one two",
    "Write about the sea.",
)
KINDS = {
    "greedy": stoic.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
    "seeded": stoic.SamplingParams(
        max_tokens=40, temperature=0.02, top_p=0.9, seed=5, ignore_eos=True
    ),
    "penalised": stoic.SamplingParams(
        max_tokens=40,
        temperature=0,
        presence_penalty=0.1,
        frequency_penalty=0.05,
        repetition_penalty=1.02,
        logprobs=True,
        ignore_eos=True,
    ),
    "short": stoic.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
    "eos": stoic.SamplingParams(max_tokens=40, temperature=0),
}


async def _outputs(
    model: Path, mode: str, params: stoic.SamplingParams, *, batched: bool, **config: object
) -> tuple[list[stoic.CompletionResult], stoic.EngineStats]:
    cfg = engine_config(model, **{"executor": "thread", "speculative": mode, **config})
    async with stoic.Engine.start(cfg) as engine:
        if batched:
            out = list(await asyncio.gather(*(engine.complete(p, params) for p in PROMPTS)))
        else:
            out = [await engine.complete(p, params) for p in PROMPTS]
        return out, await wait_idle(engine)


@pytest.mark.parametrize("batched", [False, True], ids=["alone", "batched"])
@pytest.mark.parametrize("kind", list(KINDS))
async def test_drafts_change_nothing_in_the_output(
    tiny_model_dir: Path, kind: str, batched: bool
) -> None:
    """Every request's tokens, text, finish reason and logprobs (to rounding) with drafts
    verified equal those without; with drafts the engine proposed some and kept some (the tiny
    model repeats itself), and each kept one saved a step."""
    params = KINDS[kind]
    plain, plain_stats = await _outputs(tiny_model_dir, "off", params, batched=batched)
    drafted, stats = await _outputs(tiny_model_dir, "ngram", params, batched=batched)
    for want, got in zip(plain, drafted, strict=True):
        assert got.token_ids == want.token_ids, kind
        assert (got.text, got.finish_reason) == (want.text, want.finish_reason)
        if params.logprobs:
            assert want.logprobs is not None and got.logprobs is not None
            assert [t.token_id for t in got.logprobs] == [t.token_id for t in want.logprobs]
            assert [t.logprob for t in got.logprobs] == pytest.approx(
                [t.logprob for t in want.logprobs], abs=1e-4
            )
    assert plain_stats.spec_draft_tokens == 0
    if kind != "short":
        assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens > 0
        assert stats.steps < plain_stats.steps  # kept drafts are tokens without a step of their own
    assert stats.spec_accepted_tokens <= stats.spec_draft_tokens
    assert stats.kv_blocks_used == 0


@pytest.mark.parametrize("batched", [False, True], ids=["alone", "batched"])
async def test_constrained_requests_draft_within_their_grammar(
    tiny_model_dir: Path, batched: bool
) -> None:
    """Constrained requests draft too: each row is masked by the grammar's state after the
    drafts before it, so the output (tokens, text, finish) is the output without drafts, within
    the grammar, and drafts are kept (tests/sampling/test_grammar.py: the masks, and a grammar
    completed inside the kept tokens)."""
    params = stoic.SamplingParams(
        max_tokens=24, temperature=0, constraint=Constraint(kind="regex", text="([a-z]+ )+")
    )
    plain, _ = await _outputs(tiny_model_dir, "off", params, batched=batched)
    drafted, stats = await _outputs(tiny_model_dir, "ngram", params, batched=batched)
    assert [(o.token_ids, o.text, o.finish_reason) for o in drafted] == [
        (o.token_ids, o.text, o.finish_reason) for o in plain
    ]
    assert all(re.fullmatch("[a-z ]*", o.text) for o in drafted)
    assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens > 0


async def test_a_stop_string_inside_kept_drafts_ends_where_one_token_at_a_time_ends(
    tiny_model_dir: Path,
) -> None:
    """Requests with stop strings draft too, and end exactly as without drafts: the same
    text, token ids, finish reason and usage, with a stop string picked from each plain
    output's last third (met after drafts were kept) and one never met."""
    greedy = stoic.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain, _ = await _outputs(tiny_model_dir, "off", greedy, batched=False)
    drafts = 0
    for i, whole in enumerate(plain):
        at = len(whole.text) * 2 // 3
        for stop in (whole.text[at : at + 3], "\x00never\x00"):
            params = dataclasses.replace(greedy, stop=(stop,))
            cfg = engine_config(tiny_model_dir, executor="thread", speculative="off")
            async with stoic.Engine.start(cfg) as engine:
                want = await engine.complete(PROMPTS[i], params)
            cfg = engine_config(tiny_model_dir, executor="thread", speculative="ngram")
            async with stoic.Engine.start(cfg) as engine:
                got = await engine.complete(PROMPTS[i], params)
                stats = await wait_idle(engine)
            assert (got.text, got.token_ids, got.finish_reason, got.completion_tokens) == (
                want.text,
                want.token_ids,
                want.finish_reason,
                want.completion_tokens,
            )
            drafts += stats.spec_accepted_tokens
            if stop != "\x00never\x00":
                assert got.finish_reason == "stop" and len(got.text) <= at
    assert drafts > 0  # (tests/scheduler/test_speculate_core.py: a stop string inside drafts)


async def test_auto_drafts_only_while_few_sequences_run(tiny_model_dir: Path) -> None:
    """``auto`` drafts for a lone request and not while more than AUTO_MAX_BATCH (2)
    sequences run."""
    params = dataclasses.replace(KINDS["greedy"], max_tokens=24)
    cfg = engine_config(tiny_model_dir, executor="thread", speculative="auto")
    async with stoic.Engine.start(cfg) as engine:
        await engine.complete(PROMPTS[2], params)
        alone = engine.stats().spec_draft_tokens
        assert alone > 0
        await asyncio.gather(*(engine.complete(p, params) for p in PROMPTS * 2))
        # the last few of the 8 may run with fewer than 3 beside them: some drafts, not many
        assert engine.stats().spec_draft_tokens - alone < alone * 8
        await wait_idle(engine)


def test_bad_speculative_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="speculative must be"):
        stoic.EngineConfig(speculative="always")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        stoic.EngineConfig(num_speculative_tokens=0)


@pytest.mark.parametrize("executor", ["process"])
async def test_the_worker_process_verifies_drafts_too(tiny_model_dir: Path, executor: str) -> None:
    """The kept tokens cross the process boundary (``StepOutput.accepted``): the same output
    as without drafts, with drafts kept."""
    params = KINDS["greedy"]
    plain, _ = await _outputs(tiny_model_dir, "off", params, batched=True, executor=executor)
    drafted, stats = await _outputs(
        tiny_model_dir, "ngram", params, batched=True, executor=executor
    )
    assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
    assert stats.spec_accepted_tokens > 0


async def test_the_default_model_on_its_c_layers_gives_the_same_text(
    default_model_dir: Path,
) -> None:
    """The default model (GGUF, the C decoder layers: a chunk of drafts runs the prompt path,
    a plain decode the decode path) in float32: greedy text with drafts equals the text
    without, on prompts that copy from their input, and drafts are kept."""
    params = stoic.SamplingParams(max_tokens=48, temperature=0)
    chat = [[{"role": "user", "content": f"Repeat exactly: {p}"}] for p in PROMPTS[:3]]
    results = {}
    for mode in ("off", "ngram"):
        cfg = engine_config(default_model_dir, executor="thread", speculative=mode)
        async with stoic.Engine.start(cfg) as engine:
            results[mode] = [await engine.complete(None, params, messages=m) for m in chat]
            stats = await wait_idle(engine)
    assert [r.token_ids for r in results["ngram"]] == [r.token_ids for r in results["off"]]
    assert stats.spec_accepted_tokens > 0


@pytest.mark.parametrize("executor", ["thread", "process"])
async def test_a_failed_step_with_drafts_resumes_to_the_same_output(
    tiny_model_dir: Path, executor: str
) -> None:
    """A step error (the thread executor) and a kill -9 of the worker (the process executor:
    the KV cache kept) while drafts are verified: with ``recovery="resume"`` every request
    ends with the output it has without a failure and without drafts."""
    params = KINDS["greedy"]
    plain, _ = await _outputs(tiny_model_dir, "off", params, batched=True)
    fault = stoic.FaultSpec(kind="error" if executor == "thread" else "crash", after_steps=6)
    drafted, stats = await _outputs(
        tiny_model_dir,
        "ngram",
        params,
        batched=True,
        executor=executor,
        recovery="resume",
        faults=(fault,),
    )
    assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
    assert stats.restarts == 1 and stats.spec_accepted_tokens > 0
