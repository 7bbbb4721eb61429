"""Sizing the KV cache from the memory left once the weights are loaded: the worker's job.

The process that runs the model (the executor's worker process, or the server's step thread)
sizes its own cache, after loading the weights (vLLM's procedure):

1. ``weights``: the memory this process holds on the device once the model is built;
2. ``activations``: the peak above that during a profiling forward at the step budget's largest
   shapes (one sequence of ``max_num_batched_tokens`` tokens, and the same tokens spread over
   ``max_num_seqs`` sequences), over a throw-away cache of just the blocks those need (on a CPU
   whose cap binds even with :func:`activation_bound` standing in, no profile: it could not
   change the answer);
3. the cache gets ``total * gpu_memory_utilization - weights - activations`` (the fraction is of
   the device's *total* memory, for everything this instance holds), less what a decode step
   over a full cache holds transiently (its attention copies one layer's blocks out of the
   pools, each group of similar context lengths padded to its longest: up to ``2 / num_layers``
   of the cache and a few MiB, :func:`stoic.model.decode_gather_keys`), and never more than is free now less the
   activations (another process on the device), nor more than an explicit cap
   (``kv_cache_memory_gib``; on a CPU 1 GiB unless given: the machine's RAM is everyone's).

What the device is asked goes through :class:`DeviceMemory` (:func:`device_memory` picks
:class:`CudaMemory` or :class:`HostMemory`, RAM and the cgroup's memory limit): tests replace
:func:`device_memory` to drive the figures. Too little memory for a cache of one step's tokens
raises :class:`~stoic.errors.InsufficientMemory`, naming the figures.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import math
import os
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..errors import InsufficientMemory
from ..model import PagedKVCache, decode_gather_keys
from ..request import SamplingParams, SeqChunk, StepBatch
from ._cpu import cgroup_chain

if TYPE_CHECKING:
    from ..config import EngineConfig
    from ._runner import ModelRunner

__all__ = [
    "CPU_KV_CACHE_GIB",
    "CacheBudget",
    "CacheSizing",
    "CudaMemory",
    "DeviceMemory",
    "HostMemory",
    "activation_bound",
    "device_memory",
    "plan_cache",
    "profile_batches",
    "release_free_memory",
    "size_kv_cache",
]

#: the KV cache's cap on a CPU when ``kv_cache_memory_gib`` is not given
CPU_KV_CACHE_GIB = 1.0
_GIB = 2**30
#: the model dimensions :func:`activation_bound` reads from its configuration
_BOUND_DIMS = ("hidden_size", "intermediate_size", "vocab_size", "num_attention_heads")
#: a cgroup v1 "no limit" reads as a huge number (PAGE_COUNTER_MAX pages)
_NO_LIMIT = 2**60


class DeviceMemory(Protocol):
    """What the sizing asks of the device the model runs on, in bytes."""

    def total(self) -> int:
        """The device's memory (RAM: the machine's, or the cgroup's limit if lower)."""

    def available(self) -> int:
        """Free for this process now (what other processes hold is not)."""

    def in_use(self) -> int:
        """What this process holds on the device now."""

    def reset_peak(self) -> None:
        """Start measuring :meth:`peak` afresh."""

    def peak(self) -> int:
        """The most this process held since :meth:`reset_peak`."""


