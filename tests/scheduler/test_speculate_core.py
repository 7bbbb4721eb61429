"""Speculative decoding in the scheduler's core (no model): a decode carries its drafts and
their blocks, kept drafts advance the sequence several tokens in one step, refused ones leave
nothing behind, and drafts never cost another sequence its blocks."""

from __future__ import annotations

from stoic.actors.testing import create_scheduler, drain, next_letter
from stoic.request import SamplingParams, SeqChunk
from stoic.scheduler._speculate import MAX_STEP_ROWS


def _cycle(chunk: SeqChunk) -> int:
    """A model that repeats ``abcd``: every draft from the sequence's own output is right."""
    return ord("a") + (chunk.start_pos + len(chunk.token_ids)) % 4


def _run(
    speculative: str, sample=_cycle, **kwargs: object
) -> tuple[list[tuple[str, str | None, object]], object]:
    h = create_scheduler(speculative=speculative, **kwargs)  # type: ignore[arg-type]
    streams = [h.add(p, max_tokens=30) for p in ("hello world", "abcdabcd", "x")]
    steps = h.run_until_idle(sample=sample)
    h.check()
    assert h.allocator.used_blocks == 0
    return [drain(s) for s in streams], (steps, h.core.stats())


def test_kept_drafts_give_the_same_output_in_fewer_steps() -> None:
    plain, (plain_steps, _) = _run("off")
    drafted, (steps, stats) = _run("ngram")
    assert drafted == plain
    assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens == stats.spec_draft_tokens
    assert steps < plain_steps / 2  # up to 5 tokens a step once the cycle is seen


def test_refused_drafts_change_nothing_and_pause_the_sequence() -> None:
    """A model that follows the alphabet by position refuses the drafts the prompts suggest
    ("hello world" proposes what followed its "l" and "o"): the output is the plain one, no
    step more, and fewer drafts were kept than proposed."""
    plain, (plain_steps, _) = _run("off", next_letter)
    drafted, (steps, stats) = _run("ngram", next_letter)
    assert drafted == plain and steps <= plain_steps
    assert stats.spec_accepted_tokens < stats.spec_draft_tokens


def test_drafts_take_only_spare_blocks_and_never_preempt() -> None:
    """With blocks for the sequences' own tokens only, drafts shrink to what is spare: the
    same preemptions as without drafts (none), the same output."""
    plain, (_, plain_stats) = _run("off", num_blocks=30, block_size=4)
    drafted, (_, stats) = _run("ngram", num_blocks=30, block_size=4)
    assert drafted == plain
    assert stats.preemptions == plain_stats.preemptions


def test_max_tokens_bounds_the_drafts() -> None:
    h = create_scheduler(speculative="ngram")
    stream = h.add("abcdabcd", max_tokens=3)
    h.run_until_idle(sample=_cycle)
    text, finish, _ = drain(stream)
    assert (len(text), finish) == (3, "length")
    assert all(c.drafts <= 2 for b in h.batches for c in b.chunks)


def test_a_step_of_drafts_stays_within_the_kernels_rows() -> None:
    """Decodes and their drafts together never pass MAX_STEP_ROWS tokens a step (the steps the
    C layers and the int8 tiles take whole): one sequence alone verifies its k drafts, four
    share what is left after their own tokens; the output is the plain one."""
    prompts = ("abcdabcd", "abab", "aaaa", "dcba")

    def run(mode: str) -> tuple[list[object], object]:
        h = create_scheduler(speculative=mode, num_speculative_tokens=6)  # type: ignore[arg-type]
        streams = [h.add(p, max_tokens=30) for p in prompts]
        h.run_until_idle(sample=_cycle)
        h.check()
        return [drain(s) for s in streams], h

    plain, _ = run("off")
    drafted, h = run("ngram")
    assert drafted == plain
    decode_steps = [b for b in h.batches if all(len(c.token_ids) == 1 + c.drafts for c in b.chunks)]
    assert any(c.drafts for b in decode_steps for c in b.chunks)
    assert all(sum(len(c.token_ids) for c in b.chunks) <= MAX_STEP_ROWS for b in decode_steps)
    alone = create_scheduler(speculative="ngram", num_speculative_tokens=6)
    alone.add("abcdabcd", max_tokens=30)
    alone.run_until_idle(sample=_cycle)
    assert max(c.drafts for b in alone.batches for c in b.chunks) == 6


def test_a_stop_string_completed_by_a_kept_draft_drops_the_drafts_after_it() -> None:
    """The cycling model keeps every draft, so ``"cdab"`` is completed inside a run of kept
    drafts: the text, finish and the sequence's tokens are the ones without drafts (the
    drafts after the completing token are not appended), in fewer steps."""
    params = SamplingParams(max_tokens=30, stop=("dabc",))

    def run(mode: str) -> tuple[object, int, int]:
        h = create_scheduler(speculative=mode)  # type: ignore[arg-type]
        stream = h.add("abcdabcd", params=params)
        h.run_until_idle(sample=_cycle)
        h.check()
        assert h.allocator.used_blocks == 0
        return drain(stream), h.core.stats().generated_tokens, len(h.batches)

    (plain, plain_tokens, plain_steps) = run("off")
    (drafted, tokens, steps) = run("ngram")
    assert plain[1] == "stop"
    assert drafted == plain and tokens == plain_tokens
    assert steps < plain_steps
