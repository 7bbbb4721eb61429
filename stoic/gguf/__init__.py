"""GGUF files: the header read without torch, the model's metadata (config, tokenizer) written
once into the cache, the tensors read from the mapped file, and the quantised weights used as they
are (:class:`QLinear` over the C kernels' layouts) or repacked (G8, oneDNN's bfloat16 layout).

Knows the kernels; knows no architecture's forward, no request and no actor.
"""

from ._cache import (
    CONVERTED,
    CacheEntry,
    commit_entry,
    default_cache_dir,
    find_entry,
    gguf_content_key,
    list_entries,
    new_entry_dir,
    remove_entry,
    select_for_prune,
)
from ._header import GgufError, GgufHeader, GgufTensor, read_gguf_header
from ._matrices import MixedMatrix, QuantizedMatrix, read_llama_blocks
from ._metadata import write_gguf_metadata
from ._packed import PackedLinear
from ._quant import (
    DENSE_KERNEL_ROWS,
    EVERY_ROW,
    MAX_KERNEL_ROWS,
    QLinear,
    choose_layouts,
    kernels_for,
    prepare_quantized,
    require_quantized,
)
from ._weights import (
    GgufFile,
    GgufWeights,
    QuantizedEmbedding,
    kernel_matrix,
    lazy_tensors,
    load_gguf_model,
)

__all__ = [
    "CONVERTED",
    "DENSE_KERNEL_ROWS",
    "EVERY_ROW",
    "MAX_KERNEL_ROWS",
    "CacheEntry",
    "GgufError",
    "GgufFile",
    "GgufHeader",
    "GgufTensor",
    "GgufWeights",
    "MixedMatrix",
    "PackedLinear",
    "QLinear",
    "QuantizedEmbedding",
    "QuantizedMatrix",
    "choose_layouts",
    "commit_entry",
    "default_cache_dir",
    "find_entry",
    "gguf_content_key",
    "kernel_matrix",
    "kernels_for",
    "lazy_tensors",
    "list_entries",
    "load_gguf_model",
    "new_entry_dir",
    "prepare_quantized",
    "read_gguf_header",
    "read_llama_blocks",
    "remove_entry",
    "require_quantized",
    "select_for_prune",
    "write_gguf_metadata",
]
