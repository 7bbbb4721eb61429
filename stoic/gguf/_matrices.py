"""A GGUF file's quantised matrices as the kernels take them: a matrix's blocks
(:class:`QuantizedMatrix`, a view of the mapped file), several stacked for a fused projection
(:class:`MixedMatrix`, kept apart where their types differ), and the reading of a Llama-layout
file's projections and head (:func:`read_llama_blocks`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..kernels import Kernels, Product
from ._header import GgufTensor
from ._weights import GgufFile, kernel_matrix

__all__ = ["MixedMatrix", "QuantizedMatrix", "read_llama_blocks"]

_LLAMA_TENSORS = {
    "q": "attn_q",
    "k": "attn_k",
    "v": "attn_v",
    "qkv": "attn_qkv",  # Phi-3's fused [q; k; v]
    "o": "attn_output",
    "gate": "ffn_gate",
    "up": "ffn_up",  # Phi-3's fused [gate; up]
    "down": "ffn_down",
}


@dataclass(frozen=True)
class QuantizedMatrix:
    """``rows`` x ``cols`` weights as GGML blocks: uint8 ``[rows, cols / weights * block_bytes]``
    (``weights`` a block: 32, or 256 for a K-quant)."""

    kind: str
    blocks: torch.Tensor
    cols: int

    @property
    def rows(self) -> int:
        return int(self.blocks.shape[0])

    @property
    def pieces(self) -> list[tuple[str, torch.Tensor]]:
        """``(kind, blocks)`` of each part, top to bottom (this one matrix)."""
        return [(self.kind, self.blocks)]

    @staticmethod
    def stack(parts: list[QuantizedMatrix | None]) -> QuantizedMatrix | MixedMatrix | None:
        """The matrices one below the other (a fused projection): the matrix itself for one, a
        :class:`MixedMatrix` of them for several (never a copy: their blocks may be the file's
        mapped pages), None when any is missing or they differ in width."""
        found = [p for p in parts if p is not None]
        if not found or len(found) != len(parts) or len({p.cols for p in found}) != 1:
            return None
        return found[0] if len(found) == 1 else MixedMatrix(tuple(found))

    def bind(
        self,
        kernels: Kernels,
        bias: torch.Tensor | None,
        *,
        fixed: bool = False,
        int8_rows: bool = False,
    ) -> Product:
        """The product by these blocks (and a float32 ``bias``), repacked once; ``fixed``: in
        the fixed order, ``int8_rows``: products of up to eight rows on int8 activations where
        the kernels have them (:class:`stoic.kernels._qkernels.Product`)."""
        return kernels.bind(self.kind, self.blocks, bias, fixed=fixed, int8_rows=int8_rows)

    def matches(self, kernels: Kernels, weight: torch.Tensor) -> bool:
        """Whether these blocks hold ``weight`` (the de-quantised copy), judged on a sample of
        rows spread over the matrix (a wrong name mapping or row permutation shows in any)."""
        if tuple(weight.shape) != (self.rows, self.cols):
            return False
        picks = sorted(
            {0, 1, 2, 3, self.rows // 3, self.rows // 2 + 1, self.rows - 2, self.rows - 1}
        )
        index = torch.tensor([r for r in picks if 0 <= r < self.rows])
        mine = kernels.dequantize(self.kind, self.blocks.index_select(0, index), self.cols)
        theirs = weight.detach().index_select(0, index.to(weight.device)).cpu()
        return torch.equal(mine.to(theirs.dtype), theirs)


@dataclass(frozen=True)
class MixedMatrix:
    """Matrices one below the other (a fused projection), kept apart: one product over them,
    where their types differ each part multiplied on its own type (a mixed file: Q4_K_M holds
    some layers' V projection as Q6_K under Q4_K queries and keys;
    :meth:`stoic.kernels._qkernels.Kernels.bind_stack`), where they agree one product over their rows
    stacked."""

    parts: tuple[QuantizedMatrix, ...]

    @property
    def kind(self) -> str:
        """The parts' types, joined by ``+`` (``"Q4_K+Q6_K"``)."""
        return "+".join(dict.fromkeys(p.kind for p in self.parts))

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.parts)

    @property
    def pieces(self) -> list[tuple[str, torch.Tensor]]:
        """``(kind, blocks)`` of each part, top to bottom."""
        return [(p.kind, p.blocks) for p in self.parts]

    @property
    def cols(self) -> int:
        return self.parts[0].cols

    def bind(
        self,
        kernels: Kernels,
        bias: torch.Tensor | None,
        *,
        fixed: bool = False,
        int8_rows: bool = False,
    ) -> Product:
        if len({p.kind for p in self.parts}) == 1:  # stacked for the repacking only (the
            # product holds its own repacked copy: the stack is freed once it is made)
            blocks = torch.cat([p.blocks for p in self.parts])
            return kernels.bind(self.kind, blocks, bias, fixed=fixed, int8_rows=int8_rows)
        return kernels.bind_stack(
            [(p.kind, p.blocks) for p in self.parts], bias, fixed=fixed, int8_rows=int8_rows
        )

    def matches(self, kernels: Kernels, weight: torch.Tensor) -> bool:
        """Whether each part holds its rows of ``weight`` (:meth:`QuantizedMatrix.matches`)."""
        if weight.dim() != 2 or weight.shape[0] != self.rows:
            return False
        slices = weight.split_with_sizes([p.rows for p in self.parts])
        return all(p.matches(kernels, w) for p, w in zip(self.parts, slices, strict=True))


