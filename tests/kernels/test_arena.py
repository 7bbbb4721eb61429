"""The int8 layouts in shared memory (:class:`stoic.kernels.SharedLayouts`): what a first worker
packs there, a later one maps by the record instead of packing, byte for byte the same and
multiplying the same; a request the record does not have at its place is packed privately."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from gguf_blocks import random_blocks
from test_int8rows import vnni_kernels

from stoic.kernels import G8Layout, Gemm8, Kernels, SharedLayouts, use_layouts

__all__ = ["vnni_kernels"]  # the fixture, used by name

PARTS = [
    [("Q4_K", random_blocks("Q4_K", 40, 512, seed=60))],
    [("Q6_K", random_blocks("Q6_K", 37, 512, seed=61))],
    [("Q8_0", random_blocks("Q8_0", 16, 256, seed=62))],
]


ROWS_COLS = {"Q4_K": (40, 512), "Q6_K": (37, 512), "Q8_0": (16, 256)}


@pytest.fixture
def memfd() -> Iterator[int]:
    fd = os.memfd_create("test-layouts", os.MFD_CLOEXEC)
    yield fd
    os.close(fd)


def _pack_all(kernels: Kernels, arena: SharedLayouts | None) -> list[tuple[torch.Tensor, int]]:
    with use_layouts(arena):
        return [tuple(kernels.g8_layout(parts)) for parts in PARTS]  # type: ignore[misc]


def test_a_later_worker_maps_what_the_first_packed_byte_for_byte(
    vnni_kernels: Kernels, memfd: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first arena packs every layout into the memory and records where; a second, given
    the record, maps each without packing anything, at other addresses in this process, each
    byte and layout id the same as a private packing's, and products over them equal."""
    private = _pack_all(vnni_kernels, None)
    first = SharedLayouts(memfd)
    packed = _pack_all(vnni_kernels, first)
    assert [e.nbytes for e in first.table] == [p.numel() for p, _ in private]
    assert os.fstat(memfd).st_size >= sum(e.nbytes for e in first.table)
    built: list[int] = []
    real = Kernels._g8_layout

    def counting(self: Kernels, *args: object) -> object:
        built.append(1)
        return real(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(Kernels, "_g8_layout", counting)
    later = SharedLayouts(memfd, first.table)
    mapped = _pack_all(vnni_kernels, later)
    assert built == [] and later.table == ()
    for (a, la), (b, lb), (c, lc) in zip(private, packed, mapped, strict=True):
        assert la == lb == lc and torch.equal(a, b) and torch.equal(a, c)
        assert c.data_ptr() != b.data_ptr()
    assert later.mapped_bytes == first.packed_bytes == sum(e.nbytes for e in first.table) > 0
    for (p, layout), (m, _), parts in zip(private, mapped, PARTS, strict=True):
        rows, cols = ROWS_COLS[parts[0][0]]
        x = torch.randn(5, cols, generator=torch.Generator().manual_seed(63))
        alone = Gemm8(vnni_kernels, G8Layout(p, layout), rows, cols, None)(x)
        assert torch.equal(alone, Gemm8(vnni_kernels, G8Layout(m, layout), rows, cols, None)(x))


def test_a_later_worker_maps_by_key_in_any_order_and_packs_what_the_record_lacks(
    vnni_kernels: Kernels, memfd: int
) -> None:
    """A later worker asking in another order maps each layout by its key (types, shapes and a
    checksum of the blocks: two matrices of one shape are told apart); one the record lacks
    (other blocks of the same shape) is packed in its own memory, and the shared memory is
    left as the first worker wrote it."""
    first = SharedLayouts(memfd)
    packed = _pack_all(vnni_kernels, first)
    size = os.fstat(memfd).st_size
    later = SharedLayouts(memfd, first.table)
    other = [("Q4_K", random_blocks("Q4_K", 40, 512, seed=64))]  # PARTS[0]'s shape
    with use_layouts(later):
        got = [vnni_kernels.g8_layout(parts) for parts in (PARTS[1], other, PARTS[2], PARTS[0])]
    assert later.mapped_bytes == sum(p.numel() for p, _ in packed)
    assert later.private_bytes == got[1].packed.numel()
    assert torch.equal(got[0].packed, packed[1][0]) and torch.equal(got[3].packed, packed[0][0])
    assert not torch.equal(got[1].packed, packed[0][0])
    assert os.fstat(memfd).st_size == size
