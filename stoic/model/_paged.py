"""The paged KV cache and the attention function that reads and writes it.

The cache is a pool of fixed-size blocks per layer (head-major: ``[kv_heads * num_blocks, block_size,
head_dim]``); a sequence owns a *block table*, the list of block ids holding its positions in order.
:func:`paged_attention` is the torch attention backend's (:mod:`._attention`, which also points
transformers' ``AttentionInterface`` at the step's planned attention under the name
``"stoic_paged"``, so a model's own transformers implementation runs unchanged). Every step packs all scheduled tokens of all sequences into one row
(``[1, total_tokens]``) and passes the step's planned attention along as a keyword argument;
for the torch backend that calls :func:`paged_attention` with the step's :class:`StepMetadata`, which scatters the new keys and values into their slots, then attends:

* the decode tokens (one query per sequence) in a few groups of similar context length, each
  group in one batched call over its gathered blocks with a length mask;
* each prefill chunk on its own, causally, over its sequence's blocks (or directly over the new
  keys when the chunk starts at position 0).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from ._pagecommit import PageCommitter
from ._sharedkv import map_pools

__all__ = [
    "ATTN_IMPLEMENTATION",
    "DecodeGroup",
    "KVCacheSpec",
    "PagedKVCache",
    "PrefillChunk",
    "StepMetadata",
    "decode_gather_keys",
    "empty_device_cache",
    "group_decodes",
    "paged_attention",
    "write_kv",
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

    @classmethod
    def for_model(
        cls,
        config: Any,
        *,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> KVCacheSpec:
        """The cache of a model with (text) configuration ``config``: no weights needed."""
        heads = int(config.num_attention_heads)
        return cls(
            num_layers=int(config.num_hidden_layers),
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
            block_size=block_size,
            num_blocks=num_blocks,
            dtype=dtype,
            device=device,
        )


class PagedKVCache:
    """The KV tensors: one key and one value pool per layer.

    Each pool is head-major: ``[kv_heads * num_blocks, block_size, head_dim]``, where row
    ``h * num_blocks + b`` holds head ``h`` of block ``b``. Gathering a batch's blocks with one
    index of shape ``[batch, kv_heads, blocks]`` then yields ``[batch, kv_heads, tokens, head_dim]``
    contiguously, which the attention matmuls consume without another copy.
    """

    def __init__(self, spec: KVCacheSpec, *, memory_fd: int | None = None) -> None:
        """Allocate the pools (empty: the scheduler zeroes each block before its first use), or
        with ``memory_fd`` (a host cache only) map them over that shared memory
        (:mod:`._sharedkv`: they outlive this process).

        :raises ValueError: ``memory_fd`` is sized for another cache, or the cache is not on
            the host.
        """
        self.spec = spec
        #: the pools are shared memory another process owns (:mod:`._sharedkv`)
        self.shared = memory_fd is not None
        shape = (spec.num_kv_heads * spec.num_blocks, spec.block_size, spec.head_dim)
        self.keys: list[torch.Tensor]
        self.values: list[torch.Tensor]
        if memory_fd is not None:
            if spec.device.type != "cpu":
                raise ValueError(f"KV pools in shared memory are host memory, not {spec.device}")
            self.keys, self.values = map_pools(memory_fd, spec.num_layers, shape, spec.dtype)
        else:
            self.keys = [
                torch.empty(shape, dtype=spec.dtype, device=spec.device)
                for _ in range(spec.num_layers)
            ]
            self.values = [
                torch.empty(shape, dtype=spec.dtype, device=spec.device)
                for _ in range(spec.num_layers)
            ]
        #: a host cache's pages, committed by the step thread while it has no step to run
        #: (:mod:`._pagecommit`); nothing to commit on a device (memory allocated when asked)
        self.pages = PageCommitter([*self.keys, *self.values])

    @property
    def committing(self) -> bool:
        """Whether pages are left to commit (:attr:`pages`; never once released)."""
        return bool(self.keys) and self.pages.pending

    def commit_idle(self) -> bool:
        """Commit one call's worth of :attr:`pages`, the step thread's work while it has no step
        to run (a call is short: :data:`~._pagecommit.STEP_BYTES`); returns :attr:`committing`."""
        if self.committing:
            self.pages.advance()
        return self.committing

    def block_rows(self, blocks: tuple[int, ...] | list[int]) -> torch.Tensor:
        """The pool rows of ``blocks``, ``[kv_heads, len(blocks)]`` (a host tensor): row ``h *
        num_blocks + b`` holds head ``h`` of block ``b``."""
        heads = torch.arange(self.spec.num_kv_heads)[:, None] * self.spec.num_blocks
        return heads + torch.tensor(blocks, dtype=torch.int64)[None, :]

    def zero_rows(self, rows: torch.Tensor) -> None:
        """Zero pool ``rows`` (on the pools' device; :meth:`block_rows`) in every pool."""
        for pool in (*self.keys, *self.values):
            pool.index_fill_(0, rows, 0)

    def zero_blocks(self, blocks: tuple[int, ...]) -> None:
        """Zero every head of ``blocks`` in every pool (before their first use)."""
        if blocks:
            self.zero_rows(self.block_rows(blocks).view(-1).to(self.keys[0].device))

    @property
    def released(self) -> bool:
        return not self.keys

    def release(self) -> None:
        """Drop every tensor (idempotent). The memory returns to the allocator once unreferenced."""
        self.keys.clear()
        self.values.clear()


def empty_device_cache(device: torch.device) -> None:
    """Hand the caching allocator's unused memory back to the device after a cache is released.

    CUDA only (a no-op on CPU, or where CUDA is unavailable); it raises nothing of its own.
    """
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class DecodeGroup:
    """Single-token queries of a step with similar context lengths, attended in one batched call.

    A step's decodes are split into a few such groups by context length (see
    :func:`group_decodes`) so that short sequences do not pay for the padding of the longest.
    """

    #: positions of these queries in the packed token row, ``[B]``
    q_index: torch.Tensor
    #: pool rows to gather, ``[B, kv_heads, max_blocks]`` (block tables padded with block 0)
    gather_index: torch.Tensor
    #: context lengths (including the new token), ``[B]``
    context_lens: torch.Tensor
    #: the new token's position per sequence, ``[B]``
    positions: torch.Tensor
    max_blocks: int
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict, compare=False)

    def masked_out(self, block_size: int, sliding_window: int | None) -> torch.Tensor:
        """``[B, 1, 1, keys]``: true where a key must not be attended (padding, outside window)."""
        if sliding_window not in self.masks:
            keys = torch.arange(self.max_blocks * block_size, device=self.context_lens.device)
            hidden = keys[None, :] >= self.context_lens[:, None]
            if sliding_window is not None:
                hidden |= keys[None, :] <= (self.positions[:, None] - sliding_window)
            self.masks[sliding_window] = hidden[:, None, None, :]
        return self.masks[sliding_window]


