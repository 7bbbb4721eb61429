"""Prompt-lookup drafts (stoic/scheduler/_ngram.py): the index proposes exactly what a scan of
the whole sequence would, whatever the tokens, and never the suffix's own occurrence."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stoic.scheduler._ngram import NgramIndex


def _scan(tokens: list[int], k: int, min_n: int, max_n: int) -> tuple[int, ...]:
    """The reference: for the longest suffix first, the latest earlier occurrence's followers,
    the tokens from it to the end repeated as often as ``k`` needs."""
    size = len(tokens)
    for n in range(min(max_n, size), min_n - 1, -1):
        suffix = tokens[size - n :]
        for end in range(size - 1, n - 1, -1):
            if tokens[end - n : end] == suffix:
                return tuple((tokens + tokens[end:] * k)[end : end + k])
    return ()


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 4), max_size=60),
    st.integers(1, 6),
    st.integers(1, 3),
    st.integers(0, 3),
)
def test_proposals_equal_a_scan_of_the_sequence_after_every_token(
    tokens: list[int], k: int, min_n: int, extra: int
) -> None:
    index = NgramIndex(min_n=min_n, max_n=min_n + extra)
    for end, token in enumerate(tokens, 1):
        index.append(token)
        assert index.propose(k) == _scan(tokens[:end], k, min_n, min_n + extra)
    assert len(index) == len(tokens)


def test_a_quoted_passage_is_proposed_and_the_longest_match_wins() -> None:
    passage = [10, 11, 12, 13, 14, 15]
    index = NgramIndex([1, 2, *passage, 3, 4, 12, 13, 99, 12, 13, 14], min_n=1, max_n=3)
    # "12 13 14" occurred once (in the passage): its followers, not the later "12 13 99"'s
    assert index.propose(3) == (15, 3, 4)
    index = NgramIndex([5, 6, 7, 5, 6, 8, 5, 6], min_n=2, max_n=2)
    assert index.propose(2) == (8, 5)  # the latest earlier "5 6" is followed by 8
    assert NgramIndex([1, 2, 3], min_n=2).propose(4) == ()  # "2 3" never occurred before
    # past the end the copy goes on over itself: the sequence repeating with the match's period
    assert NgramIndex([7, 7, 7], min_n=1, max_n=2).propose(5) == (7,) * 5
    assert NgramIndex([1, 2, 3, 1, 2, 3, 1], min_n=1, max_n=3).propose(5) == (2, 3, 1, 2, 3)
    assert NgramIndex([1, 1], min_n=1).propose(0) == ()


def test_bad_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramIndex(min_n=3, max_n=2)
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramIndex(min_n=0)
