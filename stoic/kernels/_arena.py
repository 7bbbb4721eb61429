"""Where the int8 layouts' bytes live: private memory, or shared memory every worker maps.

A 1.5B Q4_K_M file's layouts (:meth:`Kernels.g8_layout`) are 1.1 GiB packed from the file's
blocks in 0.8 s; an 8B file's 5.2 GiB in about 4 s. Packed privately, every worker process of a
server holds its own copy (a warm spare doubles them) and a replacement after ``kill -9`` packs
them again. With a :class:`SharedLayouts` in place (:func:`use_layouts`) the first worker packs
each layout into one ``memfd`` the server owns, at an offset it records; the record (its
:attr:`SharedLayouts.table`, a few KiB) goes to the server, which hands it and the ``memfd``
to every later worker, whose arena then maps each layout read-only instead of packing it. So the
layouts' memory is one copy however many workers there are, and outlives any of them.

Each request names its layout by a key: the variant asked for, and each part's type, shape and a
checksum of its first and last 4 KiB of blocks (matrices of one shape differ there). A later
worker maps the recorded layout of the same key, whatever the order it asks in; a key the
record lacks (another file, other flags) is packed privately (counted in
:meth:`SharedLayouts.stats`).
The mapped pages are read-only in a later worker: a stray write there is a crash of that worker
(replaced as any), never a corruption of the copy the others serve from.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import warnings
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch

__all__ = ["LayoutEntry", "SharedLayouts", "current_layouts", "use_layouts"]

#: a layout's bytes: ``alloc(nbytes)`` gives a uint8 tensor of that many to pack into
Alloc = Callable[[int], torch.Tensor]


class LayoutEntry(NamedTuple):
    """One packed layout in the shared memory."""

    key: str
    offset: int
    nbytes: int
    #: the layout id it was packed in (``G8Layout.layout``)
    layout: int


class SharedLayouts:
    """The layouts of one worker in the ``memfd`` ``fd`` (the server's; not closed here):
    packed into it and recorded where ``table`` is None (the first worker), else mapped from
    it by ``table`` (a later one)."""

    def __init__(self, fd: int, table: tuple[LayoutEntry, ...] | None = None) -> None:
        self._fd = fd
        self._given: dict[str, list[LayoutEntry]] | None = None
        if table is not None:
            self._given = {}
            for entry in table:  # equal keys (equal matrices): each mapped once, in order
                self._given.setdefault(entry.key, []).append(entry)
        self._recorded: list[LayoutEntry] = []
        self._size = 0
        #: the mappings, kept as long as the process runs (tensors over them hold pointers)
        self._maps: list[mmap.mmap] = []
        self.mapped_bytes = 0
        self.packed_bytes = 0
        self.private_bytes = 0
        if table is None:
            os.ftruncate(fd, 0)  # a start tried again (after an out-of-memory error) repacks

    @property
    def table(self) -> tuple[LayoutEntry, ...]:
        """What was packed here (the record a later worker maps by); empty when mapping."""
        return tuple(self._recorded)

    def stats(self) -> dict[str, float]:
        """MiB mapped from the record, packed into the shared memory, packed privately."""
        mib = 2**20
        return {
            "shared_mapped_mib": round(self.mapped_bytes / mib, 1),
            "shared_packed_mib": round(self.packed_bytes / mib, 1),
            "private_mib": round(self.private_bytes / mib, 1),
        }

    def take(
        self, key: str, build: Callable[[Alloc], tuple[torch.Tensor, int]]
    ) -> tuple[torch.Tensor, int]:
        """The layout named ``key``: ``build(alloc)`` packs it (into what ``alloc`` gives) and
        returns its bytes and layout id; a later worker maps it instead where the record has
        ``key``.

        :raises ValueError: what ``build`` raises.
        """
        if self._given is not None:
            if self._given.get(key):
                entry = self._given[key].pop(0)
                self.mapped_bytes += entry.nbytes
                return self._map(entry.offset, entry.nbytes, writable=False), entry.layout
            packed, layout = build(empty_bytes)
            self.private_bytes += packed.numel()
            return packed, layout
        offsets: list[int] = []

        def alloc(nbytes: int) -> torch.Tensor:
            offset = -(-self._size // mmap.PAGESIZE) * mmap.PAGESIZE
            os.ftruncate(self._fd, offset + max(nbytes, 1))
            self._size = offset + nbytes
            offsets.append(offset)
            return self._map(offset, nbytes, writable=True)

        packed, layout = build(alloc)
        if len(offsets) != 1 or packed.numel() != self._size - offsets[0]:
            raise AssertionError(f"layout {key!r}: one allocation expected, got {len(offsets)}")
        self._recorded.append(LayoutEntry(key, offsets[0], packed.numel(), layout))
        self.packed_bytes += packed.numel()
        return packed, layout

    def _map(self, offset: int, nbytes: int, *, writable: bool) -> torch.Tensor:
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
        view = mmap.mmap(self._fd, nbytes, offset=offset, access=access)
        self._maps.append(view)
        with warnings.catch_warnings():  # read-only on purpose: the kernels only read it
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(view, dtype=torch.uint8)


def empty_bytes(nbytes: int) -> torch.Tensor:
    """Private memory for a layout's bytes (outside an arena, or a key it lacks)."""
    return torch.empty(nbytes, dtype=torch.uint8)


_current: SharedLayouts | None = None


def current_layouts() -> SharedLayouts | None:
    """The arena :meth:`Kernels.g8_layout` packs into now (None: private memory)."""
    return _current


@contextlib.contextmanager
def use_layouts(arena: SharedLayouts | None) -> Iterator[SharedLayouts | None]:
    """Pack the layouts made while the block runs in ``arena`` (a worker's load)."""
    global _current
    before, _current = _current, arena
    try:
        yield arena
    finally:
        _current = before
