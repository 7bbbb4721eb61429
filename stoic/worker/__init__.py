"""The step worker: what the process that runs the model does each step and at its start.

:class:`ModelRunner` runs one batched forward over the paged KV cache per step and samples;
the step's inputs are built on the host (:mod:`._inputs`); the KV cache is sized from the
memory the weights leave (:func:`size_kv_cache`); compute threads follow the CPU the process
really gets (:class:`ThreadGovernor`, :func:`cpu_budget`).

Knows the model, the sampler and the GGUF weights; knows no actor, scheduler or HTTP.
"""

from ._cpu import CpuBudget, cpu_budget
from ._memory import CacheBudget, CacheSizing, DeviceMemory, device_memory, size_kv_cache
from ._runner import ModelRunner
from ._threads import ThreadGovernor

__all__ = [
    "CacheBudget",
    "CacheSizing",
    "CpuBudget",
    "DeviceMemory",
    "ModelRunner",
    "ThreadGovernor",
    "cpu_budget",
    "device_memory",
    "size_kv_cache",
]
