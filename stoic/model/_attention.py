"""Attention backends: the one seam between a step's decoder layers and the paged KV cache.

A backend does the attention of a step's packed tokens (prefill chunks and decode tokens
together) over the paged cache in two halves, as the paged-attention libraries do:

* :meth:`AttentionBackend.plan`, once a step: from the step's :class:`._paged.StepMetadata`
  (block tables, context lengths, positions, write slots: built on the host by the runner and
  moved to the device in one copy, :func:`to_device`) whatever the backend needs for every layer
  (its own index layout, workspace, kernel choices);
* :meth:`StepAttention.forward`, once a layer: write the layer's new keys and values into the
  cache, attend, return ``[1, N, heads, head_dim]``.

Neither half may read a tensor back from the device (no ``.item()``, ``.tolist()``, ``int()``
of a device tensor): what the plan needs on the host (the step's highest position, its token
count) the runner gives it as Python numbers. The step's one device-to-host read is the sampled
ids' ``.tolist()`` (:mod:`._sampling`).

:func:`choose_attention` picks the backend once, at load, by device, dtype and what the machine
has; its :attr:`~AttentionBackend.name` is logged in ``model.compute_path`` (``attention``) and
shown in ``/v1/models``. Adding a backend (a GPU one over FlashInfer's paged wrappers, say) is one
class with these two methods and one line in :func:`choose_attention` (docs/architecture.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..kernels import Kernels
from ._cattention import PagedCAttention
from ._cdecode import CDecoder
from ._paged import ATTN_IMPLEMENTATION, StepMetadata, paged_attention

__all__ = [
    "AttentionBackend",
    "CPagedAttention",
    "StepAttention",
    "TorchPagedAttention",
    "choose_attention",
    "interface_attention",
    "register_attention",
    "to_device",
]


class StepAttention(Protocol):
    """One step's planned attention, run once a layer."""

    def forward(
        self,
        module: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scaling: float | None,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """``[1, N, heads, head_dim]`` for ``q`` ``[1, heads, N, head_dim]`` and ``k``/``v``
        ``[1, kv_heads, N, head_dim]`` of layer ``module`` (its ``layer_idx`` names the cache
        layer); the keys and values are written into the step's cache first."""
        ...


class AttentionBackend(Protocol):
    """Plans a step's attention over the paged cache (see the module's docstring)."""

    #: what ``model.compute_path`` logs as ``attention``
    name: str

    def plan(self, step: StepMetadata, tokens: int, *, windowed: bool = False) -> StepAttention:
        """The attention of ``step`` (``tokens`` packed tokens); ``windowed``: some token is at
        or past a layer's sliding window (a backend without windows must hand it to one with)."""
        ...


@dataclass(frozen=True)
class _TorchStep:
    step: StepMetadata

    def forward(
        self,
        module: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scaling: float | None,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        return paged_attention(
            module,
            q,
            k,
            v,
            self.step,
            scaling=scaling,
            sliding_window=sliding_window,
            softcap=softcap,
        )


class TorchPagedAttention:
    """torch's operators over the gathered blocks (:func:`._paged.paged_attention`): any device,
    any dtype, sliding windows and soft caps; the plan is the step's metadata itself."""

    name = "torch-paged"

    def plan(self, step: StepMetadata, tokens: int, *, windowed: bool = False) -> StepAttention:
        return _TorchStep(step)


class CPagedAttention:
    """The decode tokens, and the prompt chunks where the build has the chunk kernel (AVX-512),
    in C over the blocks in place (:class:`._cattention.PagedCAttention`); the rest in torch. A
    step C takes nothing of (a window reached, a cache neither float32 nor bfloat16 on the
    CPU) runs all in torch."""

    name = "c-paged"

    def __init__(self, kernels: Kernels) -> None:
        self._kernels = kernels

    def plan(self, step: StepMetadata, tokens: int, *, windowed: bool = False) -> StepAttention:
        if windowed or not PagedCAttention.applies(step, self._kernels):
            return _TorchStep(step)
        return PagedCAttention(self._kernels, step, tokens)


def choose_attention(
    kernels: Kernels | None,
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    device: torch.device,
    dtype: torch.dtype,
) -> AttentionBackend:
    """The attention backend of a model of these shapes on ``device`` computing in ``dtype``,
    given the quantised ``kernels`` (None: none here); the one place a backend is chosen. The C
    backend plans for torch any step whose KV cache it cannot read (not float32 or bfloat16:
    :data:`stoic.kernels._qkernels.C_POOL_DTYPES`)."""
    if (
        kernels is not None
        and device.type == "cpu"
        and dtype == torch.float32
        and CDecoder.supports(torch.float32, head_dim, heads, kv_heads)
    ):
        return CPagedAttention(kernels)
    return TorchPagedAttention()


def interface_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    stoic_step: StepAttention | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface function (models on transformers' own decoder layers):
    the step's planned attention, passed along as the ``stoic_step`` keyword."""
    if stoic_step is None:
        raise RuntimeError("stoic_paged attention called without a planned step")
    out = stoic_step.forward(
        module,
        query,
        key,
        value,
        scaling=scaling,
        sliding_window=sliding_window,
        softcap=softcap,
    )
    return out, None


_registered = False


def register_attention() -> None:
    """Register :func:`interface_attention` with transformers (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, interface_attention)
    _registered = True


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a CPU tensor the caller never writes again) on ``device`` in one copy.

    On CUDA the copy is from pinned memory and does not block the host: the caching host
    allocator keeps the pinned buffer until the copy's stream has used it. On the CPU, ``host``
    itself (pinning there is a no-op: nothing is copied).
    """
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
