"""The sampler on hand-made float32 logits: each penalty's exact arithmetic, logit bias, min-p,
and rows that use none of them left exactly as they were."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from stoic.errors import InvalidRequest
from stoic.request import SamplingParams, SeqChunk
from stoic.sampling import adjust_logits, sample

VOCAB = 8
EOS = 7
NO_EOS: frozenset[int] = frozenset()


def _chunk(
    params: SamplingParams, output_ids: tuple[int, ...] = (), prompt_ids: tuple[int, ...] = ()
) -> SeqChunk:
    """A sampling chunk as :func:`stoic.actors._plan.chunks_of` builds it for ``params``."""
    counts = params.counts_output
    return SeqChunk(
        seq_id=0,
        token_ids=(1,),
        start_pos=len(prompt_ids) + len(output_ids),
        block_table=(0,),
        sample=True,
        params=params,
        num_generated=len(output_ids),
        output_ids=output_ids if counts else (),
        prompt_ids=prompt_ids if counts and params.counts_prompt else (),
    )


def _row(*values: float) -> torch.Tensor:
    return torch.tensor([list(values)], dtype=torch.float32)


BASE = (3.0, -1.5, 0.5, 2.0, -4.0, 1.0, 0.0, 0.25)


def test_frequency_and_presence_penalties_count_generated_tokens_only() -> None:
    """OpenAI semantics: ``logit[t] -= presence * (count[t] > 0) + frequency * count[t]`` over
    the generated tokens; a token seen only in the prompt is not penalised."""
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    chunk = _chunk(params, output_ids=(3, 3, 3, 5), prompt_ids=(0, 1))
    out = adjust_logits(_row(*BASE), [chunk], NO_EOS)
    expected = list(BASE)
    expected[3] = 2.0 - 0.5 - 3 * 0.25
    expected[5] = 1.0 - 0.5 - 0.25
    assert torch.equal(out, _row(*expected))


def test_negative_penalties_raise_the_generated_tokens() -> None:
    """Negative presence and frequency penalties (down to -2) add instead of subtract."""
    params = SamplingParams(presence_penalty=-2.0, frequency_penalty=-1.0)
    out = adjust_logits(_row(*BASE), [_chunk(params, output_ids=(4, 4))], NO_EOS)
    expected = list(BASE)
    expected[4] = -4.0 + 2.0 + 2 * 1.0
    assert torch.equal(out, _row(*expected))


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    """vLLM / transformers semantics over prompt and output tokens: a seen token's positive
    logit is divided by the penalty, a negative one multiplied; unseen tokens keep theirs."""
    params = SamplingParams(repetition_penalty=2.0)
    chunk = _chunk(params, output_ids=(2, 2), prompt_ids=(0, 1, 6))
    out = adjust_logits(_row(*BASE), [chunk], NO_EOS)
    expected = list(BASE)
    expected[0] = 3.0 / 2.0  # prompt, positive
    expected[1] = -1.5 * 2.0  # prompt, negative
    expected[2] = 0.5 / 2.0  # output, counted once however often it came
    expected[6] = 0.0  # zero stays zero
    assert torch.equal(out, _row(*expected))


def test_repetition_penalty_comes_before_frequency_and_presence() -> None:
    """Both kinds on one row: the logit is divided first, then the counts are subtracted."""
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0, presence_penalty=0.5)
    out = adjust_logits(_row(*BASE), [_chunk(params, output_ids=(0,))], NO_EOS)
    expected = list(BASE)
    expected[0] = 3.0 / 2.0 - 1.0 - 0.5
    assert torch.equal(out, _row(*expected))


def test_logit_bias_is_added_to_the_named_tokens() -> None:
    """Each ``(token, bias)`` pair adds ``bias`` to that token's logit, and nothing else moves."""
    params = SamplingParams(logit_bias=((1, 100.0), (3, -2.5)))
    out = adjust_logits(_row(*BASE), [_chunk(params)], NO_EOS)
    expected = list(BASE)
    expected[1] = -1.5 + 100.0
    expected[3] = 2.0 - 2.5
    assert torch.equal(out, _row(*expected))


