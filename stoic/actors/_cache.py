"""The cache manager: owns the block allocator and the KV tensors' lifetime."""

from __future__ import annotations

from collections.abc import Callable
from typing import assert_never

from ..model import KVCacheSpec, PagedKVCache, empty_device_cache
from ..runtime import Actor, Reply
from ._allocator import BlockAllocator, OutOfBlocks
from ._messages import (
    AcquireKV,
    AllocateBlocks,
    Allocation,
    BlockGrant,
    CacheMsg,
    CacheStats,
    CommitBlocks,
    DropAll,
    FreeBlocks,
    GetCacheStats,
    PrefixQuery,
)

__all__ = ["CacheManager"]


class CacheManager(Actor[CacheMsg]):
    """Owns the :class:`BlockAllocator` and the :class:`PagedKVCache` tensors.

    ``DropAll`` frees every block and releases the tensors (emptying the CUDA allocator's cache on
    GPUs); the next ``AcquireKV`` (from a restarted executor) re-creates them. With
    ``make_cache=None`` (the process executor) the tensors live in the worker process: this actor
    keeps the logical side only (allocator, block tables, prefix hashes, which blocks are not
    yet zeroed) and ``AcquireKV`` answers ``None``.
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        *,
        make_cache: Callable[[KVCacheSpec], PagedKVCache] | None = PagedKVCache,
    ) -> None:
        self.spec = spec
        self.allocator = BlockAllocator(spec.num_blocks)
        self._make_cache = make_cache
        self._kv: PagedKVCache | None = None
        #: the pools are to be (re)created before the next use (at start, after a DropAll)
        self._stale = True
        self._drops = 0
        #: blocks not yet zeroed since the tensors were created (see StepBatch.zero_blocks)
        self._unzeroed: set[int] = set()

    async def on_start(self) -> None:
        self._recreate()
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
                for entry in entries:
                    self.allocator.commit(entry.seq_id, entry.start, entry.hashes)
            case FreeBlocks(seq_ids=seq_ids):
                for seq_id in seq_ids:
                    self.allocator.free(seq_id)
            case DropAll(reply=reply):
                freed = self.allocator.free_all()
                self._release()
                self._stale = True
                self._drops += 1
                self.context.log.debug("cache.dropped_all", blocks_freed=freed)
                reply.send(freed)
            case AcquireKV(reply=reply):
                if self._stale:
                    self._recreate()
                    self.context.log.debug("cache.recreated", blocks=self.spec.num_blocks)
                reply.send(self._kv)
            case GetCacheStats(reply=reply):
                reply.send(self.stats())
            case _:
                assert_never(message)

    def _allocate(
        self,
        grants: tuple[BlockGrant, ...],
        prefixes: tuple[PrefixQuery, ...],
        reply: Reply[Allocation],
    ) -> None:
        try:
            tables, cached = self.allocator.allocate(grants, prefixes)
        except (OutOfBlocks, ValueError) as exc:
            reply.fail(exc)
            return
        fresh = tuple(b for g in grants for b in tables[g.seq_id] if b in self._unzeroed)
        self._unzeroed.difference_update(fresh)
        reply.send(Allocation(tables, self.allocator.free_blocks, fresh, cached))

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

    def _recreate(self) -> None:
        # every block starts unzeroed: allocating the pools empty (not zeroed) keeps a restart fast
        self._unzeroed = set(range(self.spec.num_blocks))
        if self._make_cache is not None:
            self._kv = self._make_cache(self.spec)
        self._stale = False

    def _release(self) -> None:
        if self._kv is not None:
            self._kv.release()
            self._kv = None
        empty_device_cache(self.spec.device)
