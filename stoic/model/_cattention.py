"""Decode tokens' attention in C on the steps the C layers do not run whole.

The C layers (:mod:`._cdecode`) serve decode-only steps of few tokens. Every other step goes
through the torch path, whose decode attention (:func:`._paged.paged_attention`) gathers each
decode group's blocks, padded to the group's longest sequence, into a new tensor a layer: at 32
sequences of mixed lengths (contexts 60-430) those copies and the batched products over the
padding took 60 of a 137 ms decode step (measured on a Xeon, 2 cores). The C kernel
``stoic_decode_attention`` attends over the paged blocks in place, each sequence over its own
length, so :class:`DecodeAttention` hands it the decode tokens of such a step; prefill chunks
keep torch's attention. The formulas are the torch path's (float32; results differ by float32
rounding, as the C layers' do).

The step plan of :class:`._attention.CDecodeAttention` (the quantised kernels, :mod:`._qkernels`,
and a float32 KV cache on the CPU).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ._cdecode import block_tables
from ._paged import StepMetadata, paged_attention
from ._qkernels import Kernels

__all__ = ["DecodeAttention"]


class DecodeAttention:
    """One step's attention with its decode tokens in C: built once a step, called a layer."""

    def __init__(self, kernels: Kernels, step: StepMetadata, tokens: int) -> None:
        self._k = kernels
        self._step = step
        #: the step without its decode groups, for torch's attention over the prefill chunks
        self._prefills = dataclasses.replace(step, decodes=()) if step.prefills else None
        self.q_index = torch.cat([g.q_index for g in step.decodes]).to(torch.int64)
        # every token's block table in step order (the C layers' own), then the decode tokens'
        tables, lens = block_tables(step, tokens)
        self._tables = tables.index_select(0, self.q_index)
        self._lens = lens.index_select(0, self.q_index)
        kv_heads = int(tables.shape[1])
        self._write = (
            step.write_index.view(kv_heads, tokens).index_select(1, self.q_index).contiguous()
        )

    @staticmethod
    def applies(step: StepMetadata) -> bool:
        """Whether a step's decodes can be attended in C: it has some, over a float32 cache on
        the CPU."""
        spec = step.cache.spec
        return bool(step.decodes) and spec.dtype == torch.float32 and spec.device.type == "cpu"

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
        written into the cache (:class:`._attention.StepAttention`). The C kernel has neither
        window nor soft cap: the backend plans such steps for torch.

        :raises torch.OutOfMemoryError: if the kernel could not allocate its scratch.
        """
        if softcap:
            raise ValueError("the C decode attention has no soft cap")
        scaling = attn.scaling if scaling is None else scaling
        step = self._step
        heads, n, dim = q.shape[1], q.shape[2], q.shape[3]
        kv_heads = k.shape[1]
        if self._prefills is not None:  # writes every token's key and value, attends prefills
            out = paged_attention(attn, q, k, v, self._prefills, scaling=scaling)[0]
        else:
            out = q.new_empty((n, heads, dim))
        idx = self.q_index
        m = int(idx.numel())
        qd = q[0].index_select(1, idx).transpose(0, 1).float().contiguous()
        kd = k[0].index_select(1, idx).transpose(0, 1).float().contiguous()
        vd = v[0].index_select(1, idx).transpose(0, 1).float().contiguous()
        got = torch.empty(m, heads, dim)
        layer = int(getattr(attn, "layer_idx", 0))
        cache = step.cache
        rc = self._k.attention(
            qd.data_ptr(), kd.data_ptr(), vd.data_ptr(),
            cache.keys[layer].data_ptr(), cache.values[layer].data_ptr(),
            self._write.data_ptr(), self._tables.data_ptr(), self._lens.data_ptr(),
            m, heads, kv_heads, dim, cache.spec.block_size, self._tables.shape[2],
            float(scaling), got.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise torch.OutOfMemoryError(f"decode attention kernel failed ({rc})")
        out.index_copy_(0, idx, got.to(out.dtype))
        return out.unsqueeze(0)