#: the fixed cost of one more decode group, in (sequence x key position) units: measured on a
#: 2-core CPU, one group's ~10 small ops per layer cost about as much as attending ~1,500 more
#: key positions
GROUP_OVERHEAD_KEYS = 1500


def group_decodes(
    context_blocks: list[int], block_size: int, overhead: int = GROUP_OVERHEAD_KEYS
) -> list[list[int]]:
    """Split decodes into groups of similar context length; returns lists of indices.

    Each group is padded to its longest context, so one group for a batch of mixed lengths does
    up to ~2x the attention work needed. The split minimises ``sum(len(group) * longest *
    block_size + overhead)`` over contiguous runs of the length-sorted batch (an exact dynamic
    programme over the distinct lengths, at most a few dozen).
    """
    if not context_blocks:
        return []
    values = sorted(set(context_blocks))
    counts = [0] * len(values)
    where = {v: i for i, v in enumerate(values)}
    for b in context_blocks:
        counts[where[b]] += 1
    # best[j]: cost of covering values[:j]; cut[j]: where the last group of that cover starts
    best = [0.0] + [math.inf] * len(values)
    cut = [0] * (len(values) + 1)
    for j in range(1, len(values) + 1):
        members = 0
        for i in range(j, 0, -1):
            members += counts[i - 1]
            cost = best[i - 1] + members * values[j - 1] * block_size + overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i - 1
    bounds: list[int] = []
    j = len(values)
    while j > 0:
        bounds.append(values[j - 1])
        j = cut[j]
    bounds.sort()
    groups: list[list[int]] = [[] for _ in bounds]
    for index, b in enumerate(context_blocks):
        groups[bisect.bisect_left(bounds, b)].append(index)
    return groups


