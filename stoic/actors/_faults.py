"""Fault injection into executor steps (off unless the engine enables it).

:class:`FaultInjector` decides, step by step, whether a step fails and how (on the event loop, or
in the thread executor's worker thread); :func:`enact_fault` makes it happen where the model
runs: in the worker thread, or in the worker process (:mod:`stoic.executor._procworker`).
"""

from __future__ import annotations

import ctypes
import os
import random
import signal
import threading
import time
from collections.abc import Iterable

import torch

from ..config import PROCESS_ONLY_FAULTS, FaultSpec
from ..model import StepProgress

__all__ = [
    "ALLOC_FAILED_MESSAGE",
    "FATAL_CUDA_MESSAGE",
    "FaultInjector",
    "InjectedFault",
    "enact_fault",
]

#: exactly what PyTorch raises once a kernel poisoned the CUDA context
FATAL_CUDA_MESSAGE = (
    "CUDA error: an illegal memory access was encountered\n"
    "CUDA kernel errors might be asynchronously reported at some other API call"
)
#: cudaErrorIllegalAddress: the ``error_code`` torch gives the AcceleratorError it raises
_ILLEGAL_ADDRESS = 700
#: exactly what PyTorch raises (a plain RuntimeError, not its OutOfMemoryError) when cuBLAS cannot
#: allocate its handle's memory on a full GPU
ALLOC_FAILED_MESSAGE = "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"


class InjectedFault(RuntimeError):
    """The ``"error"`` kind: a plain RuntimeError raised inside the step."""


def enact_fault(spec: FaultSpec, progress: StepProgress | None = None) -> None:
    """Make the step fail the way ``spec`` says, where the model runs, just before the step.

    ``oom``, ``alloc_failed``, ``error`` and ``fatal`` raise (``fatal``: the
    :class:`torch.AcceleratorError` torch 2.8 and later raise for a poisoned context, a plain
    RuntimeError on an older torch); ``device_assert`` indexes a CUDA tensor out of range
    (a real device-side assert); ``hang`` spins on the CPU for ``spec.seconds`` without a
    progress tick (then the step runs); ``slow`` throttles the step: each tick of ``progress``
    waits ``spec.seconds`` (without a counter, the step waits ``spec.seconds`` once); ``crash``
    (SIGKILL), ``segfault`` (a real SIGSEGV) and ``abort`` (``os.abort()``) end the process, so
    they are only armed with the process executor.
    """
    match spec.kind:
        case "oom":
            raise torch.OutOfMemoryError("injected fault: CUDA out of memory (simulated)")
        case "error":
            raise InjectedFault("injected fault: executor error")
        case "alloc_failed":
            raise RuntimeError(ALLOC_FAILED_MESSAGE)
        case "fatal":
            raise _poisoned_context()
        case "hang":
            _spin(spec.seconds)
        case "slow":
            if progress is not None:
                progress.throttle(spec.seconds)
            else:
                time.sleep(spec.seconds)
        case "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        case "segfault":
            ctypes.string_at(0)  # reads address 0: the kernel sends SIGSEGV
        case "abort":
            os.abort()
        case "device_assert":
            _device_assert()


def _poisoned_context() -> RuntimeError:
    """What torch raises after a kernel's illegal memory access, with its type and error code."""
    accelerator_error: type[RuntimeError] | None = getattr(torch, "AcceleratorError", None)
    if accelerator_error is None:
        return RuntimeError(FATAL_CUDA_MESSAGE)
    error = accelerator_error(FATAL_CUDA_MESSAGE)
    error.error_code = _ILLEGAL_ADDRESS  # type: ignore[attr-defined]  # as torch sets it
    return error


def _spin(seconds: float) -> None:
    """Busy-loop for ``seconds``, holding a CPU and ticking no progress: what a step stuck in a
    loop looks like to the step watchdog (a sleeping step would leave its core to others).
    It only returns: a SIGTERM to the process ends it as it ends a step stuck in native code."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        pass


def _device_assert() -> None:
    """Index a tensor out of range on the GPU: a real device-side assert, which poisons the
    CUDA context (on a CPU the same index is a plain IndexError)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    values = torch.zeros(4, device=device)
    values[torch.tensor([4], device=device)].sum().item()
    if device == "cuda":
        torch.cuda.synchronize()


class FaultInjector:
    """Decides, step by step, whether the step fails and how. Thread-safe: specs are set from the
    event loop and consulted where steps are dispatched.
    """

    def __init__(self, specs: tuple[FaultSpec, ...] = ()) -> None:
        self._lock = threading.Lock()
        self._armed: list[tuple[FaultSpec, int, random.Random | None]] = []
        #: ``match`` specs: they fire on the prompts of a batch (:meth:`match`)
        self._matching: tuple[FaultSpec, ...] = ()
        self.injected = 0
        for spec in specs:
            self.add(spec)

    def add(self, spec: FaultSpec) -> None:
        with self._lock:
            if spec.match is not None:
                self._matching = (*self._matching, spec)
                return
            rng = random.Random(spec.seed) if spec.probability is not None else None
            self._armed.append((spec, spec.after_steps or 0, rng))

    def clear(self) -> None:
        with self._lock:
            self._armed.clear()
            self._matching = ()

    @property
    def matching(self) -> bool:
        """A ``match`` spec is armed (the scheduler then checks each batch's prompts)."""
        return bool(self._matching)

    def match(self, prompts: Iterable[str]) -> FaultSpec | None:
        """The first armed ``match`` spec whose text is in one of ``prompts`` (a step's batch):
        that step gets it. ``match`` specs stay armed until cleared."""
        specs = self._matching
        if not specs:
            return None
        texts = tuple(prompts)
        for spec in specs:
            assert spec.match is not None
            if any(spec.match in text for text in texts):
                with self._lock:
                    self.injected += 1
                return spec
        return None

    def decide(self) -> FaultSpec | None:
        """Called once per step: the fault this step gets, if any. An ``after_steps`` fault
        fires once, then is disarmed; a ``probability`` fault stays armed until cleared."""
        if not self._armed:
            return None
        fire: FaultSpec | None = None
        with self._lock:
            keep: list[tuple[FaultSpec, int, random.Random | None]] = []
            for spec, countdown, rng in self._armed:
                if rng is not None:
                    if fire is None and rng.random() < float(spec.probability or 0.0):
                        fire = spec
                    keep.append((spec, countdown, rng))
                elif countdown <= 1 and fire is None:
                    fire = spec
                else:
                    keep.append((spec, countdown - 1, rng))
            self._armed = keep
            if fire is not None:
                self.injected += 1
        return fire

    @staticmethod
    def in_thread(spec: FaultSpec | None, progress: StepProgress | None = None) -> None:
        """Enact ``spec`` (if any) in the thread executor's worker thread, before a step whose
        progress counter is ``progress``."""
        if spec is not None:
            if spec.kind in PROCESS_ONLY_FAULTS:  # refused when armed; never kill the server
                raise InjectedFault(f"injected fault {spec.kind!r} needs the process executor")
            enact_fault(spec, progress)
