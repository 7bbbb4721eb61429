"""Products of many rows over a matrix's quantised blocks with int8 activations (``_gemm8.c``).

In the default mode with a fast dense dtype (``--dtype auto`` chose bfloat16), a step of more
than ``kernel_rows`` tokens (a prefill chunk, a decode step of 9 or more sequences) multiplied by
the bfloat16 copy of the weights. Where the CPU has AVX-512 VNNI and every part of a matrix is of
a type ``_gemm8.c`` reads (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K), it multiplies by the file's
own integers instead, its activations quantised to int8 per block of 32: 0.61-0.77x the packed
bfloat16 product's time (docs/benchmarks.md). Not the float product (``_gemm8.c`` states the
numerics): never with ``--dtype float32`` nor ``--deterministic``.
"""

from __future__ import annotations

import torch

from ._qkernels import GGML_TYPES, Kernels, get_threads

__all__ = ["G8_TYPES", "Gemm8"]

#: the dtypes of x and y the product reads and writes
_DTYPES = (torch.float32, torch.bfloat16)
#: the GGML types the layout is built from (Q6_K's scale per 16 weights does not fit it)
G8_TYPES = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K"})


class Gemm8:
    """``x @ W.T (+ bias)`` for ``x`` float32 ``[M, cols]``, W the matrix stacked from
    ``parts`` (each ``(kind, blocks)``, one below the other), in the G8 layout (1.25 bytes a
    weight). Thread-safe: calls share nothing but their arguments."""

    __slots__ = ("_bias", "_kernels", "_packed", "cols", "rows")

    def __init__(
        self,
        kernels: Kernels,
        packed: torch.Tensor,
        rows: int,
        cols: int,
        bias: torch.Tensor | None,
    ) -> None:
        self._kernels = kernels
        self._packed = packed
        self._bias = bias
        self.rows = rows
        self.cols = cols

    @classmethod
    def bind(
        cls,
        kernels: Kernels,
        parts: list[tuple[str, torch.Tensor]],
        bias: torch.Tensor | None,
    ) -> Gemm8 | None:
        """The product over ``parts``, or None where this build has no int8 products or a part
        is of a type the layout does not hold (the caller keeps its dense product).

        :raises ValueError: if a part's blocks do not fit its type or the parts differ in width.
        """
        if not kernels.int8_rows or not parts or any(k not in G8_TYPES for k, _ in parts):
            return None
        decoded = [_decode(kernels, kind, blocks) for kind, blocks in parts]
        cols = decoded[0][0].shape[1]
        if any(q.shape[1] != cols for q, _, _ in decoded):
            raise ValueError(
                f"cannot stack matrices of widths {[q.shape[1] for q, _, _ in decoded]}"
            )
        q, d, m = (torch.cat(t) if len(decoded) > 1 else t[0] for t in zip(*decoded, strict=True))
        rows = q.shape[0]
        if bias is not None and (bias.dtype != torch.float32 or bias.shape != (rows,)):
            raise ValueError(f"a bias of {tuple(bias.shape)} for {rows} outputs")
        packed = torch.empty(kernels.g8_bytes(rows, cols), dtype=torch.uint8)
        rc = kernels.g8_pack(
            q.data_ptr(), d.data_ptr(), m.data_ptr(), rows, cols, packed.data_ptr()
        )
        if rc != 0:
            raise ValueError(f"cannot lay out a {rows} x {cols} matrix for int8 products")
        return cls(kernels, packed, rows, cols, None if bias is None else bias.contiguous())

    @property
    def nbytes(self) -> int:
        """The bytes the layout holds."""
        return self._packed.numel()

    def __call__(self, x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[M, rows]`` in ``dtype`` (float32 or bfloat16: rounded to nearest even, as torch
        converts), for ``x`` float32 or bfloat16 (read as it is: no converted copy).

        :raises ValueError: if ``x`` is not float32 or bfloat16 ``[M, cols]`` contiguous, or
            ``dtype`` neither; ``torch.OutOfMemoryError`` if the kernel could not allocate its
            int8 copy of ``x``.
        """
        if (
            x.dtype not in _DTYPES
            or dtype not in _DTYPES
            or x.dim() != 2
            or x.shape[1] != self.cols
            or not x.is_contiguous()
        ):
            raise ValueError(
                f"cannot multiply x {tuple(x.shape)} {x.dtype} by {(self.rows, self.cols)}"
            )
        m = x.shape[0]
        y = torch.empty(m, self.rows, dtype=dtype)
        bias = None if self._bias is None else self._bias.data_ptr()
        rc = self._kernels.g8_mm(
            x.data_ptr(), x.dtype == torch.bfloat16, m, self.cols, self._packed.data_ptr(),
            self.rows, bias, y.data_ptr(), dtype == torch.bfloat16, get_threads(),
        )  # fmt: skip
        if rc != 0:  # 1 (no VNNI) cannot happen: bind checked it
            raise torch.OutOfMemoryError(f"int8 product failed ({rc})")
        return y


def _decode(
    kernels: Kernels, kind: str, blocks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The unsigned integers (uint8 ``[N, K]``), scales and offsets (float32 ``[N, K / 32]``)
    of ``blocks`` (uint8 ``[N, K / weights * block_bytes]``): w = q d + m."""
    ggml = GGML_TYPES[kind]
    n, row_bytes = blocks.shape
    if blocks.dtype != torch.uint8 or not blocks.is_contiguous() or row_bytes % ggml.block_bytes:
        raise ValueError(f"not {kind} blocks: {blocks.dtype} {tuple(blocks.shape)}")
    cols = row_bytes // ggml.block_bytes * ggml.weights
    q = torch.empty(n, cols, dtype=torch.uint8)
    d = torch.empty(n, cols // 32, dtype=torch.float32)
    m = torch.empty(n, cols // 32, dtype=torch.float32)
    rc = kernels.g8_decode(
        ggml.type_id, blocks.data_ptr(), n, cols, q.data_ptr(), d.data_ptr(), m.data_ptr()
    )
    if rc != 0:
        raise ValueError(f"cannot decode {kind} blocks {tuple(blocks.shape)}")
    return q, d, m
