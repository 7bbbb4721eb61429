"""Engine configuration and fault-injection specs."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from .errors import InsufficientMemory, InvalidRequest

__all__ = [
    "FAULT_KINDS",
    "KV_CACHE_DTYPES",
    "LOAD_FORMATS",
    "PROCESS_ONLY_FAULTS",
    "EngineConfig",
    "FaultKind",
    "FaultSpec",
    "LoadFormat",
]

FaultKind = Literal[
    "oom",
    "alloc_failed",
    "error",
    "hang",
    "slow",
    "fatal",
    "device_assert",
    "crash",
    "segfault",
    "abort",
]
FAULT_KINDS: tuple[FaultKind, ...] = get_args(FaultKind)
#: faults that end the process that runs the model: only the process executor survives them
PROCESS_ONLY_FAULTS = frozenset({"crash", "segfault", "abort"})


@dataclass(frozen=True)
class FaultSpec:
    """A fault to inject into executor steps (for tests and failure rehearsals).

    Kinds: ``oom`` (out of memory), ``alloc_failed`` (exactly the RuntimeError torch raises when
    cuBLAS cannot allocate on a full GPU: an out-of-memory failure too), ``error`` (an
    exception), ``fatal`` (exactly the error a poisoned CUDA context raises), ``device_assert`` (a real out-of-range index on the GPU, which
    poisons the context; a plain error on a CPU), ``hang`` (the step spins on a CPU for
    ``seconds`` without progress, then runs: past ``step_timeout`` it is a hung step), ``slow``
    (each progress tick of the step, one per decoder layer and one at its start and end, waits
    ``seconds``: a slow step that keeps progressing, which the watchdog leaves alone), and, with
    the process executor only, ``crash`` (the worker SIGKILLs itself), ``segfault`` (a real
    SIGSEGV) and ``abort`` (``os.abort()``).

    Exactly one trigger: ``after_steps=N`` (the Nth following step fails, once),
    ``probability=p`` with ``seed`` (every step fails with probability p until cleared), or
    ``match="text"`` (every step whose batch holds a sequence whose prompt contains ``text``
    fails, until cleared: a poison request).
    """

    kind: FaultKind
    after_steps: int | None = None
    probability: float | None = None
    seed: int | None = None
    match: str | None = None
    #: how long a ``"hang"`` spins; how long each progress tick of a ``"slow"`` step waits
    seconds: float = 30.0

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise InvalidRequest(f"kind must be one of {', '.join(FAULT_KINDS)}", param="kind")
        triggers = (self.after_steps, self.probability, self.match)
        if sum(t is not None for t in triggers) != 1:
            raise InvalidRequest(
                "give exactly one of after_steps, probability or match", param="after_steps"
            )
        if self.match is not None and (not isinstance(self.match, str) or not self.match):
            raise InvalidRequest("match must be a non-empty string", param="match")
        if self.after_steps is not None and (
            not isinstance(self.after_steps, int) or self.after_steps < 1
        ):
            raise InvalidRequest("after_steps must be an integer >= 1", param="after_steps")
        if self.probability is not None and not 0.0 < float(self.probability) <= 1.0:
            raise InvalidRequest("probability must be in (0, 1]", param="probability")
        if not 0.0 <= self.seconds <= 3600.0:
            raise InvalidRequest("seconds must be between 0 and 3600", param="seconds")


#: ``--quantization``: ``"auto"`` (a GGUF model's quantised weights, where this machine's CPU and C
#: compiler allow), ``"gguf"`` (the same, required: the start fails without), ``"none"`` (only
#: the de-quantised float weights)
Quantization = Literal["auto", "gguf", "none"]

#: ``--weight-layouts``: ``"fast"`` (a GGUF model's blocks repacked for steps of few rows, and
#: for bigger ones the int8 layout or a dense copy: 2-3x the file's bytes), ``"compact"`` (the
#: repacked blocks alone, every step on them: about the file's bytes, slower prefill), ``"auto"``
#: (fast where its layouts take at most half the memory available at load, else compact). With
#: int8 products (VNNI, a fast dtype) the types of :data:`stoic.kernels.G8_ALONE_TYPES` hold one
#: layout for every step under either: the choice only matters for the others (5-bit types)
WeightLayouts = Literal["auto", "fast", "compact"]
WEIGHT_LAYOUTS = ("auto", "fast", "compact")

#: ``--load-format`` (vLLM's name and meaning): ``"auto"`` (the model's weights: a GGUF file's
#: blocks, a directory's safetensors) or ``"dummy"`` (random weights made on the device in the
#: compute dtype from the model's configuration: a directory needs no weight files; the
#: outputs are meaningless, the shapes, memory and speed are the real model's)
LoadFormat = Literal["auto", "dummy"]
LOAD_FORMATS = ("auto", "dummy")

#: ``--kv-cache-dtype``'s choices (``EngineConfig.kv_cache_dtype``; ``auto``:
#: :mod:`stoic.model._precision`)
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
#: ``--speculative``: draft by prompt lookup whenever one is found, only while few sequences
#: run, or never (stoic/scheduler/_speculate.py)
Speculative = Literal["auto", "ngram", "off"]
SPECULATIVE_MODES: tuple[Speculative, ...] = get_args(Speculative)
#: ``--speculative auto`` drafts while at most this many sequences run. Measured
#: (benchmarks/spec_bench.py --mode auto, default model, 2 cores, decode tokens/s against
#: ``off``): 1 client 1.52x on grounded requests, 1.06x on open ones; 2 clients 1.26x and
#: 0.98x; 4 clients 1.05x and 0.94x: past two sequences a step's rows cost what drafts save
SPECULATIVE_AUTO_BATCH = 2


@dataclass(frozen=True)
class EngineConfig:
    """Everything :meth:`stoic.Engine.start` needs. Defaults suit the default model on a CPU."""

    #: ``"default"`` (the embedded SmolLM2-135M-Instruct), a ``.gguf`` file, or a model directory
    model: str = "default"
    #: the name clients use in the ``model`` field (defaults to the model's name)
    served_model_name: str | None = None
    #: ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:1"``...
    device: str = "auto"
    #: ``"auto"``, ``"float32"``, ``"bfloat16"``, ``"float16"``
    dtype: str = "auto"
    #: where converted GGUF models are cached (default ``$STOIC_CACHE_DIR`` or ``~/.cache/stoic``)
    cache_dir: Path | None = None
    #: steps of few tokens (decode) on a GGUF model's quantised weights, on a CPU: ``"auto"``
    #: where the CPU (AVX2) and a C compiler allow, ``"gguf"`` required, ``"none"`` never. The
    #: numbers are the de-quantised weights' own (docs/operations.md, "Quantised weights")
    quantization: Quantization = "auto"
    #: which layouts a GGUF model's quantised weights are held in (:data:`WeightLayouts`)
    weight_layouts: WeightLayouts = "auto"
    #: where the weights come from (:data:`LoadFormat`): the model's own, or random ones
    load_format: LoadFormat = "auto"
    #: every token's logits computed independently of the batch it is in, of how its prompt was
    #: chunked and of whether its context came from the prefix cache or a re-prefill: the same
    #: greedy (or seeded) text alone or in any batch, and ``recovery="resume"`` exact, in the
    #: dtype ``"auto"`` picks. A GGUF model of the C layers' families only (others are refused
    #: at start); prefill is slower (docs/operations.md, "Deterministic mode")
    deterministic: bool = False
    #: what the KV cache holds: ``"auto"``, ``"float32"``, ``"bfloat16"``, ``"float16"``.
    #: ``"auto"``: bfloat16 for a GGUF model decoding on its quantised blocks in the C layers
    #: with ``dtype="auto"`` (the C attention reads it widened to float32; half the bytes its
    #: decode attention streams), except with ``deterministic``; else ``dtype``'s type
    #: (:mod:`stoic.model._precision`)
    kv_cache_dtype: str = "auto"
    #: tokens per KV block
    block_size: int = 16
    #: KV blocks; ``None``: the process that runs the model sizes the cache after loading the
    #: weights, from what ``gpu_memory_utilization`` leaves (:mod:`stoic.worker._memory`)
    num_kv_blocks: int | None = None
    #: a cap on the KV cache in GiB; ``None``: 1 GiB on a CPU (the RAM is the machine's), none on
    #: a GPU
    kv_cache_memory_gib: float | None = None
    #: the fraction of the device's *total* memory this instance may hold: weights, a step's
    #: activations and the KV cache together (vLLM's meaning); on a CPU, of RAM
    gpu_memory_utilization: float = 0.9
    #: sequences decoding at once
    max_num_seqs: int = 64
    #: tokens per step (decode tokens + prefill chunks); ``None``: 256 on a CPU, 2048 on a GPU,
    #: and never fewer than ``max_num_seqs``. A step with prefill stalls every decoding sequence
    #: for its whole duration, and a request arriving mid-step waits for it: on a CPU, where a
    #: prefill token costs ~0.45 ms, 256 shortens those stalls against 512 (inter-token latency
    #: p99 at 32 clients 201-233 vs 342 ms on 2 cores) at about the same throughput and TTFT
    #: (docs/benchmarks.md, "Step budget")
    max_num_batched_tokens: int | None = None
    #: reuse the KV blocks of a prompt prefix already computed (a shared system prompt, earlier
    #: turns of a chat): those tokens are not computed again
    enable_prefix_caching: bool = True
    #: requests admitted and not yet finished; beyond it, :class:`~stoic.errors.Overloaded`
    max_waiting: int = 512
    #: seconds a request may wait to start: one whose wait, estimated at admission from the
    #: queue ahead of it and the measured step rate, is longer is refused at once
    #: (:class:`~stoic.errors.Overloaded`, 429 with ``Retry-After``) rather than admitted to be
    #: late (a request's own ``timeout`` may ask for less). ``None``: no limit
    max_queue_wait: float | None = 30.0
    #: tenants' weights in the fair share of step tokens (a tenant not named: 1.0)
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    #: sequences one tenant may have running at once (None: ``max_num_seqs`` only)
    tenant_max_running: int | None = None
    #: requests one tenant may have admitted and not finished (None: ``max_waiting`` only)
    tenant_max_queued: int | None = None
    #: while sequences decode, a step carries prompt chunks only up to this many times a
    #: decode-only step's measured duration: a shorter inter-token tail for a longer prefill.
    #: ``None``: prompt chunks up to the token budget
    decode_stretch: float | None = None
    #: speculative decoding by prompt lookup: a decoding sequence verifies up to
    #: ``num_speculative_tokens`` tokens proposed from its own prompt and output in the same
    #: step (``"ngram"``: whenever a draft is found; ``"auto"``: only while few sequences run,
    #: where a step is bandwidth-bound; ``"off"``). See docs/operations.md, "Speculative decoding"
    speculative: Speculative = "auto"
    num_speculative_tokens: int = 4
    #: context length override (defaults to the model's)
    max_model_len: int | None = None
    #: restart intensity: more than ``max_restarts`` executor failures within ``restart_window``
    #: seconds marks the engine failed (with ``recovery="resume"``, the failures of an isolation
    #: probe, a suspect run alone, are charged to it and not counted)
    max_restarts: int = 5
    restart_window: float = 60.0
    #: a step whose progress (a tick per decoder layer) stops for this long is a hang: with the
    #: process executor the worker is killed and replaced; with the thread executor the engine
    #: is marked failed. A step that keeps progressing runs however long it takes
    step_timeout: float = 120.0
    #: where the model runs: ``"process"`` (a worker process the engine replaces when it dies,
    #: crashes, hangs or poisons its device) or ``"thread"`` (a thread of this process)
    executor: Literal["process", "thread"] = "thread"
    #: with the process executor: warm worker processes (weights loaded) that take over at once
    executor_spares: int = 0
    #: compute threads of the step (torch's and the C kernels' pools): None sizes them to the
    #: CPU this process may use (its affinity mask, capped by its cgroup's CPU quota)
    threads: int | None = None
    #: while other processes take CPUs from the engine, run the step on fewer threads (a pool
    #: waiting for a descheduled thread collapses), and grow back when CPUs go idle
    #: (docs/operations.md, "Shared machines"); False: always ``threads``
    adapt_threads: bool = True
    #: allow :meth:`stoic.Engine.inject_fault` (and ``POST /admin/faults``)
    enable_fault_injection: bool = False
    faults: tuple[FaultSpec, ...] = field(default_factory=tuple)
    #: how long a graceful stop lets running requests finish
    drain_timeout: float = 30.0
    #: on an executor failure: ``"fail"`` ends every sequence that started with the error and its
    #: partial output; ``"resume"`` re-admits them to continue where they stopped
    recovery: Literal["fail", "resume"] = "fail"
    #: with ``recovery="resume"``: times one request may be resumed; then it fails as under
    #: ``"fail"``
    max_resumes: int = 3
    #: with the process executor on a host: the KV pools live in memory the engine owns and
    #: every worker maps, so a worker killed from outside, hung or failing a step leaves its
    #: keys and values to its replacement, and resumed sequences compute only the failed step
    #: again (docs/operations.md, "What survives a failure"). None: on wherever possible (the
    #: process executor on a CPU, Linux); True where it is not is an error; False: off
    kv_outlives_worker: bool | None = None

    def __post_init__(self) -> None:
        if self.faults and not self.enable_fault_injection:
            raise ValueError("faults given at start need enable_fault_injection=True")
        if self.executor not in ("process", "thread"):
            raise ValueError(f"executor must be 'process' or 'thread', not {self.executor!r}")
        for spec in self.faults:
            self.check_fault(spec)
        if self.quantization not in ("auto", "gguf", "none"):
            raise ValueError(
                f"quantization must be 'auto', 'gguf' or 'none', not {self.quantization!r}"
            )
        if self.weight_layouts not in WEIGHT_LAYOUTS:
            raise ValueError(
                f"weight_layouts must be one of {', '.join(WEIGHT_LAYOUTS)}, "
                f"not {self.weight_layouts!r}"
            )
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"load_format must be one of {', '.join(LOAD_FORMATS)}, not {self.load_format!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"not {self.kv_cache_dtype!r}"
            )
        if self.recovery not in ("fail", "resume"):
            raise ValueError(f"recovery must be 'fail' or 'resume', not {self.recovery!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError("threads must be >= 1")
        if self.max_resumes < 0:
            raise ValueError("max_resumes must be >= 0")
        if self.speculative not in SPECULATIVE_MODES:
            raise ValueError(
                f"speculative must be one of {', '.join(SPECULATIVE_MODES)}, "
                f"not {self.speculative!r}"
            )
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be between 1 and 16")
        if self.decode_stretch is not None and not self.decode_stretch > 1:
            raise ValueError("decode_stretch must be > 1 (or None: the token budget only)")
        if self.max_queue_wait is not None and not self.max_queue_wait > 0:
            raise ValueError("max_queue_wait must be > 0 (or None: no limit)")
        bad = {name: w for name, w in self.tenant_weights.items() if not w > 0}
        if bad:
            raise ValueError(f"tenant weights must be > 0: {bad}")
        for name in ("tenant_max_running", "tenant_max_queued"):
            limit = getattr(self, name)
            if limit is not None and limit < 1:
                raise ValueError(f"{name} must be >= 1 (or None: no limit)")
        if self.kv_outlives_worker and self.executor != "process":
            raise ValueError(
                "kv_outlives_worker needs the process executor (executor='process'): with "
                "the thread executor the KV cache lives and dies with the server"
            )
        if self.kv_outlives_worker and self.device.startswith("cuda"):
            raise ValueError(
                "kv_outlives_worker is implemented for host memory only: on a GPU the KV "
                "pools die with the worker (docs/architecture.md has the design)"
            )
        if self.executor_spares < 0 or (self.executor_spares and self.executor != "process"):
            raise ValueError("executor_spares must be >= 0 and needs executor='process'")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], not {self.gpu_memory_utilization}"
            )
        if self.kv_cache_memory_gib is not None and self.kv_cache_memory_gib <= 0:
            raise ValueError("kv_cache_memory_gib must be > 0")
        if (
            self.max_num_batched_tokens is not None
            and self.max_num_batched_tokens < self.max_num_seqs
        ):
            # every running sequence must fit one decode token into each step, or the youngest
            # would starve
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.max_num_seqs})"
            )

    def check_fault(self, spec: FaultSpec) -> None:
        """:raises ValueError: if ``spec`` would kill the server (a process-ending fault with the
        thread executor)."""
        if spec.kind in PROCESS_ONLY_FAULTS and self.executor != "process":
            raise ValueError(
                f"fault kind {spec.kind!r} ends the process that runs the model: it needs "
                "the process executor (executor='process', --executor process)"
            )

    def check_spares(self, device: str) -> None:
        """Refuse warm spare workers that a GPU ``device`` has no memory for. Each worker (the
        serving one and every spare) holds its own weights, activations and cache, and sizes
        them to ``gpu_memory_utilization`` of the device's total memory: side by side they need
        ``gpu_memory_utilization * (1 + executor_spares) <= 1``, unless ``num_kv_blocks`` sizes
        each worker's cache explicitly. On a CPU the cache is capped (``kv_cache_memory_gib``,
        1 GiB by default) and the spares are allowed.

        :raises InsufficientMemory: the spares do not fit.
        """
        if not self.executor_spares or not device.startswith("cuda") or self.num_kv_blocks:
            return
        workers = 1 + self.executor_spares
        if self.gpu_memory_utilization * workers > 1.0 + 1e-9:
            raise InsufficientMemory(
                f"--executor-spares {self.executor_spares} puts {workers} copies of the model on "
                f"{device}, each sized to --gpu-memory-utilization "
                f"{self.gpu_memory_utilization:g} of its memory ({workers} x "
                f"{self.gpu_memory_utilization:g} > 1): give at most --gpu-memory-utilization "
                f"{math.floor(100 / workers) / 100:g}, or --num-kv-blocks, or no spares"
            )

    def step_token_budget(self, device_type: str) -> int:
        """``max_num_batched_tokens``, or its default for ``device_type`` (``"cpu"``, ``"cuda"``)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return max(self.max_num_seqs, 256 if device_type == "cpu" else 2048)
