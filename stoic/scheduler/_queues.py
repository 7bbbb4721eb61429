"""Where the scheduler's sequences are: waiting, running, held back by a poison isolation, and
by request id; the one way a sequence's blocks go back and the content hashes its blocks are
shared and committed under (the prefix cache's bookkeeping on the allocator).

Shared by the core (planning, completion, admission, removal) and its recovery collaborator
(:class:`~stoic.scheduler._recovery.Recovery`), which move sequences between these queues only
through the methods here.
"""

from __future__ import annotations

from collections import deque

from ._allocator import BlockAllocator
from ._plan import prefix_blocks
from ._sequence import Seq, SeqStatus, block_hashes
from ._tenants import TenantShares

__all__ = ["SeqQueues"]


class SeqQueues:
    """The sequences admitted and not yet ended, in three queues, and their blocks.

    A sequence is in exactly one of :attr:`waiting` (admission order; a preempted one at the
    front), :attr:`running` or :attr:`held` (held back while a poison isolation runs a suspect
    alone), and in :attr:`by_request`, from :meth:`admit` until :meth:`unlink`.
    """

    def __init__(
        self, allocator: BlockAllocator, block_size: int, shares: TenantShares | None = None
    ) -> None:
        #: the KV cache's logical side: block tables, free list, prefix cache
        self.allocator = allocator
        #: the tenants' shares: a sequence joins its tenant at :meth:`admit`, leaves at
        #: :meth:`unlink`
        self.shares = shares or TenantShares()
        self.block_size = block_size
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.held: list[Seq] = []
        self.by_request: dict[str, Seq] = {}

    def everyone(self) -> list[Seq]:
        """Every sequence not ended: running, then waiting, then held back."""
        return [*self.running, *self.waiting, *self.held]

    def admit(self, seq: Seq, *, hold: bool) -> None:
        """Queue a new sequence: held back (``hold``: an isolation runs) or waiting."""
        self.by_request[seq.request_id] = seq
        self.shares.joined(seq.tenant)
        (self.held if hold else self.waiting).append(seq)

    def unlink(self, seq: Seq) -> None:
        """Forget a sequence, whatever its state, and give its blocks back."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            (self.held if seq in self.held else self.waiting).remove(seq)
        seq.status = SeqStatus.FINISHED
        if self.by_request.get(seq.request_id) is seq:
            del self.by_request[seq.request_id]
            self.shares.left(seq.tenant)
        self.release(seq)

    def release(self, seq: Seq) -> None:
        """The one way blocks go back: forget ``seq``'s table and free its blocks (a block another
        sequence shares stays in use; a committed one stays in the prefix cache, evictable)."""
        if not seq.block_table:
            return
        self.allocator.free(seq.seq_id)
        seq.block_table = ()
        seq.committed_blocks = 0

    def restart(self, seq: Seq) -> None:
        """``seq`` starts again from nothing computed (preempted, resumed, or stepping aside):
        its blocks go back and it is marked waiting; the caller queues it."""
        self.release(seq)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING

    def prefix_hashes(self, seq: Seq) -> tuple[bytes, ...]:
        """The hashes of the blocks a starting ``seq`` may share from the prefix cache."""
        return self._hashes(seq, prefix_blocks(seq, self.block_size))

    def commit_full_blocks(self, seq: Seq) -> None:
        """Cache the blocks a completed step filled, for later sequences with the same prefix."""
        full = min(seq.num_computed // self.block_size, len(seq.block_table))
        if full > seq.committed_blocks:
            hashes = self._hashes(seq, full)[seq.committed_blocks :]
            self.allocator.commit(seq.seq_id, seq.committed_blocks, hashes)
            seq.committed_blocks = full

    def _hashes(self, seq: Seq, count: int) -> tuple[bytes, ...]:
        return block_hashes(seq.all_ids, self.block_size, count, seq.hashes)