def test_rows_without_penalties_are_left_exactly_as_they_were() -> None:
    """In a batch mixing plain, penalised and biased rows, only the rows that ask are changed;
    a batch where no row asks gets the very same tensor back (no copy)."""
    plain = SamplingParams(temperature=0.0)
    penalised = SamplingParams(frequency_penalty=1.0, repetition_penalty=1.5)
    biased = SamplingParams(logit_bias=((2, 10.0),))
    logits = torch.cat([_row(*BASE)] * 3)
    chunks = [_chunk(plain), _chunk(penalised, (0,), (1,)), _chunk(biased)]
    out = adjust_logits(logits, chunks, NO_EOS)
    assert torch.equal(out[0], logits[0])
    assert torch.equal(out[1], _row(2.0 - 1.0, -2.25, *BASE[2:])[0])
    assert torch.equal(out[2], _row(*BASE[:2], 10.5, *BASE[3:])[0])
    assert torch.equal(logits, torch.cat([_row(*BASE)] * 3))  # the input is not modified
    assert adjust_logits(logits, [_chunk(plain)] * 3, NO_EOS) is logits


def test_a_logit_bias_of_100_forces_the_greedy_token() -> None:
    """Greedy decoding honours the bias: +100 on the least likely token makes it the choice."""
    params = SamplingParams(temperature=0.0, logit_bias=((4, 100.0),))
    assert [t.token_id for t in sample(_row(*BASE), [_chunk(params)], NO_EOS)] == [4]


def test_min_tokens_ban_wins_over_a_positive_logit_bias_on_eos() -> None:
    """Before ``min_tokens``, EOS stays banned even with a +100 bias on it."""
    params = SamplingParams(temperature=0.0, min_tokens=2, logit_bias=((EOS, 100.0),))
    chunk = _chunk(params)
    assert sample(_row(*BASE), [chunk], frozenset({EOS}))[0].token_id == 0


def test_logprobs_are_those_of_the_raw_logits() -> None:
    """Biases and penalties change the choice, not the reported logprobs."""
    params = SamplingParams(
        temperature=0.0, logprobs=True, logit_bias=((4, 100.0),), frequency_penalty=1.0
    )
    logits = _row(*BASE)
    token = sample(logits, [_chunk(params, output_ids=(0,))], NO_EOS)[0]
    assert token.token_id == 4
    assert token.logprob == torch.log_softmax(logits, dim=-1)[0, 4].item()


def _draws(params: SamplingParams, logits: torch.Tensor, n: int) -> list[int]:
    """One seeded draw for each of the seeds ``0..n-1``, as one batch."""
    chunks = [_chunk(dataclasses.replace(params, seed=s)) for s in range(n)]
    return [t.token_id for t in sample(logits.expand(n, -1), chunks, NO_EOS)]


def test_min_p_drops_tokens_below_its_share_of_the_top_probability() -> None:
    """With probabilities (0.5, 0.3, 0.2), ``min_p=0.5`` keeps only tokens at >= 0.25: the 0.2
    token is never drawn, though it is without ``min_p``; ``min_p=1`` keeps only the top one."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    assert set(_draws(SamplingParams(temperature=1.0), logits, 300)) == {0, 1, 2}
    assert set(_draws(SamplingParams(temperature=1.0, min_p=0.5), logits, 300)) == {0, 1}
    assert set(_draws(SamplingParams(temperature=1.0, min_p=1.0), logits, 300)) == {0}


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": 2.5}, "repetition_penalty"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"logit_bias": ((1, 101.0),)}, "logit_bias"),
        ({"logit_bias": ((1, float("inf")),)}, "logit_bias"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
        ({"logit_bias": ((True, 1.0),)}, "logit_bias"),
        ({"logit_bias": ((1, 1.0), (1, 2.0))}, "logit_bias"),
        ({"logit_bias": ((VOCAB, 1.0),)}, "logit_bias"),
    ],
)
def test_out_of_range_sampling_values_are_invalid_requests(
    kwargs: dict[str, Any], param: str
) -> None:
    """Each out-of-range value raises InvalidRequest naming its parameter (``logit_bias`` ids
    are checked against the vocabulary when its size is given)."""
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(**kwargs).validate(vocab_size=VOCAB)
    assert info.value.param == param


def test_range_limits_are_valid() -> None:
    """The ends of each range are accepted."""
    for kwargs in (
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"repetition_penalty": 2.0, "min_p": 1.0},
        {"repetition_penalty": 0.01, "min_p": 0.0},
        {"logit_bias": ((0, -100.0), (VOCAB - 1, 100))},
    ):
        SamplingParams(**kwargs).validate(vocab_size=VOCAB)
