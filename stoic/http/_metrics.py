"""Prometheus metrics, in a registry of the app's own (never the process-global one).

Request counters and latency histograms are updated by the handlers; the engine's gauges and
counters (sequences, KV cache, restarts, failed sequences) are read from
:meth:`stoic.Engine.stats` at scrape time, so they are never stale.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from ..engine import FAILURE_KINDS, STATES, EngineStats
from ..errors import EngineFailed, EngineStarting, EngineStopped, Overloaded, StoicError
from ._engine import EngineLike
from ._errors import status_of

__all__ = ["CONTENT_TYPE_LATEST", "Metrics", "Outcome", "outcome_of"]

Outcome = Literal["success", "invalid", "overloaded", "unavailable", "failed", "aborted", "error"]

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


def outcome_of(exc: BaseException) -> Outcome:
    """How a request that raised ``exc`` is counted in ``stoic_requests_total``."""
    if isinstance(exc, Overloaded):
        return "overloaded"
    if isinstance(exc, EngineFailed | EngineStopped | EngineStarting):
        return "unavailable"
    if isinstance(exc, StoicError):
        return "invalid" if status_of(exc)[0] < 500 else "failed"
    return "error"


#: the per-tenant families: (name, help, kind, the TenantStats field)
_TENANT_FAMILIES = (
    ("stoic_tenant_running", "Sequences running, by tenant.", "gauge", "running"),
    ("stoic_tenant_waiting", "Sequences admitted, not yet running, by tenant.", "gauge", "waiting"),
    ("stoic_tenant_weight", "The tenant's weight in the fair share of step tokens.", "gauge",
     "weight"),
    ("stoic_tenant_requests_admitted", "Requests admitted, by tenant.", "counter", "admitted"),
    ("stoic_tenant_requests_refused",
     "Requests refused at admission (tenant limits, a deadline the queue cannot meet), by "
     "tenant.", "counter", "refused"),
    ("stoic_tenant_requests_timed_out", "Requests ended by their own deadline, by tenant.",
     "counter", "timed_out"),
    ("stoic_tenant_computed_tokens",
     "Tokens the steps computed for the tenant (prompt chunks and decodes): its share.",
     "counter", "computed_tokens"),
)  # fmt: skip


def _tenant_metrics(stats: EngineStats) -> Iterator[Metric]:
    """Each tenant's counters and gauges (label ``tenant``; ``""`` is the default tenant)."""
    for name, doc, kind, attr in _TENANT_FAMILIES:
        family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
            name, doc, labels=["tenant"]
        )
        for tenant, t in stats.tenants:
            family.add_metric([tenant], getattr(t, attr))
        yield family


