"""The cache manager: owns the block allocator and the KV tensors' lifetime."""

from __future__ import annotations

from collections.abc import Callable
from typing import assert_never

import torch

from ...model import KVCacheSpec, PagedKVCache
from .. import Actor
from ._messages import (
    AcquireKV,
    AllocateBlocks,
    Allocation,
    CacheMsg,
    CacheStats,
    DropAll,
    FreeBlocks,
    GetCacheStats,
)

__all__ = ["BlockAllocator", "CacheManager", "OutOfBlocks"]


class OutOfBlocks(Exception):
    """An allocation asked for more blocks than are free; nothing was allocated."""


class BlockAllocator:
    """Fixed pool of block ids with per-sequence block tables.

    Invariant: every block id is either in the free list or in exactly one table.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        # pop() from the end hands out low ids first (keeps tables compact, easier to read in logs)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[int, list[int]] = {}

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def sequences(self) -> int:
        return len(self._tables)

    def table(self, seq_id: int) -> tuple[int, ...]:
        return tuple(self._tables.get(seq_id, ()))

    def grow(self, grants: tuple[tuple[int, int], ...]) -> dict[int, tuple[int, ...]]:
        """Append ``n`` blocks to each sequence's table; all-or-nothing.

        :raises OutOfBlocks: if the grants together need more than the free blocks.
        :raises ValueError: on a negative count.
        """
        if any(n < 0 for _, n in grants):
            raise ValueError("negative block count")
        need = sum(n for _, n in grants)
        if need > len(self._free):
            raise OutOfBlocks(f"need {need} blocks, {len(self._free)} free")
        out: dict[int, tuple[int, ...]] = {}
        for seq_id, n in grants:
            table = self._tables.setdefault(seq_id, [])
            for _ in range(n):
                table.append(self._free.pop())
            out[seq_id] = tuple(table)
        return out

    def free(self, seq_id: int) -> int:
        """Return a sequence's blocks to the pool (unknown ids are a no-op). Returns blocks freed."""
        table = self._tables.pop(seq_id, None)
        if not table:
            return 0
        self._free.extend(reversed(table))
        return len(table)

    def free_all(self) -> int:
        freed = self.used_blocks
        self._tables.clear()
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
            case AllocateBlocks(grants=grants, reply=reply):
                try:
                    tables = self.allocator.grow(grants)
                except (OutOfBlocks, ValueError) as exc:
                    reply.fail(exc)
                else:
                    fresh = tuple(
                        b for seq_id, _ in grants for b in tables[seq_id] if b in self._unzeroed
                    )
                    self._unzeroed.difference_update(fresh)
                    reply.send(Allocation(tables, self.allocator.free_blocks, fresh))
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

    def stats(self) -> CacheStats:
        return CacheStats(
            blocks_total=self.allocator.num_blocks,
            blocks_used=self.allocator.used_blocks,
            block_size=self.spec.block_size,
            sequences=self.allocator.sequences,
            tensors_allocated=self._kv is not None and not self._kv.released,
            drops=self._drops,
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
