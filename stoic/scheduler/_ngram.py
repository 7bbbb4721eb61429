"""Prompt-lookup drafts: the tokens that followed the latest earlier occurrence of a sequence's
last n tokens, found in O(1) a token (issue 51's proposer; llama.cpp's and vLLM's n-gram
speculation look the same up by scanning).

:class:`NgramIndex` keeps, for each n in ``[min_n, max_n]``, the end of the latest earlier
occurrence of every n-gram of the sequence (prompt and output alike), updated as tokens are
appended. :meth:`NgramIndex.propose` tries the longest n first (and copies on past the sequence's
end, periodically): the longer the match, the likelier the continuation repeats (code being edited, a quoted passage, JSON that repeats its keys). A
match is an *earlier* occurrence: the sequence's own last n tokens are never their own match.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["NgramIndex"]


class NgramIndex:
    """The n-grams of one sequence's tokens and where each last occurred.

    :param min_n: the shortest suffix matched (at least 1).
    :param max_n: the longest (at least ``min_n``).
    :raises ValueError: if ``1 <= min_n <= max_n`` does not hold.
    """

    def __init__(self, tokens: Iterable[int] = (), *, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, not {min_n} and {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self._tokens: list[int] = []
        #: per n (index n - min_n): n-gram -> end (exclusive) of its latest occurrence, for the
        #: n-grams that end before the last token (so the suffix never finds itself)
        self._ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(min_n, max_n + 1)]
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def append(self, token: int) -> None:
        """Add the sequence's next token."""
        tokens = self._tokens
        end = len(tokens)  # the n-grams ending here (before ``token``) become searchable
        for n, ends in zip(range(self.min_n, self.max_n + 1), self._ends, strict=True):
            if end >= n:
                ends[tuple(tokens[end - n : end])] = end
        tokens.append(token)

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.append(token)

    def propose(self, k: int) -> tuple[int, ...]:
        """``k`` tokens that followed the latest earlier occurrence of the longest suffix
        (``max_n`` tokens down to ``min_n``) that occurred before; ``()`` if none did (or
        ``k`` < 1). Where the followers run into the sequence's end the copy goes on over the
        tokens it has proposed (an overlapping copy, as LZ77's): the sequence repeating with
        the period the match found. A loop of p tokens (a list, a refrain, a model stuck on a
        phrase) then gets ``k`` drafts, not p; measured on a 1.5B model that repeats itself,
        ~1 draft a step before, 4 after."""
        tokens = self._tokens
        if k < 1:
            return ()
        size = len(tokens)
        for n in range(min(self.max_n, size), self.min_n - 1, -1):
            end = self._ends[n - self.min_n].get(tuple(tokens[size - n :]))
            if end is not None:
                out = tokens[end : end + k]
                while len(out) < k:  # end + len(out) >= size: a token proposed p back
                    out.append(out[end + len(out) - size])
                return tuple(out)
        return ()
