"""The device check: what stoic must do on an NVIDIA GPU, in one command of a few minutes, on a
machine with torch but no network and no weight file (a GPU lent for 15 minutes).

It starts ``stoic serve`` as a user would (the default command: the process executor, the KV
cache sized from the memory left) on ``--model`` (default ``shapes/llama3.1-8b`` with
``--load-format dummy``: the 8B shape, random weights made on the GPU, no file), then checks in
turn, each part unable to pass by accident:

1. **ready**: ``GET /health`` answers 200 (the seconds it took);
2. **sizing**: ``/v1/models``' ``memory`` says the cache was profiled, and the used memory that
   ``nvidia-smi`` reports is within ``--gpu-memory-utilization`` of the total (plus
   ``--context-mib`` for the CUDA contexts);
3. **served**: a greedy completion of 16 tokens (EOS ignored);
4. **oom**: another process takes the device's free memory but ``--margin-mib``, and a prompt of
   ``--oom-tokens`` tokens must fail with torch's own "CUDA out of memory" (HTTP 500, code
   ``executor_oom``: a real one, fault injection never armed), ``stoic_scheduler_token_budget``
   must halve, and once the other process ends the same greedy completion is served again;
5. **kill -9** of the worker process: a new worker (a new pid on ``/health``) serves the same
   greedy text (the seconds it took);
6. **device assert**: an injected out-of-range index on the GPU (a real device-side assert,
   ``POST /admin/faults``) fails its request with code ``executor_fatal`` naming the assert, a
   new worker replaces the poisoned one and serves the same greedy text;
7. **throughput** at ``--levels`` clients (default 1, 32, 128; mixed chat prompts, 64 tokens
   each, streamed): tokens/s and TTFT p50; a level passes when no request failed.

It prints a table, writes every figure to ``--json`` (default ``gpu_check.json``, or
``$OUT/gpu_check.json`` where ``OUT`` is set) and exits 0 (PASS) or 1 (FAIL, any miss). Without a
visible CUDA device it exits 1 with one line (nothing checked). ``--rehearse`` runs it on the
CPU instead (what the test suite does: parts 2's nvidia-smi, 4 and 6 need CUDA and are reported
skipped; the rest run for real).

On the device (see ``benchmarks/gpu_travel.py`` for what travels and the exact command)::

    make gpu-check            # = python3 benchmarks/gpu_check.py, wheels in .whl installed first
    python3 benchmarks/gpu_check.py [--model shapes/qwen2.5-1.5b] [--levels 1 32 128]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.load import run_load
from harness.report import fmt_s, markdown, quantile
from harness.servers import GREEDY, System, free_port
from harness.workload import mixed_prompts

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The capital of France is"
#: a process that holds the device's free memory but a margin until its stdin closes
HOG = """
import sys, torch
free, total = torch.cuda.mem_get_info()
held = torch.empty(max(0, free - int(sys.argv[1]) * 2**20), dtype=torch.uint8, device="cuda")
print(f"held {held.numel() / 2**20:.0f} MiB of {free / 2**20:.0f} MiB free", flush=True)
sys.stdin.read()
"""


@dataclass
class Check:
    name: str
    #: True / False; None: skipped (it needs CUDA)
    passed: bool | None
    detail: str
    seconds: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)


def cuda_missing() -> str | None:
    """Why no CUDA device can be checked, or None when one is visible."""
    try:
        import torch
    except ImportError as exc:
        return f"gpu_check: torch cannot be imported ({exc}): nothing checked"
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return None
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (
        f"gpu_check: no CUDA device visible (torch {torch.__version__}, {build}, "
        f"CUDA_VISIBLE_DEVICES={'unset' if hidden is None else repr(hidden)}): nothing checked"
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


class Server:
    """``stoic serve`` from this source tree (``python -m stoic``: the device has no install),
    and the requests the checks make."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        port = free_port()
        flags = ["--model", args.model, "--load-format", args.load_format]
        flags += ["--device", "cpu" if args.rehearse else "cuda", "--enable-fault-injection"]
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        self.system = System(
            "stoic",
            [sys.executable, "-m", "stoic", "serve", "--port", str(port), *flags],
            port,
            "default",
            dict(GREEDY),
            work / "stoic.log",
            env={**os.environ, "PYTHONPATH": path},
        )
        self.url = self.system.url
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))

    async def text(self, path: str) -> str:
        async with self.session.get(self.url + path) as resp:
            return await resp.text()

    async def get(self, path: str) -> Any:
        return json.loads(await self.text(path))

    async def complete(self, prompt: str | list[int], max_tokens: int = 16) -> tuple[int, Any]:
        body = {"model": "default", "prompt": prompt, "max_tokens": max_tokens}
        body |= {"temperature": 0, "ignore_eos": True}
        async with self.session.post(self.url + "/v1/completions", json=body) as resp:
            return resp.status, json.loads(await resp.text())

    async def greedy(self) -> str:
        """The greedy completion of :data:`PROMPT`, or what failed it (a check then fails)."""
        status, body = await self.complete(PROMPT)
        if status != 200 or body["usage"]["completion_tokens"] != 16:
            return f"<HTTP {status}: {json.dumps(body)[:300]}>"
        return str(body["choices"][0]["text"])

    async def worker_pid(self) -> int | None:
        return (await self.get("/health")).get("executor", {}).get("pid")

    async def budget(self) -> float | None:
        for line in (await self.text("/metrics")).splitlines():
            if line.startswith("stoic_scheduler_token_budget "):
                return float(line.split()[1])
        return None

    async def replaced(self, old_pid: int | None, limit: float = 180.0) -> int | None:
        """The new worker's pid once ``/health`` is ok with one other than ``old_pid``."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, json.JSONDecodeError):
                health = await self.get("/health")
                pid = health.get("executor", {}).get("pid")
                if health.get("status") == "ok" and pid not in (None, old_pid):
                    return int(pid)
            await asyncio.sleep(0.25)
        return None

    def log_tail(self, lines: int = 40) -> str:
        text = self.system.log.read_text(errors="replace") if self.system.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


async def check_sizing(server: Server, args: argparse.Namespace) -> Check:
    memory = (await server.get("/v1/models"))["data"][0]["memory"]
    figures = {"memory": memory}
    if args.rehearse:
        return Check(
            "sizing",
            bool(memory["profiled"] and memory["kv_blocks"] > 0),
            f"profiled={memory['profiled']} kv_blocks={memory['kv_blocks']} "
            "(no nvidia-smi on a CPU)",
            figures=figures,
        )
    used, total = nvidia_smi_used()
    limit = total * args.gpu_memory_utilization + args.context_mib
    figures |= {"nvidia_smi_used_mib": used, "nvidia_smi_total_mib": total, "limit_mib": limit}
    return Check(
        "sizing",
        bool(memory["profiled"]) and used <= limit,
        f"profiled={memory['profiled']} kv_blocks={memory['kv_blocks']} "
        f"({memory['kv_cache_mib']:.0f} MiB) weights {memory.get('weights_mib')} MiB; "
        f"nvidia-smi used {used:.0f} of {total:.0f} MiB (limit {limit:.0f})",
        figures=figures,
    )


async def check_oom(server: Server, args: argparse.Namespace, reference: str) -> Check:
    if args.rehearse:
        return Check("oom", None, "skipped: needs CUDA")
    before = await server.budget()
    hog = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        HOG,
        str(args.margin_mib),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert hog.stdout is not None
        held = (await hog.stdout.readline()).decode().strip()
        status, body = await server.complete([100 + i % 20000 for i in range(args.oom_tokens)], 1)
        after = None
        for _ in range(120):  # the recovery halves the budget within a few seconds
            after = await server.budget()
            if after is not None and before is not None and after < before:
                break
            await asyncio.sleep(0.25)
    finally:
        assert hog.stdin is not None
        hog.stdin.close()
        await asyncio.wait_for(hog.wait(), 60)
    error = body.get("error", {}) if isinstance(body, dict) else {}
    message = str(error.get("message", ""))
    text = await server.greedy()
    real = "out of memory" in message.lower() and "injected" not in message
    passed = (
        status == 500
        and error.get("code") == "executor_oom"
        and real
        and before is not None
        and after == before // 2
        and text == reference
    )
    return Check(
        "oom",
        passed,
        f"{held}; HTTP {status} {error.get('code')} budget {before} -> {after}, served again="
        f"{text == reference} ({message.splitlines()[0][:100] if message else body})",
        figures={"status": status, "code": error.get("code"), "budget": [before, after]},
    )


async def check_kill(server: Server, reference: str) -> Check:
    pid = await server.worker_pid()
    if pid is None:
        return Check("kill -9", False, "no worker pid on /health")
    started = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    new = await server.replaced(pid)
    seconds = time.perf_counter() - started
    text = await server.greedy()
    return Check(
        "kill -9",
        new is not None and text == reference,
        f"worker {pid} killed; new worker {new} serving after {seconds:.1f} s, same text="
        f"{text == reference}",
        seconds,
    )


async def check_device_assert(server: Server, args: argparse.Namespace, reference: str) -> Check:
    if args.rehearse:
        return Check("device assert", None, "skipped: needs CUDA")
    pid = await server.worker_pid()
    fault = {"kind": "device_assert", "after_steps": 1}
    async with server.session.post(server.url + "/admin/faults", json=fault) as resp:
        armed = resp.status
    started = time.perf_counter()
    status, body = await server.complete("Hello")
    error = body.get("error", {}) if isinstance(body, dict) else {}
    new = await server.replaced(pid)
    seconds = time.perf_counter() - started
    text = await server.greedy()
    passed = (
        armed == 200
        and status == 500
        and error.get("code") == "executor_fatal"
        and "device-side assert" in str(error.get("message"))
        and new is not None
        and text == reference
    )
    return Check(
        "device assert",
        passed,
        f"armed {armed}; HTTP {status} {error.get('code')}; new worker {new} after "
        f"{seconds:.1f} s, same text={text == reference}",
        seconds,
    )


async def throughput(server: Server, args: argparse.Namespace) -> list[Check]:
    rows = []
    for level in args.levels:
        prompts = mixed_prompts(max(8, 2 * level), seed=level)
        bodies = [server.system.body(p, args.tokens) for p in prompts]
        records, seconds = await run_load(
            server.url + "/v1/chat/completions", bodies, level, budget=args.level_budget
        )
        ok = [r for r in records if r.ok]
        tokens = sum(r.output_tokens for r in ok)
        ttft = quantile([r.ttft for r in ok if r.ttft is not None], 0.5)
        failed = [r.error for r in records if not r.ok]
        rows.append(
            Check(
                f"throughput x{level}",
                bool(ok) and not failed,
                f"{tokens / seconds:.1f} tokens/s, TTFT p50 {fmt_s(ttft)} s, "
                f"{len(ok)}/{len(records)} ok" + (f" ({failed[0]})" if failed else ""),
                seconds,
                {
                    "clients": level,
                    "tokens_per_s": tokens / seconds,
                    "ttft_p50_s": ttft,
                    "requests": len(records),
                    "failed": len(failed),
                },
            )
        )
    return rows


async def run(args: argparse.Namespace) -> list[Check]:
    work = Path(tempfile.mkdtemp(prefix="stoic-gpu-check-"))
    server = Server(args, work)
    checks: list[Check] = []
    started = time.perf_counter()
    try:
        await server.system.start(args.ready_limit)
    except RuntimeError as exc:
        return [Check("ready", False, str(exc).splitlines()[0], time.perf_counter() - started)]
    try:
        checks.append(Check("ready", True, "GET /health 200", time.perf_counter() - started))
        checks.append(await check_sizing(server, args))
        reference = await server.greedy()
        served = not reference.startswith("<HTTP")
        checks.append(Check("served", served, f"16 greedy tokens: {reference[:60]!r}"))
        checks.append(await check_oom(server, args, reference))
        checks.append(await check_kill(server, reference))
        checks.append(await check_device_assert(server, args, reference))
        checks += await throughput(server, args)
    except Exception as exc:  # a broken check fails the run with what it was doing
        checks.append(Check("unexpected error", False, f"{type(exc).__name__}: {exc}"))
    finally:
        if any(c.passed is False for c in checks):
            checks[-1].figures["server_log_tail"] = server.log_tail()
        await server.session.close()
        server.system.stop()
    return checks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "shapes" / "llama3.1-8b"))
    parser.add_argument("--load-format", default="dummy", choices=["auto", "dummy"])
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--tokens", type=int, default=64, help="output tokens a request")
    parser.add_argument("--level-budget", type=float, default=60.0, help="seconds a level")
    parser.add_argument("--ready-limit", type=float, default=300.0)
    parser.add_argument("--margin-mib", type=int, default=32, help="what the hog leaves free")
    parser.add_argument("--oom-tokens", type=int, default=4096, help="the OOM prompt's tokens")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--context-mib", type=float, default=1024.0, help="CUDA contexts' room")
    parser.add_argument("--json", type=Path, default=None, help="where the results go")
    parser.add_argument("--rehearse", action="store_true", help="on the CPU (no CUDA parts)")
    args = parser.parse_args()
    if not args.rehearse and (missing := cuda_missing()) is not None:
        print(missing, file=sys.stderr)
        return 1
    began = time.perf_counter()
    checks = asyncio.run(run(args))
    passed = all(c.passed is not False for c in checks)
    print(
        markdown(
            ("check", "pass", "outcome"),
            [
                (c.name, {True: "yes", False: "NO", None: "skipped"}[c.passed], c.detail)
                for c in checks
            ],
        )
    )
    out = args.json or Path(os.environ.get("OUT", ".")) / "gpu_check.json"
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    results = {
        "passed": passed,
        "seconds": round(time.perf_counter() - began, 1),
        "device": device,
        "torch": torch.__version__,
        "model": args.model,
        "load_format": args.load_format,
        "rehearse": args.rehearse,
        "checks": [asdict(c) for c in checks],
    }
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"{'PASS' if passed else 'FAIL'} ({results['seconds']} s; results in {out})")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
