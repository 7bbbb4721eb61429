"""The GPU check: what stoic must do on an NVIDIA GPU, each part unable to pass by accident.

1. **A real CUDA out-of-memory error inside the forward** (the default model, the thread
   executor, fault injection off, so nothing can be injected): after a warm-up request, the
   allocator is capped at what is in use plus ``--margin-mib``
   (``torch.cuda.set_per_process_memory_fraction``), then a prompt that fills one step of
   ``--prefill-tokens`` needs more than that. Passes only if the request fails with
   ``ExecutorFailed`` of kind ``oom`` whose message is torch's own ("CUDA out of memory"), not
   retryable, the step token budget halves, and the next request is served with the warm-up's
   greedy text.
2. **A real device-side assert** (the process executor, fault ``device_assert``: an out-of-range
   index on the GPU): passes only if the request fails with kind ``fatal`` naming the assert, a
   new worker process serves, and its greedy text is the one before.
3. **The KV cache's sizing** (every engine above sizes its cache from the memory left, as the
   default command does: ``--kv-blocks`` fixes it instead): passes only if the engine says it
   profiled, and the device's used memory that ``nvidia-smi`` reports once it serves is within
   ``--gpu-memory-utilization`` of the total (plus ``--context-mib`` for CUDA contexts).
4. **Throughput** at concurrency 1 and 32 (64 greedy tokens a request, the default command's
   process executor) on the tiny random model and ``--model`` (the default model; a shape with
   ``--load-format dummy``, e.g. ``--model shapes/llama3.1-8b``, needs no weight file): a table,
   no verdict.

Exits 1 with one line when no CUDA device is visible (nothing can be checked), 1 with FAIL when
a check fails, 0 with PASS. About two minutes on an H200.

    python benchmarks/gpu_check.py [--margin-mib 32] [--prefill-tokens 8192] [--skip-throughput]
        [--model shapes/llama3.1-8b --load-format dummy] [--kv-blocks N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.report import fmt_s, markdown
from harness.workload import mixed_prompts, quiet_logs, stoic_mixed, tag_prompts, wait_idle

import stoic
from stoic.errors import ExecutorFailed, StoicError

GREEDY = stoic.SamplingParams(max_tokens=16, temperature=0)
PROMPT = "The capital of France is"


async def served(engine: stoic.Engine) -> str:
    """The greedy answer to :data:`PROMPT`, or what failed it (a check then fails, not the run)."""
    try:
        return (await engine.complete(PROMPT, GREEDY)).text
    except StoicError as exc:
        return f"<{type(exc).__name__}: {exc}>"


def cuda_missing() -> str | None:
    """Why no CUDA device can be checked, or None when one is visible."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return None
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (
        f"gpu_check: no CUDA device visible (torch {torch.__version__}, {build}, "
        f"CUDA_VISIBLE_DEVICES={'unset' if hidden is None else repr(hidden)}): nothing checked"
    )


async def check_oom(args: argparse.Namespace) -> tuple[bool, str]:
    """Part 1; ``(passed, what happened)``."""
    import torch

    config = stoic.EngineConfig(
        model=args.model,
        load_format=args.load_format,
        device="cuda",
        executor="thread",  # the allocator capped here is the forward's own
        recovery="fail",
        num_kv_blocks=args.kv_blocks,
        max_num_batched_tokens=args.prefill_tokens,
    )
    async with stoic.Engine.start(config) as engine:
        before = (await engine.complete(PROMPT, GREEDY)).text
        budget = engine.stats().token_budget
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # what is cached, not in use, must not count as room
        in_use = torch.cuda.memory_allocated(device)
        limit = in_use + args.margin_mib * 2**20
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(limit / total, device)
        print(f"allocator capped at {limit / 2**20:.0f} MiB ({in_use / 2**20:.0f} MiB in use)")
        tokens = min(args.prefill_tokens, engine.max_model_len - 1)
        long_prompt = [100 + i % 20000 for i in range(tokens)]
        try:
            try:
                await engine.complete(long_prompt, stoic.SamplingParams(max_tokens=1))
                return False, f"a {tokens}-token prefill under the cap raised nothing"
            except ExecutorFailed as exc:
                error = exc
            for _ in range(1200):  # the recovery (the budget's halving) within 60 s
                if engine.stats().restarts >= 1:
                    break
                await asyncio.sleep(0.05)
            after_budget = engine.stats().token_budget
            text = await served(engine)
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
        stats = await wait_idle(engine)
        real = "out of memory" in error.message and "injected" not in error.message
        passed = (
            error.kind == "oom"
            and real
            and not error.retryable
            and after_budget == budget // 2
            and text == before
            and stats.faults_injected == 0
        )
        first_line = error.message.splitlines()[0][:100]
        return passed, (
            f"kind={error.kind} retryable={error.retryable} budget {budget} -> {after_budget} "
            f"served again={text == before} ({first_line})"
        )


