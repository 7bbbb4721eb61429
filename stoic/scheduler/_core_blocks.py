"""Block tables and the prefix cache's bookkeeping, one part of
:class:`~stoic.scheduler._core.SchedulerCore`: the one way blocks go back (``_release``), the
content hashes a sequence's blocks are looked up and committed under, and the commit of the
blocks a completed step filled. Split from :mod:`stoic.scheduler._core` (module and class
size); it is a mixin over the core's state, which :class:`~stoic.scheduler.SchedulerCore`
initialises, and is never used on its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._allocator import BlockAllocator
from ._plan import prefix_blocks
from ._sequence import Sequence, block_hashes

if TYPE_CHECKING:
    from ._records import SchedulerConfig

__all__ = ["CoreBlocks"]


class CoreBlocks:
    """The block and prefix-cache part of the scheduler's core (see
    :class:`~stoic.scheduler.SchedulerCore` for the invariants)."""

    # the core's state this part reads and writes (initialised by SchedulerCore.__init__)
    cfg: SchedulerConfig
    allocator: BlockAllocator

    def _release(self, seq: Sequence) -> None:
        """The one way blocks go back: forget ``seq``'s table and free its blocks (a block another
        sequence shares stays in use; a committed one stays in the prefix cache, evictable)."""
        if not seq.block_table:
            return
        self.allocator.free(seq.seq_id)
        seq.block_table = ()
        seq.committed_blocks = 0

    def _hashes(self, seq: Sequence, count: int) -> tuple[bytes, ...]:
        return block_hashes(seq.all_ids, self.cfg.block_size, count, seq.hashes)

    def _prefix_hashes(self, seq: Sequence) -> tuple[bytes, ...]:
        """The hashes of the blocks a starting ``seq`` may share from the prefix cache."""
        return self._hashes(seq, prefix_blocks(seq, self.cfg.block_size))

    def _commit_full_blocks(self, seq: Sequence) -> None:
        """Cache the blocks a completed step filled, for later sequences with the same prefix."""
        full = min(seq.num_computed // self.cfg.block_size, len(seq.block_table))
        if full > seq.committed_blocks:
            hashes = self._hashes(seq, full)[seq.committed_blocks :]
            self.allocator.commit(seq.seq_id, seq.committed_blocks, hashes)
            seq.committed_blocks = full
