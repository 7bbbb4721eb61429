"""Committing a host KV cache's pages in the step thread's idle time.

A pool from ``torch.empty`` is address space only: each 4 KiB page is faulted in by the first
step that writes it, inside that step. Where a first touch is dear that is a large part of a
prompt chunk's cost: on this project's virtual machines (the host backs each page on its first
touch, and takes freed memory back) it costs about 35 us a page, a 225-token chunk of the
default model writes some 1,300 fresh pages, and that step took 1.25-1.65x its time over
committed pages (``benchmarks/kv_commit_bench.py``). Every token a server has not yet held pays
it until the whole cache has been used once.

Committing the whole cache before reporting ready (llama.cpp clears its KV buffer at start)
took 6-7 s a GiB there: a restarted worker would take twice as long to take over. Committing
in a background thread, even at nice 19, slowed the steps it ran beside by 10-15% (when it ran
it held a core for a whole time slice, which a step's threads then waited for). So the thread
that runs the steps commits the pages itself while it has no step to run
(:meth:`PageCommitter.advance`, 256 KiB a call, then it looks for a step again): a server idle
for some seconds after start has its whole cache committed by then, a busy one commits nothing
and pays the first touches as before, and no step waits more than one call's pages (about 2 ms
at 35 us a page; about 0.03 ms on a machine whose first touch costs 0.5 us).

The call is ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14): the kernel faults each page in,
writable, without touching its contents, so it is right for pools that already hold live
keys and values. Without it (another kernel or platform) nothing is committed ahead; a call
the kernel refuses (``EINVAL``: a kernel before 5.14; ``ENOMEM``) ends the work with one
``kv_cache.commit_stopped`` warning. A warm spare commits nothing until it serves (the worker's
``role``): it may never, and it would take the CPU beside the serving worker's steps. A
device's tensors have nothing to commit (their memory is allocated when asked).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
from collections.abc import Sequence

import torch

from .._logging import get_logger
from ._libc import libc_function

__all__ = ["STEP_BYTES", "PageCommitter"]

_log = get_logger("stoic.model")

#: ``MADV_POPULATE_WRITE`` (linux/mman.h, Linux 5.14); Python's mmap module does not name it
_MADV_POPULATE_WRITE = 23
_PAGE = mmap.PAGESIZE
#: bytes a call (:meth:`PageCommitter.advance`, a whole number of pages): the longest a step
#: can wait for the idle work
STEP_BYTES = max(1, (256 << 10) // _PAGE) * _PAGE


_MADVISE = libc_function("madvise", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


class PageCommitter:
    """Commits the pages of some host tensors a call at a time (the module's notes).

    It holds their addresses, not the tensors: the owner keeps them alive while it calls
    :meth:`advance`. ``committed`` of ``total`` bytes are done; ``failed`` names why it stopped
    short (the kernel refused the call), else None.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._spans: list[tuple[int, int]] = []
        for tensor in tensors:
            if tensor.device.type == "cpu" and tensor.numel():
                start = tensor.data_ptr() // _PAGE * _PAGE
                self._spans.append((start, tensor.data_ptr() + tensor.nbytes))
        self.total = sum(end - start for start, end in self._spans)
        self.committed = 0
        self.failed: str | None = None if _MADVISE is not None else "no MADV_POPULATE_WRITE"
        self._span = 0
        self._at = self._spans[0][0] if self._spans else 0

    @property
    def pending(self) -> bool:
        """Whether there are pages left to commit (False once done, or once the call failed)."""
        return self.failed is None and self._span < len(self._spans)

    def advance(self, limit: int = STEP_BYTES) -> bool:
        """Commit up to ``limit`` more bytes; returns :attr:`pending` afterwards. Never raises:
        a refused call (an old kernel: ``EINVAL``; no memory: ``ENOMEM``) ends the work, named
        in :attr:`failed`."""
        if not self.pending or _MADVISE is None:
            return False
        end = self._spans[self._span][1]
        size = min(limit, end - self._at)
        if _MADVISE(self._at, size, _MADV_POPULATE_WRITE) != 0:
            code = ctypes.get_errno()
            self.failed = errno.errorcode.get(code, str(code))
            _log.warning(
                "kv_cache.commit_stopped",
                error=self.failed,
                committed_mib=round(self.committed / 2**20, 1),
                total_mib=round(self.total / 2**20, 1),
            )
            return False
        self.committed += size
        self._at += size
        if self._at >= end:
            self._span += 1
            if self._span < len(self._spans):
                self._at = self._spans[self._span][0]
        return self.pending