def nvidia_smi_used() -> tuple[float, float]:
    """The first GPU's used and total memory in MiB, as ``nvidia-smi`` reports them."""
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.splitlines()[0]
    used, total = (float(x) for x in out.split(","))
    return used, total


def check_sizing(engine: stoic.Engine, args: argparse.Namespace) -> tuple[bool, str]:
    """Part 3 on a serving engine; ``(passed, what happened)``."""
    sizing = engine.kv_sizing
    used, total = nvidia_smi_used()
    limit = total * engine.config.gpu_memory_utilization + args.context_mib
    passed = (sizing.profiled or args.kv_blocks is not None) and used <= limit
    return passed, (
        f"profiled={sizing.profiled} kv_blocks={sizing.num_blocks} "
        f"nvidia-smi used {used:.0f} of {total:.0f} MiB (limit {limit:.0f})"
    )


async def check_device_assert(args: argparse.Namespace) -> tuple[bool, str, tuple[bool, str]]:
    """Part 2, and part 3 on its engine (the default command's process executor);
    ``(passed, what happened, sizing)``."""
    config = stoic.EngineConfig(
        model=args.model,
        load_format=args.load_format,
        device="cuda",
        executor="process",
        enable_fault_injection=True,
        num_kv_blocks=args.kv_blocks,
    )
    async with stoic.Engine.start(config) as engine:
        before = (await engine.complete(PROMPT, GREEDY)).text
        sizing = check_sizing(engine, args)
        pid = engine.stats().executor_pid
        await engine.inject_fault(stoic.FaultSpec(kind="device_assert", after_steps=1))
        try:
            await engine.complete("Hello", GREEDY)
            return False, "the out-of-range index raised nothing", sizing
        except ExecutorFailed as exc:
            error = exc
        started = time.perf_counter()
        text = await served(engine)
        seconds = time.perf_counter() - started
        new_pid = engine.stats().executor_pid
        passed = (
            error.kind == "fatal"
            and "device-side assert" in error.message
            and new_pid not in (None, pid)
            and text == before
        )
        return (
            passed,
            f"kind={error.kind} new worker={new_pid != pid} served again={text == before} "
            f"after {seconds:.1f} s",
            sizing,
        )


async def throughput(
    model: str, name: str, kv_blocks: int | None, load_format: str = "auto"
) -> list[tuple[str, ...]]:
    """Rows at concurrency 1 (8 requests) and 32 (64 requests), 64 tokens each."""
    rows: list[tuple[str, ...]] = []
    config = stoic.EngineConfig(
        model=model,
        load_format=load_format,  # type: ignore[arg-type]
        device="cuda",
        executor="process",
        num_kv_blocks=kv_blocks,
    )
    async with stoic.Engine.start(config) as engine:
        await engine.complete(PROMPT, GREEDY)  # warm-up
        for concurrency, requests in ((1, 8), (32, 64)):
            prompts = tag_prompts(mixed_prompts(requests, seed=concurrency), f"[{name}] ")
            row = await stoic_mixed(engine, prompts, concurrency, 64)
            rows.append((name, str(concurrency), f"{row.tokens_per_s:.0f}", fmt_s(row.ttft_p50)))
    return rows


async def run(args: argparse.Namespace) -> int:
    quiet_logs()
    import torch

    checks = [("real CUDA OOM in the forward", await check_oom(args))]
    torch.cuda.empty_cache()  # this process's engine is gone: its memory is the workers' now
    passed, outcome, sizing = await check_device_assert(args)
    checks += [("device-side assert", (passed, outcome)), ("KV cache sizing", sizing)]
    print(markdown(("check", "pass", "outcome"), [(n, str(p), o) for n, (p, o) in checks]))
    if not args.skip_throughput:
        from stoic.model.testing import build_tiny_model

        tiny = build_tiny_model(Path(tempfile.mkdtemp(prefix="stoic-gpu-check-")) / "tiny")
        rows = await throughput(str(tiny), "tiny", args.kv_blocks)
        rows += await throughput(args.model, args.model, args.kv_blocks, args.load_format)
        print(markdown(("model", "concurrency", "tokens/s", "TTFT p50 (s)"), rows, align="lrrr"))
    passed = all(p for _n, (p, _o) in checks)
    print("PASS" if passed else "FAIL")
    return 0 if passed else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--margin-mib", type=int, default=32, help="the cap above what is in use")
    parser.add_argument("--prefill-tokens", type=int, default=8192, help="the step budget")
    parser.add_argument(
        "--kv-blocks", type=int, default=None, help="KV blocks of each engine (default: sized)"
    )
    parser.add_argument("--model", default="default", help="the model (default %(default)s)")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    parser.add_argument(
        "--context-mib", type=float, default=1024.0, help="room for the CUDA contexts"
    )
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args()
    missing = cuda_missing()
    if missing is not None:
        print(missing, file=sys.stderr)
        return 1
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
