"""How a runner computes: a typed record of its precision and quantised-kernel choices."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ComputePath"]


@dataclass(frozen=True)
class ComputePath:
    """What an executor's model runner multiplies with, as decided at its load.

    Built from :attr:`ModelRunner.quantized` (the summary a worker process reports when ready),
    so the server can show it without loading weights of its own (``stoic_model_info``).
    """

    #: activations and KV cache (``float32``, ``bfloat16``, ...)
    dtype: str
    #: the weights of products over more than ``kernel_rows`` rows
    dense_dtype: str
    #: projections that run on the GGUF file's quantised blocks, of ``projections``
    quantized_projections: int
    projections: int
    #: the LM head's block type on the kernels, or None (float weights)
    head: str | None
    #: whether decode-only steps run the C layers
    c_layers: bool
    #: steps of at most this many tokens run on the blocks
    kernel_rows: int

    @property
    def kernels(self) -> bool:
        """Whether anything runs on the quantised kernels."""
        return self.quantized_projections > 0 or self.head is not None

    @classmethod
    def from_summary(cls, summary: Mapping[str, Any]) -> ComputePath:
        """From a runner's ``quantized`` summary.

        :raises KeyError: if the summary lacks a field (a worker of another stoic version).
        """
        return cls(
            dtype=str(summary["dtype"]),
            dense_dtype=str(summary["dense_dtype"]),
            quantized_projections=int(summary["projections"]),
            projections=int(summary["of"]),
            head=None if summary["head"] is None else str(summary["head"]),
            c_layers=bool(summary["c_layers"]),
            kernel_rows=int(summary["kernel_rows"]),
        )
