"""Failure classes as a GPU operator expects them: every allocation failure is out of memory (the
step budget backs off), an error that poisons the device context is fatal in-process and
replaces the worker process, anything else fails the step. Real exception types with the
messages torch and its libraries raise; the engine's reaction with faults injected."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
import torch
from support import collect, engine_config, wait_idle, wait_replaced, wait_restarts

import stoic
from stoic.errors import EngineFailed, ExecutorFailed
from stoic.executor import ExecutorFault, classify_failure, kv_survives

# the advice lines torch appends to a CUDA runtime error (c10_cuda_check_implementation)
_ADVICE = (
    "\nCUDA kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1"
    "\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n"
)

#: what torch raises on allocation failures, as a plain RuntimeError
ALLOCATION_FAILURES = [
    "CUDA error: out of memory" + _ADVICE,  # cudaErrorMemoryAllocation on an older torch
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasLtMatmul( ltHandle, "
    "computeDesc.descriptor(), &alpha_val, mat1_ptr, Adesc.descriptor(), ...)`",
    "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
    "cusolver error: CUSOLVER_STATUS_ALLOC_FAILED, when calling `cusolverDnCreate(handle)`",
    "CUDA error: CUSPARSE_STATUS_ALLOC_FAILED when calling `cusparseCreate(handle)`",
    "cuFFT error: CUFFT_ALLOC_FAILED",
    "HIPBLAS_STATUS_ALLOC_FAILED when calling `hipblasCreate(handle)`",
    "MPS backend out of memory (MPS allocated: 17.68 GB, other allocations: 3.95 MB, max "
    "allowed: 18.13 GB). Tried to allocate 1024.00 MB on private pool. Use "
    "PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable upper limit for memory allocations (may "
    "cause system failure).",
    "[enforce fail at alloc_cpu.cpp:117] err == 0. DefaultCPUAllocator: can't allocate memory: "
    "you tried to allocate 132426121216 bytes. Error code 12 (Cannot allocate memory)",
    "[enforce fail at alloc_cpu.cpp:81] data. DefaultCPUAllocator: not enough memory: you tried "
    "to allocate 1981808640 bytes.",
]

#: the caching allocators' own messages, raised as torch.OutOfMemoryError
ALLOCATOR_MESSAGES = [
    "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.15 GiB "
    "of which 1.06 MiB is free. Including non-PyTorch memory, this process has 79.14 GiB memory "
    "in use. Of the allocated memory 78.11 GiB is allocated by PyTorch, and 412.34 MiB is "
    "reserved by PyTorch but unallocated.",
    "HIP out of memory. Tried to allocate 3.31 GiB. GPU 0 has a total capacity of 128.00 GiB "
    "of which 780.24 MiB is free.",
    "XPU out of memory. Tried to allocate 2.00 GiB.",
    "",  # the type alone decides
]

#: the sticky CUDA errors: after one the context cannot be used again
POISONED = [
    "CUDA error: an illegal memory access was encountered" + _ADVICE,
    "CUDA error: an illegal instruction was encountered\nSearch for "
    "`cudaErrorIllegalInstruction' in https://docs.nvidia.com/cuda/cuda-runtime-api/"
    "group__CUDART__TYPES.html for more information.",
    "CUDA error: uncorrectable ECC error encountered" + _ADVICE,
    "CUDA error: unspecified launch failure" + _ADVICE,
    "CUDA error: device-side assert triggered" + _ADVICE,
    "CUDA error: misaligned address" + _ADVICE,
    "CUDA error: the launch timed out and was terminated" + _ADVICE,
    "CUDA error: uncorrectable NVLink error detected during the execution" + _ADVICE,
    "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, opb, "
    "m, n, k, &alpha, a, lda, b, ldb, &beta, c, ldc)`",
]

#: ordinary exceptions a step may raise: the device is fine
ORDINARY = [
    ValueError("probability tensor contains either `inf`, `nan` or element < 0"),
    IndexError("index 4 is out of bounds for dimension 0 with size 4"),
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x576 and 64x576)"),
    RuntimeError("Expected all tensors to be on the same device"),
    KeyError("model.layers.0.self_attn.q_proj.weight"),
]

ACCELERATOR_ERROR: type[RuntimeError] | None = getattr(torch, "AcceleratorError", None)
needs_accelerator_error = pytest.mark.skipif(
    ACCELERATOR_ERROR is None, reason="this torch has no torch.AcceleratorError (added in 2.8)"
)


def _accelerator_error(message: str, code: int) -> RuntimeError:
    """A torch.AcceleratorError as torch raises it: the message and the CUDA error code."""
    assert ACCELERATOR_ERROR is not None
    error = ACCELERATOR_ERROR(message)
    error.error_code = code  # type: ignore[attr-defined]
    return error


@pytest.mark.parametrize("message", ALLOCATION_FAILURES)
def test_every_allocation_failure_is_out_of_memory(message: str) -> None:
    """cuBLAS, cuDNN, cuSOLVER, cuSPARSE, cuFFT, hipBLAS, the MPS and CPU allocators and a raw
    cudaMalloc each report running out of memory in their own words: all are ``oom``."""
    assert classify_failure(RuntimeError(message)) == "oom"


@pytest.mark.parametrize("message", ALLOCATOR_MESSAGES)
def test_torch_out_of_memory_errors_are_out_of_memory(message: str) -> None:
    """torch.OutOfMemoryError (torch.cuda.OutOfMemoryError is the same class) and Python's
    MemoryError are ``oom`` whatever they say."""
    assert torch.cuda.OutOfMemoryError is torch.OutOfMemoryError
    assert classify_failure(torch.OutOfMemoryError(message)) == "oom"
    assert classify_failure(MemoryError(message)) == "oom"


@pytest.mark.parametrize("message", POISONED)
def test_errors_that_poison_the_context_are_fatal(message: str) -> None:
    """The sticky CUDA errors are ``fatal`` as the RuntimeError an older torch raises."""
    assert classify_failure(RuntimeError(message)) == "fatal"


@needs_accelerator_error
@pytest.mark.parametrize(
    ("message", "code"),
    [
        (POISONED[0], 700),  # cudaErrorIllegalAddress
        (POISONED[1], 715),  # cudaErrorIllegalInstruction
        (POISONED[2], 214),  # cudaErrorECCUncorrectable
        (POISONED[3], 719),  # cudaErrorLaunchFailure
        ("CUDA error: operating system call failed" + _ADVICE, 304),
        ("CUDA error: unknown error" + _ADVICE, 999),
    ],
)
def test_an_accelerator_error_that_is_not_out_of_memory_is_fatal(message: str, code: int) -> None:
    """A torch.AcceleratorError (what torch >= 2.8 raises for a failed CUDA runtime call)
    poisons the context as far as stoic knows, named in the marker list or not, unless CUDA
    says the context survives it (next test)."""
    assert classify_failure(_accelerator_error(message, code)) == "fatal"


@needs_accelerator_error
@pytest.mark.parametrize(
    ("message", "code"),
    [
        ("CUDA error: invalid argument", 1),
        ("CUDA error: invalid configuration argument", 9),
        ("CUDA error: invalid device function", 98),
        ("CUDA error: no kernel image is available for execution on the device", 209),
        ("CUDA error: too many resources requested for launch", 701),
        ("CUDA error: operation not supported", 801),
    ],
)
def test_an_accelerator_error_the_context_survives_is_a_step_failure(
    message: str, code: int
) -> None:
    """The CUDA errors a call reports before any work runs leave the context usable: ``error``
    (the step fails, the engine and its worker serve on), so a request that makes a kernel's
    launch invalid cannot fail the thread executor's engine."""
    assert classify_failure(_accelerator_error(message + _ADVICE, code)) == "error"
    # the same words without the code (an older torch's RuntimeError) were never fatal
    assert classify_failure(RuntimeError(message)) == "error"


