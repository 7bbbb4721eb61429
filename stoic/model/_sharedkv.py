"""KV pools in memory that outlives the process computing into them.

With the process executor the worker computes every key and value, but a worker that dies
(``kill -9``, the kernel's OOM killer, a watchdog's kill of a hang) takes private pools with
it, and every resumed sequence is prefilled again from its prompt. So on a host the server
creates the pools' memory (:class:`KVMemory`: one ``memfd``, anonymous shared memory with no
name on any file system) and every worker it starts inherits the descriptor and maps it
(:func:`map_pools`): the pages belong to the file, not to a process, and survive the worker;
a replacement maps the same pages and the scheduler's block tables still say what each holds.

Layout: the ``2 * num_layers`` pools of a :class:`~._paged.KVCacheSpec` one after the other,
keys then values of layer 0, then layer 1..., each starting on a page boundary
(:func:`pools_layout`). The first worker sizes the file (its sizing decides ``num_blocks``);
a later one finds it sized and checks that the size is what its own spec needs.

Dropping the contents (:meth:`KVMemory.drop`) punches the whole file out: its pages go back
to the kernel and read as zeros afterwards, while every mapping stays valid. That is the drop
after a segfault, a poisoned device or an out-of-memory failure, done by whichever process
holds the descriptor; a worker that is alive may keep its mapping.

A device's memory is not a file: on a GPU the same ownership needs a keeper process that
allocates the pools and lends them to each worker (CUDA IPC handles); ``docs/architecture.md``
has the design. Only the host implements it here.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

import torch

from ._libc import libc_function

__all__ = ["KVMemory", "drop_contents", "map_pools", "pools_layout", "shared_kv_available"]

_PAGE = mmap.PAGESIZE
#: ``fallocate`` flags (linux/falloc.h): free the range's pages, keep the file's size
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02


def shared_kv_available() -> bool:
    """Whether this platform can share KV pools between processes (Linux: ``memfd_create``)."""
    return sys.platform.startswith("linux") and hasattr(os, "memfd_create")


def pools_layout(
    num_layers: int, pool_shape: tuple[int, ...], dtype: torch.dtype
) -> tuple[int, int]:
    """``(stride, total)``: the bytes from one pool's start to the next (a pool's bytes rounded
    up to a page) and the file's size for ``2 * num_layers`` pools of ``pool_shape``."""
    element = torch.empty((), dtype=dtype).element_size()
    pool = element
    for dim in pool_shape:
        pool *= dim
    stride = -(-pool // _PAGE) * _PAGE
    return stride, 2 * num_layers * stride


_FALLOCATE = libc_function("fallocate", ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)


class KVMemory:
    """The KV pools' memory: a ``memfd`` this process owns and its workers inherit.

    The descriptor is inheritable only where it is passed (``pass_fds``); it lives until
    :meth:`close`. Creating one costs nothing: the file is empty until the first worker sizes it.

    :raises OSError: if the kernel refuses the ``memfd`` (no such call, or no memory).
    """

    def __init__(self, name: str = "stoic-kv") -> None:
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)

    @property
    def size(self) -> int:
        """The file's size (0 until the first worker sized it)."""
        return os.fstat(self.fd).st_size

    def drop(self) -> None:
        """Drop every key and value: the pages go back to the kernel and read as zeros after;
        mappings stay valid. Idempotent; a no-op on an empty file."""
        drop_contents(self.fd)

    def close(self) -> None:
        """Close the descriptor: the memory is freed once no worker maps it any more."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def drop_contents(fd: int) -> None:
    """Punch the whole of file ``fd`` out (see :meth:`KVMemory.drop`). Without ``fallocate``
    the file is truncated to nothing and sized again, which does the same for a ``memfd``.

    :raises OSError: if the kernel refuses both.
    """
    size = os.fstat(fd).st_size
    if not size:
        return
    flags = _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE
    if _FALLOCATE is not None and _FALLOCATE(fd, flags, 0, size) == 0:
        return
    os.ftruncate(fd, 0)
    os.ftruncate(fd, size)


def map_pools(
    fd: int, num_layers: int, pool_shape: tuple[int, ...], dtype: torch.dtype
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The key and value pools of every layer, as tensors over file ``fd``'s shared pages.

    Sizes an empty file to :func:`pools_layout`'s total (the first worker); a file of another
    size is another model's or another sizing's.

    :raises ValueError: the file's size is neither 0 nor what ``pool_shape`` needs.
    """
    stride, total = pools_layout(num_layers, pool_shape, dtype)
    size = os.fstat(fd).st_size
    if size == 0:
        os.ftruncate(fd, total)
    elif size != total:
        raise ValueError(
            f"the shared KV memory holds {size} bytes, this cache needs {total}: it was sized "
            "for another model or block count"
        )
    # the mapping lives as long as a tensor over it (torch.frombuffer keeps the buffer)
    memory = mmap.mmap(fd, total, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    count = 1
    for dim in pool_shape:
        count *= dim
    pools = [
        torch.frombuffer(memory, dtype=dtype, count=count, offset=i * stride).view(pool_shape)
        for i in range(2 * num_layers)
    ]
    return pools[0::2], pools[1::2]
