"""A host KV cache's pages are committed in the step thread's idle time (stoic/model/_pagecommit.py):
a committed cache's first writes take no page fault, and committing never changes what the
pools hold, so it is right between steps of a cache in use."""

from __future__ import annotations

import resource

import pytest
import torch

from stoic.model import KVCacheSpec, PagedKVCache
from stoic.model._pagecommit import STEP_BYTES

_PAGE = 4096


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


def _faults_writing(cache: PagedKVCache) -> int:
    """Minor page faults taken while writing one value into every page of every pool."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for pool in _pools(cache):
        pool.view(-1)[:: _PAGE // pool.element_size()] = 1.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def _commit_all(cache: PagedKVCache) -> int:
    calls = 0
    while cache.commit_idle():
        calls += 1
    assert cache.pages is not None
    if cache.pages.failed:
        pytest.skip(f"the kernel commits no pages ahead here ({cache.pages.failed})")
    return calls + 1


def test_a_committed_host_cache_takes_no_page_fault_in_its_first_writes() -> None:
    pages = 64 * 2**20 // _PAGE  # 512 blocks of 64 KiB x 2 layers: 64 MiB of pools
    lazy = PagedKVCache(_spec(512))
    # the baseline: first touches fault (a page at a time, or a few: the kernel may map small
    # multi-page folios)
    assert _faults_writing(lazy) > pages // 16
    lazy.release()
    cache = PagedKVCache(_spec(512))
    assert cache.committing
    calls = _commit_all(cache)
    assert cache.pages is not None and cache.pages.committed == cache.pages.total
    assert calls >= cache.pages.total // STEP_BYTES  # a call commits at most STEP_BYTES
    assert not cache.committing
    assert _faults_writing(cache) < pages // 100


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
    assert released.pages is not None and released.pages.committed == 0
    meta = PagedKVCache(_spec(8, device="meta"))
    assert meta.pages is None and not meta.committing and not meta.commit_idle()