class CudaMemory:
    """A CUDA device, through torch's caching allocator (what it allocated; the CUDA context
    and other native allocations are what ``1 - gpu_memory_utilization`` leaves room for)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def total(self) -> int:
        return int(torch.cuda.mem_get_info(self.device)[1])

    def available(self) -> int:
        torch.cuda.empty_cache()
        return int(torch.cuda.mem_get_info(self.device)[0])

    def in_use(self) -> int:
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.memory_allocated(self.device))

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_allocated(self.device))


class HostMemory:
    """RAM, for a model on the CPU: the process's resident set (weights, activations and the
    rest of the process), its high-water mark (``VmHWM``, reset through
    ``/proc/self/clear_refs`` where Linux allows; else the process's lifetime peak, which can
    only make the cache smaller), and the machine's memory bounded by its cgroup's limit."""

    def __init__(self, *, proc: Path = Path("/proc"), root: Path = Path("/")) -> None:
        self._proc = proc
        self._root = root

    def _cgroup(self) -> tuple[int, int] | None:
        """(limit, usage) of the tightest cgroup memory limit above this process, or None."""
        best: tuple[int, int] | None = None
        for directory in cgroup_chain(self._proc, self._root, "memory"):
            for limit_file, usage_file in (
                ("memory.max", "memory.current"),
                ("memory.limit_in_bytes", "memory.usage_in_bytes"),
            ):
                try:
                    text = (directory / limit_file).read_text().strip()
                    if text == "max" or int(text) >= _NO_LIMIT:
                        continue
                    limit, usage = int(text), int((directory / usage_file).read_text())
                except (OSError, ValueError):
                    continue
                if best is None or limit - usage < best[0] - best[1]:
                    best = (limit, usage)
        return best

    def _meminfo(self, field: str) -> int:
        """A ``/proc/meminfo`` field in bytes (the machine's memory where that is unreadable)."""
        try:
            for line in (self._proc / "meminfo").read_text().splitlines():
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    def total(self) -> int:
        total = self._meminfo("MemTotal")
        cgroup = self._cgroup()
        return min(total, cgroup[0]) if cgroup else total

    def available(self) -> int:
        available = self._meminfo("MemAvailable")
        cgroup = self._cgroup()
        return min(available, max(0, cgroup[0] - cgroup[1])) if cgroup else available

    def in_use(self) -> int:
        try:
            pages = int((self._proc / "self" / "statm").read_text().split()[1])
        except (OSError, ValueError, IndexError):
            return self.peak()
        return pages * os.sysconf("SC_PAGE_SIZE")

    def reset_peak(self) -> None:
        # resets VmHWM; where refused, peak() is the lifetime's
        with contextlib.suppress(OSError):
            (self._proc / "self" / "clear_refs").write_text("5")

    def peak(self) -> int:
        try:
            for line in (self._proc / "self" / "status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def release_free_memory() -> None:
    """Hand the C heap's free memory back to the system (glibc's ``malloc_trim``): loading
    frees many short-lived buffers (a 1.5B model's repacking: about 200 MiB) that the heap
    would otherwise keep resident. Nothing where the C library has no such call."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def device_memory(device: torch.device) -> DeviceMemory:
    """What :func:`size_kv_cache` asks about ``device`` (tests replace this function)."""
    if device.type == "cuda":
        return CudaMemory(device)
    return HostMemory()


@dataclass(frozen=True)
class CacheBudget:
    """What the worker sizes its KV cache within (built by the server from its configuration)."""

    block_size: int
    #: the step budget's largest shape: tokens per step and sequences per step
    step_tokens: int
    max_seqs: int
    #: the fraction of the device's total memory this instance may hold (``--gpu-memory-
    #: utilization``: weights, activations and cache together)
    utilization: float
    #: the cache's explicit cap in bytes (``--kv-cache-memory``; on a CPU 1 GiB by default)
    cap_bytes: int | None = None
    #: a fixed number of blocks (``--num-kv-blocks``, or the first worker's figure for every
    #: later one): no profiling
    num_blocks: int | None = None
    #: ``--max-model-len`` (None: the model's own): the longest context a chunk attends over
    max_model_len: int | None = None

    @classmethod
    def of(cls, config: EngineConfig, device_type: str) -> CacheBudget:
        """The budget ``config`` gives a model on a ``device_type`` (``"cpu"``, ``"cuda"``)."""
        cap = config.kv_cache_memory_gib
        if cap is None and device_type == "cpu":
            cap = CPU_KV_CACHE_GIB
        return cls(
            block_size=config.block_size,
            step_tokens=config.step_token_budget(device_type),
            max_seqs=config.max_num_seqs,
            utilization=config.gpu_memory_utilization,
            cap_bytes=None if cap is None else int(cap * _GIB),
            num_blocks=config.num_kv_blocks,
            max_model_len=config.max_model_len,
        )

    @property
    def min_blocks(self) -> int:
        """The smallest cache worth serving with: one step's tokens."""
        return max(1, math.ceil(self.step_tokens / self.block_size))


@dataclass(frozen=True)
class CacheSizing:
    """How the cache was sized (bytes; all 0 but the blocks when the figure was given)."""

    num_blocks: int
    bytes_per_block: int
    total: int = 0
    available: int = 0
    weights: int = 0
    activations: int = 0
    #: True: sized here from the memory figures; False: the figure was given
    #: (``num_kv_blocks``, a restart)
    profiled: bool = False
    #: ``activations`` is :func:`activation_bound`'s figure, not a profiling forward's peak (a
    #: CPU whose cache cap binds even so: the profile could not change the blocks)
    activations_bound: bool = False

    @property
    def cache_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def describe(self) -> dict[str, object]:
        """The figures in MiB, for the ``engine.kv_sizing`` event and the health report."""

        def mib(n: int) -> float:
            return round(n / 2**20, 1)

        figures: dict[str, object] = {
            "kv_blocks": self.num_blocks,
            "kv_cache_mib": mib(self.cache_bytes),
            "profiled": self.profiled,
        }
        if self.profiled:
            figures |= {
                "device_total_mib": mib(self.total),
                "device_available_mib": mib(self.available),
                "weights_mib": mib(self.weights),
                "activations_peak_mib": mib(self.activations),
            }
            if self.activations_bound:
                figures["activations_bound"] = True
        return figures


def plan_cache(
    budget: CacheBudget,
    *,
    bytes_per_block: int,
    total: int,
    available: int,
    weights: int,
    activations: int,
    gather_per_block: int = 0,
    gather_fixed: int = 0,
    device: str = "the device",
) -> CacheSizing:
    """The blocks the measured figures leave room for (the arithmetic of :func:`size_kv_cache`):
    each block costs ``bytes_per_block``, and ``gather_per_block`` more held transiently by a
    step over a full cache, plus ``gather_fixed`` once (what the profiling forward, on an empty
    cache, cannot see: the decode attention's copy, :func:`stoic.model.decode_gather_keys`).

    :raises InsufficientMemory: fewer than :attr:`CacheBudget.min_blocks` fit; the message names
        the figures.
    """
    allowed = int(total * budget.utilization)
    room = min(allowed - weights - activations, available - activations) - gather_fixed
    blocks = max(0, room) // (bytes_per_block + gather_per_block)
    if budget.cap_bytes is not None:
        blocks = min(blocks, budget.cap_bytes // bytes_per_block)
    if blocks < budget.min_blocks:

        def gib(n: int) -> str:
            return f"{n / _GIB:.2f} GiB"

        need = budget.min_blocks * (bytes_per_block + gather_per_block) + gather_fixed
        raise InsufficientMemory(
            f"no room for the KV cache on {device}: it has {gib(total)}, "
            f"--gpu-memory-utilization {budget.utilization:g} allows {gib(allowed)}, "
            f"{gib(available)} is free; the weights take {gib(weights)} and a step of "
            f"{budget.step_tokens} tokens peaks at {gib(activations)} of activations, leaving "
            f"{gib(max(0, room))} where at least {gib(need)} ({budget.min_blocks} blocks of "
            f"{budget.block_size} tokens) is needed: raise --gpu-memory-utilization, lower "
            "--max-num-batched-tokens / --max-num-seqs, or use a smaller model or dtype"
        )
    return CacheSizing(
        num_blocks=blocks,
        bytes_per_block=bytes_per_block,
        total=total,
        available=available,
        weights=weights,
        activations=activations,
        profiled=True,
    )


def profile_batches(
    budget: CacheBudget, context: int, *, continued: bool
) -> list[tuple[StepBatch, int]]:
    """The steps the sizing's profiling forward runs, each with the blocks it needs: the step
    budget's tokens from position 0 in one sequence and spread over the most sequences; with
    ``continued``, also one chunk of the step's tokens that continues a sequence to
    ``context`` (the longest context), whose attention reads every earlier key. On a GPU that
    chunk runs SDPA with a mask (and grouped-query heads), which falls back to the math kernel
    and materialises ``[heads, chunk, context]`` scores: the largest activation a step can
    have, and one a profile of chunks from position 0 never meets (an OOM on the first long
    prompt). On a CPU the cache is capped (``--kv-cache-memory``) and a full-context chunk
    would add seconds to every start: not profiled there."""
    seqs = max(1, min(budget.max_seqs, budget.step_tokens))
    batches = [_profile_batch(budget.step_tokens, s, budget.block_size) for s in sorted({1, seqs})]
    if continued and context > 1:
        batches.append(_continued_batch(min(budget.step_tokens, context - 1), context, budget))
    return batches


def _continued_batch(tokens: int, context: int, budget: CacheBudget) -> tuple[StepBatch, int]:
    """One chunk of ``tokens`` that ends a ``context``-token sequence (its earlier positions'
    keys in the throw-away cache: zeros)."""
    blocks = math.ceil(context / budget.block_size)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    chunk = SeqChunk(0, (0,) * tokens, context - tokens, tuple(range(blocks)), True, params)
    return StepBatch((chunk,), zero_blocks=tuple(range(blocks))), blocks


def _profile_batch(tokens: int, seqs: int, block_size: int) -> tuple[StepBatch, int]:
    """``tokens`` prefill tokens from position 0 spread over ``seqs`` sequences, each sampling
    once, and the blocks they need."""
    base, extra = divmod(tokens, seqs)
    chunks, used = [], 0
    params = SamplingParams(max_tokens=1, temperature=0.0)
    for seq in range(seqs):
        length = base + (seq < extra)
        blocks = math.ceil(length / block_size)
        table = tuple(range(used, used + blocks))
        used += blocks
        chunks.append(SeqChunk(seq, (0,) * length, 0, table, True, params))
    return StepBatch(tuple(chunks), zero_blocks=tuple(range(used))), used


def size_kv_cache(runner: ModelRunner, budget: CacheBudget) -> CacheSizing:
    """Size ``runner``'s KV cache within ``budget`` (its weights loaded): a profiling forward at
    the step budget's largest shapes, then :func:`plan_cache`. A fixed
    :attr:`CacheBudget.num_blocks` is returned as it is, unprofiled. On a CPU whose cache cap
    binds even with :func:`activation_bound` for the activations (a CPU's usual case: 1 GiB of a
    machine's RAM), that bound stands in for the profile, which could not change the blocks.

    :raises InsufficientMemory: not even a cache of one step's tokens fits.
    """
    one = runner.kv_spec(1, budget.block_size)
    per_block = one.bytes_per_block
    if budget.num_blocks is not None:
        return CacheSizing(budget.num_blocks, per_block)
    device = runner.loaded.device
    memory = device_memory(device)
    weights = memory.in_use()
    model_len = runner.loaded.max_model_len
    context = min(budget.max_model_len or model_len, model_len)
    layer_key = per_block // one.num_layers // budget.block_size  # one key and value, one layer
    longest = math.ceil(context / budget.block_size)

    def plan(activations: int) -> CacheSizing:
        return plan_cache(
            budget,
            bytes_per_block=per_block,
            total=memory.total(),
            available=memory.available(),
            weights=weights,
            activations=activations,
            # a decode step copies one layer's blocks of its sequences out of the pools at a
            # time, each group of similar lengths padded to its longest (_paged.py, decode
            # attention): over a full cache, up to twice a layer's worth of it, and a little
            # per length class
            gather_per_block=decode_gather_keys(1, 0, budget.block_size) * layer_key,
            gather_fixed=decode_gather_keys(0, longest, budget.block_size) * layer_key,
            device=str(device),
        )

    bound = activation_bound(runner.loaded.config, budget) if device.type == "cpu" else None
    if bound is not None and budget.cap_bytes is not None:
        # the profile costs a step of the budget's tokens twice (2.7 s for a 1.5B model on two
        # cores: a fifth of a start); where even the bound leaves the cap binding, it could not
        # change the answer
        with contextlib.suppress(InsufficientMemory):
            bounded = plan(bound)
            if bounded.num_blocks == budget.cap_bytes // per_block:
                return dataclasses.replace(bounded, activations_bound=True)
    activations = 0
    for batch, blocks in profile_batches(budget, context, continued=device.type != "cpu"):
        kv = PagedKVCache(runner.kv_spec(blocks, budget.block_size))
        try:
            before = memory.in_use()  # the throw-away cache is not an activation
            memory.reset_peak()
            runner.execute(batch, kv)
            activations = max(activations, memory.peak() - before)
        finally:
            kv.release()
            del kv
    return plan(activations)


def activation_bound(config: Any, budget: CacheBudget) -> int | None:
    """An upper bound of a CPU step's activations at ``budget``'s largest shapes, from the
    model's dimensions (None where ``config`` lacks one: a model to profile): twice what a step
    would hold if every float32 temporary of every token lived at once (its residual, norm,
    query/key/value, attention output, gate, up, activation, a logits row) with a chunk's
    attention scores and three vocabulary-wide rows per sampled sequence, plus 64 MiB. The
    profile measures 77 MiB for a 1.5B model where this says 706 MiB."""
    dims = [getattr(config, name, None) for name in _BOUND_DIMS]
    sizes = [d for d in dims if isinstance(d, int) and d > 0]
    if len(sizes) != len(dims):
        return None
    hidden, inter, vocab, heads = sizes
    tokens, seqs = budget.step_tokens, max(1, min(budget.max_seqs, budget.step_tokens))
    per_token = 4 * (6 * hidden + 4 * inter + vocab)
    scores = 4 * heads * tokens * tokens
    sampled = 4 * 3 * seqs * vocab
    return 2 * (tokens * per_token + scores + sampled) + 64 * 2**20
