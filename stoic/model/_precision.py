"""Which floating-point types a model runs in: ``--dtype`` resolved for the machine at hand.

Three types are chosen, not one:

* the model's **dtype**: its activations, norms and embeddings;
* the **KV cache dtype** (``LoadedModel.kv_dtype``, ``--kv-cache-dtype``): what the paged pools
  hold. ``None`` means the same as the dtype;
* the **dense dtype** (``LoadedModel.dense_dtype``): the type of the weights that matrix products
  over many rows (prefill chunks, large decode batches) multiply by. ``None`` means the same as
  the dtype.

``--dtype float32`` / ``bfloat16`` / ``float16`` set all three to that type (an explicit
``--kv-cache-dtype`` still sets the cache's). ``--dtype auto`` on CUDA is bfloat16 (float16
where the GPU lacks it). On a CPU it measures (:mod:`._dtype_probe`):
float32 or bfloat16, whichever multiplies faster here, cached per CPU model and torch version.
For a GGUF model whose decode steps run on the file's quantised blocks in the C layers (a
``llama``, ``qwen2`` or ``phi3`` file: :data:`C_LAYER_FILES`)
(:mod:`stoic.gguf._quant`, ``--quantization`` not ``none``, the kernels buildable here), ``auto`` keeps
the activations in float32, because the kernels and the C decode layers
compute in float32, and uses the probe's choice only as the dense dtype. On a CPU with AMX
(bfloat16 tiles) that puts steps of few tokens on the 4-bit blocks with float32 arithmetic and
prefill chunks on bfloat16 tiles, 5-6x faster than float32 there; where bfloat16 measures slower
(AVX2 CPUs, AVX-512 ones without AMX) everything stays float32, as before. Full bfloat16 made
decode steps slower on an AMX CPU (no C layers: they need float32; docs/benchmarks.md).

For such a model ``auto`` also puts the KV cache in bfloat16 (``--kv-cache-dtype auto``;
not with ``--deterministic``, whose rows kernel reads float32 pools): the C attention widens a
bfloat16 key or value to float32 exactly and computes in float32, and its decode attention,
which reads every sequence's keys and values from memory each step, is bound by those reads
(a third of a 31-sequence decode step over float32 pools; over bfloat16 ones it took 0.74x the
time, the step 0.81-0.94x: docs/benchmarks.md, "A bfloat16 KV cache"), and the same memory
holds twice the tokens. llama.cpp keeps its cache in float16, vLLM in the model's dtype. Each
key and value is rounded once, when written, to 8 significant bits.

A bfloat16 dense dtype rounds each prefill product's inputs to bfloat16, as a bfloat16 model
does, and a bfloat16 cache its keys and values: exact-output comparisons (greedy equal to
transformers' ``generate``) take ``--dtype float32`` (which keeps a float32 cache).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import KV_CACHE_DTYPES, Quantization
from ._dtype_probe import probe_cpu_dtype

__all__ = [
    "C_LAYER_FILES",
    "DTYPE_NAMES",
    "KV_CACHE_DTYPES",
    "Precision",
    "decodes_on_blocks",
    "parse_dtype",
    "parse_kv_cache_dtype",
    "resolve_dtype",
    "resolve_precision",
]

#: the GGUF architectures whose decode steps run in the C layers (:mod:`._cdecode`: Llama and
#: Mistral, Qwen2, Phi-3); Qwen3's and Gemma 3's run torch layers on the blocks, where float32
#: activations were not measured to pay
C_LAYER_FILES = ("llama", "qwen2", "phi3")

DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass(frozen=True)
class Precision:
    """The model's dtype, the dense products' and the KV cache's (None: the model's)."""

    dtype: torch.dtype
    dense_dtype: torch.dtype | None = None
    kv_dtype: torch.dtype | None = None


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A dtype named as ``--dtype`` names it.

    :raises ValueError: for an unknown name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPE_NAMES)}")
    return DTYPE_NAMES[dtype]


def parse_kv_cache_dtype(kv_cache_dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``--kv-cache-dtype`` as a dtype; None for ``auto`` (or None: the rule of
    :func:`resolve_precision` decides).

    :raises ValueError: for a name not in :data:`KV_CACHE_DTYPES`.
    """
    if kv_cache_dtype in (None, "auto"):
        return None
    if isinstance(kv_cache_dtype, str) and kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"unknown KV cache dtype {kv_cache_dtype!r}; use one of {', '.join(KV_CACHE_DTYPES)}"
        )
    assert kv_cache_dtype is not None
    return parse_dtype(kv_cache_dtype)


def resolve_dtype(
    dtype: str | torch.dtype | None, device: torch.device, cache_root: Path | None = None
) -> torch.dtype:
    """``None``/``"auto"``: bfloat16 on CUDA (float16 where bfloat16 is unsupported); on a CPU,
    float32 or bfloat16, whichever a short matrix-product probe measures faster
    (:func:`._dtype_probe.probe_cpu_dtype`, cached per CPU model and torch version under
    ``cache_root``).

    :raises ValueError: for an unknown dtype name.
    """
    if dtype not in (None, "auto"):
        assert dtype is not None
        return parse_dtype(dtype)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return probe_cpu_dtype(cache_root)


def decodes_on_blocks(gguf: Path, device: torch.device, cache_root: Path) -> bool:
    """Whether a model loaded from ``gguf`` on ``device`` can decode on its quantised blocks
    with the C layers: a file of :data:`C_LAYER_FILES`, and the kernels built (or buildable)
    here."""
    from ..gguf import GgufError, kernels_for, read_gguf_header
    from ..kernels import Kernels

    try:
        if read_gguf_header(gguf).architecture not in C_LAYER_FILES:
            return False
    except (OSError, GgufError):
        return False
    return isinstance(kernels_for(gguf, device, cache_root), Kernels)


def resolve_precision(
    dtype: str | torch.dtype | None,
    device: torch.device,
    cache_root: Path,
    *,
    gguf: Path | None = None,
    quantization: Quantization = "auto",
    kv_cache_dtype: str | torch.dtype | None = "auto",
    deterministic: bool = False,
) -> Precision:
    """The model's dtype, dense dtype and KV cache dtype for ``--dtype dtype`` and
    ``--kv-cache-dtype kv_cache_dtype`` (see the module docstring).

    :raises ValueError: for an unknown dtype name.
    """
    chosen = resolve_dtype(dtype, device, cache_root)
    kv = parse_kv_cache_dtype(kv_cache_dtype)
    on_blocks = (
        dtype in (None, "auto")
        and device.type == "cpu"
        and gguf is not None
        and quantization != "none"
        and decodes_on_blocks(gguf, device, cache_root)
    )
    if not on_blocks:
        return Precision(chosen, kv_dtype=None if kv == chosen else kv)
    if kv is None and not deterministic:
        kv = torch.bfloat16
    dense = None if chosen == torch.float32 else chosen
    return Precision(torch.float32, dense, None if kv == torch.float32 else kv)
