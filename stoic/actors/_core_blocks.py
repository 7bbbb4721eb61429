"""Block tables and the prefix cache's bookkeeping, one part of
:class:`~stoic.actors._core.SchedulerCore`: the one way blocks go back (``_release``), the
holder counts that keep the free-block estimate exact, the queued prefix-cache commits and block
frees (:meth:`CoreBlocks.take_cache_updates`) and the prefix view. Split from
:mod:`stoic.actors._core` (module and class size); it is a mixin over the core's state, which
:class:`~stoic.actors._core.SchedulerCore` initialises, and is never used on its own.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from ._messages import BlockCommit
from ._plan import Planned, prefix_blocks
from ._sequence import Sequence, block_hashes

if TYPE_CHECKING:
    from ._prefix_view import PrefixView
    from ._records import SchedulerConfig

__all__ = ["CoreBlocks"]


class CoreBlocks:
    """The block and prefix-cache part of the scheduler's core (see
    :class:`~stoic.actors._core.SchedulerCore` for the invariants)."""

    # the core's state this part reads and writes (initialised by SchedulerCore.__init__)
    cfg: SchedulerConfig
    _free_blocks: int
    _holders: Counter[int]
    _to_free: list[int]
    _to_commit: list[BlockCommit]
    _prefix_view: PrefixView
    _prefix_missed_tokens: int

    def _release(self, seq: Sequence) -> int:
        """The one way blocks go back: forget ``seq``'s table and queue its blocks' release.

        Returns how many blocks became free (a block another sequence shares stays in use).
        """
        if not seq.block_table:
            return 0
        freed = self._set_table(seq, ())
        seq.committed_blocks = 0
        self._to_free.append(seq.seq_id)
        return freed

    def _set_table(self, seq: Sequence, table: tuple[int, ...]) -> int:
        """Give ``seq`` a new block table, keeping the holder counts; returns how many blocks
        of its old table nobody holds any more (they count as free again)."""
        holders = self._holders
        for block in table:
            holders[block] += 1
        freed = 0
        for block in seq.block_table:
            holders[block] -= 1
            if holders[block] == 0:
                del holders[block]
                freed += 1
        seq.block_table = table
        self._free_blocks += freed
        return freed

    def take_cache_updates(self) -> tuple[tuple[BlockCommit, ...], tuple[int, ...]]:
        """The prefix-cache commits and block frees queued since the last call, to be sent in
        that order (a finished sequence's full blocks must be committed before they are freed)."""
        commits, self._to_commit = tuple(self._to_commit), []
        frees, self._to_free = tuple(self._to_free), []
        return commits, frees

    def _hashes(self, seq: Sequence, count: int) -> tuple[bytes, ...]:
        return block_hashes(seq.all_ids, self.cfg.block_size, count, seq.hashes)

    def _learn_prefixes(self, planned: list[Planned], cached_blocks: dict[int, int]) -> None:
        """Update the prefix view from the cache manager's answer (``cached_blocks``: the blocks
        it shared, by sequence): shared blocks are the most recently used now; blocks believed
        cached but not shared are believed no more (the next request is not misled), and
        counted as missed."""
        size = self.cfg.block_size
        for p in planned:
            shared = cached_blocks.get(p.seq.seq_id, 0)
            self._prefix_view.add(p.seq.hashes[:shared])
            if p.charge is None:
                continue
            believed = (p.n_tokens - p.charge) // size
            if believed > shared:
                self._prefix_missed_tokens += (believed - shared) * size
                self._prefix_view.discard(p.seq.hashes[shared:believed])

    def _believed_cached(self, seq: Sequence) -> int:
        """Tokens of ``seq``'s prefix the prefix cache is believed to share when it starts."""
        if not self._prefix_view:
            return 0
        count = prefix_blocks(seq, self.cfg.block_size)
        return self._prefix_view.leading(self._hashes(seq, count)) * self.cfg.block_size

    # -- completion -----------------------------------------------------------------------------

    def _commit_full_blocks(self, seq: Sequence) -> None:
        """Queue the blocks this step filled for the prefix cache."""
        full = min(seq.num_computed // self.cfg.block_size, len(seq.block_table))
        if full > seq.committed_blocks:
            hashes = self._hashes(seq, full)[seq.committed_blocks :]
            self._to_commit.append(BlockCommit(seq.seq_id, seq.committed_blocks, hashes))
            self._prefix_view.add(hashes)
            seq.committed_blocks = full
