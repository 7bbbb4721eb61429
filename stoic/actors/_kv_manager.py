"""The cache manager: owns the KV tensors' lifetime and their drop after a failure.

The KV cache's logical side (block tables, free list, prefix hash index, reference counts,
which blocks are not zeroed yet) is the scheduler core's :class:`~stoic.scheduler.BlockAllocator`:
the planner consults it synchronously, so a step is planned on the true cache state rather than
on a guess of what this actor would answer (see :mod:`stoic.scheduler`). What stays here is
what has a lifetime beyond one step's bookkeeping: the tensors, created at start and after a
drop, released on ``DropAll`` and at shutdown.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import assert_never

from ..model import KVCacheSpec, PagedKVCache, empty_device_cache
from ..runtime import Actor
from ._messages import AcquireKV, CacheMsg, DropAll, KVLease

__all__ = ["KVCacheManager"]


class KVCacheManager(Actor[CacheMsg]):
    """Owns the :class:`PagedKVCache` tensors.

    ``DropAll`` releases the tensors (emptying the CUDA allocator's cache on GPUs); the next
    ``AcquireKV`` (from a restarted executor) re-creates them. With ``make_cache=None`` (the
    process executor) the tensors live in the worker process, which drops and re-creates its
    own: the lease carries no tensors, only whether they were dropped. A recovery that keeps
    the cache (pools that outlive the worker) sends no ``DropAll``: the next lease says
    ``dropped=False``.
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        *,
        make_cache: Callable[[KVCacheSpec], PagedKVCache] | None = PagedKVCache,
    ) -> None:
        self.spec = spec
        self._make_cache = make_cache
        self._kv: PagedKVCache | None = None
        #: the cache's contents were dropped since the last lease (or none was given yet:
        #: nothing in the cache is known)
        self._dropped = True

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
            case DropAll(reply=reply):
                held = self._kv is not None
                self._release()
                self._dropped = True
                self.context.log.debug("cache.dropped_all", tensors_released=held)
                reply.send(held)
            case AcquireKV(reply=reply):
                if self._recreate():
                    self.context.log.debug("cache.recreated", blocks=self.spec.num_blocks)
                reply.send(KVLease(self._kv, self._dropped))
                self._dropped = False
            case _:
                assert_never(message)

    def _recreate(self) -> bool:
        """Create the tensors if they live here and are not there (at start, after a drop);
        returns whether it did."""
        # the pools are allocated empty (not zeroed) to keep a restart fast: the scheduler's
        # allocator has every block to be zeroed before its first use (StepBatch.zero_blocks)
        if self._make_cache is None or self._kv is not None:
            return False
        self._kv = self._make_cache(self.spec)
        return True

    def _release(self) -> None:
        if self._kv is not None:
            self._kv.release()
            self._kv = None
        empty_device_cache(self.spec.device)
