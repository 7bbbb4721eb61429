"""The cache manager: owns the block allocator and the KV tensors' lifetime."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import assert_never

import torch

from ...model import KVCacheSpec, PagedKVCache
from .. import Actor, Reply
from ._messages import (
    AcquireKV,
    AllocateBlocks,
    Allocation,
    CacheMsg,
    CacheStats,
    CommitBlocks,
    DropAll,
    FreeBlocks,
    GetCacheStats,
)

__all__ = ["BlockAllocator", "CacheManager", "OutOfBlocks"]


class OutOfBlocks(Exception):
    """An allocation asked for more blocks than are free; nothing was allocated."""


class BlockAllocator:
    """Fixed pool of block ids with per-sequence block tables and a prefix cache.

    **Prefix caching.** A full block whose keys and values a completed step wrote can be
    *committed* under its content hash (a chain over every token up to the block's end, see
    :func:`~stoic.actors.engine._sequence.block_hashes`). A new sequence whose first blocks hash
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

    def grow(self, grants: tuple[tuple[int, int], ...]) -> dict[int, tuple[int, ...]]:
        """Extend each ``(seq_id, total)`` table to ``total`` blocks; all-or-nothing.

        :raises OutOfBlocks: if the grants together need more than the free blocks.
        :raises ValueError: on a negative count.
        """
        if any(n < 0 for _, n in grants):
            raise ValueError("negative block count")
        need = sum(max(0, n - len(self._tables.get(seq_id, ()))) for seq_id, n in grants)
        if need > self.free_blocks:
            raise OutOfBlocks(f"need {need} blocks, {self.free_blocks} free")
        out: dict[int, tuple[int, ...]] = {}
        for seq_id, n in grants:
            table = self._tables.setdefault(seq_id, [])
            while len(table) < n:
                block = self._take()
                self._refs[block] = 1
                table.append(block)
            out[seq_id] = tuple(table)
        return out

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
        """Forget every table and every cached block (their contents are gone)."""
        freed = self.used_blocks
        self._tables.clear()
        self._refs.clear()
        self._by_hash.clear()
        self._hash_of.clear()
        self._evictable.clear()
        self._free = list(range(self.num_blocks - 1, -1, -1))
        return freed


class CacheManager(Actor[CacheMsg]):
    """Owns the :class:`BlockAllocator` and the :class:`PagedKVCache` tensors.

    ``DropAll`` frees every block and releases the tensors (emptying the CUDA allocator's cache on
    GPUs); the next ``AcquireKV`` (from a restarted executor) re-creates them.
    """

    def __init__(
        self, spec: KVCacheSpec, *, make_cache: Callable[[KVCacheSpec], PagedKVCache] = PagedKVCache
    ) -> None:
        self.spec = spec
        self.allocator = BlockAllocator(spec.num_blocks)
        self._make_cache = make_cache
        self._kv: PagedKVCache | None = None
        self._drops = 0
        #: blocks not yet zeroed since the tensors were created (see StepBatch.zero_blocks)
        self._unzeroed: set[int] = set()

    async def on_start(self) -> None:
        self._kv = self._create()
        self.context.log.info(
            "cache.started",
            blocks=self.spec.num_blocks,
            block_size=self.spec.block_size,
            mib=round(self.spec.bytes_per_block * self.spec.num_blocks / 2**20, 1),
        )

    async def on_stop(self) -> None:
        self._release()

    async def receive(self, message: CacheMsg) -> None:
        match message:
            case AllocateBlocks(grants=grants, reply=reply, prefixes=prefixes):
                self._allocate(grants, prefixes, reply)
            case CommitBlocks(entries=entries):
                for seq_id, start, hashes in entries:
                    self.allocator.commit(seq_id, start, hashes)
            case FreeBlocks(seq_ids=seq_ids):
                for seq_id in seq_ids:
                    self.allocator.free(seq_id)
            case DropAll(reply=reply):
                freed = self.allocator.free_all()
                self._release()
                self._drops += 1
                self.context.log.info("cache.dropped_all", blocks_freed=freed)
                reply.send(freed)
            case AcquireKV(reply=reply):
                if self._kv is None or self._kv.released:
                    self._kv = self._create()
                    self.context.log.info("cache.recreated", blocks=self.spec.num_blocks)
                reply.send(self._kv)
            case GetCacheStats(reply=reply):
                reply.send(self.stats())
            case _:
                assert_never(message)

    def _allocate(
        self,
        grants: tuple[tuple[int, int], ...],
        prefixes: tuple[tuple[int, tuple[bytes, ...]], ...],
        reply: Reply[Allocation],
    ) -> None:
        allocator = self.allocator
        shared = {seq_id: allocator.match(seq_id, hashes) for seq_id, hashes in prefixes}
        try:
            tables = allocator.grow(grants)
        except (OutOfBlocks, ValueError) as exc:
            for seq_id, n in shared.items():  # all-or-nothing: give the shared blocks back
                if n:
                    allocator.free(seq_id)
            reply.fail(exc)
            return
        fresh = tuple(b for seq_id, _ in grants for b in tables[seq_id] if b in self._unzeroed)
        self._unzeroed.difference_update(fresh)
        cached = {seq_id: n for seq_id, n in shared.items() if n}
        reply.send(Allocation(tables, allocator.free_blocks, fresh, cached))

    def stats(self) -> CacheStats:
        return CacheStats(
            blocks_total=self.allocator.num_blocks,
            blocks_used=self.allocator.used_blocks,
            block_size=self.spec.block_size,
            sequences=self.allocator.sequences,
            tensors_allocated=self._kv is not None and not self._kv.released,
            drops=self._drops,
            cached_blocks=self.allocator.cached_blocks,
            evictions=self.allocator.evictions,
        )

    def _create(self) -> PagedKVCache:
        # every block starts unzeroed: allocating the pools empty (not zeroed) keeps a restart fast
        self._unzeroed = set(range(self.spec.num_blocks))
        return self._make_cache(self.spec)

    def _release(self) -> None:
        if self._kv is not None:
            self._kv.release()
            self._kv = None
        if self.spec.device.type == "cuda" and torch.cuda.is_available():
            torch.cuda.empty_cache()