@needs_accelerator_error
def test_an_accelerator_error_for_a_failed_allocation_is_out_of_memory() -> None:
    """cudaErrorMemoryAllocation (2) raised as torch.AcceleratorError, advice lines included
    (they mention device-side assertions), is ``oom``, not ``fatal``."""
    error = _accelerator_error("CUDA error: out of memory" + _ADVICE, 2)
    assert classify_failure(error) == "oom"


@pytest.mark.parametrize("error", ORDINARY, ids=lambda e: type(e).__name__)
def test_ordinary_exceptions_stay_step_failures(error: Exception) -> None:
    assert classify_failure(error) == "error"


def test_a_worker_fault_keeps_the_kind_the_worker_gave_it() -> None:
    """The process executor classifies in the worker; the server keeps that kind."""
    fault = ExecutorFault("RuntimeError: CUDA error: out of memory", "fatal")
    assert classify_failure(fault) == "fatal"


@pytest.mark.parametrize(
    ("kind", "exitcode", "kept"),
    [
        ("error", None, True),  # a step raised: the worker wrote only the failed step's slots
        ("hang", -15, True),  # the watchdog's SIGTERM (then SIGKILL) of a hung step
        ("crash", -9, True),  # kill -9: an operator, the kernel's OOM killer
        ("crash", -15, True),
        ("crash", 1, True),  # a Python-level exit
        ("crash", -11, False),  # SIGSEGV: memory corruption is possible
        ("crash", -7, False),  # SIGBUS
        ("crash", -6, False),  # abort()
        ("crash", -4, False),  # SIGILL
        ("crash", None, False),  # died, how not known
        ("oom", None, False),  # the seed's semantics: drop and back off
        ("fatal", None, False),  # a poisoned device
    ],
)
def test_the_kv_cache_survives_only_failures_that_cannot_corrupt_it(
    kind: str, exitcode: int | None, kept: bool
) -> None:
    """Pools that outlive the worker are kept after a kill from outside, a hang or a step
    that raised; dropped after a fault of the worker's own, out of memory or a poisoned
    device."""
    fault = ExecutorFault("worker failed", kind, pid=1234, exitcode=exitcode)  # type: ignore[arg-type]
    assert kv_survives(fault, fault.kind) is kept


