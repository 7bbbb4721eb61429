"""``--timed-serve``: ``stoic serve`` with ``ModelRunner.execute`` timed, the step accounting of
the serving benchmark's engine-overhead section."""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.report import quantile
from harness.servers import (
    BLOCK_SIZE,
    GREEDY,
    MAX_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    NUM_KV_BLOCKS,
    System,
    free_port,
)

from . import SCRIPT


def stoic_system(work: Path) -> System:
    """``stoic serve`` through :func:`timed_serve`: the same ``stoic.cli.main``, with the time
    the executor spends in ``ModelRunner.execute`` recorded (SIGUSR1 dumps and resets it)."""
    port = free_port()
    argv = [sys.executable, str(SCRIPT), "--timed-serve", str(work / "stoic-steps.jsonl")]
    # the thread executor: the timer wraps ModelRunner.execute in this process
    argv += ["serve", "--model", "default", "--dtype", "bfloat16", "--executor", "thread"]
    argv += ["--port", str(port), "--log-level", "warning", "--block-size", str(BLOCK_SIZE)]
    argv += ["--num-kv-blocks", str(NUM_KV_BLOCKS)]
    argv += ["--max-num-batched-tokens", str(MAX_BATCHED_TOKENS)]
    argv += ["--max-num-seqs", str(MAX_NUM_SEQS)]
    system = System("stoic serve", argv, port, "default", dict(GREEDY), work / "stoic.log")
    system.steps_file = work / "stoic-steps.jsonl"
    return system


def timed_serve(stats_path: str, argv: Sequence[str]) -> int:
    """Run ``stoic serve`` (``stoic.cli.main``) timing every ``ModelRunner.execute`` call.

    On SIGUSR1 one JSON line goes to ``stats_path``: steps, seconds inside ``execute`` and the
    gaps between consecutive steps since the previous SIGUSR1; then the counters reset.
    """
    from stoic.cli import main as stoic_main
    from stoic.worker import _runner

    original = _runner.ModelRunner.execute
    fresh: dict[str, Any] = {"busy": 0.0, "steps": 0, "last": None, "gaps": []}
    stats: dict[str, Any] = {**fresh, "gaps": [], "since": time.perf_counter(), "current": None}

    def execute(self: Any, batch: Any, cache: Any) -> Any:
        t0 = stats["current"] = time.perf_counter()
        try:
            return original(self, batch, cache)
        finally:
            t1 = time.perf_counter()
            stats["current"] = None
            if stats["last"] is not None:
                stats["gaps"].append(t0 - stats["last"])
            stats["busy"] += t1 - max(t0, stats["since"])  # a window may start mid-step
            stats["steps"] += 1
            stats["last"] = t1

    def dump(*_: Any) -> None:
        now = time.perf_counter()
        busy, current, gaps = stats["busy"], stats["current"], stats["gaps"]
        if current is not None:  # a step in flight: count its part inside the window
            busy += now - max(current, stats["since"])
        line = {
            "window_s": now - stats["since"],
            "steps": stats["steps"],
            "execute_s": busy,
            "gaps_s": sum(gaps),
            "gap_p50_ms": 1000 * (quantile(gaps, 0.5) or 0.0),
            "gap_p90_ms": 1000 * (quantile(gaps, 0.9) or 0.0),
            "gap_max_ms": 1000 * max(gaps, default=0.0),
        }
        with open(stats_path, "a") as out:
            out.write(json.dumps(line) + "\n")
        stats.update(fresh, gaps=[], since=now)

    _runner.ModelRunner.execute = execute  # type: ignore[method-assign]
    signal.signal(signal.SIGUSR1, dump)
    return stoic_main(list(argv))