def decode_gather_keys(
    cached_blocks: int, longest_blocks: int, block_size: int, overhead: int = GROUP_OVERHEAD_KEYS
) -> int:
    """The most key positions a step's decode groups gather in all (each group padded to its
    longest context) when the decoding sequences hold ``cached_blocks`` blocks together and none
    more than ``longest_blocks``: what the KV sizing reserves for the decode attention's copy.

    Why it holds: :func:`group_decodes` minimises ``padded keys + overhead x groups``, so its
    split costs no more than putting each sequence in the group of its power-of-two length class
    (``[2^k, 2^(k+1))`` blocks: at most ``longest_blocks.bit_length()`` groups), where every
    sequence is padded to less than twice its own length. Hence ``padded <= 2 x cached keys +
    overhead x longest_blocks.bit_length()``: one group of mixed lengths can gather up to twice
    the cache's keys, not once."""
    return 2 * cached_blocks * block_size + overhead * longest_blocks.bit_length()


@dataclass(frozen=True)
class PrefillChunk:
    """A run of prompt tokens of one sequence, attended causally."""

    #: slice of the packed token row
    start: int
    end: int
    #: position of the chunk's first token in its sequence
    start_pos: int
    #: pool rows of the sequence's blocks covering its context, ``[kv_heads, blocks]``
    gather_index: torch.Tensor
    masks: dict[tuple[int | None, int], torch.Tensor] = field(default_factory=dict, compare=False)

    def mask(
        self,
        sliding_window: int | None,
        device: torch.device,
        align: int = 1,
        *,
        explicit: bool = False,
    ) -> torch.Tensor | None:
        """Causal mask with offset, ``[1, 1, n, keys]``, true where attended; ``None`` when
        SDPA's own ``is_causal`` suffices (never with ``explicit``). With ``align`` > 1 both
        sides are padded to a multiple of it: padding keys are never attended, and each padding
        query attends the first key only (a row with no key at all would be NaN)."""
        if self.start_pos == 0 and sliding_window is None and not explicit:
            return None
        key = (sliding_window, align)
        if key not in self.masks:
            n = self.end - self.start
            keys = self.start_pos + n
            q_pos = torch.arange(self.start_pos, self.start_pos + n, device=device)[:, None]
            k_pos = torch.arange(keys, device=device)[None, :]
            allowed = k_pos <= q_pos
            if sliding_window is not None:
                allowed &= k_pos > q_pos - sliding_window
            if align > 1:
                padded = allowed.new_zeros((_round_up(n, align), _round_up(keys, align)))
                padded[:n, :keys] = allowed
                padded[n:, 0] = True
                allowed = padded
            self.masks[key] = allowed[None, None]
        return self.masks[key]


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


#: bfloat16 prompt attention on a CPU pads queries and keys to a multiple of this. PyTorch's
#: flash kernel takes a much slower path for other lengths: a 243-token chunk after 150 cached
#: tokens (9 query heads over 3) took 873 us a layer against 472 us padded to 256 x 400, a
#: fresh 243-token prompt 508 against 324 us (aligned lengths: equal; the padding copies
#: ~25 us). float32 is left as it is: its results stay bitwise those of an unpadded call.
PREFILL_ALIGN = 16


