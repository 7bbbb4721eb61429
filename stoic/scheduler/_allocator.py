"""The block allocator: a fixed pool of KV block ids, per-sequence block tables, a prefix cache.

The logical side of the KV cache, owned by the scheduler's core so that a step is planned on
the true state (the prefix lookup, the blocks' allocation and the plan in one synchronous
call, as vLLM's scheduler does). The physical side, the KV tensors and their drop after a
failure, is the cache manager actor's (:class:`stoic.actors.KVCacheManager`).
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["BlockAllocator", "OutOfBlocks"]


class OutOfBlocks(Exception):
    """An allocation asked for more blocks than are free; nothing was allocated."""


class BlockAllocator:
    """Fixed pool of block ids with per-sequence block tables and a prefix cache.

    **Prefix caching.** A full block whose keys and values a completed step wrote can be
    *committed* under its content hash (a chain over every token up to the block's end, see
    :func:`~stoic.scheduler.block_hashes`). A new sequence whose first blocks hash
    the same shares those blocks instead of computing them (:meth:`match`); a shared block is
    reference-counted. A committed block nobody references stays cached, *evictable*, in
    least-recently-used order, and is handed out again (its hash forgotten) only when no block is
    free.

    Invariant: every block id is in exactly one of: the free list, the evictable set (reference
    count 0, committed), or one or more tables (reference count = number of tables holding it).
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        # pop() from the end hands out low ids first (keeps tables compact, easier to read in logs)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[int, list[int]] = {}
        self._refs: dict[int, int] = {}
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        #: blocks not handed out since the pool was created or dropped (not zeroed yet)
        self._unzeroed: set[int] = set(range(num_blocks))
        self.evictions = 0

    @property
    def free_blocks(self) -> int:
        """Blocks an allocation can take: free ones plus cached ones nobody uses."""
        return len(self._free) + len(self._evictable)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - self.free_blocks

    @property
    def cached_blocks(self) -> int:
        """Committed blocks (in use or evictable)."""
        return len(self._hash_of)

    @property
    def sequences(self) -> int:
        return len(self._tables)

    def table(self, seq_id: int) -> tuple[int, ...]:
        return tuple(self._tables.get(seq_id, ()))

    def lookup(self, hashes: tuple[bytes, ...]) -> tuple[int, int]:
        """What :meth:`match` would share, changing nothing: ``(blocks, unused)``, the leading
        cached blocks of ``hashes`` and how many of them no table holds (evictable: sharing
        takes those out of :attr:`free_blocks`)."""
        blocks = unused = 0
        for digest in hashes:
            block = self._by_hash.get(digest)
            if block is None:
                break
            blocks += 1
            unused += block in self._evictable
        return blocks, unused

    def match(self, seq_id: int, hashes: tuple[bytes, ...]) -> int:
        """Start ``seq_id``'s (empty) table with the cached blocks of its longest cached prefix.

        Returns the number of blocks shared (0 when the sequence already has blocks).
        """
        if self._tables.get(seq_id):
            return 0
        shared: list[int] = []
        for digest in hashes:
            block = self._by_hash.get(digest)
            if block is None:
                break
            shared.append(block)
        for block in shared:
            self._evictable.pop(block, None)
            self._refs[block] = self._refs.get(block, 0) + 1
        if shared:
            self._tables[seq_id] = shared
        return len(shared)

    def grow(self, seq_id: int, total: int) -> tuple[int, ...]:
        """Extend ``seq_id``'s table to ``total`` blocks; all-or-nothing.

        Returns the blocks it took that were never handed out since the pool was created or
        last dropped (:meth:`free_all`): their memory holds no zeros yet (see
        :attr:`stoic.request.StepBatch.zero_blocks`).

        :raises OutOfBlocks: if that needs more than the free blocks (nothing changes).
        """
        table = self._tables.get(seq_id, [])
        need = total - len(table)
        if need > self.free_blocks:
            raise OutOfBlocks(f"need {need} blocks, {self.free_blocks} free")
        if need <= 0:
            return ()
        self._tables[seq_id] = table
        fresh: list[int] = []
        for _ in range(need):
            block = self._take()
            self._refs[block] = 1
            table.append(block)
            if block in self._unzeroed:
                self._unzeroed.discard(block)
                fresh.append(block)
        return tuple(fresh)

    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        block, _ = self._evictable.popitem(last=False)  # least recently used
        del self._by_hash[self._hash_of.pop(block)]
        self.evictions += 1
        return block

    def commit(self, seq_id: int, start: int, hashes: tuple[bytes, ...]) -> int:
        """Cache blocks ``start, start+1, ...`` of ``seq_id``'s table under ``hashes``.

        Only call it once a step has written those blocks completely. A hash already cached (the
        same prefix computed twice at once) keeps its first block. Returns blocks committed.
        """
        table = self._tables.get(seq_id, [])
        committed = 0
        for index, digest in enumerate(hashes, start):
            if index >= len(table):
                break
            block = table[index]
            if digest in self._by_hash or block in self._hash_of:
                continue
            self._by_hash[digest] = block
            self._hash_of[block] = digest
            committed += 1
        return committed

    def free(self, seq_id: int) -> int:
        """Release a sequence's blocks (unknown ids are a no-op). Returns blocks it held.

        Blocks still shared with another sequence stay in use; committed ones become evictable
        (most recently used last); the rest go back to the free list.
        """
        table = self._tables.pop(seq_id, None)
        if not table:
            return 0
        for block in reversed(table):
            refs = self._refs[block] - 1
            if refs:
                self._refs[block] = refs
                continue
            del self._refs[block]
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._free.append(block)
        return len(table)

    def free_all(self) -> int:
        """Forget every table and every cached block: the KV tensors were dropped, so their
        contents are gone and every block is to be zeroed again before its first use.
        Returns how many blocks were in use."""
        freed = self.used_blocks
        self._tables.clear()
        self._refs.clear()
        self._by_hash.clear()
        self._hash_of.clear()
        self._evictable.clear()
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._unzeroed = set(range(self.num_blocks))
        return freed

    def check_invariant(self) -> None:
        """Assert the allocator's invariant (for tests): every block is in exactly one of the free
        list, the evictable set or one or more tables, with a reference count equal to the
        number of tables holding it; the hash maps are inverse of each other.

        :raises AssertionError: naming the first violation.
        """
        held: dict[int, int] = {}
        for table in self._tables.values():
            assert len(set(table)) == len(table), f"a table holds a block twice: {table}"
            for block in table:
                held[block] = held.get(block, 0) + 1
        assert held == self._refs, f"reference counts {self._refs} != table holdings {held}"
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a block is twice in the free list"
        assert not free & evictable, f"blocks both free and evictable: {free & evictable}"
        assert not (free | evictable) & held.keys(), "a free or evictable block is held"
        assert free | evictable | held.keys() == set(range(self.num_blocks)), "a block is lost"
        assert evictable <= self._hash_of.keys(), "an evictable block is not committed"
        assert self._unzeroed <= free, "a block not zeroed yet was handed out"
        assert {b: h for h, b in self._by_hash.items()} == self._hash_of, "hash maps disagree"
