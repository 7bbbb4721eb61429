"""/metrics, /health, and the app mounted under a prefix in a host application."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from http_helpers import Server, run_app, stream_with_error_at_step
from prometheus_client.parser import text_string_to_metric_families
from support import wait_idle

import stoic
from stoic.http import create_app
from stoic.http._deferred import DeferredEngine

pytestmark = pytest.mark.asyncio(loop_scope="session")

EXPECTED = {
    "stoic_requests_total",
    "stoic_sequences_running",
    "stoic_sequences_waiting",
    "stoic_kv_cache_blocks_used",
    "stoic_kv_cache_blocks_total",
    "stoic_kv_cache_usage",
    "stoic_executor_restarts_total",
    "stoic_failed_sequences_total",
    "stoic_time_to_first_token_seconds_bucket",
    "stoic_inter_token_latency_seconds_bucket",
    "stoic_request_duration_seconds_bucket",
    "stoic_generation_tokens_total",
    "stoic_prompt_tokens_total",
    "stoic_prefix_cache_hit_tokens_total",
    "stoic_kv_cache_blocks_cached",
    "stoic_model_info",
}


async def _samples(http: aiohttp.ClientSession, url: str) -> dict[tuple[str, str], float]:
    async with http.get(url) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = await r.text()
    return {
        (s.name, ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_metrics_parse_and_count(
    server: Server, http: aiohttp.ClientSession, engine: stoic.Engine
) -> None:
    """/metrics is valid Prometheus text with every stoic metric; a completion moves the
    request, token and time-to-first-token counters; engine gauges match engine.stats()."""
    url = f"{server.url}/metrics"
    before = await _samples(http, url)
    body = {"model": "default", "prompt": "Hi", "max_tokens": 3, "ignore_eos": True}
    async with http.post(f"{server.url}/v1/completions", json=body) as r:
        assert r.status == 200
    after = await _samples(http, url)
    # labelled counters have no sample before their first request: check after one
    assert {name for name, _ in after} >= EXPECTED
    ok = ("stoic_requests_total", "endpoint=completions,outcome=success")
    assert after[ok] == before.get(ok, 0) + 1
    tokens = ("stoic_generation_tokens_total", "")
    assert after[tokens] == before.get(tokens, 0) + 3
    ttft = ("stoic_time_to_first_token_seconds_count", "")
    assert after[ttft] == before.get(ttft, 0) + 1
    stats = engine.stats()
    assert after[("stoic_kv_cache_blocks_total", "")] == stats.kv_blocks_total
    assert after[("stoic_prefix_cache_hit_tokens_total", "")] == stats.prefix_cached_tokens
    assert after[("stoic_kv_cache_blocks_cached", "")] == stats.kv_blocks_cached
    by_kind = {
        labels.removeprefix("kind="): value
        for (name, labels), value in after.items()
        if name == "stoic_executor_restarts_total"
    }
    assert set(by_kind) == {"error", "oom", "fatal", "hang", "crash"}
    assert sum(by_kind.values()) == stats.restarts
    assert by_kind == {kind: dict(stats.restarts_by_kind).get(kind, 0) for kind in by_kind}
    assert after[("stoic_executor_pid", "")] == stats.executor_pid
    assert after[("stoic_engine_state", "state=serving")] == 1.0
    compute = stats.compute
    assert compute is not None and compute.dtype == "float32"
    info = [labels for (name, labels), v in after.items() if name == "stoic_model_info" and v == 1]
    assert len(info) == 1
    shown = dict(pair.split("=", 1) for pair in info[0].split(","))
    assert shown == {
        "architecture": compute.architecture,
        "attention": compute.attention,
        "c_layers": str(compute.c_layers).lower(),
        "decoder": compute.decoder,
        "dense_dtype": compute.dense_dtype,
        "kv_cache_dtype": compute.kv_cache_dtype,
        "deterministic": "false",
        "dtype": "float32",
        "head": compute.head or "none",
        "kernel_rows": str(compute.kernel_rows),
        "logits": compute.logits,
        "quantized_projections": f"{compute.quantized_projections}/{compute.projections}",
        "row_activations": compute.row_activations,
        "int8_batched_projections": str(compute.int8_batched_projections),
        "weight_layouts": compute.weight_layouts,
    }
    assert compute.attention == "c-paged" and compute.architecture == "LlamaForCausalLM"


@pytest.mark.usefixtures("fault_cleanup")
async def test_an_executor_failure_moves_the_failure_counters(
    server: Server, http: aiohttp.ClientSession, engine: stoic.Engine
) -> None:
    """An injected executor error while one request streams: /metrics counts exactly one
    restart of kind "error" (no other kind), one failed sequence and one completions request
    with outcome "failed" (read from the exposition text before and after, not engine.stats())."""
    url = f"{server.url}/metrics"
    await wait_idle(engine, 10.0, serving=True)
    before = await _samples(http, url)
    events = await stream_with_error_at_step(http, server.url, 4)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "executor_error"
    await wait_idle(engine, 10.0, serving=True)
    after = await _samples(http, url)

    def delta(name: str, labels: str = "") -> float:
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    restarts = "stoic_executor_restarts_total"
    assert delta(restarts, "kind=error") == 1
    for kind in ("oom", "fatal", "hang", "crash"):
        assert delta(restarts, f"kind={kind}") == 0
    assert delta("stoic_failed_sequences_total") == 1
    assert delta("stoic_requests_total", "endpoint=completions,outcome=failed") == 1
    assert delta("stoic_requests_total", "endpoint=completions,outcome=success") == 0
    assert after[("stoic_engine_state", "state=serving")] == 1.0


async def test_metrics_while_the_model_loads_show_an_idle_engine(
    fake_server: Callable[..., Any], http: aiohttp.ClientSession
) -> None:
    """While the model loads, /metrics shows the idle record (EngineStats.idle): state
    starting, the configured token budget, no executor pid or model info, every other engine
    count and gauge 0."""
    config = stoic.EngineConfig(model="fake", max_num_batched_tokens=64)
    server = await fake_server(DeferredEngine(config))
    samples = await _samples(http, f"{server.url}/metrics")
    assert samples.pop(("stoic_engine_state", "state=starting")) == 1.0
    assert samples.pop(("stoic_scheduler_token_budget", "")) == 64
    names = {name for name, _labels in samples}
    assert "stoic_executor_pid" not in names and "stoic_model_info" not in names
    assert {"stoic_sequences_running", "stoic_kv_cache_blocks_total"} <= names
    assert {
        "stoic_requests_resumed_total",
        "stoic_resume_reused_tokens_total",
        "stoic_resume_recomputed_tokens_total",
        "stoic_compute_threads",
    } <= names
    nonzero = {k: v for k, v in samples.items() if v and not k[0].endswith("_created")}
    assert nonzero == {}


async def test_health_ok(server: Server, http: aiohttp.ClientSession, engine: stoic.Engine) -> None:
    """/health is 200 {"status": "ok"} while the engine serves, with the executor's process,
    incarnation and restarts."""
    async with http.get(f"{server.url}/health") as r:
        assert r.status == 200
        body = await r.json()
    stats = engine.stats()
    assert body == {
        "status": "ok",
        "executor": {
            "pid": stats.executor_pid,
            "incarnation": stats.incarnation,
            "restarts": stats.restarts,
        },
    }


async def test_mounted_under_prefix(engine: stoic.Engine) -> None:
    """create_app mounts under a prefix next to the host's own routes and serves the SDK there;
    each app has its own metrics registry."""

    async def home(request: web.Request) -> web.Response:
        return web.Response(text="host")

    host = web.Application()
    host.router.add_get("/", home)
    host.add_subapp("/llm", create_app(engine))
    host.add_subapp("/llm2", create_app(engine))
    async with run_app(host) as server, aiohttp.ClientSession() as http:
        async with http.get(f"{server.url}/") as r:
            assert await r.text() == "host"
        async with http.get(f"{server.url}/llm/health") as r:
            assert r.status == 200
        async with server.client("/llm") as client:
            result = await client.chat.completions.create(
                model="default", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
            )
            assert result.choices[0].message.content is not None
            with pytest.raises(openai.BadRequestError):
                await client.chat.completions.create(model="default", messages=[], max_tokens=2)
        async with http.get(f"{server.url}/llm/v1/nothing") as r:
            assert r.status == 404
        first = await _samples(http, f"{server.url}/llm/metrics")
        second = await _samples(http, f"{server.url}/llm2/metrics")
        key = ("stoic_requests_total", "endpoint=chat,outcome=success")
        assert first[key] == 1 and key not in second