@dataclass(frozen=True)
class StepMetadata:
    """Everything the attention function needs for one step; built once, used by every layer."""

    cache: PagedKVCache
    #: flat pool position of every packed token's key/value, head-major: ``[kv_heads * N]``
    write_index: torch.Tensor
    decodes: tuple[DecodeGroup, ...]
    prefills: tuple[PrefillChunk, ...]
    #: the step's highest position (a host number: nothing reads it back from the device)
    max_position: int


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    step: StepMetadata,
    *,
    scaling: float | None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The step's attention over the paged cache (the torch backend's, :mod:`._attention`).

    ``query`` is ``[1, heads, N, head_dim]``; ``key``/``value`` are ``[1, kv_heads, N, head_dim]``
    for the N packed new tokens (rotary embedding already applied), written into the cache of
    ``module``'s layer first. Returns ``[1, N, heads, head_dim]``. ``softcap`` (Gemma 2's
    ``attn_logit_softcapping``) caps the scaled scores at ``softcap * tanh(score / softcap)``
    before the mask, as transformers' eager attention does. transformers itself calls
    :func:`._attention.interface_attention`, never this.
    """
    meta = step
    layer = int(getattr(module, "layer_idx", 0))
    cache = meta.cache
    k_pool, v_pool = cache.keys[layer], cache.values[layer]
    write_kv(cache, layer, meta.write_index, key, value)

    q = query[0]  # [heads, N, D]
    if not meta.prefills and len(meta.decodes) == 1:
        # a decode-only step: its one group holds every token, in order (no gather, no scatter)
        decoded = _decode_attention(
            q, k_pool, v_pool, meta.decodes[0], scaling, sliding_window, softcap
        )
        return decoded.unsqueeze(0)
    heads, n_tokens, head_dim = q.shape
    out = q.new_empty((n_tokens, heads, head_dim))
    for decode in meta.decodes:
        attended = _decode_attention(q, k_pool, v_pool, decode, scaling, sliding_window, softcap)
        out.index_copy_(0, decode.q_index, attended)

    for chunk in meta.prefills:
        out[chunk.start : chunk.end] = _prefill_attention(
            q, key, value, k_pool, v_pool, chunk, scaling, sliding_window, softcap
        )
    return out.unsqueeze(0)


def write_kv(
    cache: PagedKVCache,
    layer: int,
    write_index: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
) -> None:
    """Write a step's new keys and values (``[1, kv_heads, N, head_dim]``) into ``layer``'s
    pools at the flat pool positions ``write_index`` (:attr:`StepMetadata.write_index`)."""
    for pool, new in ((cache.keys[layer], key[0]), (cache.values[layer], value[0])):
        # one pass to the pool's dtype and a contiguous layout (``new`` is a strided view of
        # the step's projection), then the scattered rows
        rows = torch.empty(new.shape, dtype=pool.dtype, device=pool.device).copy_(new)
        pool.view(-1, pool.shape[-1]).index_copy_(0, write_index, rows.view(-1, pool.shape[-1]))


def _prefill_attention(
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    chunk: PrefillChunk,
    scaling: float | None,
    sliding_window: int | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One prompt chunk's attention, ``[n, heads, head_dim]``, for the step's queries ``q``
    ``[heads, N, D]`` and new keys/values ``[1, kv_heads, N, D]`` (its context from the pool).
    With ``softcap``, written out (SDPA has no soft cap)."""
    n = chunk.end - chunk.start
    qp = q[:, chunk.start : chunk.end].unsqueeze(0)  # [1, H, n, D]
    length = chunk.start_pos + n
    align = PREFILL_ALIGN if qp.dtype == torch.bfloat16 and qp.device.type == "cpu" else 1
    if length % align == 0 and n % align == 0:
        align = 1
    if chunk.start_pos == 0:
        kp = key[:, :, chunk.start : chunk.end]
        vp = value[:, :, chunk.start : chunk.end]
    else:
        head_dim = k_pool.shape[-1]
        kv_heads = chunk.gather_index.shape[0]
        rows = chunk.gather_index.view(-1)
        kp = k_pool.index_select(0, rows).view(1, kv_heads, -1, head_dim)[:, :, :length]
        vp = v_pool.index_select(0, rows).view(1, kv_heads, -1, head_dim)[:, :, :length]
    if softcap:
        allowed = chunk.mask(sliding_window, q.device, explicit=True)
        assert allowed is not None
        return _capped_attention(qp, kp.to(qp.dtype), vp.to(qp.dtype), allowed, scaling, softcap)
    if align > 1:
        # zeros, not the pool's stale rows past the context: a masked NaN would still poison
        # the scores' arithmetic
        qp = _zero_padded(qp, _round_up(n, align), qp.dtype)
        kp = _zero_padded(kp, _round_up(length, align), qp.dtype)
        vp = _zero_padded(vp, _round_up(length, align), qp.dtype)
    else:
        # bfloat16 queries (a bfloat16 dense dtype) over the float32 cache: the chunk's
        # context is converted to bfloat16, as a bfloat16 model's cache holds it. Masked
        # SDPA over a chunk's 2-D mask measured 0.70x float32's time in bfloat16 (a
        # 243-token chunk after 150 cached tokens, 9 query heads over 3: 885 vs 1,266 us a
        # layer); the slow masked bfloat16 path is the decode groups' (note below)
        kp, vp = kp.to(qp.dtype), vp.to(qp.dtype)
    mask = chunk.mask(sliding_window, q.device, align)
    op = F.scaled_dot_product_attention(
        qp,
        kp,
        vp,
        attn_mask=mask,
        # padding queries and keys come after every real one: causal order keeps them apart
        is_causal=mask is None,
        scale=scaling,
        enable_gqa=True,
    )
    return op[0, :, :n].transpose(0, 1)


