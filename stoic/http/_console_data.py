"""What the operator's console shows, as one JSON-ready snapshot a second.

:class:`ConsoleSampler` samples the engine's statistics and the app's latency histograms once a
second for the app's life and keeps the last minutes as a chart series: output tokens per
second, and the time to first token and inter-token latency percentiles over a sliding minute
(computed from the Prometheus histograms' buckets, the way Grafana's ``histogram_quantile``
does, so the console and a dashboard over ``/metrics`` agree). :func:`snapshot` adds what is true
now: the executor, the sequences, the incidents (:meth:`stoic.Engine.activity`), the replicas
(with ``--replicas``) and the fault kinds that may be armed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict
from typing import Any

from aiohttp import web
from prometheus_client import Histogram

from ..config import FAULT_KINDS, PROCESS_ONLY_FAULTS
from ..engine import Activity, EngineStats, Incident
from ._engine import EngineLike
from ._metrics import Metrics

__all__ = ["ConsoleSampler", "quantile", "snapshot"]

#: seconds between samples (and between the console's updates)
PERIOD = 1.0
#: samples kept for the charts: five minutes
POINTS = 300
#: the latency percentiles' sliding window, in samples (one minute)
WINDOW = 60
QUANTILES = (0.5, 0.9, 0.99)

#: cumulative bucket counts of a histogram: (upper bound, observations at or below it)
Buckets = tuple[tuple[float, float], ...]


def buckets(histogram: Histogram) -> Buckets:
    """``histogram``'s cumulative bucket counts now, by upper bound (the last one ``+Inf``)."""
    found: list[tuple[float, float]] = []
    for family in histogram.collect():
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                found.append((float(sample.labels["le"]), float(sample.value)))
    return tuple(sorted(found))


