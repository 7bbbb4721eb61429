"""The bfloat16 prefill's elementwise operators in C (``_cops.c``): one pass each.

With ``--dtype auto``'s precision split (:mod:`stoic.model._precision`) a step of more rows than the blocks
take runs its products on bfloat16 weights, and its values between products stay bfloat16
(:mod:`stoic.model._fused`). Around the products, torch spent about 30 of a 243-token prefill step's ~100
ms: RMSNorm as six operators and a conversion, the rotary embedding as five, SiLU x up as two.
:class:`PrefillOps` does each in one C pass. float32 arithmetic rounded once to bfloat16, so
results differ from torch's only where torch rounds an intermediate to bfloat16 too.

Only bfloat16 work values on the CPU: a float32 step keeps torch's own arithmetic (and so
``--dtype float32``'s outputs equal transformers').
"""

from __future__ import annotations

import torch

from ._qkernels import Kernels

__all__ = ["PrefillOps"]


class PrefillOps:
    """The three operators over contiguous CPU tensors; :meth:`supports` says for which shapes.

    Each method raises :class:`ValueError` on an argument it cannot take (never silently
    computes something else); the caller checks :meth:`supports` first.
    """

    def __init__(self, kernels: Kernels) -> None:
        self._k = kernels

    @staticmethod
    def supports(width: int, head_dim: int) -> bool:
        """Whether a model of hidden ``width`` and ``head_dim`` fits the kernels' vectors."""
        return width % 8 == 0 and head_dim % 16 == 0

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """bfloat16 ``weight * x * rsqrt(mean(x^2) + eps)`` over the last dimension of float32
        ``x`` (transformers' LlamaRMSNorm, then the conversion to the next product's dtype)."""
        width = x.shape[-1]
        _check(x, torch.float32, "x")
        _check(weight, torch.float32, "weight")
        if weight.shape != (width,) or width % 8:
            raise ValueError(f"weight {tuple(weight.shape)} for rows of {width}")
        out = torch.empty(x.shape, dtype=torch.bfloat16)
        rows = x.numel() // width if width else 0
        rc = self._k.rms_norm_bf16(
            x.data_ptr(), rows, width, weight.data_ptr(), eps, out.data_ptr(), _threads()
        )
        _ok(rc, "rms_norm_bf16")
        return out

    def rotate_(
        self, y: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        """Rotate, in place, the first ``heads`` heads of each row of bfloat16 ``y`` (``[..., N,
        width]``, heads of ``head_dim`` side by side) by float32 ``cos``/``sin`` ``[N,
        head_dim]``: ``v * cos + rotate_half(v) * sin``, as transformers' Llama does."""
        _check(y, torch.bfloat16, "y")
        width = y.shape[-1]
        rows = y.numel() // width if width else 0
        for name, t in (("cos", cos), ("sin", sin)):
            _check(t, torch.float32, name)
            if t.shape != (rows, head_dim):
                raise ValueError(f"{name} {tuple(t.shape)}, want {(rows, head_dim)}")
        if heads * head_dim > width or head_dim % 16:
            raise ValueError(f"{heads} heads of {head_dim} in rows of {width}")
        rc = self._k.rope_bf16(
            y.data_ptr(), rows, width, heads, head_dim, cos.data_ptr(), sin.data_ptr(), _threads()
        )
        _ok(rc, "rope_bf16")

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """bfloat16 ``silu(gate) * up`` (both bfloat16, the same shape; rows may be strided, as
        the two halves of a fused ``[gate; up]`` product are)."""
        if gate.shape != up.shape:
            raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
        width = gate.shape[-1]
        rows = gate.numel() // width if width else 0
        strides = []
        for name, t in (("gate", gate), ("up", up)):
            if t.dtype != torch.bfloat16 or t.device.type != "cpu":
                raise ValueError(f"{name} must be a bfloat16 CPU tensor, not {t.dtype} {t.device}")
            flat = t.view(rows, width) if rows else t
            if rows and (flat.stride(1) != 1 or (rows > 1 and flat.stride(0) < width)):
                raise ValueError(f"{name}'s rows must be contiguous")
            strides.append(flat.stride(0) if rows else width)
        out = torch.empty(gate.shape, dtype=torch.bfloat16)
        rc = self._k.silu_mul_bf16(
            gate.data_ptr(), strides[0], up.data_ptr(), strides[1], rows, width,
            out.data_ptr(), _threads(),
        )  # fmt: skip
        _ok(rc, "silu_mul_bf16")
        return out


def _threads() -> int:
    return torch.get_num_threads()


def _check(t: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous {dtype} CPU tensor, not {t.dtype} {t.device}"
        )


def _ok(rc: int, name: str) -> None:
    if rc != 0:
        raise ValueError(f"stoic_{name} refused its arguments ({rc})")
