"""KV pools in shared memory (:mod:`stoic.model._sharedkv`): sized by the first mapping, the same
pages in every process that maps them, surviving a process killed with SIGKILL, dropped to
zeros with every mapping still valid, and refused when sized for another cache."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from stoic.model import KVCacheSpec, KVMemory, PagedKVCache, shared_kv_available

pytestmark = pytest.mark.skipif(not shared_kv_available(), reason="needs Linux memfd")


def _spec(num_blocks: int = 8, dtype: torch.dtype = torch.float32) -> KVCacheSpec:
    return KVCacheSpec(
        num_layers=3,
        num_kv_heads=2,
        head_dim=16,
        block_size=4,
        num_blocks=num_blocks,
        dtype=dtype,
        device=torch.device("cpu"),
    )


_CHILD = """
import os, signal, sys, torch
from stoic.model import KVCacheSpec, PagedKVCache
spec = KVCacheSpec(3, 2, 16, 4, 8, torch.float32, torch.device("cpu"))
kv = PagedKVCache(spec, memory_fd=int(sys.argv[1]))
for layer in range(3):
    kv.keys[layer].fill_(layer + 1)
    kv.values[layer].fill_(-(layer + 1))
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_pools_written_by_a_process_killed_with_sigkill_are_there_for_the_next() -> None:
    """A child maps the memory, writes every pool and is killed with SIGKILL: a new mapping
    here finds every value it wrote, each pool in its own place."""
    memory = KVMemory()
    try:
        child = subprocess.run(
            [sys.executable, "-c", _CHILD, str(memory.fd)], pass_fds=(memory.fd,), check=False
        )
        assert child.returncode == -signal.SIGKILL
        kv = PagedKVCache(_spec(), memory_fd=memory.fd)
        for layer in range(3):
            assert torch.all(kv.keys[layer] == layer + 1)
            assert torch.all(kv.values[layer] == -(layer + 1))
    finally:
        memory.close()


def test_two_mappings_share_every_page_and_a_drop_zeroes_them_in_both() -> None:
    """What one mapping writes the other reads; :meth:`KVMemory.drop` leaves both mappings
    valid, reading zeros, the file's size unchanged."""
    memory = KVMemory()
    try:
        a = PagedKVCache(_spec(), memory_fd=memory.fd)
        b = PagedKVCache(_spec(), memory_fd=memory.fd)
        assert a.shared and memory.size > 0
        a.values[2][5].fill_(7.0)
        assert torch.all(b.values[2][5] == 7.0) and torch.all(b.keys[2] == 0)
        size = memory.size
        memory.drop()
        assert memory.size == size
        assert torch.all(a.values[2] == 0) and torch.all(b.values[2] == 0)
        b.keys[0].fill_(3.0)  # still writable after the drop
        assert torch.all(a.keys[0] == 3.0)
    finally:
        memory.close()


def test_memory_sized_for_another_cache_is_refused() -> None:
    """A worker whose spec needs another size (another model, another block count) gets a
    clear error instead of pools over the wrong bytes."""
    memory = KVMemory()
    try:
        PagedKVCache(_spec(8), memory_fd=memory.fd)
        with pytest.raises(ValueError, match="sized for another model or block count"):
            PagedKVCache(_spec(9), memory_fd=memory.fd)
    finally:
        memory.close()


def test_pools_start_page_aligned_and_hold_the_spec_dtype() -> None:
    """Each pool starts on a page boundary (the C kernels' vector loads) and has the spec's
    shape and dtype."""
    memory = KVMemory()
    try:
        kv = PagedKVCache(_spec(5, torch.bfloat16), memory_fd=memory.fd)
        page = os.sysconf("SC_PAGE_SIZE")
        for pool in (*kv.keys, *kv.values):
            assert pool.data_ptr() % page == 0
            assert pool.shape == (2 * 5, 4, 16) and pool.dtype == torch.bfloat16
    finally:
        memory.close()


def test_shared_pools_are_host_memory_only() -> None:
    """A device's cache cannot be mapped from a file: refused before anything is mapped."""
    spec = _spec()
    meta = KVCacheSpec(**{**spec.__dict__, "device": torch.device("meta")})
    with pytest.raises(ValueError, match="host memory"):
        PagedKVCache(meta, memory_fd=0)
