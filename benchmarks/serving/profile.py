"""py-spy profile of the stoic server: raw samples per thread, classified by what the executor
thread and the event loop run."""

from __future__ import annotations

import collections
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EXECUTOR_CATS = ("forward", "sampling", "step inputs", "hand-off / other", "idle")
LOOP_CATS = (
    "scheduling",
    "detokenising",
    "messaging (actors, streams)",
    "HTTP (aiohttp, stoic.http, JSON)",
    "logging / metrics",
    "asyncio loop",
    "other",
    "idle",
)
IDLE_LEAVES = (
    "EpollSelector.select",
    "Condition.wait",
    "Event.wait",
    "StepWorker._loop",  # its only C call is the blocking queue.get()
    "Thread.join",
    "_worker",
)


def _frame_key(frame: str) -> str:
    return re.sub(r":\d+\)$", ")", frame)


def _func(frame: str) -> str:
    return frame.split(" (", 1)[0]


def _file(frame: str) -> str:
    return frame.rpartition(" (")[2].rstrip(")").rsplit(":", 1)[0]


def classify_executor(frames: Sequence[str]) -> str:
    funcs = [_func(f) for f in frames]
    if "ModelRunner.execute" in funcs:
        files = [_file(f) for f in frames]
        if "build_inputs" in funcs or "PagedKVCache.zero_rows" in funcs:
            return "step inputs"
        if any(
            fn == "sample" and fl.endswith("_sampling.py")
            for fn, fl in zip(funcs, files, strict=True)
        ):
            return "sampling"
        return "forward"
    if funcs and funcs[-1].endswith(IDLE_LEAVES):
        return "idle"
    return "hand-off / other"


def _loop_category(frame: str) -> str | None:
    fn, fl = _func(frame), _file(frame)
    if (
        "detokeni" in fn
        or fn.endswith(("_token_text", "_apply_stop_strings"))
        or fl.startswith("tokenizers/")
        or "tokenization_utils" in fl
    ):
        return "detokenising"
    if fl.startswith(("stoic/http/", "aiohttp/", "json/", "multidict/", "yarl/", "pydantic/")):
        return "HTTP (aiohttp, stoic.http, JSON)"
    if fl.startswith(("structlog/", "logging/", "prometheus_client/")):
        return "logging / metrics"
    # the engine's actors (stoic/actors/) schedule, except their streams and messages; the
    # generic runtime (stoic/runtime/), the facade (stoic/engine/) and queues are messaging
    if fl.startswith("stoic/actors/") and not fl.endswith(("_stream.py", "_messages.py")):
        return "scheduling"
    if fl.startswith(
        ("stoic/actors/", "stoic/runtime/", "stoic/engine/", "asyncio/queues.py", "anyio/")
    ):
        return "messaging (actors, streams)"
    return None


def classify_loop(frames: Sequence[str]) -> str:
    if frames and _func(frames[-1]).endswith(IDLE_LEAVES):
        return "idle"
    for frame in reversed(frames):  # the innermost recognised frame decides
        cat = _loop_category(frame)
        if cat is not None:
            return cat
    if any(_file(f).startswith("asyncio/") for f in frames):
        return "asyncio loop"
    return "other"


@dataclass
class Profile:
    seconds: float
    rate: int
    command: str
    executor: dict[str, float]  # category -> share of wall
    loop: dict[str, float]
    samples: dict[str, int]  # thread -> samples
    top_executor: list[tuple[str, float]]  # self time
    top_loop_self: list[tuple[str, float]]
    top_loop_incl: list[tuple[str, float]]
    other_threads_busy: float
    tids: dict[int, str] = field(default_factory=dict)  # OS thread id -> Python thread name
    profiler_cpu: float = 0.0  # py-spy's own CPU, in cores
    client_cpu: float = 0.0  # the load generator's CPU, in cores

    @property
    def overhead(self) -> float:
        return 1.0 - self.executor.get("forward", 0.0) - self.executor.get("sampling", 0.0)


def parse_profile(path: Path, seconds: float, rate: int, command: str) -> Profile:
    threads: dict[str, collections.Counter[tuple[str, ...]]] = collections.defaultdict(
        collections.Counter
    )
    tids: dict[int, str] = {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        head = frames[0]
        name = head.split("): ", 1)[1] if "): " in head else head
        tid = re.match(r"thread \((\d+)\)", head)
        if tid:
            tids[int(tid.group(1))] = name
        threads[name][tuple(frames[1:])] += int(count)

    def shares(
        stacks: collections.Counter[tuple[str, ...]], classify: Any, cats: Sequence[str]
    ) -> dict[str, float]:
        total = sum(stacks.values()) or 1
        out = dict.fromkeys(cats, 0.0)
        for frames, n in stacks.items():
            out[classify(frames)] += n / total
        return out

    def top_self(
        stacks: collections.Counter[tuple[str, ...]], skip_idle: bool, n: int
    ) -> list[tuple[str, float]]:
        total = sum(stacks.values()) or 1
        c: collections.Counter[str] = collections.Counter()
        for frames, k in stacks.items():
            if frames and not (skip_idle and _func(frames[-1]).endswith(IDLE_LEAVES)):
                c[_frame_key(frames[-1])] += k
        return [(f, k / total) for f, k in c.most_common(n)]

    def top_incl(stacks: collections.Counter[tuple[str, ...]], n: int) -> list[tuple[str, float]]:
        total = sum(stacks.values()) or 1
        c: collections.Counter[str] = collections.Counter()
        for frames, k in stacks.items():
            if frames and _func(frames[-1]).endswith(IDLE_LEAVES):
                continue
            keys = {
                _frame_key(f)
                for f in frames
                if _file(f).startswith(("stoic/", "aiohttp/"))
                and not _file(f).startswith(("stoic/__main__.py", "stoic/cli/"))
            }
            for key in keys:
                c[key] += k
        return [(f, k / total) for f, k in c.most_common(n)]

    exe_name = next((t for t in threads if t.startswith("stoic-executor")), None)
    exe = threads.get(exe_name or "", collections.Counter())
    loop = threads.get("MainThread", collections.Counter())
    others = [s for t, s in threads.items() if t not in (exe_name, "MainThread")]
    busy_other = sum(
        k for s in others for f, k in s.items() if f and not _func(f[-1]).endswith(IDLE_LEAVES)
    )
    ticks = max(sum(loop.values()), 1)
    return Profile(
        seconds=seconds,
        rate=rate,
        command=command,
        executor=shares(exe, classify_executor, EXECUTOR_CATS),
        loop=shares(loop, classify_loop, LOOP_CATS),
        samples={t: sum(s.values()) for t, s in threads.items()},
        top_executor=top_self(exe, True, 10),
        top_loop_self=top_self(loop, True, 12),
        top_loop_incl=top_incl(loop, 14),
        other_threads_busy=busy_other / ticks,
        tids=tids,
    )
