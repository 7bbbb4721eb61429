"""A host KV cache's pages are committed in the step thread's idle time (stoic/model/_pagecommit.py):
a committed cache's first writes take no page fault, and committing never changes what the
pools hold, so it is right between steps of a cache in use."""

from __future__ import annotations

import mmap
import resource

import pytest
import torch

from stoic.model import KVCacheSpec, PagedKVCache
from stoic.model._pagecommit import STEP_BYTES, PageCommitter

_PAGE = mmap.PAGESIZE


def _spec(num_blocks: int, device: str = "cpu") -> KVCacheSpec:
    # 2 layers x 2 heads x 16 positions x 64 floats: 8 KiB a head's block, 64 KiB a block
    return KVCacheSpec(
        num_layers=2,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        num_blocks=num_blocks,
        dtype=torch.float32,
        device=torch.device(device),
    )


def _pools(cache: PagedKVCache) -> tuple[torch.Tensor, ...]:
    return (*cache.keys, *cache.values)


def _faults_writing(tensors: tuple[torch.Tensor, ...]) -> int:
    """Minor page faults taken while writing one byte into every page of ``tensors``."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for tensor in tensors:
        flat = tensor.view(-1).view(torch.uint8)
        flat[::_PAGE] = 1
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def _fresh(size: int) -> tuple[mmap.mmap, torch.Tensor]:
    """``size`` bytes of a new anonymous mapping no one has touched (small pools of a cache
    may come from heap memory earlier tests faulted in), without huge pages where the kernel
    would give them."""
    region = mmap.mmap(-1, size)
    if hasattr(region, "madvise") and hasattr(mmap, "MADV_NOHUGEPAGE"):
        region.madvise(mmap.MADV_NOHUGEPAGE)
    return region, torch.frombuffer(region, dtype=torch.uint8)


def _commit_all(cache: PagedKVCache) -> int:
    calls = 0
    while cache.commit_idle():
        calls += 1
    if cache.pages.failed:
        pytest.skip(f"the kernel commits no pages ahead here ({cache.pages.failed})")
    return calls + 1


def test_committed_pages_take_no_fault_on_their_first_writes() -> None:
    size = 32 * 2**20
    pages = size // _PAGE
    region, lazy = _fresh(size)
    baseline = _faults_writing((lazy,))
    if baseline < pages // 16:  # the kernel maps large folios on a first touch here
        pytest.skip(f"{baseline} faults for {pages} fresh pages: nothing to save")
    region2, fresh = _fresh(size)
    committer = PageCommitter([fresh])
    calls = 0
    while committer.advance():
        calls += 1
    if committer.failed:
        pytest.skip(f"the kernel commits no pages ahead here ({committer.failed})")
    assert committer.committed == committer.total == size
    assert calls + 1 == -(-size // STEP_BYTES)  # a call commits STEP_BYTES, the last the rest
    assert _faults_writing((fresh,)) < pages // 100
    del lazy, fresh
    region.close()
    region2.close()


def test_a_host_caches_idle_work_commits_all_its_pools_then_stops() -> None:
    cache = PagedKVCache(_spec(512))
    assert cache.committing
    _commit_all(cache)
    assert cache.pages.committed == cache.pages.total >= sum(p.nbytes for p in _pools(cache))
    assert not cache.committing and not cache.commit_idle()


def test_committing_never_changes_what_the_pools_hold() -> None:
    cache = PagedKVCache(_spec(256))
    marks = [torch.arange(0, pool.numel(), 997) for pool in _pools(cache)]
    for i, (pool, at) in enumerate(zip(_pools(cache), marks, strict=True)):
        pool.view(-1)[at] = float(i + 1)  # a step wrote here before the idle work reached it
    for _ in range(5):
        cache.commit_idle()
    for pool in _pools(cache):
        pool.view(-1)[-1] = -1.0  # and here, ahead of it
    _commit_all(cache)
    for i, (pool, at) in enumerate(zip(_pools(cache), marks, strict=True)):
        flat = pool.view(-1)
        assert bool((flat[at[at < flat.numel() - 1]] == float(i + 1)).all())
        assert float(flat[-1]) == -1.0


def test_a_released_cache_or_a_device_cache_commits_nothing() -> None:
    released = PagedKVCache(_spec(64))
    released.release()
    assert not released.committing and not released.commit_idle()
    assert released.pages.committed == 0
    meta = PagedKVCache(_spec(8, device="meta"))
    assert meta.pages.total == 0 and not meta.committing and not meta.commit_idle()
