"""The torch side of one fused decoder layer (:class:`._fused.FusedLlama`'s steps that do not
run the C layers): the norm, q/k/v product and rotary before attention, and the output
projection, residuals and gated MLP after it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..gguf import QLinear
from ..kernels import PrefillOps

__all__ = ["SPLIT_MLP_ROWS", "attention_inputs", "mlp_block"]

#: from this many tokens in a step on, gate and up are two matrix products: one fused product
#: of twice the width measured 3-8% slower at 32 rows on an AVX2 CPU (and faster at one row)
SPLIT_MLP_ROWS = 16


def attention_inputs(
    hidden: torch.Tensor,
    norm: torch.Tensor,
    qkv: QLinear,
    cos: torch.Tensor,
    sin: torch.Tensor,
    sizes: list[int],
    eps: float,
    ops: PrefillOps | None = None,
    qk_norm: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's rotated queries and keys, and its values, each ``[1, heads, N, head_dim]``, for
    ``hidden`` ``[1, N, width]`` (``cos``/``sin`` ``[1, 1, N, head_dim]``). With ``ops`` (a
    bfloat16 step) the norm and rotary run in C (``cos``/``sin`` float32 ``[N, head_dim]``), and
    q, k and v are views of the one product's result. With ``qk_norm`` (the query and key
    heads' RMSNorm weights; never with ``ops``) each head is normalised before the rotary."""
    n, dim = hidden.shape[1], cos.shape[-1]
    if ops is not None:
        assert qk_norm is None, "the C operators have no q/k norms"
        y = qkv(ops.rms_norm(hidden, norm, eps), native=True)
        ops.rotate_(y, (sizes[0] + sizes[1]) // dim, dim, cos, sin)
        heads = y.view(1, n, -1, dim).transpose(1, 2)
        q, k, v = heads.split_with_sizes([size // dim for size in sizes], 1)
        return q, k, v
    x = F.rms_norm(hidden, (hidden.shape[-1],), norm, eps)
    qk, v = qkv(x, native=True).split_with_sizes([sizes[0] + sizes[1], sizes[2]], -1)
    qk_heads = [sizes[0] // dim, sizes[1] // dim]
    qk = qk.view(1, n, -1, dim)
    if qk_norm is not None:
        q, k = qk.split_with_sizes(qk_heads, 2)
        q = F.rms_norm(q, (dim,), qk_norm[0], eps)
        qk = torch.cat((q, F.rms_norm(k, (dim,), qk_norm[1], eps)), 2)
    # queries and keys rotated together: one set of elementwise ops for both
    qk = _rotate(qk.transpose(1, 2), cos, sin)
    q, k = qk.split_with_sizes(qk_heads, 1)
    return q, k, v.view(1, n, -1, dim).transpose(1, 2)


def mlp_block(
    hidden: torch.Tensor,
    attn_out: torch.Tensor,
    o: QLinear,
    norm: torch.Tensor,
    gate_up: QLinear,
    down: QLinear,
    eps: float,
    ops: PrefillOps | None = None,
    *,
    post: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    gelu: bool = False,
) -> torch.Tensor:
    """The rest of a layer after attention (``attn_out`` ``[1, N, heads, head_dim]``): output
    projection and residual, then norm, gated MLP and residual; returns ``[1, N, width]``.
    With ``ops`` (a bfloat16 step) the norm and SiLU x up run in C. ``post`` (Gemma): the
    norms of the attention's and the MLP's outputs before their residuals; ``gelu``: GELU
    (tanh) x up instead of SiLU x up (neither with ``ops``)."""
    n = hidden.shape[1]
    width = hidden.shape[-1]
    # a product's result in another dtype than hidden's is promoted by the addition
    if post[0] is not None:
        attended = F.rms_norm(o(attn_out.reshape(1, n, -1), native=True), (width,), post[0], eps)
        hidden = hidden + attended
    else:
        hidden = o.add_to(hidden, attn_out.reshape(1, n, -1))
    if ops is not None:
        x = ops.rms_norm(hidden, norm, eps)
    else:
        x = F.rms_norm(hidden, (hidden.shape[-1],), norm, eps)
    if gate_up.uses_kernel(n) or (n < SPLIT_MLP_ROWS and gate_up.packed is None):
        gate, up = gate_up(x, native=True).chunk(2, -1)
    else:  # the same rows of the same tensor, as two products (faster at many rows; the
        # packed copy holds the two halves)
        gate, up = gate_up.dense(x, 2, native=True)
    if gelu:
        act = F.gelu(gate, approximate="tanh") * up
    else:
        act = ops.silu_mul(gate, up) if ops is not None else F.silu(gate) * up
    if post[1] is not None:
        return hidden + F.rms_norm(down(act, native=True), (width,), post[1], eps)
    return down.add_to(hidden, act)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of ``x`` (``[1, heads, N, D]``), as transformers' Llama applies it."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)
