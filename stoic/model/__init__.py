"""The model: loading one from local files (a GGUF file's own blocks, or a model directory),
the precision it runs in, its forward over the paged KV cache (the fused Llama-family decoder,
the C decode layers, the attention backends) and its logits.

Knows the GGUF weights, the kernels and the request's value types; knows no step worker,
sampler, actor or HTTP (the layers contract in pyproject.toml).
"""

from ._attention import AttentionBackend, TorchPagedAttention, register_attention, to_device
from ._codec import load_token_codec, token_codec, vocab_size
from ._compute import ComputePath, matrix_types
from ._deterministic import cache_refusal, refusal, refuse, require_deterministic
from ._fused import FusedLlama, fuse_llama
from ._loader import (
    DEFAULT_MODEL_NAME,
    LoadedModel,
    cuda_devices,
    default_gguf_path,
    load_model,
    resolve_device,
    resolve_dtype,
)
from ._logits import OutputLayer
from ._paged import (
    ATTN_IMPLEMENTATION,
    DecodeGroup,
    KVCacheSpec,
    PagedKVCache,
    PrefillChunk,
    StepMetadata,
    decode_gather_keys,
    empty_device_cache,
    group_decodes,
)
from ._sharedkv import KVMemory, drop_contents, shared_kv_available
from ._source import check_model_source, one_line
from ._stepprogress import StepProgress, tick

__all__ = [
    "ATTN_IMPLEMENTATION",
    "DEFAULT_MODEL_NAME",
    "AttentionBackend",
    "ComputePath",
    "DecodeGroup",
    "FusedLlama",
    "KVCacheSpec",
    "KVMemory",
    "LoadedModel",
    "OutputLayer",
    "PagedKVCache",
    "PrefillChunk",
    "StepMetadata",
    "StepProgress",
    "TorchPagedAttention",
    "cache_refusal",
    "check_model_source",
    "cuda_devices",
    "decode_gather_keys",
    "default_gguf_path",
    "drop_contents",
    "empty_device_cache",
    "fuse_llama",
    "group_decodes",
    "load_model",
    "load_token_codec",
    "matrix_types",
    "one_line",
    "refusal",
    "refuse",
    "register_attention",
    "require_deterministic",
    "resolve_device",
    "resolve_dtype",
    "shared_kv_available",
    "tick",
    "to_device",
    "token_codec",
    "vocab_size",
]
