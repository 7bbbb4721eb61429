"""``/console`` over HTTP (the browser tests are in test_console_browser.py): who gets the data
stream, what a snapshot holds, and the latency percentiles behind its charts."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import aiohttp
import pytest
from http_fakes import FakeEngine
from http_helpers import run_app
from prometheus_client import CollectorRegistry, Histogram

from stoic.config import EngineConfig
from stoic.engine import EngineStats, Health
from stoic.http import AccessPolicy, create_app
from stoic.http._console_data import buckets, quantile
from stoic.http._deferred import DeferredEngine
from stoic.http._state import STATE

ADMIN, USER = "admin-secret", "user-secret"


async def _first_event(url: str, key: str | None = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{url}/console/stream", headers=headers) as r,
    ):
        if r.status != 200:
            return r.status, await r.json()
        assert r.headers["Content-Type"].startswith("text/event-stream")
        block = await r.content.readuntil(b"\n\n")
        return r.status, json.loads(block.decode().removeprefix("data: "))


@pytest.mark.parametrize(
    ("policy", "key", "status"),
    [
        (AccessPolicy(api_keys=(USER,), admin_key=ADMIN), None, 401),
        (AccessPolicy(api_keys=(USER,), admin_key=ADMIN), "wrong", 401),
        (AccessPolicy(api_keys=(USER,), admin_key=ADMIN), USER, 403),
        (AccessPolicy(api_keys=(USER,), admin_key=ADMIN), ADMIN, 200),
        (AccessPolicy(api_keys=(USER,)), None, 401),
        (AccessPolicy(api_keys=(USER,)), USER, 200),
        (AccessPolicy(), None, 200),
    ],
    ids=["admin-none", "admin-wrong", "admin-api-key", "admin-ok", "api-none", "api-ok", "open"],
)
async def test_the_console_stream_needs_the_admin_key_when_set_else_an_api_key(
    policy: AccessPolicy, key: str | None, status: int
) -> None:
    """The data stream is guarded like the admin routes when an admin key is set (an API key is
    a 403), by the API keys otherwise; a refusal carries no data. The page itself is open."""
    async with run_app(create_app(FakeEngine(), access=policy)) as server:
        got, body = await _first_event(server.url, key)
        assert got == status
        if status == 200:
            assert body["executor"]["state"] == "serving"
        else:
            assert set(body) == {"error"}
        async with aiohttp.ClientSession() as http:
            for path, kind in [("", "text/html"), ("/console.js", "text/javascript")]:
                async with http.get(f"{server.url}/console{path}") as r:
                    assert (r.status, r.content_type) == (200, kind)
            async with http.get(f"{server.url}/console/secrets.txt") as r:
                assert r.status == 404


async def test_a_snapshot_shows_the_backed_off_budget_replicas_and_the_faults_allowed() -> None:
    """A budget below the configured one is flagged backed off; replica rows appear for an
    engine with replicas; the fault buttons offer only the kinds the executor survives (none
    without fault injection)."""

    @dataclasses.dataclass
    class Posting:
        replica: str
        pid: int
        stats: EngineStats

    class Replicated(FakeEngine):
        def replicas(self) -> list[Posting]:
            stats = dataclasses.replace(self.stats(), state="recovering", running=2)
            return [Posting("r1", 11, self.stats()), Posting("r2", 12, stats)]

    thread = EngineConfig(model="fake", executor="thread", enable_fault_injection=True)
    async with run_app(create_app(Replicated(config=thread))) as server:
        _, snap = await _first_event(server.url)
    assert [(r["replica"], r["state"], r["running"]) for r in snap["replicas"]] == [
        ("r1", "serving", 0),
        ("r2", "recovering", 2),
    ]
    assert snap["faults"]["kinds"] and "crash" not in snap["faults"]["kinds"]
    assert snap["work"]["running"] is None  # the fake has no per-sequence view
    async with run_app(create_app(FakeEngine())) as server:
        _, snap = await _first_event(server.url)
    assert snap["replicas"] is None and snap["faults"]["kinds"] == []
    assert snap["work"]["backed_off"] is False

    class BackedOff(FakeEngine):
        def stats(self) -> EngineStats:
            return dataclasses.replace(super().stats(), token_budget=64)

        def activity(self) -> Any:
            from stoic.engine import Activity

            return Activity((), (), (), 256, 0)

    async with run_app(create_app(BackedOff())) as server:
        _, snap = await _first_event(server.url)
    assert snap["work"]["backed_off"] is True
    assert (snap["work"]["token_budget"], snap["work"]["token_budget_configured"]) == (64, 256)
    assert snap["work"]["running"] == [] and snap["incidents"] == []


async def test_a_loading_engine_has_no_activity_yet() -> None:
    """While the model loads the console shows the state ``starting`` and no sequences."""
    async with run_app(create_app(DeferredEngine(EngineConfig(model="fake")))) as server:
        _, snap = await _first_event(server.url)
    assert snap["executor"]["state"] == "starting"
    assert snap["work"]["running"] is None and snap["incidents"] is None


def test_percentiles_between_two_readings_count_only_the_observations_between() -> None:
    """Prometheus' interpolation over the buckets' increase: the observations before the first
    reading do not count; one above the last bound counts as that bound; none: None."""
    histogram = Histogram("x", "x", buckets=(0.1, 0.2, 0.4), registry=CollectorRegistry())
    for _ in range(100):
        histogram.observe(0.35)  # before the window
    before = buckets(histogram)
    assert quantile(0.5, before, buckets(histogram)) is None
    for v in [0.05] * 50 + [0.15] * 40 + [0.3] * 9 + [9.0]:
        histogram.observe(v)
    after = buckets(histogram)
    assert quantile(0.5, before, after) == pytest.approx(0.1)
    assert quantile(0.7, before, after) == pytest.approx(0.15)
    assert quantile(0.25, before, after) == pytest.approx(0.05)
    assert quantile(1.0, before, after) == pytest.approx(0.4)


async def test_the_stream_sends_a_snapshot_a_second_and_ends_when_the_server_drains() -> None:
    """Snapshots keep coming about once a second; a draining server ends the stream (so that
    an open console never holds a shutdown up)."""
    app = create_app(FakeEngine())
    async with (
        run_app(app) as server,
        aiohttp.ClientSession() as http,
        http.get(f"{server.url}/console/stream") as r,
    ):
        loop = asyncio.get_running_loop()
        started = loop.time()
        times = [json.loads((await r.content.readuntil(b"\n\n"))[6:])["time"] for _ in range(3)]
        assert times == sorted(times) and 1.5 < loop.time() - started < 6
        app[STATE].draining = True
        rest = await asyncio.wait_for(r.content.read(), 5)
        assert rest.count(b"data: ") <= 1  # at most the snapshot already on its way


async def test_a_ray_front_end_shows_one_row_per_replica_from_its_board() -> None:
    """``stoic serve --replicas``: the front end's replica view (what the replicas posted to
    their board) becomes the console's replica rows, in replica order, with each replica's
    prefix-cache hit rate, and the routing in force."""
    from stoic.ray import RayEngine
    from stoic.ray._board import Posting
    from stoic.ray._stats import ReplicaView

    class Handle:
        def options(self, **_: Any) -> Handle:
            return self

    view = ReplicaView(board=None, idle=EngineStats.idle(), routing="prefix")
    serving = dataclasses.replace(
        EngineStats.idle("serving"),
        running=3,
        executor_pid=41,
        prompt_tokens=400,
        prefix_cached_tokens=300,
    )
    failed = EngineStats.idle("failed")
    view.postings = [
        Posting("a", 41, serving, Health("serving"), 0.0),
        Posting("b", 42, failed, Health("failed", "too many restarts"), 0.0),
    ]
    engine = RayEngine(
        Handle(),
        EngineConfig(model="fake"),
        None,
        model_name="m",
        max_model_len=64,
        view=view,  # type: ignore[arg-type]
    )
    async with run_app(create_app(engine)) as server:
        _, snap = await _first_event(server.url)
    rows = [(r["replica"], r["state"], r["pid"], r["running"]) for r in snap["replicas"]]
    assert rows == [("a", "serving", 41, 3), ("b", "failed", 42, 0)]
    assert [r["prefix_hit_rate"] for r in snap["replicas"]] == [0.75, 0.0]
    assert snap["routing"] == "prefix"
    assert snap["executor"]["state"] == "serving" and snap["incidents"] is None


async def test_a_snapshot_lists_each_tenant_with_its_counters() -> None:
    """The console's data has one row per tenant: its weight, sequences now, requests admitted,
    refused and timed out, and tokens computed; none before any tenant was seen."""
    from stoic.scheduler import TenantStats

    class Tenanted(FakeEngine):
        def stats(self) -> EngineStats:
            rows = (("", TenantStats(1.0, running=1)), ("acme", TenantStats(3.0, refused=2)))
            return dataclasses.replace(super().stats(), tenants=rows)

    async with run_app(create_app(Tenanted())) as server:
        _, snap = await _first_event(server.url)
    assert [(t["tenant"], t["weight"], t["running"], t["refused"]) for t in snap["tenants"]] == [
        ("", 1.0, 1, 0),
        ("acme", 3.0, 0, 2),
    ]
    async with run_app(create_app(FakeEngine())) as server:
        _, snap = await _first_event(server.url)
    assert snap["tenants"] == []
