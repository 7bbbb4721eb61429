"""Everything that touches torch and transformers. Knows nothing of actors or HTTP."""

from ._batch import SampledToken, SeqChunk, StepBatch, StepOutput
from ._cache import default_cache_dir
from ._chat import apply_chat_template
from ._compute import ComputePath
from ._cpu import CpuBudget, cpu_budget
from ._deterministic import require_deterministic
from ._grammar import Constraint, ConstraintKind, GrammarBackend, GrammarVocab
from ._llguidance import LLGuidanceBackend
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
from ._params import SamplingParams
from ._quant import require_quantized
from ._request import Request
from ._runner import ModelRunner
from ._source import check_model_source
from ._stepprogress import StepProgress
from ._text import Detokenizer, StopStrings, TokenCodec, vocab_size
from ._threads import ThreadGovernor

__all__ = [
    "DEFAULT_MODEL_NAME",
    "CacheBudget",
    "CacheSizing",
    "ComputePath",
    "Constraint",
    "ConstraintKind",
    "CpuBudget",
    "Detokenizer",
    "DeviceMemory",
    "GrammarBackend",
    "GrammarVocab",
    "KVCacheSpec",
    "LLGuidanceBackend",
    "LoadedModel",
    "ModelRunner",
    "PagedKVCache",
    "Request",
    "SampledToken",
    "SamplingParams",
    "SeqChunk",
    "StepBatch",
    "StepOutput",
    "StepProgress",
    "StopStrings",
    "ThreadGovernor",
    "TokenCodec",
    "apply_chat_template",
    "check_model_source",
    "cpu_budget",
    "cuda_devices",
    "default_cache_dir",
    "default_gguf_path",
    "device_memory",
    "empty_device_cache",
    "load_model",
    "require_deterministic",
    "require_quantized",
    "resolve_device",
    "resolve_dtype",
    "size_kv_cache",
    "vocab_size",
]