@pytest.mark.asyncio
async def test_a_worker_found_dead_on_a_broken_pipe_says_how_it_ended() -> None:
    """A worker killed with SIGKILL and found dead at once (its pipe broken before the reader
    thread reaped it) still reports its signal, so a kill from outside keeps the KV cache
    instead of counting as a death of unknown cause."""
    from stoic.executor._process import WorkerProcess

    worker = WorkerProcess()
    os.kill(worker.pid, signal.SIGKILL)
    fault = worker._died()
    assert fault.exitcode == -signal.SIGKILL and "SIGKILL" in str(fault)
    assert kv_survives(fault, fault.kind)


# the engine's reaction, with the real forms injected into its steps (the tiny model on a CPU)

PARAMS = stoic.SamplingParams(max_tokens=150, temperature=0, ignore_eos=True)


@pytest.mark.model
@pytest.mark.asyncio
@pytest.mark.parametrize("executor", ["thread", "process"])
async def test_a_cublas_allocation_failure_backs_the_budget_off_and_keeps_the_worker(
    tiny_model_dir: Path, executor: str
) -> None:
    """cuBLAS's RuntimeError (not torch's OutOfMemoryError) mid-generation: the stream fails
    with kind ``oom``, the step token budget is halved, the same worker process serves the next
    request, and the restart is counted as ``oom``."""
    config = engine_config(
        tiny_model_dir, executor=executor, max_num_seqs=4, max_num_batched_tokens=64
    )
    async with stoic.Engine.start(config) as engine:
        pid = engine.stats().executor_pid
        assert engine.stats().token_budget == 64
        stream = await engine.submit("the quick brown fox", PARAMS)
        await engine.inject_fault(stoic.FaultSpec(kind="alloc_failed", after_steps=2))
        _text, error = await asyncio.wait_for(collect(stream), 60)
        assert isinstance(error, ExecutorFailed) and error.kind == "oom", error
        assert "CUBLAS_STATUS_ALLOC_FAILED" in error.message
        await wait_restarts(engine, 1, limit=30.0)
        assert engine.stats().token_budget == 32
        short = stoic.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        assert (await engine.complete("hello", short)).completion_tokens == 4
        stats = await wait_idle(engine, 10.0, serving=True)
        assert stats.executor_pid == pid
        assert stats.restarts_by_kind == (("oom", 1),)


@pytest.mark.model
@pytest.mark.asyncio
async def test_a_poisoned_device_fails_the_engine_with_the_thread_executor(
    tiny_model_dir: Path,
) -> None:
    """The error a poisoned context raises (a torch.AcceleratorError where torch has it) in the
    server's own process: no restart can help, so every stream ends with EngineFailed, the
    engine reports failed, and new requests are refused."""
    async with stoic.Engine.start(engine_config(tiny_model_dir, executor="thread")) as engine:
        stream = await engine.submit("the quick brown fox", PARAMS)
        await engine.inject_fault(stoic.FaultSpec(kind="fatal", after_steps=2))
        _text, error = await asyncio.wait_for(collect(stream), 60)
        assert isinstance(error, EngineFailed), error
        assert "illegal memory access" in error.message
        failure = await asyncio.wait_for(engine.wait_failed(), 10)
        assert "unrecoverable device error" in str(failure)
        assert engine.health().state == "failed"
        with pytest.raises(EngineFailed):
            await engine.submit("hello", PARAMS)


@pytest.mark.model
@pytest.mark.asyncio
async def test_a_poisoned_device_replaces_the_worker_process(tiny_model_dir: Path) -> None:
    """The same error in the process executor's worker: the stream fails with kind ``fatal``,
    that worker is never used again (a new process serves), the budget is untouched."""
    config = engine_config(tiny_model_dir, executor="process", max_num_batched_tokens=64)
    async with stoic.Engine.start(config) as engine:
        pid = engine.stats().executor_pid
        stream = await engine.submit("the quick brown fox", PARAMS)
        await engine.inject_fault(stoic.FaultSpec(kind="fatal", after_steps=2))
        _text, error = await asyncio.wait_for(collect(stream), 60)
        assert isinstance(error, ExecutorFailed) and error.kind == "fatal", error
        if ACCELERATOR_ERROR is not None:
            assert "AcceleratorError" in error.message  # the worker raised torch's real type
        await wait_replaced(engine, pid, restarts=1)
        short = stoic.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        assert (await engine.complete("hello", short)).completion_tokens == 4
        stats = await wait_idle(engine, 10.0, serving=True)
        assert stats.token_budget == 64
        assert stats.restarts_by_kind == (("fatal", 1),)
