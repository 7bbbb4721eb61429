"""``Request.generated``: a request that continues after tokens it generated before (a Ray
migration's) gives exactly the rest of the uninterrupted output, greedy, seeded, penalised and
constrained;
its stream carries only the new tokens; bad ``generated`` tokens are refused at admission.

The tiny model in float32: a continuation must equal the uninterrupted output token for token.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
from support import engine_config, wait_idle

import stoic
from stoic.errors import InvalidRequest
from stoic.request import Constraint, Detokenizer

pytestmark = [pytest.mark.model, pytest.mark.asyncio]

TOKENS = 20
PROMPT = "Write about the number 7 and the number 7 again."
PARAMS = {
    "greedy": stoic.SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True),
    "seeded": stoic.SamplingParams(
        max_tokens=TOKENS, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True
    ),
    "penalised": stoic.SamplingParams(
        max_tokens=TOKENS,
        min_tokens=TOKENS - 2,
        temperature=0.8,
        seed=3,
        presence_penalty=0.6,
        frequency_penalty=0.9,
        logprobs=True,
    ),
    # the grammar's matcher replays the generated tokens before the first step
    "constrained": stoic.SamplingParams(
        max_tokens=TOKENS,
        temperature=0,
        ignore_eos=True,
        constraint=Constraint(kind="regex", text="[a-z ]+"),
    ),
}
#: where the continuations start (tokens already generated)
SPLITS = (1, 9, TOKENS - 1)


async def _streamed(
    stream: stoic.RequestStream,
) -> tuple[str, tuple[int, ...], list[stoic.Delta]]:
    got = [d async for d in stream]
    return "".join(d.text for d in got), tuple(t for d in got for t in d.token_ids), got


@pytest.mark.parametrize("kind", list(PARAMS))
async def test_a_continuation_generates_exactly_the_rest_of_the_output(
    tiny_model_dir: Path, kind: str
) -> None:
    """The request alone gives tokens T; the same request with ``generated=T[:k]`` (for several
    k, all at once, in one batch) streams exactly T[k:] (their logprobs, to rounding), the text after
    T[:k]'s, the same finish reason; ``max_tokens`` and ``min_tokens`` count T[:k]; its usage
    counts the original prompt and the new tokens only."""
    params = PARAMS[kind]
    async with stoic.Engine.start(engine_config(tiny_model_dir, executor="thread")) as engine:
        whole = await engine.complete(PROMPT, params)
        tokens = whole.token_ids
        assert len(tokens) == TOKENS and whole.finish_reason == "length"
        streams = [await engine.submit(PROMPT, params, generated=tokens[:k]) for k in SPLITS]
        outputs = await asyncio.gather(*(_streamed(s) for s in streams))
        backend = engine.tokenizer.backend_tokenizer
        for k, (text, ids, deltas) in zip(SPLITS, outputs, strict=True):
            assert ids == tokens[k:], (kind, k)
            before = Detokenizer(backend, generated=tokens[:k]).text
            assert before + text == whole.text, (kind, k)
            assert deltas[-1].finish_reason == whole.finish_reason
            assert deltas[-1].prompt_tokens == whole.prompt_tokens
            assert deltas[-1].completion_tokens == TOKENS - k
            if params.logprobs:
                assert whole.logprobs is not None
                got = [lp for d in deltas for lp in d.logprobs or ()]
                want = whole.logprobs[k:]
                assert [t.token_id for t in got] == [t.token_id for t in want]
                # float32 without deterministic mode: a batch's sums may round differently
                assert [t.logprob for t in got] == pytest.approx(
                    [t.logprob for t in want], abs=1e-4
                )
        await wait_idle(engine)


async def test_the_old_way_of_continuing_differs(tiny_model_dir: Path) -> None:
    """The continuation the ingress sent before ``generated`` existed (the tokens so far
    appended to the prompt, the budget reduced) does not give the rest of a seeded or
    penalised request: what the test above checks is not true by accident."""
    async with stoic.Engine.start(engine_config(tiny_model_dir, executor="thread")) as engine:
        for kind in ("seeded", "penalised"):
            params = PARAMS[kind]
            whole = await engine.complete(PROMPT, params)
            k = 9
            prompt = (*engine.tokenize(PROMPT), *whole.token_ids[:k])
            old = dataclasses.replace(
                params, max_tokens=TOKENS - k, min_tokens=max(0, params.min_tokens - k)
            )
            assert (await engine.complete(prompt, old)).token_ids != whole.token_ids[k:], kind


async def test_bad_generated_tokens_are_refused_and_the_engine_still_serves(
    tiny_model_dir: Path,
) -> None:
    """Ids outside the vocabulary, as many tokens as ``max_tokens`` (or the context leaves),
    or tokens the request's grammar refuses (a special token, a digit after letters where
    letters and spaces are allowed): InvalidRequest naming ``generated``, before any output;
    the engine serves the next request as before."""
    params = PARAMS["greedy"]
    async with stoic.Engine.start(engine_config(tiny_model_dir, executor="thread")) as engine:
        expected = (await engine.complete(PROMPT, params)).token_ids
        constrained = stoic.SamplingParams(
            max_tokens=8, constraint=Constraint(kind="regex", text="[a-z ]+")
        )
        unbounded = stoic.SamplingParams(max_tokens=None)
        digit = engine.tokenize("7", add_special_tokens=False)
        left = engine.max_model_len - len(engine.tokenize(PROMPT))
        bad = [
            (params, (1, 2, 10**9)),
            (params, (-1,)),
            (params, tuple(expected)),
            (params, (*expected, 5)),
            (unbounded, (5,) * left),
            (constrained, (5,)),
            (constrained, (*engine.tokenize(" abc", add_special_tokens=False), *digit)),
        ]
        for p, generated in bad:
            with pytest.raises(InvalidRequest) as raised:
                await engine.submit(PROMPT, p, generated=generated)
            assert raised.value.param == "generated", generated[:3]
        assert (await engine.complete(PROMPT, params)).token_ids == expected
        await wait_idle(engine)


async def test_generated_tokens_past_an_end_are_refused_and_before_min_tokens_continue(
    tiny_model_dir: Path,
) -> None:
    """A ``generated`` token that would have ended the output (a stop token, or EOS without
    ``ignore_eos``, once ``min_tokens`` are out: the rule the scheduler applies to each sampled
    token) is refused, naming ``generated``; the same token before ``min_tokens``, or EOS with
    ``ignore_eos``, is a token like any other and the continuation runs to ``max_tokens``."""
    greedy = PARAMS["greedy"]
    async with stoic.Engine.start(engine_config(tiny_model_dir, executor="thread")) as engine:
        expected = (await engine.complete(PROMPT, greedy)).token_ids
        stop = dataclasses.replace(greedy, stop_token_ids=(expected[3],))
        eos = engine.tokenizer.eos_token_id
        assert isinstance(eos, int)
        no_ignore = dataclasses.replace(greedy, ignore_eos=False)
        for p, generated in [(stop, expected[:5]), (no_ignore, (*expected[:2], eos))]:
            with pytest.raises(InvalidRequest, match="stop token") as raised:
                await engine.submit(PROMPT, p, generated=generated)
            assert raised.value.param == "generated"
        # the stop token before min_tokens: continued (the ban on it ends at min_tokens, so it
        # may end the output from then on)
        late = dataclasses.replace(stop, min_tokens=6)
        out = await engine.complete(PROMPT, late, generated=expected[:5])
        assert out.token_ids and len(out.token_ids) <= TOKENS - 5
        if out.finish_reason == "stop":
            assert out.token_ids[-1] == expected[3]
        else:
            assert len(out.token_ids) == TOKENS - 5
        # EOS with ignore_eos: continued to max_tokens
        out = await engine.complete(PROMPT, greedy, generated=(*expected[:2], eos))
        assert out.finish_reason == "length"
        assert len(out.token_ids) == TOKENS - 3
        await wait_idle(engine)
