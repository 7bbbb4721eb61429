"""The replicas' statistics as the ingress sees them: summed for stoic's usual metric names and
``/health``, and per replica (label ``replica``) for the metrics that tell replicas apart."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections import Counter
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..engine import STATES, EngineStats, Health
from ..scheduler import TenantStats
from ._board import Posting

__all__ = ["ReplicaView", "sum_stats"]

#: fields that are not summed over replicas (what sums them makes no sense)
_NOT_SUMMED = {
    "state",
    "executor_pid",
    "restarts_by_kind",
    "max_batch_size",
    "token_budget",
    "compute",
    "tenants",
}


def sum_stats(stats: list[EngineStats]) -> EngineStats:
    """One :class:`~stoic.EngineStats` for many replicas: counts summed, ``max_batch_size`` and
    ``token_budget`` the largest, the state the best (serving if any replica serves), no
    executor pid, the first reporting replica's ``compute`` (replicas share one config).
    Counters of a replica that was replaced leave the sums (a counter reset)."""
    if not stats:
        raise ValueError("no statistics to sum")
    summed: dict[str, Any] = {}
    for f in dataclasses.fields(EngineStats):
        if f.name not in _NOT_SUMMED:
            summed[f.name] = sum(getattr(s, f.name) for s in stats)
    by_kind: Counter[str] = Counter()
    for s in stats:
        by_kind.update(dict(s.restarts_by_kind))
    return EngineStats(
        **summed,
        state=_best_state([s.state for s in stats]),
        executor_pid=None,
        restarts_by_kind=tuple(sorted(by_kind.items())),  # type: ignore[arg-type]
        max_batch_size=max(s.max_batch_size for s in stats),
        token_budget=max(s.token_budget for s in stats),
        compute=next((s.compute for s in stats if s.compute is not None), None),
        tenants=_sum_tenants(stats),
    )


def _sum_tenants(stats: list[EngineStats]) -> tuple[tuple[str, TenantStats], ...]:
    """Each tenant's counters summed over the replicas (its weight: the first replica's)."""
    summed: dict[str, TenantStats] = {}
    for s in stats:
        for name, t in s.tenants:
            into = summed.get(name)
            if into is None:
                summed[name] = dataclasses.replace(t)
                continue
            for f in dataclasses.fields(TenantStats):
                if f.name != "weight":
                    setattr(into, f.name, getattr(into, f.name) + getattr(t, f.name))
    return tuple(sorted(summed.items()))


def _best_state(states: list[Any]) -> Any:
    for state in ("serving", "recovering", "starting", "stopping"):
        if state in states:
            return state
    return "failed"


class ReplicaView:
    """The latest postings of the replicas' board, read every ``period`` seconds by
    :meth:`run`; ``migrated`` counts the requests the ingress moved between replicas."""

    def __init__(
        self, board: Any, idle: EngineStats, period: float = 1.0, routing: str = "least-loaded"
    ) -> None:
        self._board = board
        self._idle = idle
        self._period = period
        #: how the ingress picks a replica (``--routing``)
        self.routing = routing
        self.postings: list[Posting] = []
        self.migrated = 0

    async def refresh(self) -> list[Posting]:
        """Read the board now."""
        self.postings = list(await self._board.read.remote())
        return self.postings

    async def run(self) -> None:
        """Read the board every ``period`` seconds until cancelled."""
        while True:
            with contextlib.suppress(Exception):  # the board restarting: keep the last read
                await self.refresh()
            await asyncio.sleep(self._period)

    def total(self) -> EngineStats:
        if not self.postings:
            return self._idle
        return sum_stats([p.stats for p in self.postings])

    def health(self) -> Health:
        healths = [p.health for p in self.postings]
        if not healths:
            return Health(state="starting", reason="no replica has reported yet")
        ok: list[Health] = [h for h in healths if h.ok]
        if ok:
            return ok[0]
        state = _best_state([h.state for h in healths])
        reasons = sorted({h.reason for h in healths if h.reason})
        return Health(state=state, reason="; ".join(reasons) or None)

    def collector(self) -> Any:
        """A Prometheus collector of the per-replica metrics."""
        return _ReplicaCollector(self)


class _ReplicaCollector:
    def __init__(self, view: ReplicaView) -> None:
        self._view = view

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        postings = self._view.postings
        yield CounterMetricFamily(
            "stoic_requests_migrated",
            "Requests moved to another replica after theirs died or failed (one per move).",
            value=self._view.migrated,
        )
        routing = GaugeMetricFamily(
            "stoic_routing_info",
            "How the ingress picks a replica (--routing): 1.",
            labels=["routing"],
        )
        routing.add_metric([self._view.routing], 1.0)
        yield routing
        state = GaugeMetricFamily(
            "stoic_replicas", "Engine replicas reporting, by engine state.", labels=["state"]
        )
        for name in STATES:
            state.add_metric([name], sum(p.stats.state == name for p in postings))
        yield state
        per_replica = (
            ("stoic_replica_sequences_running", "Sequences being decoded.", "running"),
            ("stoic_replica_sequences_waiting", "Sequences admitted, not running.", "waiting"),
            ("stoic_replica_kv_cache_usage", "Fraction of KV blocks in use.", "kv_cache_usage"),
            ("stoic_replica_executor_restarts", "Executor restarts.", "restarts"),
            ("stoic_replica_generated_tokens", "Tokens generated.", "generated_tokens"),
            ("stoic_replica_prompt_tokens", "Prompt tokens admitted.", "prompt_tokens"),
            (
                "stoic_replica_prefix_cache_hit_tokens",
                "Prompt tokens found in the replica's prefix cache (over "
                "stoic_replica_prompt_tokens: its hit rate; --routing prefix raises it).",
                "prefix_cached_tokens",
            ),
            (
                "stoic_replica_prefix_cache_hit_rate",
                "stoic_replica_prefix_cache_hit_tokens over stoic_replica_prompt_tokens.",
                "prefix_hit_rate",
            ),
        )
        for metric, doc, attr in per_replica:
            family = GaugeMetricFamily(metric, doc, labels=["replica"])
            for p in postings:
                family.add_metric([p.replica], float(getattr(p.stats, attr)))
            yield family
