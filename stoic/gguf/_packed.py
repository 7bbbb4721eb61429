"""bfloat16 weights packed once for oneDNN's CPU matrix products.

``F.linear`` over a bfloat16 weight on a CPU hands the weight to oneDNN, which reorders it into
its blocked layout (AMX tiles where the CPU has them) on every call. Reordered once at load
(``torch.ops.mkldnn._reorder_linear_weight``, what inductor's CPU weight freezing uses) and
multiplied with ``torch.ops.mkldnn._linear_pointwise``, the same product gives bitwise the same
result in less time: over the default model's gate projection (576 x 1,536, a Xeon with AMX,
2 threads) 17 rows 76 -> 36 us, 64 rows 112 -> 74, 243 rows 253 -> 200, 1,024 rows 718 -> 682
(docs/benchmarks.md, "Packed bfloat16 weights").

Only bfloat16 (a float32 product stays MKL's, whose results ``--dtype float32``'s equality
with transformers relies on) and only where the operators exist and accept the weight: anything
else keeps ``F.linear``.
"""

from __future__ import annotations

import torch

from .._logging import get_logger

__all__ = ["PackedLinear"]

_log = get_logger("stoic.model")
#: the batch size oneDNN is told to expect when choosing the packed layout (a prefill step's
#: order of magnitude; any number of rows is multiplied correctly)
_ROWS_HINT = 256


class PackedLinear:
    """``parts`` products over equal row slices of a bfloat16 ``weight`` (and ``bias``), each
    slice packed once. :meth:`build` returns None where packing is not available."""

    __slots__ = ("_slices",)

    def __init__(self, slices: tuple[tuple[torch.Tensor, torch.Tensor | None], ...]) -> None:
        self._slices = slices

    @property
    def nbytes(self) -> int:
        """Bytes of the packed weights (their elements: oneDNN's padding not counted)."""
        return sum(w.numel() * w.element_size() for w, _ in self._slices)

    @classmethod
    def build(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, parts: int = 1
    ) -> PackedLinear | None:
        """The packed form of ``weight`` ``[out, in]`` cut into ``parts`` row slices, or None if
        it is not a bfloat16 CPU matrix or this torch cannot pack it (logged)."""
        if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2:
            return None
        if not torch.backends.mkldnn.is_available() or weight.shape[0] % parts:  # type: ignore[no-untyped-call]
            return None
        biases = bias.chunk(parts) if bias is not None else (None,) * parts
        try:
            reorder = torch.ops.mkldnn._reorder_linear_weight
            slices = tuple(
                (reorder(w.contiguous(), _ROWS_HINT), None if b is None else b.contiguous())
                for w, b in zip(weight.chunk(parts, 0), biases, strict=True)
            )
            probe = torch.zeros(1, weight.shape[1], dtype=torch.bfloat16)
            packed = cls(slices)
            packed(probe)  # the product runs here, or not at all
        except (AttributeError, RuntimeError, NotImplementedError) as exc:
            _log.info("model.packing.off", reason=f"{type(exc).__name__}: {exc}"[:200])
            return None
        return packed

    @property
    def parts(self) -> int:
        return len(self._slices)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``x @ slice.T + bias`` for each slice; ``x`` bfloat16 ``[..., in]``."""
        return tuple(
            torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "") for w, b in self._slices
        )