def _unpermute(rows: int, heads: int) -> torch.Tensor:
    """The row order transformers gives a Q or K projection read from a GGUF file (llama.cpp
    stores them permuted for its rotary layout; transformers' ``reverse_permute_weights``)."""
    dim = rows // heads // 2
    return torch.arange(rows).reshape(heads, dim, 2).transpose(1, 2).reshape(rows)


def _read_matrix(
    file: GgufFile, tensor: GgufTensor, order: torch.Tensor | None = None
) -> QuantizedMatrix | None:
    """``tensor``'s blocks as a view of the mapped file (its pages shared, not copied: rows
    reordered by ``order`` are a copy), or None where the kernels cannot take it."""
    kind = kernel_matrix(tensor)
    if kind is None:
        return None
    blocks = file.raw(tensor)
    if order is not None:
        blocks = blocks.index_select(0, order)
    return QuantizedMatrix(kind, blocks, tensor.dims[0])


def read_llama_blocks(gguf: Path | GgufFile, config: Any) -> dict[str, QuantizedMatrix]:
    """The quantised matrices of a Llama-layout GGUF file (Llama, Mistral, Qwen2, Qwen3, Phi-3:
    :data:`stoic.model._fused.FUSED_TYPES`), keyed ``"{layer}.{q|k|v|qkv|o|gate|up|down}"`` and ``"head"``
    (``output.weight``, else the tied ``token_embd.weight``), rows in transformers' order (the
    Q and K rows of a ``llama`` file un-permuted, as transformers' loader does for that
    architecture only). Matrices of types the kernels lack are left out. The blocks are views
    of the file mapped copy-on-write (:class:`._gguf_weights.GgufFile`): every process that
    maps the file shares its pages.

    :raises OSError: if the file cannot be read; ``ValueError`` if it is not GGUF or truncated.
    """
    file = gguf if isinstance(gguf, GgufFile) else GgufFile(gguf)
    tensors = file.header.tensors
    permuted = file.header.architecture == "llama"
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    out: dict[str, QuantizedMatrix] = {}
    for i in range(int(config.num_hidden_layers)):
        for short, name in _LLAMA_TENSORS.items():
            tensor = tensors.get(f"blk.{i}.{name}.weight")
            if tensor is None:
                continue
            order = None
            if permuted and short in ("q", "k") and len(tensor.dims) == 2:
                order = _unpermute(tensor.dims[1], heads if short == "q" else kv_heads)
            found = _read_matrix(file, tensor, order)
            if found is not None:
                out[f"{i}.{short}"] = found
    head = tensors.get("output.weight") or tensors.get("token_embd.weight")
    found = _read_matrix(file, head) if head is not None else None
    if found is not None:
        out["head"] = found
    return out
