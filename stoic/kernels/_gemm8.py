"""Products of many rows over a matrix's quantised blocks with int8 activations (``_gemm8.c``).

In the default mode with a fast dense dtype (``--dtype auto`` chose bfloat16), a step of more
than ``kernel_rows`` tokens (a prefill chunk, a decode step of 9 or more sequences) multiplied by
the bfloat16 copy of the weights. Where the CPU has AVX-512 VNNI and every part of a matrix is of
a type ``_gemm8.c`` reads (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), it multiplies by the
file's own integers instead, its activations quantised to int8 per block of 32: 0.61-0.77x the
packed bfloat16 product's time (docs/benchmarks.md). Not the float product (``_gemm8.c`` states the
numerics): never with ``--dtype float32``. (``--deterministic`` multiplies on the same layouts
through the C layers' products, :meth:`._qkernels.Kernels.bind` with ``fixed``, not this class.)
"""

from __future__ import annotations

import torch

from ._qkernels import (
    G8_TYPES,
    GGML_TYPES,
    G8Layout,
    Kernels,
    Product,
    _check_bias,
    get_threads,
)

__all__ = ["G8_TYPES", "Gemm8"]

#: the dtypes of x and y the product reads and writes
_DTYPES = (torch.float32, torch.bfloat16)


class Gemm8:
    """``x @ W.T (+ bias)`` for ``x`` float32 ``[M, cols]``, W the matrix stacked from
    ``parts`` (each ``(kind, blocks)``, one below the other), in the G8 layout (1.125-1.5 bytes
    a weight, :meth:`Kernels.g8_layout`). Thread-safe: calls share nothing but their arguments."""

    __slots__ = ("_bias", "_kernels", "_layout", "cols", "rows", "shared")

    def __init__(
        self,
        kernels: Kernels,
        layout: G8Layout,
        rows: int,
        cols: int,
        bias: torch.Tensor | None,
    ) -> None:
        self._kernels = kernels
        self._layout = layout
        self._bias = bias
        self.rows = rows
        self.cols = cols
        #: whether the layout is a :class:`Product`'s (:meth:`over`): its bytes are counted there
        self.shared = False

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
        layout = kernels.g8_layout(parts)
        rows = sum(int(blocks.shape[0]) for _, blocks in parts)
        ggml = GGML_TYPES[parts[0][0]]
        cols = int(parts[0][1].shape[1]) // ggml.block_bytes * ggml.weights
        _check_bias(bias, rows)
        return cls(kernels, layout, rows, cols, None if bias is None else bias.contiguous())

    @classmethod
    def over(cls, kernels: Kernels, product: Product, bias: torch.Tensor | None) -> Gemm8 | None:
        """The product over ``product``'s own G8 layout (:attr:`Product.g8`, one matrix: no
        copy), or None where it has none."""
        if not product.g8 or product.parts:
            return None
        _check_bias(bias, product.rows)
        layout = G8Layout(product.packed, product.layout & ~kernels.layouts.fixed_order)
        gemm = cls(
            kernels, layout, product.rows, product.cols, None if bias is None else bias.contiguous()
        )
        gemm.shared = True
        return gemm

    @property
    def layout(self) -> int:
        """The layout's id as the kernels name it (``_gemm8.c``: G8 and its variants)."""
        return self._layout.layout

    @property
    def nbytes(self) -> int:
        """The bytes the layout holds."""
        return self._layout.packed.numel()

    def __call__(
        self,
        x: torch.Tensor,
        dtype: torch.dtype = torch.float32,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[M, rows]`` in ``dtype`` (float32 or bfloat16: rounded to nearest even, as torch
        converts), for ``x`` float32 or bfloat16 (read as it is: no converted copy). With
        ``residual`` (float32 ``[M, rows]``) the result is ``residual + x @ W.T (+ bias)``, the
        addition in the kernel's float32 before any rounding to ``dtype`` (a layer's residual
        stream: no separate addition, no bfloat16 rounding of the product first).

        :raises ValueError: if ``x`` is not float32 or bfloat16 ``[M, cols]`` contiguous,
            ``dtype`` neither, or ``residual`` not float32 ``[M, rows]`` contiguous;
            ``torch.OutOfMemoryError`` if the kernel could not allocate its int8 copy of ``x``.
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
        if residual is not None and (
            residual.dtype != torch.float32
            or tuple(residual.shape) != (m, self.rows)
            or not residual.is_contiguous()
        ):
            raise ValueError(
                f"cannot add a residual {tuple(residual.shape)} {residual.dtype} "
                f"to a product of {(m, self.rows)}"
            )
        y = torch.empty(m, self.rows, dtype=dtype)
        bias = None if self._bias is None else self._bias.data_ptr()
        res = None if residual is None else residual.data_ptr()
        rc = self._kernels.g8_mm(
            x.data_ptr(), x.dtype == torch.bfloat16, m, self.cols,
            self._layout.packed.data_ptr(), self.rows, self._layout.layout, bias, res,
            y.data_ptr(), dtype == torch.bfloat16, get_threads(),
        )  # fmt: skip
        if rc != 0:  # 1 (no VNNI) cannot happen: bind checked it
            raise torch.OutOfMemoryError(f"int8 product failed ({rc})")
        return y
