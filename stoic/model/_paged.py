"""The paged KV cache and the attention function that reads and writes it.

The cache is a pool of fixed-size blocks per layer (``[num_blocks, block_size, kv_heads,
head_dim]``); a sequence owns a *block table*, the list of block ids holding its positions in order.
The model's own transformers implementation runs unchanged: its attention modules are pointed at
:func:`paged_attention` through transformers' ``AttentionInterface`` under the name
``"stoic_paged"``. Every step packs all scheduled tokens of all sequences into one row
(``[1, total_tokens]``) and passes a :class:`StepMetadata` along as a keyword argument; the
attention function scatters the new keys and values into their slots, then attends:

* all decode tokens (one query per sequence) together, in one batched SDPA call over their
  gathered blocks with a length mask;
* each prefill chunk on its own, causally, over its sequence's blocks (or directly over the new
  keys when the chunk starts at position 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "ATTN_IMPLEMENTATION",
    "DecodeGroup",
    "KVCacheSpec",
    "PagedKVCache",
    "PrefillChunk",
    "StepMetadata",
    "paged_attention",
    "register_paged_attention",
]

ATTN_IMPLEMENTATION = "stoic_paged"


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of the paged cache."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    dtype: torch.dtype
    device: torch.device

    @property
    def bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size


class PagedKVCache:
    """The KV tensors: one key and one value pool per layer. Block 0..num_blocks-1 are usable."""

    def __init__(self, spec: KVCacheSpec) -> None:
        self.spec = spec
        shape = (spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.keys: list[torch.Tensor] = [
            torch.zeros(shape, dtype=spec.dtype, device=spec.device) for _ in range(spec.num_layers)
        ]
        self.values: list[torch.Tensor] = [
            torch.zeros(shape, dtype=spec.dtype, device=spec.device) for _ in range(spec.num_layers)
        ]

    @property
    def released(self) -> bool:
        return not self.keys

    def release(self) -> None:
        """Drop every tensor (idempotent). The memory returns to the allocator once unreferenced."""
        self.keys.clear()
        self.values.clear()


@dataclass(frozen=True)
class DecodeGroup:
    """All single-token queries of a step, attended in one batched call."""

    #: positions of these queries in the packed token row, ``[B]``
    q_index: torch.Tensor
    #: block tables padded with block 0, ``[B, max_blocks]``
    block_tables: torch.Tensor
    #: context lengths (including the new token), ``[B]``
    context_lens: torch.Tensor
    #: the new token's position per sequence, ``[B]``
    positions: torch.Tensor
    max_blocks: int
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict, compare=False)

    def mask(self, block_size: int, sliding_window: int | None) -> torch.Tensor:
        if sliding_window not in self.masks:
            keys = torch.arange(self.max_blocks * block_size, device=self.context_lens.device)
            allowed = keys[None, :] < self.context_lens[:, None]
            if sliding_window is not None:
                allowed &= keys[None, :] > (self.positions[:, None] - sliding_window)
            self.masks[sliding_window] = allowed[:, None, None, :]
        return self.masks[sliding_window]


@dataclass(frozen=True)
class PrefillChunk:
    """A run of prompt tokens of one sequence, attended causally."""

    #: slice of the packed token row
    start: int
    end: int
    #: position of the chunk's first token in its sequence
    start_pos: int
    #: the sequence's blocks covering positions ``0 .. start_pos + (end - start) - 1``
    block_table: torch.Tensor
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict, compare=False)

    def mask(self, sliding_window: int | None, device: torch.device) -> torch.Tensor | None:
        """Causal mask with offset; ``None`` when SDPA's own ``is_causal`` suffices."""
        if self.start_pos == 0 and sliding_window is None:
            return None
        if sliding_window not in self.masks:
            n = self.end - self.start
            q_pos = torch.arange(self.start_pos, self.start_pos + n, device=device)[:, None]
            k_pos = torch.arange(self.start_pos + n, device=device)[None, :]
            allowed = k_pos <= q_pos
            if sliding_window is not None:
                allowed &= k_pos > q_pos - sliding_window
            self.masks[sliding_window] = allowed[None, None]
        return self.masks[sliding_window]


