"""The run: servers side by side over HTTP, the profiled pass, then the Python API; every
measurement guarded against other processes' CPU use. Also ``--url`` (one endpoint only)."""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import harness.workload as eb
from harness.cpu import CpuWatch, all_jiffies, jiffies, sched_delta, schedstat, top_processes
from harness.load import RequestRecord, Result, run_load
from harness.report import fmt_pct, fmt_s
from harness.servers import BIN, System, llama_system, open_log, transformers_system

from . import CONCURRENCY, MAX_OTHER_CPU, QUIET_CPU, SCRIPT
from .profile import Profile, parse_profile
from .tables import find, results_table
from .timed import stoic_system

T = TypeVar("T")


@dataclass
class Settings:
    quick: bool
    requests: dict[int, int]
    api_requests: int
    max_tokens: int
    budget: float
    docs: Path
    work: Path
    llama_server: str | None
    profile: bool
    rate: int
    retries: int
    wait_quiet: float


class Bench:
    def __init__(self, settings: Settings) -> None:
        self.s = settings
        self.results: list[Result] = []
        self.api_rows: list[eb.Row] = []
        self.api_other: list[float | None] = []
        self.disturbed: list[str] = []
        self.dtype_rows: list[tuple[str, int, float]] = []
        # torch loop: tokens/s with each attention implementation (of the kept runs)
        self.variants: list[tuple[str, dict[str, Any], dict[str, float]]] = []
        self.pending_variants: dict[int, tuple[str, dict[str, Any], dict[str, float]]] = {}
        self.profile: Profile | None = None
        self.profiled_pass: Result | None = None
        self.notes: list[str] = []
        self.passes = 0
        #: llama.cpp's command line and ``--version`` output, when it was measured
        self.llama: tuple[list[str], str] | None = None
        self.started = time.time()
        self.load_before = Path("/proc/loadavg").read_text().split()[:3]
        self.load_after: list[str] = []
        self.model_dir = Path()
        self.prompt_len = 0
        self.prompt_range = (0, 0)

    def log(self, text: str) -> None:
        print(f"[{time.time() - self.started:7.1f}s] {text}", flush=True)

    async def guarded(
        self, label: str, run: Callable[[], Awaitable[T]], pids: Sequence[int]
    ) -> tuple[T, float | None]:
        """Run one measurement; when other processes took more than ``MAX_OTHER_CPU`` of the
        machine meanwhile, wait for quiet and repeat it, keeping the least disturbed run."""
        best: tuple[T, float | None] | None = None
        for attempt in range(1 + self.s.retries):
            if attempt:
                await self.wait_quiet(pids, 180.0)
            watch = CpuWatch(pids)
            value = await run()
            other = watch.stop()
            if best is None or (other or 0.0) < (best[1] or 0.0):
                best = (value, other)
            if other is None or other <= MAX_OTHER_CPU:
                break
            self.log(f"{label}: other processes used {other:.0%} of the CPU")
            self.disturbed.append(f"{label} ({other:.0%})")
        assert best is not None
        kept = self.pending_variants.pop(id(best[0]), None)
        if kept is not None:
            self.variants.append(kept)
        self.pending_variants.clear()
        return best

    async def wait_quiet(self, pids: Sequence[int], limit_s: float) -> bool:
        """Wait (at most ``limit_s``) for a 5 s window where others use < QUIET_CPU."""
        deadline = time.monotonic() + limit_s
        while True:
            watch = CpuWatch(pids)
            before = all_jiffies()
            await asyncio.sleep(5.0)
            other = watch.stop()
            if other is None or other < QUIET_CPU:
                return True
            busiest = top_processes(before, all_jiffies(), {os.getpid(), *pids})
            if time.monotonic() > deadline:
                self.log(f"machine still busy ({other:.0%} used by others: {busiest}); going on")
                return False
            self.log(f"waiting for quiet: others use {other:.0%} of the CPU ({busiest})")

    def tagged(self, prompts: Sequence[Any]) -> list[Any]:
        """The prompts with a new tag for this pass (see :func:`harness.workload.tag_prompts`)."""
        self.passes += 1
        return eb.tag_prompts(prompts, f"[pass {self.passes}] ")

    async def measure(
        self, system: System, prompts: Sequence[Any], concurrency: int, pids: Sequence[int]
    ) -> Result:
        url = system.url + "/v1/chat/completions"
        pid = system.proc.pid if system.proc else 0

        async def run() -> tuple[list[RequestRecord], float, Any, Any]:
            # tagged per attempt: a repeat after a noisy run must not find its prompts cached
            bodies = [system.body(p, self.s.max_tokens) for p in self.tagged(prompts)]
            await system.step_stats()  # reset
            before = schedstat(pid)
            records, seconds = await run_load(url, bodies, concurrency, budget=self.s.budget)
            sched = sched_delta(before, schedstat(pid), seconds)
            return records, seconds, sched, await system.step_stats()

        (records, seconds, sched, steps), other = await self.guarded(
            f"{system.name} c={concurrency}", run, pids
        )
        result = Result(system.name, concurrency, len(prompts), records, seconds, other)
        result.sched = sched
        result.steps = steps
        if len(records) < len(prompts):
            result.note = f"stopped after the {self.s.budget:.0f} s budget"
            self.notes.append(f"{system.name} c={concurrency}: {result.note}.")
        self.log(
            f"{system.name:28s} c={concurrency:<3d} {result.tokens_per_s:7.1f} tok/s  "
            f"TTFT p50 {fmt_s(result.ttft(0.5))}  errors {result.errors}  "
            f"({len(records)}/{len(prompts)} requests, {seconds:.1f} s, other CPU "
            f"{fmt_pct(result.other_cpu)})"
            + (
                ""
                if result.execute_share is None
                else f"; executor in steps {result.execute_share:.1%} of wall"
            )
        )
        return result

    async def warm(self, system: System) -> Result:
        prompts = eb.mixed_prompts(8, seed=99)
        bodies = [system.body(p, 8) for p in prompts]
        records, seconds = await run_load(
            system.url + "/v1/chat/completions", bodies, 8, budget=120.0
        )
        return Result(system.name, 8, len(bodies), records, seconds)

    async def start_transformers(self, model_dir: Path) -> System:
        tserve = transformers_system(self.s.work, model_dir, self.s.max_tokens, cb=True)
        try:
            await tserve.start()
            warm = await self.warm(tserve)
            if warm.errors == 0:
                return tserve
            reason = warm.summary()["first_error"]
        except RuntimeError as exc:
            reason = str(exc).splitlines()[0]
        tserve.stop()
        self.notes.append(
            f"transformers serve --continuous-batching failed on CPU ({reason}); it was measured "
            "without continuous batching."
        )
        self.log(self.notes[-1])
        tserve = transformers_system(self.s.work, model_dir, self.s.max_tokens, cb=False)
        await tserve.start()
        await self.warm(tserve)
        return tserve

    async def http_phase(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        from stoic.model import default_gguf_path

        systems: list[System] = []
        try:
            stoic_srv = stoic_system(self.s.work)
            self.log(f"starting {stoic_srv.name}: {' '.join(stoic_srv.argv)}")
            await stoic_srv.start()
            await self.warm(stoic_srv)
            systems.append(stoic_srv)
            self.log("starting transformers serve")
            try:
                tserve = await self.start_transformers(model_dir)
            except RuntimeError as exc:
                self.notes.append(f"transformers serve could not start: {exc}")
                self.log(self.notes[-1])
            else:
                self.log(f"{tserve.name}: {' '.join(tserve.argv)}")
                systems.append(tserve)
            if self.s.llama_server:
                llama = llama_system(
                    self.s.work, self.s.llama_server, default_gguf_path(), max(CONCURRENCY)
                )
                self.log(f"starting {llama.name}: {' '.join(llama.argv)}")
                proc = await asyncio.create_subprocess_exec(
                    self.s.llama_server,
                    "--version",
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.STDOUT,
                )
                out, _ = await proc.communicate()
                self.llama = (llama.argv, " ".join(out.decode(errors="replace").split()))
                await llama.start()
                await self.warm(llama)
                systems.append(llama)
            pids = [s.proc.pid for s in systems if s.proc is not None]

            prompts_all = eb.mixed_prompts(max(self.s.requests.values()))
            tok = AutoTokenizer.from_pretrained(str(model_dir))
            lengths = [
                len(
                    tok.encode(
                        tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True),
                        add_special_tokens=False,
                    )
                )
                for p in eb.tag_prompts(prompts_all, "[pass 10] ")
            ]
            self.prompt_len = round(statistics.mean(lengths))
            self.prompt_range = (min(lengths), max(lengths))
            self.log(f"prompt tokens: mean {self.prompt_len}, range {self.prompt_range}")

            order: list[Any] = [*systems, "ceiling"]
            for i, c in enumerate(CONCURRENCY):
                prompts = prompts_all[: self.s.requests[c]]
                rotated = order[i % len(order) :] + order[: i % len(order)]
                for system in rotated:
                    if system == "ceiling":
                        spec = {
                            "model": str(model_dir),
                            "dtype": "bfloat16",
                            "batch": c,
                            "prompt_len": self.prompt_len,
                            "new_tokens": self.s.max_tokens,
                        }
                        row, other = await self.guarded(
                            f"ceiling c={c}",
                            functools.partial(self.worker, "loop", spec),
                            pids,
                        )
                        res = Result("torch decode loop (ceiling)", c, c, [], row.seconds, other)
                        res.records = [
                            RequestRecord(True, 0.0, row.seconds, None, row.output_tokens // c)
                            for _ in range(c)
                        ]
                        self.log(f"{res.system:28s} c={c:<3d} {res.tokens_per_s:7.1f} tok/s")
                        self.results.append(res)
                    else:
                        self.results.append(await self.measure(system, prompts, c, pids))
                if c == max(CONCURRENCY) and self.s.profile:
                    await self.profile_pass(stoic_srv, prompts, c, pids)
        finally:
            for system in systems:
                system.stop()
            for note in (s.note for s in systems if s.note):
                self.notes.append(note)

    async def profile_pass(
        self, system: System, prompts: Sequence[Any], c: int, pids: Sequence[int]
    ) -> None:
        """A second c=32 pass; py-spy samples its steady middle (from 2 s in to ~2 s before the
        end the measured pass took), with the step timer and the kernel read over the same
        window, so the three views can be compared."""
        pyspy = shutil.which("py-spy", path=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
        if pyspy is None or system.proc is None:
            self.notes.append("py-spy not found: no engine-overhead profile (pip install py-spy).")
            return
        measured = find(self.results, "stoic serve", c)
        window = max(2, int((measured.seconds if measured else 10.0) - 4.0))
        out = self.s.work / "stoic-c32.pyspy.txt"
        argv = [pyspy, "record", "--threads", "--idle", "--nonblocking", "-r", str(self.s.rate)]
        argv += ["-d", str(window), "-f", "raw", "-p", str(system.proc.pid), "-o", str(out)]
        bodies = [system.body(p, self.s.max_tokens) for p in self.tagged(prompts)]
        url = system.url + "/v1/chat/completions"
        pid = system.proc.pid
        watch = CpuWatch(pids)
        load = asyncio.create_task(run_load(url, bodies, c, budget=self.s.budget))
        await asyncio.sleep(2.0)
        self.log(f"profiling for {window} s: {' '.join(argv)}")
        await system.step_stats()  # reset: the window starts
        sched0, me0 = schedstat(pid), jiffies(os.getpid())
        kids0 = jiffies(os.getpid(), children=True) - me0
        started = time.perf_counter()
        err = open_log(self.s.work / "py-spy.log")
        try:
            spy = await asyncio.create_subprocess_exec(*argv, stdout=err, stderr=err)
            try:
                await asyncio.wait_for(spy.wait(), window + 60)
            except TimeoutError:
                spy.kill()
                await spy.wait()
        finally:
            err.close()
        steps = await system.step_stats()
        wall = time.perf_counter() - started
        tick = os.sysconf("SC_CLK_TCK")
        me1 = jiffies(os.getpid())
        spy_cpu = (jiffies(os.getpid(), children=True) - me1 - kids0) / tick / wall  # reaped
        client_cpu = (me1 - me0) / tick / wall
        sched = sched_delta(sched0, schedstat(pid), wall)
        records, seconds = await load
        result = Result("stoic serve (under py-spy)", c, len(prompts), records, seconds)
        result.other_cpu = watch.stop()
        result.sched, result.steps, result.steps_wall = sched, steps, wall
        self.profiled_pass = result
        self.log(
            f"profiled pass: {result.tokens_per_s:.1f} tok/s; window {wall:.1f} s, executor in "
            f"steps {fmt_pct(result.execute_share)} of it"
        )
        if not out.exists():
            self.notes.append(f"py-spy wrote no profile; see {self.s.work / 'py-spy.log'}")
            return
        command = (
            f"py-spy record --threads --idle --nonblocking -r {self.s.rate} -d {window} -f raw "
            f"-p <stoic serve pid> -o stoic-c32.pyspy.txt"
        )
        self.profile = parse_profile(out, wall, self.s.rate, command)
        self.profile.profiler_cpu = spy_cpu
        self.profile.client_cpu = client_cpu
        self.log(
            f"py-spy: executor outside forward+sampling {self.profile.overhead:.1%} of samples; "
            f"raw profile: {out}"
        )

    async def worker(self, kind: str, spec: dict[str, Any]) -> eb.Row:
        """One in-process measurement in a fresh Python process (see
        :func:`serving.worker.worker_main`)."""
        argv = [sys.executable, str(SCRIPT), "--worker", kind]
        argv += ["--spec", json.dumps(spec)]
        err = open_log(self.s.work / f"worker-{kind}.log")
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdout=asyncio.subprocess.PIPE, stderr=err
            )
            try:
                out, _ = await asyncio.wait_for(proc.communicate(), 900)
            except TimeoutError:
                proc.kill()
                await proc.wait()
                raise
        finally:
            err.close()
        for line in out.decode().splitlines():
            if line.startswith("RESULT "):
                data = json.loads(line[len("RESULT ") :])
                variants = data.pop("variants", {})
                row = eb.Row(**data)
                if variants:
                    self.pending_variants[id(row)] = (kind, spec, variants)
                return row
        raise RuntimeError(f"worker {kind} failed ({proc.returncode}); see {err.name}")

    async def api_phase(self, model_dir: Path) -> None:
        base = {"model": str(model_dir), "max_tokens": self.s.max_tokens}
        c1 = {**base, "n": self.s.api_requests, "dtype": "bfloat16"}

        async def api(label: str, kind: str, spec: dict[str, Any]) -> eb.Row:
            row, other = await self.guarded(label, lambda: self.worker(kind, spec), [])
            self.api_rows.append(row)
            self.api_other.append(other)
            self.log(f"{label}: {row.tokens_per_s:.1f} tok/s (other CPU {fmt_pct(other)})")
            return row

        steady = {**base, "dtype": "bfloat16", "batch": 32, "prompt_len": 128, "new_tokens": 128}
        await api("API c=1 stoic", "engine_c1", c1)
        await api("API c=1 transformers generate", "generate", c1)
        await api("steady decode torch loop", "loop", steady)
        await api("steady decode stoic", "engine_steady", base)
        # why bfloat16: the bare loop in both dtypes, batch 1 and 32
        for batch in (1, 32):
            for dtype in ("bfloat16", "float32"):
                spec = {**base, "dtype": dtype, "batch": batch, "prompt_len": 128, "new_tokens": 32}
                r, _ = await self.guarded(
                    f"dtype check {dtype} batch {batch}",
                    functools.partial(self.worker, "loop", spec),
                    [],
                )
                self.dtype_rows.append((dtype, batch, r.tokens_per_s))
                self.log(f"dtype check {dtype} batch {batch}: {r.tokens_per_s:.1f} tok/s")

    async def run(self) -> None:
        from stoic.model.testing import dequantized_model_dir

        model_dir = dequantized_model_dir()
        self.model_dir = model_dir
        if self.s.wait_quiet > 0:
            await self.wait_quiet([], self.s.wait_quiet)
        self.log(f"model directory: {model_dir}; work directory: {self.s.work}")
        if self.s.llama_server is None:
            self.notes.append(
                "llama.cpp: no `llama-server` on PATH and no --llama-server given: skipped."
            )
        await self.http_phase(model_dir)
        await self.api_phase(model_dir)


async def drive_endpoint(args: argparse.Namespace) -> None:
    """``--url``: drive one endpoint at each concurrency and print the table."""
    extra: dict[str, Any] = json.loads(args.extra_body) if args.extra_body else {}
    system = System("endpoint", [], 0, args.model, extra, Path(os.devnull))
    results = []
    for c in CONCURRENCY:
        n = (args.requests or {1: 16, 8: 64, 32: 128}[c]) if not args.quick else max(4, c)
        prompts = eb.tag_prompts(eb.mixed_prompts(n), f"[c={c}] ")
        bodies = [system.body(p, args.max_tokens) for p in prompts]
        records, seconds = await run_load(
            args.url.rstrip("/") + "/v1/chat/completions", bodies, c, budget=args.budget
        )
        results.append(Result(args.url, c, n, records, seconds))
    print(results_table(results))
