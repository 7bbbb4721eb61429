"""docs/grafana-stoic.json, the Grafana dashboard over stoic's metrics: every metric its queries
name is one a stoic server exports (so a renamed metric cannot leave a panel silently empty)."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from stoic.engine import EngineStats, Health
from stoic.http._metrics import Metrics
from stoic.ray._board import Posting
from stoic.ray._stats import ReplicaView

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docs" / "grafana-stoic.json"


def _exported() -> set[str]:
    """The sample names of a server's /metrics (every labelled family used once) and of the
    replicas' metrics (``stoic serve --replicas``)."""
    sys.path.insert(0, str(ROOT / "tests" / "http"))
    from http_fakes import FakeEngine

    class Running(FakeEngine):  # a worker process: the pid gauge is exported
        def stats(self) -> EngineStats:
            return dataclasses.replace(super().stats(), executor_pid=1234)

    metrics = Metrics(Running())
    metrics.requests.labels("chat", "success").inc()
    metrics.refused.labels("unauthorized").inc()
    metrics.tool_calls.labels("returned").inc()
    metrics.watch_connections(lambda: 0)
    registry = CollectorRegistry()
    view = ReplicaView(None, EngineStats.idle())
    view.postings = [Posting("r1", 1, EngineStats.idle("serving"), Health("serving"), 0.0)]
    registry.register(view.collector())
    text = (metrics.render() + generate_latest(registry)).decode()
    return {re.split(r"[{ ]", line)[0] for line in text.splitlines() if not line.startswith("#")}


def _queries(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["expr"]] if isinstance(node.get("expr"), str) else []
        return found + [q for v in node.values() for q in _queries(v)]
    if isinstance(node, list):
        return [q for v in node for q in _queries(v)]
    return []


def test_every_metric_the_dashboard_queries_is_exported() -> None:
    """The dashboard parses, has panels, filters by the server chosen, and names only metrics
    stoic exports."""
    dashboard = json.loads(DASHBOARD.read_text())
    queries = _queries(dashboard["panels"])
    assert len(queries) > 20
    named = {m for q in queries for m in re.findall(r"\bstoic_[a-z_]+", q)}
    unknown = named - _exported()
    assert not unknown, f"the dashboard queries metrics stoic does not export: {sorted(unknown)}"
    assert all('instance=~"$instance"' in q for q in queries)
