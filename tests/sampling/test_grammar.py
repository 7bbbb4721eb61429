"""The grammar backend (llguidance) and the executor's matcher table, with the default model's
tokenizer: masks allow exactly the valid continuations, state rebuilt by replay equals state
built token by token, bad constraints are InvalidRequest naming their field."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from stoic.errors import InvalidRequest
from stoic.request import Constraint, GrammarVocab, SamplingParams, SeqChunk
from stoic.sampling import GrammarStates, LLGuidanceBackend, apply_bitmask

EOS = 2


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def backend(tokenizer: Any) -> LLGuidanceBackend:
    return LLGuidanceBackend(GrammarVocab.from_tokenizer(tokenizer, 49152, frozenset({EOS})))


def _allowed(backend: LLGuidanceBackend, states: GrammarStates, chunk: SeqChunk) -> set[int]:
    logits = apply_bitmask(torch.zeros(1, backend.n_vocab), [0], states.bitmask([chunk]))
    return set(torch.nonzero(logits[0] == 0).flatten().tolist())


def _chunk(constraint: Constraint, generated: list[int], seq_id: int = 7) -> SeqChunk:
    params = SamplingParams(constraint=constraint)
    return SeqChunk(seq_id, (0,), 0, (0,), True, params, len(generated), tuple(generated))


def test_regex_mask_allows_exactly_the_valid_continuations(
    backend: LLGuidanceBackend, tokenizer: Any
) -> None:
    """Under ``[0-9]{3}``: at the start every allowed token is 1-3 digits and every such
    token is allowed, EOS is not; after three digits only EOS is allowed and the matcher is
    finished."""
    states = GrammarStates(backend)
    digits = Constraint("regex", "[0-9]{3}")
    allowed = _allowed(backend, states, _chunk(digits, []))
    texts = {t: tokenizer.decode([t]) for t in range(len(tokenizer))}
    valid = {t for t, s in texts.items() if re.fullmatch(r"[0-9]{1,3}", s)}
    assert allowed == valid and valid
    done = tokenizer.encode("123")
    assert _allowed(backend, states, _chunk(digits, done)) == {EOS}
    assert states.matcher(_chunk(digits, done)).is_finished


def test_replay_equals_incremental_state(backend: LLGuidanceBackend, tokenizer: Any) -> None:
    """A matcher rebuilt from the generated tokens (a new table: an executor restart), or
    rolled back when a step's token was discarded, gives the same mask as one advanced token
    by token."""
    schema = Constraint(
        "json_schema",
        json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
    )
    ids = tokenizer.encode('{"a":42}')
    incremental = GrammarStates(backend)
    for n in range(len(ids) + 1):
        step = _chunk(schema, ids[:n])
        mask = incremental.bitmask([step])
        replayed = GrammarStates(backend).bitmask([step])
        assert torch.equal(mask, replayed), n
        if n < len(ids):
            assert incremental.advance([step], [[ids[n]]]) == [0 if n == len(ids) - 1 else None]
    # a discarded step: the table holds one token more than the sequence; it rolls back
    back = _chunk(schema, ids[:2])
    assert torch.equal(incremental.bitmask([back]), GrammarStates(backend).bitmask([back]))
    assert incremental.matcher(back).tokens == ids[:2]


def test_advance_reports_completion(backend: LLGuidanceBackend, tokenizer: Any) -> None:
    """``advance`` gives the index of the token that completes the grammar (the token that
    completes it, or an end token after it), None before and for a sequence the table has not
    seen; of several tokens (a step's kept drafts) it stops at the completing one."""
    states = GrammarStates(backend)
    yes = Constraint("choice", json.dumps(["yes", "yesterday"]))
    ids = tokenizer.encode("yes")
    assert len(ids) == 1
    assert states.advance([_chunk(yes, [])], [ids]) == [None]  # not seen: nothing to advance
    states.bitmask([_chunk(yes, [])])
    assert states.advance([_chunk(yes, [])], [ids]) == [None]  # "yesterday" may still follow
    states.bitmask([_chunk(yes, ids)])
    assert states.advance([_chunk(yes, ids)], [[EOS]]) == [0]
    done = Constraint("choice", json.dumps(["yes"]))
    states.bitmask([_chunk(done, [], seq_id=8)])
    assert states.advance([_chunk(done, [], seq_id=8)], [[*ids, EOS, EOS]]) == [0]
    assert states.matcher(_chunk(done, ids, seq_id=8)).tokens == ids  # nothing after it


def test_compile_is_cached_by_constraint(backend: LLGuidanceBackend) -> None:
    """The same constraint compiles to the same grammar object; another one does not."""
    a = backend.compile(Constraint("regex", "ab+"))
    assert backend.compile(Constraint("regex", "ab+")) is a
    assert backend.compile(Constraint("regex", "ab*")) is not a


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (Constraint("json_schema", '{"type": "nope"}', "guided_json"), "nope"),
        (Constraint("json_schema", "{oops", "response_format"), "invalid json_schema"),
        (Constraint("regex", "a(b", "structured_outputs"), "unclosed group"),
        (Constraint("grammar", "start: (", "guided_grammar"), "invalid grammar"),
        (Constraint("choice", "[]", "guided_choice"), "non-empty"),
    ],
)
def test_bad_constraint_is_invalid_request(
    backend: LLGuidanceBackend, constraint: Constraint, message: str
) -> None:
    """A constraint that does not compile raises InvalidRequest naming its request field."""
    with pytest.raises(InvalidRequest, match=re.escape(message)) as info:
        backend.compile(constraint)
    assert info.value.param == constraint.param


