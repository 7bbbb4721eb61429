"""Everything that touches torch and transformers. Knows nothing of actors or HTTP."""

from ._codec import load_token_codec, token_codec, vocab_size
from ._compute import ComputePath
from ._deterministic import require_deterministic
from ._loader import (
    DEFAULT_MODEL_NAME,
    LoadedModel,
    cuda_devices,
    default_gguf_path,
    load_model,
    resolve_device,
    resolve_dtype,
)
from ._paged import KVCacheSpec, PagedKVCache, empty_device_cache
from ._source import check_model_source
from ._stepprogress import StepProgress

__all__ = [
    "DEFAULT_MODEL_NAME",
    "ComputePath",
    "KVCacheSpec",
    "LoadedModel",
    "PagedKVCache",
    "StepProgress",
    "check_model_source",
    "cuda_devices",
    "default_gguf_path",
    "empty_device_cache",
    "load_model",
    "load_token_codec",
    "require_deterministic",
    "resolve_device",
    "resolve_dtype",
    "token_codec",
    "vocab_size",
]
