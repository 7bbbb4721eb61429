"""A GGUF model's quantised weights, used as they are for steps of few tokens.

On a CPU a decode step of one sequence reads every weight once: it is bound by memory
bandwidth, and float32 weights are 6x the bytes of the GGUF file's 4-bit ones (SmolLM2-135M:
540 MB against 96 MB a token). So where :func:`quantized_weights` can, the projections of a
Llama model's layers and its LM head keep, next to the float32 (or bfloat16) copy transformers
de-quantised, the file's own blocks; :class:`QLinear` multiplies a step of at most
:data:`MAX_KERNEL_ROWS` tokens by the blocks (:mod:`stoic.kernels._qkernels`), a bigger one (a prefill
chunk, where the product is compute-bound and float32 BLAS is faster) by the float copy.

Nothing is lost: the blocks hold the float copy's weights (checked at load, row samples of every
matrix de-quantised by the kernels and compared bitwise), and the products differ from the
float ones within float32 rounding, as two BLAS kernels do (``_qkernels.c`` says how). Types: Q4_0,
Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K (what :data:`stoic.kernels._qkernels.GGML_TYPES` lists), each matrix
on its own type (a mixed file such as Q4_K_M: a fused projection of matrices of different types
is a :class:`MixedMatrix`); a matrix of any other type (Q2_K, Q3_K, IQ types, F16, ...) stays on
the float path, and so does a fused projection with one such part.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F

from .._logging import get_logger
from ..config import Quantization, WeightLayouts
from ..kernels import GGML_TYPES, Gemm8, Kernels, Product
from ._matrices import MixedMatrix, QuantizedMatrix, read_llama_blocks
from ._packed import PackedLinear
from ._weights import GgufFile

__all__ = [
    "DENSE_KERNEL_ROWS",
    "EVERY_ROW",
    "MAX_KERNEL_ROWS",
    "QLinear",
    "choose_layouts",
    "kernels_for",
    "prepare_quantized",
]

#: steps of at most this many tokens use the quantised kernels. Measured on an AVX2 CPU (2
#: cores, the default model, every matrix in turn so none stays in cache): the kernels took
#: 0.23x the float32 product's time at 1 row, 0.14x at 4, 0.31x at 8, 0.48x at 16, 0.79x at 32
#: (docs/benchmarks.md); prefill chunks are larger and compute-bound.
MAX_KERNEL_ROWS = 32
#: the same with a bfloat16 dense dtype (:mod:`stoic.model._precision`: a CPU with AMX), where bfloat16
#: tiles overtake the kernels sooner. Measured on a Xeon with AMX and AVX-512, 2 cores, the
#: default model's whole decode step, C layers on the blocks against bfloat16 products packed
#: for oneDNN (:mod:`._packed`; contexts 100-400): 23.3 vs 23.4 ms at 4 sequences, 31.9 vs 31.9
#: at 6, 32.8 vs 31.8 at 8, 45.8 vs 37.0 at 12, 57.4 vs 40.4 at 16 (with unpacked bfloat16
#: products the crossover was 16: 27.3 vs 29.6 ms at 8, 47.8 vs 49.2 at 16)
DENSE_KERNEL_ROWS = 8
#: ``--deterministic``: every step, whatever its number of tokens, on the fixed-order product
#: (:class:`stoic.kernels._qkernels.Product`: bfloat16 on the blocks and the kernels' own bfloat16 copy where
#: the CPU has AVX512_BF16, else float32 on the blocks), never on oneDNN's dense copy
EVERY_ROW = 2**31 - 1
_log = get_logger("stoic.model")


class QLinear:
    """``F.linear`` over ``weight`` and ``bias``; with ``quantized`` blocks and ``kernels``, a
    step of at most ``max_rows`` rows is multiplied by the blocks instead (same numbers).

    With a ``dense_dtype`` other than the weight's, the products of more rows multiply by a copy
    of the weights in that type (inputs rounded to it, results returned in the input's type):
    bfloat16 tiles for prefill on a CPU with AMX (:mod:`stoic.model._precision`). The copy costs its bytes
    (2 a weight for bfloat16) on top of the float weights; a bfloat16 copy is held packed for
    oneDNN (:mod:`._packed`), cut into ``pack_parts`` row slices (the gated MLP's gate and up).

    ``fixed``: the blocks' product sums each row in one order whatever the number of rows
    (``--deterministic``, with ``max_rows`` :data:`EVERY_ROW`; in bfloat16 where the kernels
    can: :meth:`stoic.kernels._qkernels.Kernels.bind`). ``int8_rows``: a step of up to eight rows multiplies the
    blocks by its activations quantised to int8 where the kernels can (not the same numbers:
    the default mode with a fast dtype only; :class:`stoic.kernels._qkernels.Product`), and so do products of
    more than ``max_rows`` rows where every part's type has the batched layout
    (:class:`stoic.kernels._gemm8.Gemm8`, 1.125-1.5 bytes a weight); those then need no dense copy, and none is
    made (their results come in ``dense_dtype`` as the copy's would). A matrix of
    :data:`stoic.kernels.G8_ALONE_TYPES` with ``int8_rows`` holds that layout alone (G4 for the
    4-bit types: about its blocks' bytes), and steps of every size multiply by it: no blocks
    repacked apart, no second copy. ``batched`` False: no batched layout for the other types
    (``--weight-layouts compact``: the blocks' product alone, every row on it where
    ``max_rows`` says so).
    """

    __slots__ = (
        "_dense_dtype",
        "_gemm8",
        "_packed",
        "_product",
        "bias",
        "dense_bias",
        "dense_made",
        "dense_weight",
        "max_rows",
        "quantized",
        "weight",
    )

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        quantized: QuantizedMatrix | MixedMatrix | None = None,
        kernels: Kernels | None = None,
        max_rows: int = MAX_KERNEL_ROWS,
        dense_dtype: torch.dtype | None = None,
        pack_parts: int = 1,
        fixed: bool = False,
        int8_rows: bool = False,
        batched: bool = True,
    ) -> None:
        self.weight = weight
        self.bias = bias
        self.quantized = quantized if kernels is not None else None
        self.max_rows = max_rows
        self._product: Product | None = None
        self._gemm8: Gemm8 | None = None
        #: bytes of dense weights made from the blocks (a matrix read from a GGUF file alone)
        self.dense_made = 0
        if self.quantized is not None and kernels is not None:
            bias32 = None if bias is None else bias.detach().float()
            self._product = self.quantized.bind(kernels, bias32, fixed=fixed, int8_rows=int8_rows)
            if int8_rows and not fixed and self._product.g8:
                # one layout for every step (G8_ALONE_TYPES): bigger steps multiply by the
                # product's own bytes, or (a stack of parts) by the product itself
                self._gemm8 = Gemm8.over(kernels, self._product, bias32)
                if self._gemm8 is None:
                    self.max_rows = EVERY_ROW
            elif batched and int8_rows and not fixed and dense_dtype not in (None, torch.float32):
                self._gemm8 = Gemm8.bind(kernels, self.quantized.pieces, bias32)
        if weight.is_meta:  # read from a GGUF file's blocks alone (:mod:`._gguf_weights`)
            weight = self._dense_from_blocks(weight, kernels, self.max_rows)
        #: what products of more than ``max_rows`` rows (or of any, without blocks) multiply by
        #: (None once packed: :attr:`_packed` holds the same numbers)
        self.dense_weight: torch.Tensor | None = weight
        self.dense_bias = bias
        self._dense_dtype = weight.dtype
        self._packed: PackedLinear | None = None
        if dense_dtype is not None and self._gemm8 is not None:
            self._dense_dtype = dense_dtype  # what the int8 products return
        elif dense_dtype is not None and dense_dtype != weight.dtype:
            copy = weight.detach().to(dense_dtype)
            self.dense_bias = None if bias is None else bias.detach().to(dense_dtype)
            self._dense_dtype = dense_dtype
            # a private copy: packed in its place where oneDNN can (no weights held twice)
            self._packed = PackedLinear.build(copy, self.dense_bias, pack_parts)
            self.dense_weight = None if self._packed is not None else copy

    def _dense_from_blocks(
        self, weight: torch.Tensor, kernels: Kernels | None, max_rows: int
    ) -> torch.Tensor:
        """The dense weights of a matrix the model holds no values of (``weight`` on ``meta``:
        its blocks are all it has): de-quantised from the blocks into ``weight``'s dtype where
        some products will multiply by them (more than ``max_rows`` rows and no int8 product
        over them), else ``weight`` itself (never read).

        :raises ValueError: if there are no blocks to make them from.
        """
        if self.quantized is None or kernels is None:
            raise ValueError(f"a {tuple(weight.shape)} matrix has neither values nor blocks")
        if self._gemm8 is not None or max_rows >= EVERY_ROW:
            return weight
        parts = [kernels.dequantize(kind, blocks, self.quantized.cols)
                 for kind, blocks in self.quantized.pieces]  # fmt: skip
        dense = torch.cat(parts) if len(parts) > 1 else parts[0]
        self.dense_made = dense.numel() * weight.element_size()
        return dense.to(weight.dtype)

    @classmethod
    def checked(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        quantized: QuantizedMatrix | MixedMatrix | None,
        kernels: Kernels | None,
        *,
        max_rows: int = MAX_KERNEL_ROWS,
        dense_dtype: torch.dtype | None = None,
        pack_parts: int = 1,
        fixed: bool = False,
        int8_rows: bool = False,
        batched: bool = True,
    ) -> QLinear:
        """A :class:`QLinear` that uses ``quantized`` only if the blocks hold ``weight``
        (:meth:`QuantizedMatrix.matches`); otherwise the float path alone."""
        if (
            quantized is not None
            and not weight.is_meta  # the blocks are the only source: nothing to compare
            and (kernels is None or not quantized.matches(kernels, weight))
        ):
            quantized = None
        return cls(
            weight, bias, quantized, kernels, max_rows, dense_dtype, pack_parts, fixed, int8_rows,
            batched,
        )  # fmt: skip

    @property
    def nbytes(self) -> int:
        """Bytes this holds of its own: the repacked blocks, the batched layout and dense
        weights made from the blocks (not a model's own weights, nor the file's pages)."""
        held = self._product.nbytes if self._product is not None else 0
        held += self._gemm8.nbytes if self._gemm8 is not None and not self._gemm8.shared else 0
        if self._packed is not None:
            held += self._packed.nbytes
        elif self.dense_made and self.dense_weight is not None:
            held += self.dense_weight.numel() * self.dense_weight.element_size()
        return held

    @property
    def product(self) -> Product | None:
        """The bound product by the blocks (None: none)."""
        return self._product

    @property
    def dense_dtype(self) -> torch.dtype:
        """The dtype products of more than ``max_rows`` rows multiply in."""
        return self._dense_dtype

    @property
    def packed(self) -> PackedLinear | None:
        """The dense copy packed for oneDNN (None: plain ``F.linear``)."""
        return self._packed

    @property
    def batched_int8(self) -> bool:
        """Whether products of more than ``max_rows`` rows take int8 activations
        (:class:`stoic.kernels._gemm8.Gemm8`) rather than the dense weights."""
        return self._gemm8 is not None or (self._product is not None and self._product.g8)

    def uses_kernel(self, rows: int) -> bool:
        return self._product is not None and rows <= self.max_rows

    def dense(
        self, x: torch.Tensor, parts: int = 1, *, native: bool = False
    ) -> tuple[torch.Tensor, ...]:
        """``x`` times the dense weights, as ``parts`` products over equal row slices of them
        (one product of the whole width measured slower at many rows for the gated MLP); each
        result in ``x``'s dtype, or with ``native`` in the dense weights' (no conversion: what
        the next product multiplies anyway)."""
        if self._gemm8 is not None:
            y = self._int8_product(self._gemm8, x, self._dense_dtype if native else x.dtype)
            return (y,) if parts == 1 else tuple(y.chunk(parts, -1))
        xin = x if x.dtype == self._dense_dtype else x.to(self._dense_dtype)
        w, b = self.dense_weight, self.dense_bias
        outs: tuple[torch.Tensor, ...]
        if w is None:  # packed: its slices, re-cut if another split is asked for
            assert self._packed is not None
            outs = self._packed(xin)
            if len(outs) != parts:
                whole = torch.cat(outs, -1) if len(outs) > 1 else outs[0]
                outs = (whole,) if parts == 1 else whole.chunk(parts, -1)
        elif parts == 1:
            outs = (F.linear(xin, w, b),)
        else:
            biases = b.chunk(parts) if b is not None else (None,) * parts
            outs = tuple(
                F.linear(xin, wp, bp) for wp, bp in zip(w.chunk(parts, 0), biases, strict=True)
            )
        return outs if native or xin is x else tuple(y.to(x.dtype) for y in outs)

    @classmethod
    def _int8_product(
        cls,
        gemm: Gemm8,
        x: torch.Tensor,
        dtype: torch.dtype,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x`` (``[..., cols]``) by ``gemm``: ``[..., rows]`` in ``dtype`` (float32 and
        bfloat16 read and written by the kernel itself, no converted copies); with
        ``residual`` (float32, ``[..., rows]``) added by the kernel in float32."""
        flat = x.reshape(cls._rows(x), x.shape[-1])
        out = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
        if not flat.shape[0]:
            return torch.empty(*x.shape[:-1], gemm.rows, dtype=dtype)
        if flat.dtype not in (torch.float32, torch.bfloat16):
            flat = flat.float()
        if not flat.is_contiguous():
            flat = flat.contiguous()
        res = None if residual is None else residual.reshape(flat.shape[0], gemm.rows)
        if res is not None and not res.is_contiguous():
            res = res.contiguous()
        y = _profiled("stoic::int8_mm", gemm, flat, out, res)
        return y.view(*x.shape[:-1], gemm.rows).to(dtype)

    def add_to(self, hidden: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``hidden + self(x, native=True)``: a layer's residual addition, promoted to
        ``hidden``'s dtype. Where the step's rows take the int8 products and ``hidden`` is
        float32 (the residual stream of a bfloat16 step), the kernel adds ``hidden`` to its
        float32 product itself: no separate addition, no bfloat16 rounding of the product
        before it (a 256-token prompt step's two additions a layer were 3% of it)."""
        rows = self._rows(x)
        gemm = self._gemm8
        if (
            gemm is None
            or rows == 0
            or self.uses_kernel(rows)
            or hidden.dtype != torch.float32
            or hidden.shape != (*x.shape[:-1], gemm.rows)
        ):
            return hidden + self(x, native=True)
        return self._int8_product(gemm, x, torch.float32, hidden)

    @staticmethod
    def _rows(x: torch.Tensor) -> int:
        width = x.shape[-1]
        return x.numel() // width if width else 0

    def out_dtype(self, x: torch.Tensor, *, native: bool = False) -> torch.dtype:
        """The dtype ``self(x, native=native)`` returns."""
        rows = self._rows(x)
        dense = rows == 0 or not self.uses_kernel(rows)
        return self._dense_dtype if native and dense else x.dtype

    def __call__(self, x: torch.Tensor, *, native: bool = False) -> torch.Tensor:
        """``x @ weight.T + bias`` in ``x``'s dtype; with ``native``, a dense product's result
        stays in the dense weights' dtype (the blocks' is converted to ``x``'s either way)."""
        rows = self._rows(x)
        product = self._product
        if product is None or rows == 0 or not self.uses_kernel(rows):
            return self.dense(x, native=native)[0]
        width = x.shape[-1]
        flat = x.reshape(rows, width)
        if flat.dtype != torch.float32:
            flat = flat.float()
        if not flat.is_contiguous():
            flat = flat.contiguous()
        y = _profiled("stoic::quantized_mm", product, flat)
        if x.dtype != torch.float32:
            y = y.to(x.dtype)
        return y.view(*x.shape[:-1], product.rows)


def _profiled(name: str, product: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """``product(*args)``, shown as ``name`` in torch.profiler's table while it records."""
    if torch._C._autograd._profiler_enabled():
        with torch.profiler.record_function(name):
            return product(*args)
    return product(*args)


def choose_layouts(
    mode: WeightLayouts,
    blocks: dict[str, QuantizedMatrix],
    *,
    batched_bytes: float,
    available: int,
    alone: frozenset[str] = frozenset(),
) -> Literal["fast", "compact"]:
    """``--weight-layouts`` resolved for a model whose matrices are ``blocks`` alone (no dense
    weights of its own: a GGUF file read directly; empty for any other model, which is
    ``fast``: it holds its dense weights anyway).

    ``fast`` holds, next to each matrix's repacked blocks (about the file's bytes), what steps of
    more rows multiply by: the int8 layout (``batched_bytes`` a weight: 1.5 at most) or a dense
    copy (its dtype's size); ``compact`` the repacked blocks alone, every step on them. A
    matrix of one of the ``alone`` types (:data:`stoic.kernels.G8_ALONE_TYPES` where the
    products take int8 activations) holds one layout for every step either way.
    ``auto`` is ``fast`` where its layouts take at most half of ``available`` (the memory free at
    load: the KV cache, other processes and warm spares need the rest), else ``compact``: with
    int8 activations a Q4_K_M file of any size is ``fast`` at about its own bytes (1.3 GiB for
    1.5B); without them a 1.5B file's 3.2 GiB is held on a 24 GiB machine, an 8B file's
    15.7 GiB is not."""
    if mode != "auto" or not blocks:
        return "compact" if mode == "compact" else "fast"
    # each matrix: its blocks' bytes (what the repacking holds, about) and the batched layout
    held = sum(
        m.rows * (m.blocks.shape[1] + (0 if m.kind in alone else m.cols * batched_bytes))
        for m in blocks.values()
    )
    return "fast" if held <= available / 2 else "compact"


def kernels_for(gguf: Path | None, device: torch.device, cache_root: Path) -> Kernels | str:
    """The kernels for a model loaded from ``gguf`` on ``device`` (built once), or why they
    cannot serve it."""
    from ..kernels import KernelsUnavailable, load_kernels

    if gguf is None:
        return "the model was not loaded from a GGUF file"
    if device.type != "cpu":
        return f"the quantised kernels run on a CPU, the model is on {device}"
    try:
        return load_kernels(cache_root)
    except KernelsUnavailable as e:
        return str(e)


def require_quantized(gguf: Path | None, device: torch.device, cache_root: Path) -> None:
    """Check, before any worker process starts, that ``--quantization gguf`` can be honoured.

    :raises ModelUnavailable: if it cannot (one line: why).
    """
    from ..errors import ModelUnavailable

    found = kernels_for(gguf, device, cache_root)
    if isinstance(found, str):
        raise ModelUnavailable(f"quantization 'gguf' cannot be used: {found}")


def prepare_quantized(
    gguf: Path | None,
    config: Any,
    device: torch.device,
    mode: Quantization,
    cache_root: Path,
    file: GgufFile | None = None,
) -> tuple[dict[str, QuantizedMatrix], Kernels | None]:
    """The quantised blocks and the kernels for a model loaded from ``gguf`` on ``device``, or
    ``({}, None)`` when ``mode`` is ``"none"`` or (``"auto"``) they cannot be used here (``file``:
    ``gguf`` already mapped, its blocks read from that mapping): why is
    logged (``model.quantization.off``: a warning for a GGUF model on a CPU, where they were
    expected).

    :raises ModelUnavailable: with ``mode="gguf"``, if they cannot be used (one line: why).
    """
    from ..errors import ModelUnavailable

    if mode == "none":
        return {}, None
    kernels = kernels_for(gguf, device, cache_root)
    if isinstance(kernels, str):
        why = kernels
    else:
        assert gguf is not None
        try:
            blocks = read_llama_blocks(file or gguf, config)
        except (OSError, ValueError) as e:
            why = f"cannot read the quantised weights of {gguf}: {e}"
        else:
            if blocks:
                return blocks, kernels
            kinds = ", ".join(GGML_TYPES)
            why = f"no matrix of {gguf} is of a type the kernels compute on ({kinds})"
    if mode == "gguf":
        raise ModelUnavailable(f"quantization 'gguf' cannot be used: {why}")
    if gguf is not None and device.type == "cpu":
        # a GGUF model on a CPU was expected to decode on its blocks: a warning (which a worker
        # process also relays to the server's log), not the quiet note a model directory gets
        _log.warning("model.quantization.off", reason=why, gguf=str(gguf))
    else:
        _log.info("model.quantization.off", reason=why)
    return {}, None
