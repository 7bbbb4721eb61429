"""Step backends: where the executor's steps run (a thread of this process, or a worker process)
and everything that differs between the two, so that nothing outside this package branches on
``EngineConfig.executor``.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from .._logging import get_logger
from ..actors import FaultInjector, InjectedFault, KVLease
from ..config import EngineConfig, FaultSpec
from ..model import ComputePath, KVCacheSpec, LoadedModel, PagedKVCache, shared_kv_available
from ..request import GrammarVocab, StepBatch, StepOutput
from ..sampling import LLGuidanceBackend
from ..worker import CacheBudget, CacheSizing, ModelRunner, ThreadGovernor, size_kv_cache
from ._failures import ExecutorFault, classify_failure
from ._process import WorkerPool, WorkerProcess
from ._procworker import WorkerSpec
from ._thread import StepWorker

__all__ = ["Attached", "ProcessBackend", "StepBackend", "ThreadBackend", "make_backend"]

_log = get_logger("stoic.executor")

#: with the process executor, the executor kills a worker whose step made no progress for the
#: step timeout; the scheduler's watchdog watches the same counter and waits this much longer,
#: as a backstop (for a step that never reached the worker, or an executor stuck itself)
_WATCHDOG_MARGIN = 10.0


@dataclass(frozen=True)
class Attached:
    """What an executor incarnation runs its steps on: the process's ``pid``, its compute path
    (for the health report), and what the ``executor.ready`` event says about it."""

    pid: int
    compute: ComputePath | None
    log: dict[str, Any] = field(default_factory=dict)


class StepBackend(abc.ABC):
    """Where steps run; one for the engine's life, across executor incarnations.

    Its life: :meth:`load` the model, :meth:`prepare` (which sizes the KV cache), then
    for each executor incarnation :meth:`attach`, :meth:`run_step` per step, :meth:`detach`;
    :meth:`close` (leaving it as a context manager) when the engine has stopped.
    """

    #: the KV tensors live in this process: the cache manager creates them with this (None:
    #: they live in the worker, and the cache manager keeps the logical side only)
    make_cache: Callable[[KVCacheSpec], PagedKVCache] | None
    #: a failure replaces the process that runs the model (so a poisoned device is recoverable)
    replaces_worker: bool
    #: the KV pools outlive the process that computes into them (known after :meth:`prepare`):
    #: a recovery may keep the cache through a failure :func:`kv_survives` trusts
    kv_outlives_worker: bool = False
    #: how much longer than ``step_timeout`` the scheduler's watchdog waits (0: it is the only one)
    watchdog_margin: float

    @abc.abstractmethod
    async def load(self, load: Callable[..., LoadedModel]) -> LoadedModel:
        """``load(weights=...)`` where this backend needs it: the weights only where they run."""

    @abc.abstractmethod
    async def prepare(
        self,
        config: EngineConfig,
        loaded: LoadedModel,
        *,
        threads: int,
        vocab: GrammarVocab | None,
        grammar: LLGuidanceBackend | None,
    ) -> CacheSizing:
        """Build what runs the steps and size the KV cache where the weights are (the first
        worker process is started and loads the model), within ``config``'s memory budget:
        the number of blocks the scheduler's allocator gets.

        :raises InsufficientMemory: not even a minimal KV cache fits.
        :raises ExecutorFault: the first worker process died or did not get ready.
        """

    @abc.abstractmethod
    async def attach(
        self, lease: KVLease, on_exit: Callable[[int], None], incarnation: int
    ) -> Attached:
        """Get ready for executor ``incarnation``: ``lease`` is the cache manager's answer to
        ``AcquireKV``; ``on_exit(pid)`` is called (from any thread) if the worker dies.

        :raises ExecutorFault: the worker died or did not get ready.
        """

    @abc.abstractmethod
    async def run_step(
        self, step_id: int, batch: StepBatch, fault: FaultSpec | None, limit: float
    ) -> StepOutput:
        """Run one step (after enacting ``fault``); ``limit``: the step timeout.

        :raises Exception: what the step raised (:class:`ExecutorFault` from a worker process).
        """

    @abc.abstractmethod
    def check_exited(self, pid: int) -> None:
        """A worker ``pid`` exited (``on_exit``).

        :raises ExecutorFault: if it is the current one.
        """

    @abc.abstractmethod
    def failure_expected(self, error: BaseException) -> bool:
        """Whether the executor's failure with ``error`` is an anticipated one (logged by the
        recovery as one event, without a traceback)."""

    @abc.abstractmethod
    def detach(self) -> None:
        """The incarnation stopped."""

    @abc.abstractmethod
    def progress(self) -> int:
        """The current step's progress counter (what the scheduler's watchdog watches)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop what runs the steps (after the actors stopped: no orphan workers)."""

    def __enter__(self) -> StepBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def make_backend(config: EngineConfig) -> StepBackend:
    """The backend ``config.executor`` names (``"thread"`` or ``"process"``)."""
    if config.executor == "thread":
        return ThreadBackend(StepWorker("stoic-executor"))
    return ProcessBackend(spares=config.executor_spares, share_kv=config.kv_outlives_worker)


class ThreadBackend(StepBackend):
    """Steps run on one worker thread of this process (every incarnation's): torch's OpenMP pool
    is per calling thread, so a new thread per restart would leave idle pools competing for the
    cores. The model is loaded and built on that thread too (one OpenMP pool in the process). A
    thread cannot be killed: the scheduler's watchdog is the only one, and a poisoned device is
    the server's own."""

    make_cache = PagedKVCache
    replaces_worker = False
    watchdog_margin = 0.0

    def __init__(self, worker: StepWorker) -> None:
        self._worker = worker
        self._runner: ModelRunner | None = None
        self._kv: PagedKVCache | None = None

    async def load(self, load: Callable[..., LoadedModel]) -> LoadedModel:
        """On the step thread; a cancellation waits for the load to end before it propagates
        (as ``anyio.to_thread.run_sync`` does), so no load outlives the start that asked for it
        (a second cancellation stops the wait)."""
        task = asyncio.ensure_future(self._worker.run(functools.partial(load, weights=True)))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            with contextlib.suppress(BaseException):
                await asyncio.wait({task})
            raise

    async def prepare(
        self,
        config: EngineConfig,
        loaded: LoadedModel,
        *,
        threads: int,
        vocab: GrammarVocab | None,
        grammar: LLGuidanceBackend | None,
    ) -> CacheSizing:
        # built, and the cache sized, on the thread that runs its steps (the blocks' repacking
        # and checks are torch operators too): one OpenMP pool in the process (Engine.start)
        governor = ThreadGovernor(threads, adapt=config.adapt_threads)
        runner = await self._worker.run(
            functools.partial(
                ModelRunner,
                loaded,
                grammar,
                quantization=config.quantization,
                threads=governor,
                deterministic=config.deterministic,
                weight_layouts=config.weight_layouts,
            )
        )
        self._runner = runner
        budget = CacheBudget.of(config, loaded.device.type)
        return await self._worker.run(functools.partial(size_kv_cache, runner, budget))

    async def attach(
        self, lease: KVLease, on_exit: Callable[[int], None], incarnation: int
    ) -> Attached:
        kv = lease.kv
        assert kv is not None, "the thread executor needs the KV tensors in this process"
        assert self._runner is not None, "prepare() first"
        self._kv = kv
        self._worker.set_idle(kv.commit_idle)  # its pages, while no step is queued
        return Attached(os.getpid(), self._runner.compute_path)

    async def run_step(
        self, step_id: int, batch: StepBatch, fault: FaultSpec | None, limit: float
    ) -> StepOutput:
        kv, runner = self._kv, self._runner
        assert kv is not None and runner is not None

        def step() -> StepOutput:
            FaultInjector.in_thread(fault, runner.progress)
            return runner.execute(batch, kv)

        return await self._worker.run(step)

    def failure_expected(self, error: BaseException) -> bool:
        """Out of memory, a poisoned device (``oom``, ``fatal``) and injected faults are
        expected. Anything else a step raises here may be a bug in the model code, and keeps its
        traceback (which shows the model's frames)."""
        return classify_failure(error) != "error" or isinstance(error, InjectedFault)

    def check_exited(self, pid: int) -> None:
        pass  # no worker process: on_exit is never called

    def detach(self) -> None:
        self._kv = None
        self._worker.set_idle(None)

    def progress(self) -> int:
        return self._runner.progress.count if self._runner is not None else 0

    def close(self) -> None:
        self._worker.__exit__()


def _exited(worker: WorkerProcess) -> ExecutorFault:
    return ExecutorFault(
        f"executor process {worker.exited}", "crash", pid=worker.pid, exitcode=worker.exitcode
    )


class ProcessBackend(StepBackend):
    """Steps run in a worker process from a :class:`WorkerPool` (which keeps ``spares`` warm
    ones). The KV tensors and weights live there; this process loads the tokenizer and config
    only. A worker whose device may be poisoned (``fatal``) is killed, so it is never reused; one
    whose step makes no progress for the step timeout is killed and fails as ``hang``, and the
    scheduler's watchdog watches the same counter ``watchdog_margin`` later, as a backstop."""

    make_cache = None
    replaces_worker = True
    watchdog_margin = _WATCHDOG_MARGIN

    def __init__(self, *, spares: int, share_kv: bool | None = None) -> None:
        """``share_kv``: the KV pools in memory this process owns (``kv_outlives_worker``;
        None: wherever possible, the host with ``memfd``)."""
        self._spares = spares
        self._share_kv = share_kv
        self._pool: WorkerPool | None = None
        self._worker: WorkerProcess | None = None

    async def load(self, load: Callable[..., LoadedModel]) -> LoadedModel:
        loaded: LoadedModel = await anyio.to_thread.run_sync(functools.partial(load, weights=False))
        return loaded

    async def prepare(
        self,
        config: EngineConfig,
        loaded: LoadedModel,
        *,
        threads: int,
        vocab: GrammarVocab | None,
        grammar: LLGuidanceBackend | None,
    ) -> CacheSizing:
        """Start the first worker: it loads the weights and sizes the cache (this process never
        touches the device: no CUDA context here)."""
        config.check_spares(str(loaded.device))  # before a worker takes the device's memory
        # the worker builds its own grammar backend from ``vocab``
        worker_spec = WorkerSpec(
            # a GGUF model's weights are its file's (its directory holds the metadata only)
            model=str(loaded.gguf or loaded.path),
            device=str(loaded.device),
            # on a GPU "auto" is the worker's to resolve: this process never asks the device
            dtype=(
                config.dtype
                if loaded.device.type == "cuda"
                else str(loaded.dtype).removeprefix("torch.")
            ),
            cache_dir=config.cache_dir,
            budget=CacheBudget.of(config, loaded.device.type),
            eos_token_ids=loaded.eos_token_ids,
            threads=threads,
            adapt_threads=config.adapt_threads,
            grammar=vocab,
            gguf=loaded.gguf,
            quantization=config.quantization,
            weight_layouts=config.weight_layouts,
            load_format=config.load_format,
            deterministic=config.deterministic,
            dense_dtype=(
                str(loaded.dense_dtype).removeprefix("torch.") if loaded.dense_dtype else None
            ),
            kv_cache_dtype=(
                config.kv_cache_dtype
                if loaded.device.type == "cuda"
                else str(loaded.cache_dtype).removeprefix("torch.")
            ),
        )
        share = self._share_kv is not False and loaded.device.type == "cpu"
        share = share and shared_kv_available()
        if self._share_kv and not share:  # asked for where it cannot be (the config refuses
            # an explicit GPU device; "auto" may resolve to one)
            _log.warning(
                "executor.kv_outlives_worker_unavailable",
                device=str(loaded.device),
                reason="host memory on Linux only (memfd): the KV pools die with the worker",
            )
        self._pool = WorkerPool(
            worker_spec,
            spares=self._spares,
            share_kv=share,
            # the int8 layouts (CPU kernels) in memory every worker maps: one copy, packed once
            share_layouts=loaded.device.type == "cpu" and shared_kv_available(),
        )
        self.kv_outlives_worker = self._pool.kv_memory is not None
        return await self._pool.start()

    async def attach(
        self, lease: KVLease, on_exit: Callable[[int], None], incarnation: int
    ) -> Attached:
        """The same process when it survived the failure (its pools dropped if the lease says
        so), else a spare or a new process (on the shared pools, punched out if dropped)."""
        assert self._pool is not None, "prepare() first"
        worker, replaced = await self._pool.acquire(drop=lease.dropped)
        worker.on_exit = lambda gone: on_exit(gone.pid)
        self._worker = worker
        if not worker.alive:  # it died between being handed out and now
            raise _exited(worker)
        worker.set_role("serving", incarnation)  # its process title says so
        return Attached(worker.pid, worker.compute, {"pid": worker.pid, "new_process": replaced})

    async def run_step(
        self, step_id: int, batch: StepBatch, fault: FaultSpec | None, limit: float
    ) -> StepOutput:
        worker = self._worker
        assert worker is not None
        try:
            return await worker.step(step_id, batch, fault, limit)
        except ExecutorFault as exc:
            if exc.kind == "fatal":
                await worker.terminate()  # a poisoned device context is never used again
            raise

    def check_exited(self, pid: int) -> None:
        worker = self._worker
        if worker is not None and pid == worker.pid:
            raise _exited(worker)

    def failure_expected(self, error: BaseException) -> bool:
        """Every :class:`ExecutorFault` (the worker's step raised, it died, hung or could not
        start) is expected: a traceback would only show this process's side of the pipe."""
        return isinstance(error, ExecutorFault)

    def detach(self) -> None:
        if self._worker is not None:
            self._worker.on_exit = None
            self._worker = None

    def progress(self) -> int:
        return self._pool.progress() if self._pool is not None else 0

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
