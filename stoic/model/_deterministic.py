"""``--deterministic``: every token's logits independent of its batch, its chunking and its cache.

A token's logits in the default mode depend on the step it is computed in: a step of few rows
multiplies on the GGUF file's blocks (one row through a factored routine, more through tiles),
a bigger one on a dense (bfloat16 where it measures faster) copy through oneDNN; decode tokens
attend in C, prefill chunks through torch; the rotary table is computed for the step's
positions. Each sums in its own order, so in the fast dtype a sequence's greedy text changes
with what it is batched with, how its prompt was chunked, and whether its context came from the
prefix cache or a re-prefill after a failure.

In deterministic mode (:class:`._fused.FusedLlama` with ``deterministic``) every step runs the
C layers (:mod:`._cdecode`), prefill chunks included:

* every product in a fixed order: each output element by one instruction sequence whatever the
  number of rows, the tile it lands in or the thread count. Where the CPU has AVX-512 VNNI and
  the model runs with a fast dense dtype, on int8 activations, as the default mode's products
  (``_gemm8.c``'s G8 layouts for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K: each row of
  x quantised per block of 32 on its own, exact integer sums, the blocks' scaled sums added in
  block order; 1.125-1.5 bytes a weight, no bfloat16 copy). Otherwise (no VNNI),
  where the CPU has AVX512_BF16
  (``_bf16fixed.c``) in bfloat16 x bfloat16 -> float32, the fast dtype's products (what the
  default mode's bfloat16 copy computes for big steps): x rounded to bfloat16 once, the weights
  de-quantised exactly and rounded to bfloat16, one 16-lane float32 ``vdpbf16ps`` accumulator
  over K from the first 32 elements, one horizontal sum; steps of few rows de-quantise the
  blocks in registers, larger ones read a bfloat16 copy made at load by the same code (2 bytes
  a weight; bitwise the same values). Elsewhere in float32 on the file's blocks
  (``FIXED_ORDER`` in ``_qkernels.c``: the tiles only, the same per-row sum whatever the number
  of rows): deterministic too, slower at many rows. Never oneDNN's dense copy;
* every token's attention a row of ``stoic_decode_attention``: the token's query over its
  sequence's first ``position + 1`` keys in the paged pools, reduced over the keys in one order
  (8 at a time from the first) that depends on nothing but that length: the same for a decode
  token, a prefill token at that position, a token whose context came from the prefix cache
  or from a re-prefill. A prefill chunk's rows are computed together
  (``stoic_prefill_attention``, ``_rows_attention.c``: each key and value read once for a
  tile of rows), each row with that kernel's operations in that order, so bitwise the same;
* RMSNorm, rotary, SiLU and the residuals per row in C; the rotary tables from
  :class:`RotaryTable` (each position's values computed once, by the same call);
* the final norm and softmax per row in torch (tested batch-invariant), sampling per row with
  a seeded row's own generator (:mod:`._sampling`).

So a token's logits are a function of its sequence's tokens alone, in the fast dtype that
``--dtype auto`` picks for such a model (float32 activations and KV, the file's 4- to 8-bit
weights; the products' inputs rounded to bfloat16 where the CPU has AVX512_BF16): ``--recovery resume`` and Ray migration continue exactly the text an uninterrupted
run gives. Models off that path (a directory model, a GGUF of another family, a sliding window,
a rotary scaling that depends on the sequence length) are refused at start with the reason:
their products run in torch/oneDNN, whose CPU kernels choose their blocking by the number of
rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..config import Quantization
from ..errors import ModelUnavailable

__all__ = ["ROTARY_PIECE", "RotaryTable", "refusal", "refuse", "require_deterministic"]

#: positions the rotary table is computed for at a time (one call each, cached)
ROTARY_PIECE = 256
#: rotary scalings whose table depends on the step's longest position, not the position alone
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


class RotaryTable:
    """A model's rotary ``cos``/``sin`` by position, each computed once.

    The model's rotary module maps positions to ``cos``/``sin`` with vectorised kernels whose
    tails may round differently from their bodies; here positions are computed in pieces of
    :data:`ROTARY_PIECE` (positions ``[k * 256, (k + 1) * 256)`` by one call), so a position's
    values do not depend on the step that first needed them.
    """

    def __init__(self, rotary: Any) -> None:
        self._rotary = rotary
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None

    def __call__(
        self, hidden: torch.Tensor, positions: torch.Tensor, highest: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``, ``sin`` ``[1, N, head_dim]`` for ``positions`` ``[1, N]`` (``hidden``: the
        step's embeddings, for the dtype and device; ``highest``: the largest position, known
        on the host, else read from ``positions``)."""
        flat = positions.reshape(-1)
        top = int(flat.max()) if highest is None and flat.numel() else (highest or 0)
        need = (top // ROTARY_PIECE + 1) * ROTARY_PIECE if flat.numel() else 0
        have = 0 if self._cos is None else int(self._cos.shape[0])
        if need > have:
            cos, sin = [], []
            for start in range(have, need, ROTARY_PIECE):
                piece = torch.arange(start, start + ROTARY_PIECE, device=positions.device)
                c, s = self._rotary(hidden[:, :1], piece[None])
                cos.append(c[0])
                sin.append(s[0])
            prior = [] if self._cos is None or self._sin is None else [(self._cos, self._sin)]
            self._cos = torch.cat([p[0] for p in prior] + cos)
            self._sin = torch.cat([p[1] for p in prior] + sin)
        assert self._cos is not None and self._sin is not None
        return self._cos.index_select(0, flat)[None], self._sin.index_select(0, flat)[None]


def refuse(why: str) -> ModelUnavailable:
    """The start-up error for a model that cannot run deterministically, ``why``."""
    return ModelUnavailable(f"--deterministic cannot be used: {why}")


def require_deterministic(
    gguf: Path | None,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    device: torch.device,
    quantization: Quantization,
    cache_root: Path,
) -> None:
    """Check, before any worker process starts, what can be known without the weights: a
    ``.gguf`` file of the C layers' architectures, kernels that run here, float32 activations
    and KV cache (the runner checks the rest: :func:`refusal`).

    :raises ModelUnavailable: if the model cannot run deterministically (one line: why).
    """
    from ._precision import C_LAYER_FILES, decodes_on_blocks

    if quantization == "none":
        raise refuse("--quantization none keeps no quantised blocks to compute on")
    if gguf is None or not decodes_on_blocks(gguf, device, cache_root):
        files = ", ".join(C_LAYER_FILES)
        raise refuse(
            f"the model does not run on the C layers here (a .gguf file of the {files} "
            "architectures, on an x86-64 CPU with AVX2 and a C compiler); other models run "
            "torch's products, whose order of sums depends on the batch"
        )
    if dtype != torch.float32:
        name = str(dtype).removeprefix("torch.")
        raise refuse(f"the C layers compute in float32, not {name} (--dtype auto or float32)")
    if (why := cache_refusal(kv_dtype)) is not None:
        raise refuse(why)


def cache_refusal(kv_dtype: torch.dtype) -> str | None:
    """Why a ``kv_dtype`` KV cache cannot run deterministically (None: it can): the rows kernel
    (``_rows_attention.c``) reads float32 pools."""
    if kv_dtype == torch.float32:
        return None
    name = str(kv_dtype).removeprefix("torch.")
    return f"its attention reads a float32 KV cache, not {name} (--kv-cache-dtype auto or float32)"


def refusal(fused: Any, rotary: Any) -> str | None:
    """Why a model cannot run deterministically (None: it can): ``fused`` is its
    :class:`._fused.FusedLlama` built with ``deterministic`` (None: not a fused family)."""
    if fused is None:
        return (
            "the model does not run on stoic's fused layers (a GGUF file of the llama, qwen2 or "
            "phi3 architectures is needed; this one runs transformers' layers, whose products "
            "and attention reduce in an order that depends on the batch)"
        )
    if fused.c_decoder is None:
        return (
            "not every layer runs in the C layers (every projection on the GGUF file's "
            "quantised blocks, a float32 dtype, no q/k norms: --dtype auto or float32 and "
            "--quantization auto or gguf, on an x86-64 CPU with AVX2)"
        )
    if fused.has_window:
        return "the model's attention has a sliding window, which the C attention lacks"
    kind = str(getattr(rotary, "rope_type", "default"))
    if any(k in kind for k in _LENGTH_DEPENDENT_ROPE):
        return f"its rotary scaling ({kind}) depends on the sequence length"
    return None