class _EngineCollector:
    """Reads the engine's statistics at each scrape."""

    def __init__(self, engine: EngineLike) -> None:
        self._engine = engine

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.stats()
        health = self._engine.health()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, value=value)

        yield gauge("stoic_sequences_running", "Sequences being decoded.", stats.running)
        yield gauge(
            "stoic_sequences_waiting", "Sequences admitted, not yet running.", stats.waiting
        )
        yield gauge("stoic_kv_cache_blocks_used", "KV cache blocks in use.", stats.kv_blocks_used)
        yield gauge("stoic_kv_cache_blocks_total", "KV cache blocks in all.", stats.kv_blocks_total)
        yield gauge(
            "stoic_kv_cache_blocks_cached",
            "KV cache blocks held by the prefix cache (in use or evictable).",
            stats.kv_blocks_cached,
        )
        yield counter(
            "stoic_prefix_cache_hit_tokens",
            "Prompt tokens whose keys and values came from the prefix cache.",
            stats.prefix_cached_tokens,
        )
        yield gauge(
            "stoic_kv_cache_usage",
            "Fraction of KV cache blocks in use (0..1).",
            stats.kv_cache_usage,
        )
        yield gauge("stoic_executor_incarnation", "Executor incarnation number.", stats.incarnation)
        restarts = CounterMetricFamily(
            "stoic_executor_restarts",
            "Executor restarts after failures, by the kind of failure.",
            labels=["kind"],
        )
        by_kind = dict(stats.restarts_by_kind)
        for kind in FAILURE_KINDS:
            restarts.add_metric([kind], by_kind.get(kind, 0))
        yield restarts
        if stats.executor_pid is not None:
            yield gauge("stoic_executor_pid", "The process the model runs in.", stats.executor_pid)
        yield counter(
            "stoic_failed_sequences",
            "Sequences ended by an executor failure.",
            stats.failed_sequences,
        )
        yield counter(
            "stoic_requests_resumed",
            "Requests resumed after an executor failure (one per request per failure).",
            stats.requests_resumed,
        )
        yield counter(
            "stoic_resume_reused_tokens",
            "Resumed requests' tokens whose keys and values outlived an executor failure (KV "
            "pools that outlive the worker, the prefix cache): not computed again.",
            stats.resume_reused_tokens,
        )
        yield counter(
            "stoic_resume_recomputed_tokens",
            "Resumed requests' tokens computed before an executor failure and prefilled again "
            "after it.",
            stats.resume_recomputed_tokens,
        )
        yield counter(
            "stoic_spec_draft_tokens",
            "Speculative decoding: proposed tokens verified (--speculative).",
            stats.spec_draft_tokens,
        )
        yield counter(
            "stoic_spec_accepted_tokens",
            "Speculative decoding: proposed tokens the model agreed with (each a token gained; "
            "over stoic_spec_draft_tokens: the acceptance rate).",
            stats.spec_accepted_tokens,
        )
        yield counter(
            "stoic_requests_resume_exhausted",
            "Requests that failed because their resumes were spent (--max-resumes).",
            stats.resumes_exhausted,
        )
        yield counter(
            "stoic_requests_isolated",
            "Requests found to cause repeated executor failures and ended alone.",
            stats.requests_isolated,
        )
        yield counter(
            "stoic_isolation_failures",
            "Executor failures of isolation probes (a suspect run alone): charged to the suspect, "
            "not counted toward the restart intensity.",
            stats.isolation_failures,
        )
        yield gauge(
            "stoic_scheduler_token_budget",
            "Tokens per step in force (halved after an out-of-memory failure, then restored).",
            stats.token_budget,
        )
        yield gauge(
            "stoic_compute_threads",
            "Compute threads of the last step: the CPU budget, fewer while other processes "
            "take CPUs from the server.",
            stats.compute_threads,
        )
        yield counter("stoic_engine_steps", "Engine steps run.", stats.steps)
        yield counter(
            "stoic_requests_timed_out",
            "Requests ended by their own deadline (finish_reason timeout).",
            stats.timed_out,
        )
        yield from _tenant_metrics(stats)
        state = GaugeMetricFamily(
            "stoic_engine_state", "1 for the engine's current state.", labels=["state"]
        )
        for name in STATES:
            state.add_metric([name], 1.0 if health.state == name else 0.0)
        yield state
        compute = stats.compute
        if compute is not None:
            labels = compute.labels()
            info = GaugeMetricFamily(
                "stoic_model_info",
                "1, labelled with how the model computes (ComputePath: /v1/models' compute): "
                "activation and dense-product dtypes, projections on the GGUF file's quantised "
                "blocks, the LM head's block type, whether decode steps run the C layers, the "
                "most rows a step runs on blocks, the architecture, decoder, logits path and "
                "attention backend, and whether every step is batch-invariant (--deterministic).",
                labels=list(labels),
            )
            info.add_metric(list(labels.values()), 1.0)
            yield info


class Metrics:
    """The metrics of one app."""

    def __init__(self, engine: EngineLike) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter(
            "stoic_requests",
            "Generation requests by endpoint and outcome.",
            ["endpoint", "outcome"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "stoic_prompt_tokens", "Prompt tokens processed.", registry=self.registry
        )
        self.generation_tokens = Counter(
            "stoic_generation_tokens", "Tokens generated.", registry=self.registry
        )
        self.ttft = Histogram(
            "stoic_time_to_first_token_seconds",
            "Time from request arrival to a choice's first token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "stoic_inter_token_latency_seconds",
            "Time between tokens of one choice (per delta, divided by its token count).",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "stoic_request_duration_seconds",
            "Time from request arrival to its last byte.",
            buckets=_E2E_BUCKETS,
            registry=self.registry,
        )
        self.refused = Counter(
            "stoic_http_refused",
            "Requests and connections refused by the access rules or the limits, by reason "
            "(unauthorized, forbidden, too_large, body_timeout, header_timeout, "
            "too_many_connections).",
            ["reason"],
            registry=self.registry,
        )
        self.tool_calls = Counter(
            "stoic_tool_calls",
            "Tool calls in chat answers: returned, or rejected (a call that did not parse or "
            "named no tool, returned as text).",
            ["outcome"],
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(engine))
        # an engine front end with metrics of its own (stoic.ray's per-replica metrics); looked
        # up on the type, so a stand-in whose __getattr__ forwards or raises is not asked
        if callable(getattr(type(engine), "metric_collectors", None)):
            for collector in engine.metric_collectors():  # type: ignore[attr-defined]
                self.registry.register(collector)

    def count_tool_calls(self, returned: int, rejected: int) -> None:
        """Count one choice's tool calls."""
        if returned:
            self.tool_calls.labels("returned").inc(returned)
        if rejected:
            self.tool_calls.labels("rejected").inc(rejected)

    def watch_connections(self, open_connections: Callable[[], int]) -> None:
        """Export ``stoic_http_connections_open`` (read at scrape time from the server's site)."""

        class _Connections:
            def describe(self) -> list[Metric]:
                return []

            def collect(self) -> Iterator[Metric]:
                yield GaugeMetricFamily(
                    "stoic_http_connections_open", "Open client connections.", open_connections()
                )

        self.registry.register(_Connections())

    def request_done(self, endpoint: str, outcome: Outcome, started: float) -> None:
        self.requests.labels(endpoint, outcome).inc()
        self.e2e.observe(time.monotonic() - started)

    def render(self) -> bytes:
        return generate_latest(self.registry)
