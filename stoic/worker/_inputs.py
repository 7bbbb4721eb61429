"""A step's inputs: token ids, positions, the attention's metadata, the rows to sample and the
fresh blocks' rows to zero.

Everything is computed on the host (Python numbers and CPU tensors), packed into one int64
buffer and moved to the device in one copy (:func:`stoic.model._attention.to_device`: pinned and
non-blocking on CUDA, none at all on the CPU); each tensor the step reads is a view of that
buffer. Nothing here reads from the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model import DecodeGroup, PagedKVCache, PrefillChunk, StepMetadata, group_decodes, to_device
from ..request import SeqChunk, StepBatch

__all__ = ["StepInputs", "build_inputs"]


@dataclass(frozen=True)
class StepInputs:
    """What one step's forward and sampling read."""

    meta: StepMetadata
    #: ``[1, N]``: every chunk's tokens, packed in batch order
    input_ids: torch.Tensor
    #: ``[1, N]``: their positions in their sequences
    positions: torch.Tensor
    #: ``[S]``: the packed rows whose logits are sampled, aligned with :attr:`sampled`
    rows: torch.Tensor
    #: the chunks that sample a token, in batch order; a chunk with drafts once per sampled row
    #: (:meth:`SeqChunk.draft_rows`: the same ``seq_id`` on consecutive rows)
    sampled: tuple[SeqChunk, ...]
    #: the pool rows of the batch's fresh blocks, to zero before the forward (None: none)
    zero_rows: torch.Tensor | None


class _Pack:
    """Host int64 tensors packed into one buffer, moved to the device in one copy."""

    def __init__(self) -> None:
        self._parts: list[torch.Tensor] = []

    def add(self, values: torch.Tensor | list[int] | list[list[int]]) -> int:
        """Pack ``values`` (a host tensor or nested lists of ints); returns its index."""
        tensor = values if isinstance(values, torch.Tensor) else torch.tensor(values)
        self._parts.append(tensor.to(torch.int64))
        return len(self._parts) - 1

    def move(self, device: torch.device) -> list[torch.Tensor]:
        """Every packed tensor, in the order added, as views of one buffer on ``device``."""
        moved = to_device(torch.cat([p.reshape(-1) for p in self._parts]), device)
        out: list[torch.Tensor] = []
        offset = 0
        for part in self._parts:
            out.append(moved[offset : offset + part.numel()].view(part.shape))
            offset += part.numel()
        return out


def build_inputs(batch: StepBatch, cache: PagedKVCache, device: torch.device) -> StepInputs:
    """The inputs of ``batch`` over ``cache`` on ``device``."""
    spec = cache.spec
    block_size = spec.block_size
    # pool row of (head h, block b) is h * num_blocks + b; flat position adds the in-block offset
    head_rows = torch.arange(spec.num_kv_heads) * spec.num_blocks
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    sample_rows: list[int] = []
    sampled: list[SeqChunk] = []
    dec_q: list[int] = []
    dec_tables: list[tuple[int, ...]] = []
    dec_lens: list[int] = []
    pack = _Pack()
    prefills: list[tuple[int, int, int, int]] = []  # start, end, start_pos, packed rows
    for chunk in batch.chunks:
        start = len(ids)
        n = len(chunk.token_ids)
        table = chunk.block_table
        ids.extend(chunk.token_ids)
        for p in range(chunk.start_pos, chunk.start_pos + n):
            pos.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
        if chunk.sample:
            # a chunk with drafts samples after each of its last drafts + 1 positions
            per_row = chunk.draft_rows()
            sample_rows.extend(range(start + n - len(per_row), start + n))
            sampled.extend(per_row)
        if n == 1:
            dec_q.append(start)
            dec_tables.append(table)
            dec_lens.append(chunk.start_pos + 1)
        else:
            used = -(-(chunk.start_pos + n) // block_size)
            rows = cache.block_rows(table[:used])
            prefills.append((start, start + n, chunk.start_pos, pack.add(rows)))
    groups: list[tuple[int, int, int, int, int]] = []  # q, rows, lengths, positions, max_blocks
    dec_blocks = [-(-n // block_size) for n in dec_lens]
    for members in group_decodes(dec_blocks, block_size):
        max_blocks = max(dec_blocks[i] for i in members)
        padded = [
            list(dec_tables[i][:max_blocks])
            + [0] * (max_blocks - min(len(dec_tables[i]), max_blocks))
            for i in members
        ]
        groups.append(
            (
                pack.add([dec_q[i] for i in members]),
                pack.add(head_rows[None, :, None] + torch.tensor(padded)[:, None, :]),
                pack.add([dec_lens[i] for i in members]),
                pack.add([dec_lens[i] - 1 for i in members]),
                max_blocks,
            )
        )
    slot_rows = head_rows[:, None] * block_size + torch.tensor(slots, dtype=torch.int64)[None, :]
    write = pack.add(slot_rows.reshape(-1))
    id_part, pos_part = pack.add([ids]), pack.add([pos])
    rows_part = pack.add(sample_rows)
    zero = pack.add(cache.block_rows(batch.zero_blocks).view(-1)) if batch.zero_blocks else None
    on_device = pack.move(device)
    meta = StepMetadata(
        cache=cache,
        write_index=on_device[write],
        decodes=tuple(
            DecodeGroup(
                q_index=on_device[q],
                gather_index=on_device[rows],
                context_lens=on_device[lens],
                positions=on_device[at],
                max_blocks=max_blocks,
            )
            for q, rows, lens, at, max_blocks in groups
        ),
        prefills=tuple(
            PrefillChunk(start, end, start_pos, on_device[rows])
            for start, end, start_pos, rows in prefills
        ),
        max_position=max(pos, default=-1),
    )
    return StepInputs(
        meta,
        on_device[id_part],
        on_device[pos_part],
        on_device[rows_part],
        tuple(sampled),
        None if zero is None else on_device[zero],
    )
