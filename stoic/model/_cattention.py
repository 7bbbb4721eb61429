"""Attention in C over the paged blocks in place, on the steps the C layers do not run whole.

The C layers (:mod:`._cdecode`) serve decode-only steps of few tokens. Every other step goes
through the torch path, whose attention (:func:`._paged.paged_attention`) gathers each decode
group's blocks, padded to the group's longest sequence, into a new tensor a layer (at 32
sequences of mixed lengths, contexts 60-430, those copies and the batched products over the
padding took 60 of a 137 ms decode step, measured on a Xeon, 2 cores), and runs a prompt
chunk through SDPA (its keys gathered first past position 0; 1.2-1.3 ms a layer for a
225-token chunk of 9 query heads over 3, about twice the C kernel's time). Here the decode
tokens go to ``stoic_decode_attention`` and each prompt chunk to ``stoic_chunk_attention``
(``_chunk_attention.c``, where the build has AVX-512; SDPA otherwise), both reading the blocks
in place, each sequence over its own length. The formulas are the torch path's (float32;
results differ by float32 rounding, as the C layers' do).

The step plan of :class:`._attention.CPagedAttention` (the quantised kernels, :mod:`stoic.kernels._qkernels`,
and a float32 or bfloat16 KV cache on the CPU: ``--kv-cache-dtype``; a bfloat16 pool halves
the bytes the decode attention streams, and the kernels widen it to float32 exactly).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..kernels import C_POOL_DTYPES, MAX_HEAD_DIM, Kernels
from ._cdecode import block_tables
from ._paged import StepMetadata, paged_attention, write_kv

__all__ = ["PagedCAttention"]


class PagedCAttention:
    """One step's attention in C (decode tokens; prompt chunks where the kernels have
    :attr:`~._qkernels.Kernels.chunk_attention_available`): built once a step, called a layer."""

    def __init__(self, kernels: Kernels, step: StepMetadata, tokens: int) -> None:
        self._k = kernels
        self._step = step
        self._chunks_in_c = bool(step.prefills) and _chunk_kernel(step, kernels)
        #: the pools' type as the kernels take it (0 float32, 1 bfloat16)
        self._bf16 = int(step.cache.spec.dtype == torch.bfloat16)
        #: the step without its decode groups, for torch's attention over the prefill chunks
        #: (where the kernels have no chunk attention)
        self._prefills = (
            dataclasses.replace(step, decodes=())
            if step.prefills and not self._chunks_in_c
            else None
        )
        self.q_index = (
            torch.cat([g.q_index for g in step.decodes]).to(torch.int64)
            if step.decodes
            else torch.empty(0, dtype=torch.int64)
        )
        self._tables = self._lens = self._write = None
        if step.decodes:  # every token's block table in step order, then the decode tokens'
            tables, lens = block_tables(step, tokens)
            self._tables = tables.index_select(0, self.q_index)
            self._lens = lens.index_select(0, self.q_index)
            kv_heads = int(tables.shape[1])
            self._write = (
                step.write_index.view(kv_heads, tokens).index_select(1, self.q_index).contiguous()
            )
        #: each chunk's pool rows, contiguous ``[kv_heads, blocks]`` for the chunk kernel
        self._chunk_tables = (
            [c.gather_index.to(torch.int64).contiguous() for c in step.prefills]
            if self._chunks_in_c
            else []
        )

    @staticmethod
    def applies(step: StepMetadata, kernels: Kernels) -> bool:
        """Whether C attends some of a step's tokens: decodes, or prompt chunks where the
        kernels have the chunk kernel, over a float32 or bfloat16 cache on the CPU."""
        spec = step.cache.spec
        return (bool(step.decodes) or (bool(step.prefills) and _chunk_kernel(step, kernels))) and (
            spec.dtype in C_POOL_DTYPES and spec.device.type == "cpu"
        )

    def forward(
        self,
        attn: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scaling: float | None,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """``[1, N, heads, head_dim]`` for ``q`` ``[1, heads, N, head_dim]`` and ``k``/``v``
        ``[1, kv_heads, N, head_dim]`` of layer ``attn``; the step's keys and values are
        written into the cache (:class:`._attention.StepAttention`). The C kernels have neither
        window nor soft cap: the backend plans such steps for torch.

        :raises torch.OutOfMemoryError: if a kernel could not allocate its scratch.
        """
        if softcap:
            raise ValueError("the C attention has no soft cap")
        scaling = attn.scaling if scaling is None else scaling
        step = self._step
        heads, n, dim = q.shape[1], q.shape[2], q.shape[3]
        kv_heads = k.shape[1]
        layer = int(getattr(attn, "layer_idx", 0))
        cache = step.cache
        threads = torch.get_num_threads()
        if self._prefills is not None:  # writes every token's key and value, attends prefills
            out = paged_attention(attn, q, k, v, self._prefills, scaling=scaling)[0]
        else:
            out = q.new_empty((n, heads, dim))
        if self._chunks_in_c:  # every token's key and value written, then each chunk attends
            write_kv(cache, layer, step.write_index, k, v)
            k_pool, v_pool = cache.keys[layer], cache.values[layer]
            for chunk, table in zip(step.prefills, self._chunk_tables, strict=True):
                rows = chunk.end - chunk.start
                qc = _float32(q[0, :, chunk.start : chunk.end].transpose(0, 1))
                got = torch.empty(rows, heads, dim)
                rc = self._k.chunk_attention(
                    qc.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), table.data_ptr(),
                    table.shape[1], chunk.start_pos, rows, heads, kv_heads, dim,
                    cache.spec.block_size, float(scaling), got.data_ptr(), threads, self._bf16,
                )  # fmt: skip
                if rc == -2:
                    raise torch.OutOfMemoryError("chunk attention kernel: out of memory")
                if rc != 0:
                    raise RuntimeError(f"chunk attention kernel refused its arguments ({rc})")
                out[chunk.start : chunk.end].copy_(got)
        if step.decodes:
            assert self._tables is not None and self._lens is not None and self._write is not None
            idx = self.q_index
            m = int(idx.numel())
            qd, kd, vd = (_float32(t[0].index_select(1, idx).transpose(0, 1)) for t in (q, k, v))
            got = torch.empty(m, heads, dim)
            rc = self._k.attention(
                qd.data_ptr(), kd.data_ptr(), vd.data_ptr(),
                cache.keys[layer].data_ptr(), cache.values[layer].data_ptr(),
                self._write.data_ptr(), self._tables.data_ptr(), self._lens.data_ptr(),
                m, heads, kv_heads, dim, cache.spec.block_size, self._tables.shape[2],
                float(scaling), got.data_ptr(), threads, self._bf16,
            )  # fmt: skip
            if rc != 0:
                raise torch.OutOfMemoryError(f"decode attention kernel failed ({rc})")
            out.index_copy_(0, idx, got.to(out.dtype))
        return out.unsqueeze(0)


def _float32(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous float32 tensor, in one pass (``.float().contiguous()`` of a strided
    bfloat16 view copies twice)."""
    return torch.empty(t.shape, dtype=torch.float32).copy_(t)


def _chunk_kernel(step: StepMetadata, kernels: Kernels) -> bool:
    """Whether ``stoic_chunk_attention`` takes the step's prompt chunks: built here (AVX-512) and
    a head dimension of its 16-lane vectors (a multiple of 16, at most :data:`MAX_HEAD_DIM`: the
    decode kernel takes multiples of 8, so a model of head dim 24 or 40 keeps SDPA for its
    chunks)."""
    dim = step.cache.spec.head_dim
    return kernels.chunk_attention_available and dim % 16 == 0 and dim <= MAX_HEAD_DIM