def test_apply_bitmask_masks_only_the_given_rows() -> None:
    """Disallowed tokens of the given rows become -inf, allowed ones keep their logits, other
    rows are untouched, and columns past the mask's width are disallowed."""
    logits = torch.arange(2 * 40, dtype=torch.float32).reshape(2, 40)
    mask = torch.zeros(1, 1, dtype=torch.int32)
    mask[0, 0] = (1 << 3) | ((1 << 31) - 2**32)  # tokens 3 and 31 (bit 31 as an int32)
    out = apply_bitmask(logits, [1], mask)
    assert torch.equal(out[0], logits[0])
    kept = torch.isfinite(out[1]).nonzero().flatten().tolist()
    assert kept == [3, 31]
    assert out[1, 3] == logits[1, 3] and out[1, 31] == logits[1, 31]


def test_min_tokens_with_a_constraint_is_refused() -> None:
    """A grammar may allow only the end before min_tokens is reached, leaving no token to
    sample: the combination is a 400 naming min_tokens, not output that breaks the grammar."""
    import pytest

    from stoic.errors import InvalidRequest
    from stoic.request import Constraint, SamplingParams

    params = SamplingParams(min_tokens=2, constraint=Constraint("regex", "a"))
    with pytest.raises(InvalidRequest) as raised:
        params.validate()
    assert raised.value.param == "min_tokens"


def test_a_chunk_with_drafts_gets_a_mask_after_each_draft(
    backend: LLGuidanceBackend, tokenizer: Any
) -> None:
    """A constrained chunk with drafts has one mask row per sampled row: after its output, then
    after each draft in turn (each equal to a matcher advanced token by token); a draft the
    grammar refuses leaves the rows after it the mask before it (they are never kept); the
    matcher is left at the sequence's output, and ``advance`` then takes the kept tokens."""
    schema = Constraint(
        "json_schema",
        json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
    )
    ids = tokenizer.encode('{"a":421}')
    params = SamplingParams(constraint=schema)
    states = GrammarStates(backend)
    drafts = tuple(ids[2:5])
    # a decode of ids[1] (generated: in the output) with three drafts after it
    chunk = SeqChunk(7, (ids[1], *drafts), 1, (0,), True, params, 2, tuple(ids[:2]), drafts=3)
    masks = states.bitmask([chunk])
    assert masks.shape[0] == 4
    for i in range(4):
        want = GrammarStates(backend).bitmask([_chunk(schema, ids[: 2 + i])])
        assert torch.equal(masks[i : i + 1], want), i
    assert states.matcher(_chunk(schema, ids[:2])).tokens == ids[:2]
    # a refused draft ("}" before any key) and the rows after it
    bad = tuple(tokenizer.encode("}")) + drafts[1:]
    refused = SeqChunk(7, (ids[1], *bad), 1, (0,), True, params, 2, tuple(ids[:2]), drafts=3)
    masks = GrammarStates(backend).bitmask([refused])
    first = GrammarStates(backend).bitmask([_chunk(schema, ids[:2])])
    assert all(torch.equal(masks[i : i + 1], first) for i in range(4))
    # the step's tokens: the sampled one and two kept drafts' rows
    assert states.advance([chunk], [ids[2:5]]) == [None]
    assert states.matcher(_chunk(schema, ids[:5])).tokens == ids[:5]
