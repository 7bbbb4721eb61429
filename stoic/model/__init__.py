"""Everything that touches torch and transformers. Knows nothing of actors or HTTP."""

from ._codec import load_token_codec, token_codec, vocab_size
from ._compute import ComputePath
from ._cpu import CpuBudget, cpu_budget
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
from ._memory import CacheBudget, CacheSizing, DeviceMemory, device_memory, size_kv_cache
from ._paged import KVCacheSpec, PagedKVCache, empty_device_cache
from ._runner import ModelRunner
from ._source import check_model_source
from ._stepprogress import StepProgress
from ._threads import ThreadGovernor

__all__ = [
    "DEFAULT_MODEL_NAME",
    "CacheBudget",
    "CacheSizing",
    "ComputePath",
    "CpuBudget",
    "DeviceMemory",
    "KVCacheSpec",
    "LoadedModel",
    "ModelRunner",
    "PagedKVCache",
    "StepProgress",
    "ThreadGovernor",
    "check_model_source",
    "cpu_budget",
    "cuda_devices",
    "default_gguf_path",
    "device_memory",
    "empty_device_cache",
    "load_model",
    "load_token_codec",
    "require_deterministic",
    "resolve_device",
    "resolve_dtype",
    "size_kv_cache",
    "token_codec",
    "vocab_size",
]
