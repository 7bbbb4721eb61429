"""The scheduler's own view of the prefix cache: which block hashes it has committed.

The cache manager owns the prefix cache and answers a new sequence's :class:`PrefixQuery` only
when the planned step's blocks are allocated, after the step's token budget was spent. Without
a guess, a sequence whose prompt starts with ``c`` cached tokens is charged for them too, and
its step computes ``c`` tokens less than the budget allows: a 16-token shared block per
admission in a burst of chat requests, a whole step's budget for an agent whose 2,000-token
tool prompt is cached (the step then carries only the decodes). vLLM's scheduler looks the
prefix up synchronously; stoic's actors cannot, so the core keeps this estimate of what the
cache holds: the hashes it committed, least recently used dropped past the pool's size, all of
them dropped with the cache.

An estimate only: the cache manager may have evicted a block since. The core charges the budget
for the tokens past the estimated prefix and, once the real answer is in, never computes more
than it charged (:func:`~stoic.actors._plan.within_charge`), so a wrong guess only leaves part
of the budget unused, as before.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

__all__ = ["PrefixView"]


class PrefixView:
    """Block hashes believed cached, at most ``capacity`` (the KV pool's blocks), LRU."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._hashes: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def add(self, hashes: Iterable[bytes]) -> None:
        """Blocks committed (or shared again): most recently used now."""
        for h in hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self._capacity:
            self._hashes.popitem(last=False)

    def leading(self, hashes: Iterable[bytes]) -> int:
        """How many of ``hashes`` (a prompt's block hashes, first block first) are believed
        cached from the first on: the blocks a prefix query would share."""
        count = 0
        for h in hashes:
            if h not in self._hashes:
                break
            count += 1
        return count

    def discard(self, hashes: Iterable[bytes]) -> None:
        """Blocks the cache manager did not share though believed cached (evicted since)."""
        for h in hashes:
            self._hashes.pop(h, None)

    def clear(self) -> None:
        """The cache was dropped (an executor failure): nothing is cached."""
        self._hashes.clear()
