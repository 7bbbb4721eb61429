"""How a runner computes: a typed record of its architecture, decoder path, attention backend,
precision and quantised-kernel choices (what ``model.compute_path`` logs and ``/v1/models`` shows)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ComputePath", "matrix_types"]


def matrix_types(gguf: Path | None) -> dict[str, str] | None:
    """The block types of a GGUF file's matrices, by role (``attn_q``, ``ffn_down``,
    ``token_embd``, ...: the tensor name without its layer number), several types of one role
    joined by ``/`` (a Q4_K_M file mixes Q4_K and Q6_K); None without a file or where its header
    cannot be read."""
    if gguf is None:
        return None
    from ..gguf import GgufError, read_gguf_header

    try:
        tensors = read_gguf_header(gguf).tensors.values()
    except (GgufError, OSError):
        return None
    roles: dict[str, set[str]] = {}
    for tensor in tensors:
        if len(tensor.dims) < 2:  # norms and biases: vectors, not matrices
            continue
        parts = tensor.name.removesuffix(".weight").split(".")
        role = ".".join(p for p in parts if not p.isdigit() and p != "blk")
        roles.setdefault(role, set()).add(_type_name(tensor.ggml_type))
    return {role: "/".join(sorted(kinds)) for role, kinds in sorted(roles.items())}


def _type_name(ggml_type: int) -> str:
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(ggml_type).name
    except (ImportError, ValueError):
        return f"type{ggml_type}"


#: fields too long or too structured for a metric label
_NOT_LABELS = frozenset({"matrix_types", "kernel_types", "whole_forward_reason", "layouts_mib"})


@dataclass(frozen=True)
class ComputePath:
    """What an executor's model runner multiplies with, as decided at its load.

    Built from :attr:`ModelRunner.quantized` (the summary a worker process reports when ready),
    so the server can show it without loading weights of its own (``stoic_model_info``).
    """

    #: activations (``float32``, ``bfloat16``, ...)
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
    #: the model's transformers class (``LlamaForCausalLM``, ...)
    architecture: str = ""
    #: ``fused`` (:mod:`._fused`) or ``transformers`` (the model's own decoder layers)
    decoder: str = "transformers"
    #: ``own-forward``: the model's ``forward`` maps stoic's hidden states to logits;
    #: ``output-layer``: the same found (at start) to add nothing to the output layer, which
    #: then runs alone; ``whole-forward``: its whole forward runs each step (:mod:`._logits`)
    logits: str = "output-layer"
    #: why ``whole-forward`` (None otherwise)
    whole_forward_reason: str | None = None
    #: the GGUF file's matrix types by role (:func:`matrix_types`); None: a model directory
    matrix_types: dict[str, str] | None = field(default=None, hash=False)
    #: the block types the kernels multiply by
    kernel_types: tuple[str, ...] = ()
    #: ``--deterministic``: every step on the blocks in the fixed order, through the C layers
    #: (each token's logits independent of its batch, chunking and cache)
    deterministic: bool = False
    #: the attention backend's name (:func:`._attention.choose_attention`: ``torch-paged``,
    #: ``c-paged``)
    attention: str = "torch-paged"
    #: what steps of one or two tokens multiply the quantised blocks by: ``int8`` (the activations
    #: quantised per block of 32, integer dot products: the default mode with a fast dtype on a
    #: CPU with AVX-512 VNNI; ``_int8rows.c``) or ``float32``
    row_activations: str = "float32"
    #: what the KV cache holds (``--kv-cache-dtype``; :mod:`._precision`)
    kv_cache_dtype: str = "float32"
    #: projections (of ``projections``) whose steps of more than ``kernel_rows`` tokens multiply
    #: the blocks by int8 activations instead of a dense copy (``_gemm8.c``: the same mode and
    #: CPUs as ``row_activations`` int8; every part of a type the layout holds)
    int8_batched_projections: int = 0
    #: ``--weight-layouts`` as resolved: ``fast`` or ``compact`` (docs/operations.md)
    weight_layouts: str = "fast"
    #: MiB the layouts made from a GGUF file's blocks hold (repacked blocks, the int8 layout,
    #: dense copies made from them; not a model's own weights, nor the file's shared pages)
    layouts_mib: float = 0.0

    def card(self) -> dict[str, Any]:
        """Every field, as JSON-ready values (what ``/v1/models`` shows as ``compute``)."""
        card = asdict(self)
        card["kernel_types"] = list(self.kernel_types)
        return card

    def labels(self) -> dict[str, str]:
        """The one-word fields as metric labels (``stoic_model_info``): every field but the
        per-role matrix and kernel type lists and the reason text, booleans as ``true``/``false``,
        ``quantized_projections`` as ``done/total``, no LM-head block type as ``none``."""
        labels: dict[str, str] = {}
        for name, value in asdict(self).items():
            if name in _NOT_LABELS or name == "projections":
                continue
            if name == "quantized_projections":
                value = f"{self.quantized_projections}/{self.projections}"
            elif isinstance(value, bool):
                value = "true" if value else "false"
            labels[name] = "none" if value is None else str(value)
        return labels

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
            kv_cache_dtype=str(summary["kv_cache_dtype"]),
            quantized_projections=int(summary["projections"]),
            projections=int(summary["of"]),
            head=None if summary["head"] is None else str(summary["head"]),
            c_layers=bool(summary["c_layers"]),
            kernel_rows=int(summary["kernel_rows"]),
            architecture=str(summary["architecture"]),
            decoder=str(summary["decoder"]),
            logits=str(summary["logits"]),
            whole_forward_reason=summary["whole_forward_reason"],
            matrix_types=summary["matrix_types"],
            kernel_types=tuple(summary["kernel_types"]),
            deterministic=bool(summary.get("deterministic", False)),
            attention=str(summary.get("attention", "torch-paged")),
            row_activations=str(summary.get("row_activations", "float32")),
            int8_batched_projections=int(summary.get("int8_batched_projections", 0)),
            weight_layouts=str(summary.get("weight_layouts", "fast")),
            layouts_mib=float(summary.get("layouts_mib", 0.0)),
        )