@dataclass(frozen=True)
class StepMetadata:
    """Everything the attention function needs for one step; built once, used by every layer."""

    cache: PagedKVCache
    #: flat slot (block * block_size + offset) of every packed token, ``[N]``
    slot_mapping: torch.Tensor
    decode: DecodeGroup | None
    prefills: tuple[PrefillChunk, ...]


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    stoic_step: StepMetadata | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface function over the paged cache.

    ``query`` is ``[1, heads, N, head_dim]``; ``key``/``value`` are ``[1, kv_heads, N, head_dim]``
    for the N packed new tokens (rotary embedding already applied). Returns ``[1, N, heads,
    head_dim]``.
    """
    if stoic_step is None:
        raise RuntimeError("stoic_paged attention called without step metadata")
    meta = stoic_step
    layer = int(getattr(module, "layer_idx", 0))
    cache = meta.cache
    block_size = cache.spec.block_size
    k_pool, v_pool = cache.keys[layer], cache.values[layer]
    flat_k = k_pool.view(-1, k_pool.shape[-2], k_pool.shape[-1])
    flat_v = v_pool.view(-1, v_pool.shape[-2], v_pool.shape[-1])
    new_k = key[0].transpose(0, 1)  # [N, kv_heads, D]
    new_v = value[0].transpose(0, 1)
    flat_k.index_copy_(0, meta.slot_mapping, new_k.to(flat_k.dtype))
    flat_v.index_copy_(0, meta.slot_mapping, new_v.to(flat_v.dtype))

    q = query[0]  # [heads, N, D]
    heads, n_tokens, head_dim = q.shape
    out = q.new_empty((n_tokens, heads, head_dim))

    decode = meta.decode
    if decode is not None:
        batch = decode.q_index.shape[0]
        qd = q.index_select(1, decode.q_index).transpose(0, 1).unsqueeze(2)  # [B, H, 1, D]
        length = decode.max_blocks * block_size
        kd = k_pool[decode.block_tables].view(batch, length, -1, head_dim).transpose(1, 2)
        vd = v_pool[decode.block_tables].view(batch, length, -1, head_dim).transpose(1, 2)
        od = F.scaled_dot_product_attention(
            qd,
            kd,
            vd,
            attn_mask=decode.mask(block_size, sliding_window),
            scale=scaling,
            enable_gqa=True,
        )
        out.index_copy_(0, decode.q_index, od.squeeze(2))

    for chunk in meta.prefills:
        qp = q[:, chunk.start : chunk.end].unsqueeze(0)  # [1, H, n, D]
        mask = chunk.mask(sliding_window, q.device)
        if chunk.start_pos == 0:
            kp = key[:, :, chunk.start : chunk.end]
            vp = value[:, :, chunk.start : chunk.end]
        else:
            length = chunk.start_pos + (chunk.end - chunk.start)
            kp = (
                k_pool[chunk.block_table]
                .view(1, -1, k_pool.shape[-2], head_dim)[:, :length]
                .transpose(1, 2)
            )
            vp = (
                v_pool[chunk.block_table]
                .view(1, -1, v_pool.shape[-2], head_dim)[:, :length]
                .transpose(1, 2)
            )
        op = F.scaled_dot_product_attention(
            qp,
            kp.to(qp.dtype),
            vp.to(qp.dtype),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scaling,
            enable_gqa=True,
        )
        out[chunk.start : chunk.end] = op[0].transpose(0, 1)
    return out.unsqueeze(0), None


_registered = False


def register_paged_attention() -> None:
    """Register :func:`paged_attention` with transformers (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
    _registered = True
