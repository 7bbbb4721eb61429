"""What a runner computes with, as one summary (``model.compute_path`` in the logs, the
:class:`~stoic.model.ComputePath` the server shows): its decoder, logits path, attention, the
projections on quantised blocks, the dtypes and the layouts' memory."""

from __future__ import annotations

from typing import Any

import torch

from ..gguf import QLinear
from ..model import FusedLlama, LoadedModel, OutputLayer, matrix_types

__all__ = ["compute_summary", "dense_dtype"]


def dense_dtype(loaded: LoadedModel, head: QLinear, *, deterministic: bool) -> torch.dtype:
    """The dtype products of many rows multiply in: deterministic mode's fixed-order products
    are bfloat16 where the CPU has AVX512_BF16 (:class:`stoic.kernels.Product`), else float32
    on the blocks, never a dense copy through oneDNN."""
    if deterministic:
        product = head.product
        return torch.bfloat16 if product is not None and product.bfloat16 else loaded.dtype
    return loaded.dense_dtype or loaded.dtype


def compute_summary(
    loaded: LoadedModel,
    fused: FusedLlama | None,
    head: QLinear,
    logits: OutputLayer,
    *,
    attention: str,
    kernel_rows: int,
    deterministic: bool,
    int8_rows: bool,
    weight_layouts: str,
) -> dict[str, Any]:
    """The runner's compute path as JSON-ready fields (``projections``: how many of ``of`` run
    on quantised blocks; ``head``: the LM head's block type on the kernels, or None)."""
    done, total = fused.quantized_projections if fused is not None else (0, 0)
    whole = logits.whole_forward
    quantized_head = None if whole else head.quantized
    kinds = fused.quantized_kinds if fused is not None else set()
    kinds |= {quantized_head.kind} if quantized_head is not None else set()
    on_blocks = bool(done) or quantized_head is not None
    return {
        "architecture": type(loaded.model).__name__,
        "decoder": "fused" if fused is not None else "transformers",
        # the model's own forward maps stoic's hidden states to logits (or, where the probe
        # found it adds nothing, the output layer alone does), or it runs whole
        "logits": "whole-forward"
        if whole
        else ("output-layer" if logits.identity else "own-forward"),
        "whole_forward_reason": logits.reason if whole else None,
        "matrix_types": matrix_types(loaded.gguf),
        "kernel_types": sorted(kinds),
        "projections": done,
        "of": total,
        "head": quantized_head.kind if quantized_head is not None else None,
        "c_layers": fused is not None and fused.c_decoder is not None,
        "kernel_rows": kernel_rows,
        "attention": attention,
        "deterministic": deterministic,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "dense_dtype": str(dense_dtype(loaded, head, deterministic=deterministic)).removeprefix(
            "torch."
        ),
        "kv_cache_dtype": str(loaded.cache_dtype).removeprefix("torch."),
        "row_activations": "int8" if int8_rows and on_blocks else "float32",
        "int8_batched_projections": fused.int8_batched_projections if fused is not None else 0,
        "weight_layouts": weight_layouts,
        # what the layouts made from the blocks hold (not the model's own weights)
        "layouts_mib": round(((fused.nbytes if fused is not None else 0) + head.nbytes) / 2**20, 1),
    }