def quantile(q: float, before: Buckets, after: Buckets) -> float | None:
    """The ``q`` quantile of the observations made between two readings of one histogram,
    interpolated linearly inside the bucket it falls in (as Prometheus' ``histogram_quantile``);
    an observation above the last finite bound counts as that bound. None: none were made."""
    old = dict(before)
    counts = [(le, n - old.get(le, 0.0)) for le, n in after]
    total = counts[-1][1] if counts else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for le, cumulative in counts:
        if cumulative >= rank:
            if le == float("inf"):
                return lower
            inside = cumulative - below
            return lower + (le - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = le, cumulative
    return lower  # pragma: no cover  (the +Inf bucket holds every observation)


class ConsoleSampler:
    """Samples ``engine``'s statistics and ``metrics``' latency histograms every
    :data:`PERIOD` seconds; :attr:`points` is the chart series of the last :data:`POINTS`."""

    def __init__(self, engine: EngineLike, metrics: Metrics) -> None:
        self._engine = engine
        self._metrics = metrics
        #: (monotonic time, generated tokens, TTFT buckets, ITL buckets), the last minute
        self._samples: deque[tuple[float, int, Buckets, Buckets]] = deque(maxlen=WINDOW + 1)
        #: one chart point per sample: wall time, tokens/s, TTFT and ITL percentiles
        self.points: deque[dict[str, Any]] = deque(maxlen=POINTS)

    def sample(self) -> None:
        """Take one sample and add its chart point."""
        now = time.monotonic()
        current = (
            now,
            self._engine.stats().generated_tokens,
            buckets(self._metrics.ttft),
            buckets(self._metrics.itl),
        )
        point: dict[str, Any] = {"t": round(time.time(), 3), "tokens_per_s": None}
        if self._samples:
            last = self._samples[-1]
            elapsed = now - last[0]
            # a counter that went down (a replaced Ray replica left the sum) is a reset, not a rate
            made = max(current[1] - last[1], 0)
            point["tokens_per_s"] = round(made / elapsed, 2) if elapsed > 0 else None
        self._samples.append(current)
        first = self._samples[0]
        for q in QUANTILES:
            name = f"p{round(q * 100)}"
            point[f"ttft_{name}"] = _ms(quantile(q, first[2], current[2]))
            point[f"itl_{name}"] = _ms(quantile(q, first[3], current[3]))
        self.points.append(point)

    async def run(self) -> None:
        """Sample every :data:`PERIOD` seconds until cancelled (an engine still loading, or
        failing to answer, is skipped)."""
        while True:
            with contextlib.suppress(Exception):
                self.sample()
            await asyncio.sleep(PERIOD)

    async def lifetime(self, app: web.Application) -> AsyncIterator[None]:
        """An ``app.cleanup_ctx``: sample while the app runs."""
        task = asyncio.create_task(self.run())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def _activity(engine: EngineLike) -> Activity | None:
    """The engine's :meth:`stoic.Engine.activity`, when it has one (a Ray front end does not)."""
    read = getattr(engine, "activity", None)
    if not callable(read):
        return None
    found = read()
    return found if isinstance(found, Activity) else None


def _replicas(engine: EngineLike) -> list[dict[str, Any]] | None:
    """One row per engine replica (``stoic serve --replicas``), or None for one engine."""
    read = getattr(type(engine), "replicas", None)
    if not callable(read):
        return None
    rows = []
    for posting in engine.replicas():  # type: ignore[attr-defined]
        stats: EngineStats = posting.stats
        rows.append(
            {
                "replica": str(posting.replica),
                "pid": posting.pid,
                "state": stats.state,
                "running": stats.running,
                "waiting": stats.waiting,
                "kv_cache_usage": round(stats.kv_cache_usage, 4),
                "incarnation": stats.incarnation,
                "restarts": stats.restarts,
                "generated_tokens": stats.generated_tokens,
                "prompt_tokens": stats.prompt_tokens,
                "prefix_cached_tokens": stats.prefix_cached_tokens,
                "prefix_hit_rate": round(stats.prefix_hit_rate, 4),
            }
        )
    return rows


def _fault_kinds(engine: EngineLike, admin: bool) -> list[str]:
    """The fault kinds the console may arm (none without ``--enable-fault-injection``)."""
    config = engine.config
    if not admin or not config.enable_fault_injection:
        return []
    process = config.executor == "process"
    return [k for k in FAULT_KINDS if process or k not in PROCESS_ONLY_FAULTS]


def snapshot(
    engine: EngineLike, points: Sequence[dict[str, Any]], *, admin: bool
) -> dict[str, Any]:
    """Everything the console shows now, JSON-ready (``admin``: the fault routes exist)."""
    stats, health, activity = engine.stats(), engine.health(), _activity(engine)
    configured = activity.token_budget_configured if activity else stats.token_budget
    work: dict[str, Any] = {
        "running_count": stats.running,
        "waiting_count": stats.waiting,
        "running": None,
        "waiting": None,
        "kv_blocks_used": stats.kv_blocks_used,
        "kv_blocks_total": stats.kv_blocks_total,
        "kv_blocks_cached": stats.kv_blocks_cached,
        "token_budget": stats.token_budget,
        "token_budget_configured": configured,
        "backed_off": 0 < stats.token_budget < configured,
        "prefix_hit_rate": (
            round(stats.prefix_cached_tokens / stats.prompt_tokens, 4)
            if stats.prompt_tokens
            else None
        ),
        "generated_tokens": stats.generated_tokens,
        # speculative decoding: drafts verified and kept (--speculative)
        "spec_draft_tokens": stats.spec_draft_tokens,
        "spec_accepted_tokens": stats.spec_accepted_tokens,
        "steps": stats.steps,
        "failed_sequences": stats.failed_sequences,
    }
    if activity is not None:
        work["running"] = [asdict(v) for v in activity.running]
        work["waiting"] = [asdict(v) for v in activity.waiting]
    return {
        "time": round(time.time(), 3),
        "model": engine.model_name,
        "executor": {
            "state": health.state,
            "reason": health.reason,
            "mode": engine.config.executor,
            "pid": stats.executor_pid,
            "incarnation": stats.incarnation,
            "restarts": stats.restarts,
            "restarts_by_kind": dict(stats.restarts_by_kind),
            "spares": activity.spares if activity else None,
        },
        "work": work,
        "series": list(points),
        "incidents": _incidents(activity),
        "replicas": _replicas(engine),
        # how requests are spread over the replicas (--routing), with replicas
        "routing": getattr(engine, "routing", None),
        "tenants": [{"tenant": name, **asdict(t)} for name, t in stats.tenants],
        "faults": {"kinds": _fault_kinds(engine, admin), "injected": stats.faults_injected},
    }


def _incidents(activity: Activity | None) -> list[dict[str, Any]] | None:
    """The incidents, newest first, without their private fields (None: not known here)."""
    if activity is None:
        return None
    return [
        {k: v for k, v in asdict(i).items() if not k.startswith("_")} | {"state": _fate(i)}
        for i in reversed(activity.incidents)
    ]


def _fate(incident: Incident) -> str:
    if incident.engine_failed is not None:
        return "engine failed"
    return "recovering" if incident.recovering else "recovered"