def _capped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scaling: float | None,
    softcap: float,
) -> torch.Tensor:
    """Soft-capped attention of ``q`` ``[1, heads, n, D]`` over ``k``/``v`` ``[1, kv_heads,
    keys, D]`` where ``allowed`` ``[1, 1, n, keys]``; returns ``[n, heads, D]``. transformers'
    eager order: scale, cap, mask, float32 softmax; query heads grouped per KV head."""
    _, heads, n, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    qg = q[0].reshape(kv_heads, heads // kv_heads * n, dim)
    scores = torch.matmul(qg, k[0].transpose(-1, -2)).float()
    scores.mul_(scaling if scaling is not None else dim**-0.5)
    scores = _cap(scores, softcap).view(kv_heads, heads // kv_heads, n, keys)
    scores.masked_fill_(~allowed[0], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(kv_heads, -1, keys)
    return torch.matmul(probs, v[0]).reshape(heads, n, dim).transpose(0, 1)


def _cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``softcap * tanh(scores / softcap)`` (``scores`` itself without a cap)."""
    if not softcap:
        return scores
    return torch.tanh(scores / softcap).mul_(softcap)


def _zero_padded(x: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """``x`` ``[1, heads, r, D]`` as ``dtype`` ``[1, heads, rows, D]``, zeros below."""
    out = x.new_empty((*x.shape[:2], rows, x.shape[-1]), dtype=dtype)
    out[:, :, : x.shape[2]] = x
    out[:, :, x.shape[2] :] = 0
    return out


def _decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    decode: DecodeGroup,
    scaling: float | None,
    sliding_window: int | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query per sequence over its gathered blocks; returns ``[B, heads, head_dim]``.

    Written as two grouped matmuls rather than SDPA: with a mask and grouped-query heads, CPU SDPA
    falls back to a path measured 13x slower in bfloat16 (0.5 ms vs 6.4 ms at batch 32, context
    512). Query heads are grouped per KV head, so keys and values are never repeated.
    """
    heads, _, head_dim = q.shape
    batch, kv_heads, _ = decode.gather_index.shape
    block_size = k_pool.shape[1]
    group = heads // kv_heads
    length = decode.max_blocks * block_size
    # all of q's tokens, in order, when the group holds every token of the step (decode only)
    qd = q if q.shape[1] == batch else q.index_select(1, decode.q_index)
    qd = qd.transpose(0, 1).reshape(batch, kv_heads, group, head_dim)
    # in the wider of the two types: bfloat16 queries over a float32 cache (a bfloat16 dense
    # dtype) have the queries converted, not the (many more) gathered keys and values; float32
    # queries over a bfloat16 cache (--kv-cache-dtype) the keys and values, widened exactly
    work = torch.promote_types(qd.dtype, k_pool.dtype)
    qd = qd.to(work)
    # index_select on the flattened index: measured ~8x faster than advanced indexing on CPU
    rows = decode.gather_index.view(-1)
    kd = k_pool.index_select(0, rows).view(batch, kv_heads, length, head_dim).to(work)
    vd = v_pool.index_select(0, rows).view(batch, kv_heads, length, head_dim).to(work)
    scores = torch.matmul(qd, kd.transpose(-1, -2)).float()
    scores.mul_(scaling if scaling is not None else head_dim**-0.5)
    scores = _cap(scores, softcap)
    scores.masked_fill_(decode.masked_out(block_size, sliding_window), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(vd.dtype)
    return torch.matmul(probs, vd).reshape(batch, heads, head_dim).to(q.dtype)
