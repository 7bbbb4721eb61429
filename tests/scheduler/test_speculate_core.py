"""Speculative decoding in the scheduler's core (no model): a decode carries its drafts and
their blocks, kept drafts advance the sequence several tokens in one step, refused ones leave
nothing behind, and drafts never cost another sequence its blocks."""

from __future__ import annotations

from stoic.actors.testing import create_scheduler, drain, next_letter
from stoic.request import SeqChunk


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
