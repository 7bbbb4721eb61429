"""The parts of stoic.ray that need no Ray cluster: errors on the wire, the health verdict, the
continuation's text, summed statistics, the replica options and the ``--replicas`` flags."""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
from pathlib import Path
from typing import Any

import pytest

from stoic import EngineConfig
from stoic.cli import build_parser
from stoic.engine import (
    STATES,
    Constraint,
    Delta,
    EngineStats,
    Health,
    Request,
    SamplingParams,
    TokenCodec,
    load_token_codec,
)
from stoic.errors import (
    ContextLengthExceeded,
    EngineFailed,
    ExecutorFailed,
    InvalidRequest,
    Overloaded,
    PartialOutput,
    StoicError,
)
from stoic.ray import ReplicaOptions, check_engine_health
from stoic.ray._app import app_options
from stoic.ray._cli import replica_options
from stoic.ray._redecode import Continuation
from stoic.ray._replica import EngineReplica, check_replica_device, replica_config
from stoic.ray._stats import sum_stats
from stoic.ray._wire import pack_error, unpack_error


@pytest.mark.parametrize(
    "error",
    [
        InvalidRequest("bad temperature", param="temperature"),
        ContextLengthExceeded("too long", param="prompt"),
        Overloaded("busy", retry_after=3.0),
        EngineFailed("gone", partial=PartialOutput("ab", (1, 2))),
        ExecutorFailed("oom", partial=PartialOutput("x", (7,)), kind="oom", retryable=False),
    ],
)
def test_errors_cross_the_wire_unchanged(error: StoicError) -> None:
    """A replica's error reaches the ingress as the same class with the same message and
    attributes (partial output, param, code, retry_after, kind, retryable)."""
    back = unpack_error(pack_error(error))
    assert type(back) is type(error)
    assert str(back) == str(error)
    assert vars(back) == vars(error)


@pytest.mark.parametrize(
    "request_",
    [
        Request("Hello", SamplingParams(max_tokens=3, stop=("\n",), seed=1), request_id="a"),
        Request([1, 2, 3], SamplingParams(constraint=Constraint("regex", "[ab]+"))),
        Request(
            messages=[{"role": "user", "content": "hi"}],
            chat_template_kwargs={"enable_thinking": False},
            add_generation_prompt=False,
        ),
    ],
)
def test_a_request_crosses_rays_wire_unchanged(request_: Request) -> None:
    """The engine's request is what the ingress sends a replica: Ray's serialisation
    (cloudpickle, protocol 5) gives back an equal request of the same class, every field and
    the sampling parameters included."""
    cloudpickle = pytest.importorskip("ray.cloudpickle")
    back = cloudpickle.loads(cloudpickle.dumps(request_, protocol=5))
    assert type(back) is Request and back == request_


@pytest.mark.parametrize("state", STATES)
def test_health_check_fails_only_a_failed_engine(state: Any) -> None:
    """Serve's health check raises for a failed engine only: a recovering (or starting,
    stopping) engine is left to stoic's own supervision."""
    health = Health(state=state, reason="why")
    if state == "failed":
        with pytest.raises(RuntimeError, match="failed"):
            check_engine_health(health)
    else:
        check_engine_health(health)


@pytest.fixture(scope="module")
def codec(tiny_model_dir: Path) -> TokenCodec:
    return load_token_codec(EngineConfig(model=str(tiny_model_dir)))


def _deltas(ids: list[int], *, finish: Any = "length", stop_reason: Any = None) -> list[Delta]:
    """One delta per token (the last one finishing)."""
    return [
        Delta(
            "r",
            "",
            (tid,),
            None,
            finish if i == len(ids) - 1 else None,
            5,
            i + 1,
            stop_reason if i == len(ids) - 1 else None,
        )
        for i, tid in enumerate(ids)
    ]


def _emitted(backend: Any, ids: list[int]) -> str:
    """The text a replica had sent for ``ids`` (its decoder holds back an incomplete
    character)."""
    from tokenizers.decoders import DecodeStream

    stream, text = DecodeStream(skip_special_tokens=True), ""
    for tid in ids:
        text += stream.step(backend, tid) or ""
    return text


def test_continuation_text_is_the_uninterrupted_text_at_every_split(codec: TokenCodec) -> None:
    """Whatever token the migration falls after, even inside a multi-byte character, the text
    the client gets before plus the continuation's is exactly the whole output's text."""
    backend = codec.tokenizer.backend_tokenizer
    whole = "Grüße, 東京! naïve café ☕ end"
    ids = codec.tokenizer.encode(whole, add_special_tokens=False)
    params = SamplingParams(max_tokens=len(ids))
    assert codec.tokenizer.decode(ids) == whole
    for split in range(len(ids) + 1):
        before = _emitted(backend, ids[:split])
        cont = Continuation(backend, params, ids[:split], before)
        after = "".join(cont.take(d)[0] for d in _deltas(ids[split:]))
        assert before + after == whole, split


def test_continuation_cuts_a_stop_string_that_spans_the_migration(codec: TokenCodec) -> None:
    """A stop string begun before the migration and completed after it ends the text where
    it begins (the held-back tail is never sent)."""
    backend = codec.tokenizer.backend_tokenizer
    ids = codec.tokenizer.encode("alpha beta STOPWORD gamma", add_special_tokens=False)
    params = SamplingParams(max_tokens=len(ids), stop=("STOPWORD",))
    split = next(
        i for i in range(len(ids)) if "STOP" in codec.tokenizer.decode(ids[:i]) and i < len(ids)
    )
    assert "STOPWORD" not in codec.tokenizer.decode(ids[:split])
    full_before = codec.tokenizer.decode(ids[:split])
    sent = full_before[: full_before.index("ST")]  # the replica held back what may begin a stop
    cont = Continuation(backend, params, ids[:split], sent)
    out, matched = "", None
    for delta in _deltas(ids[split:]):
        text, matched = cont.take(delta)
        out += text
        if matched:
            break
    assert matched == "STOPWORD"
    assert sent + out == "alpha beta "


def test_continuation_leaves_an_eos_out_of_the_text(codec: TokenCodec) -> None:
    """The EOS token that ends a continuation is counted but not decoded, as on a replica."""
    backend = codec.tokenizer.backend_tokenizer
    ids = codec.tokenizer.encode("one two", add_special_tokens=False)
    cont = Continuation(backend, SamplingParams(), ids[:1], codec.tokenizer.decode(ids[:1]))
    deltas = _deltas([*ids[1:], 2], finish="stop", stop_reason=2)
    text = "".join(cont.take(d)[0] for d in deltas)
    assert codec.tokenizer.decode(ids[:1]) + text == "one two"


def _stats(**fields: Any) -> EngineStats:
    return dataclasses.replace(EngineStats.idle("serving"), **fields)


def test_replica_stats_sum_counts_and_keep_the_best_state() -> None:
    """Counts and gauges add up over replicas; the state is serving while any replica serves;
    restarts by kind add up per kind; the batch size and step budget are the largest."""
    a = _stats(
        running=2,
        kv_blocks_used=3,
        kv_blocks_total=10,
        restarts=1,
        restarts_by_kind=(("crash", 1),),
        max_batch_size=4,
        token_budget=256,
    )
    b = _stats(
        running=1,
        kv_blocks_used=1,
        kv_blocks_total=10,
        state="failed",
        restarts_by_kind=(("crash", 2), ("oom", 1)),
        max_batch_size=7,
        token_budget=128,
    )
    total = sum_stats([a, b])
    assert (total.running, total.kv_blocks_used, total.kv_blocks_total) == (3, 4, 20)
    assert total.kv_cache_usage == pytest.approx(0.2)
    assert total.state == "serving"
    assert total.restarts_by_kind == (("crash", 3), ("oom", 1))
    assert (total.max_batch_size, total.token_budget) == (7, 256)
    assert sum_stats([b]).state == "failed"


def test_the_ingress_metrics_say_the_routing_and_each_replicas_hit_rate() -> None:
    """``stoic_routing_info`` names ``--routing``; ``stoic_replica_prefix_cache_hit_rate`` is
    each replica's prefix-cache hits over its prompt tokens (0 before any prompt)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from stoic.engine import Health
    from stoic.ray._board import Posting
    from stoic.ray._stats import ReplicaView

    view = ReplicaView(board=None, idle=EngineStats.idle(), routing="prefix")
    view.postings = [
        Posting("a", 1, _stats(prompt_tokens=800, prefix_cached_tokens=600), Health("serving"), 0),
        Posting("b", 2, _stats(), Health("serving"), 0),
    ]
    registry = CollectorRegistry()
    registry.register(view.collector())
    text = generate_latest(registry).decode()
    assert 'stoic_routing_info{routing="prefix"} 1.0' in text
    assert 'stoic_replica_prefix_cache_hit_rate{replica="a"} 0.75' in text
    assert 'stoic_replica_prefix_cache_hit_rate{replica="b"} 0.0' in text


def test_replica_options_size_serve_for_continuous_batching() -> None:
    """Each replica holds a full batch (max_ongoing_requests = max_num_seqs) and Serve queues
    up to --max-waiting more; Serve's graceful shutdown outlasts the engine's drain;
    autoscaling targets half a batch per replica."""
    config = EngineConfig(max_num_seqs=32, drain_timeout=10.0, max_waiting=100)
    fixed = ReplicaOptions(replicas=3, num_gpus=0).serve_options(config)
    assert fixed["num_replicas"] == 3
    assert fixed["max_ongoing_requests"] == 32
    assert fixed["max_queued_requests"] == 100
    assert fixed["graceful_shutdown_timeout_s"] > config.drain_timeout
    scaled = ReplicaOptions(replicas=2, max_replicas=4, min_replicas=1, num_gpus=0).serve_options(
        config
    )
    assert "num_replicas" not in scaled
    assert scaled["autoscaling_config"] == {
        "min_replicas": 1,
        "initial_replicas": 2,
        "max_replicas": 4,
        "target_ongoing_requests": 16,
    }
    with pytest.raises(ValueError, match="max_replicas"):
        ReplicaOptions(replicas=3, max_replicas=2)


def test_local_replicas_split_the_machines_cores() -> None:
    """On one machine the cores are split between the replicas (Ray CPUs and torch threads);
    what the user set stays."""
    split = ReplicaOptions(replicas=2).split_machine(cpus=8)
    assert (split.num_cpus, split.threads) == (4.0, 4)
    crowded = ReplicaOptions(replicas=3).split_machine(cpus=2)
    assert crowded.threads == 1 and crowded.num_cpus == pytest.approx(2 / 3)
    assert ReplicaOptions(replicas=2, threads=3).split_machine(cpus=8).threads == 3


def test_replica_flags_map_to_options() -> None:
    """``stoic serve --replicas ...`` flags become the replica options; without ``--replicas``
    the server runs no Ray."""
    parser = build_parser()
    args = parser.parse_args(
        [
            "serve",
            "--replicas",
            "2",
            "--max-replicas",
            "4",
            "--replica-cpus",
            "2",
            "--max-ongoing-requests",
            "8",
            "--max-migrations",
            "5",
            "--ray-address",
            "ray://head:10001",
            "--routing",
            "prefix",
        ]
    )
    options = replica_options(args)
    assert options.routing == "prefix"
    resolved = dataclasses.replace(options, num_gpus=0)
    router = resolved.serve_options(EngineConfig())["request_router_config"]
    assert router["request_router_class"] == "stoic.ray._router:PrefixAffinityRouter"
    assert "request_router_config" not in ReplicaOptions(num_gpus=0).serve_options(EngineConfig())
    with pytest.raises(ValueError, match="routing must be one of"):
        ReplicaOptions(routing="random")
    assert (options.replicas, options.max_replicas, options.num_cpus, options.threads) == (
        2,
        4,
        2.0,
        2,
    )
    assert (options.max_ongoing_requests, options.max_migrations) == (8, 5)
    assert args.ray_address == "ray://head:10001"
    plain: argparse.Namespace = parser.parse_args(["serve"])
    assert plain.replicas is None


def test_the_documented_config_file_describes_a_valid_application() -> None:
    """The config file in docs/scale-out.md gives a valid engine config, autoscaling replica
    options and the endpoint's address, as ``build_app`` reads them."""
    yaml = pytest.importorskip("yaml")
    doc = (Path(__file__).resolve().parents[2] / "docs" / "scale-out.md").read_text()
    block = doc.split("```yaml\n", 1)[1].split("```", 1)[0]
    (app,) = yaml.safe_load(block)["applications"]
    assert app["import_path"] == "stoic.ray:build_app"
    config, options, host, port = app_options(app["args"])
    assert (config.model, config.executor, config.max_num_seqs) == ("default", "process", 32)
    assert (host, port) == ("0.0.0.0", 8000)
    scaling = options.resolve_gpus(0, config.device).serve_options(config)["autoscaling_config"]
    assert scaling == {
        "min_replicas": 1,
        "initial_replicas": 2,
        "max_replicas": 4,
        "target_ongoing_requests": 16,
    }


def test_application_args_with_unknown_keys_are_refused() -> None:
    """A misspelt option in a config file is an error, not silently ignored."""
    with pytest.raises(ValueError, match="max_num_seq"):
        app_options({"engine": {"max_num_seq": 4}})
    with pytest.raises(ValueError, match="replica"):
        app_options({"replica": {}})
    with pytest.raises(ValueError, match="replicaz"):
        app_options({"replicas": {"replicaz": 2}})


def test_the_guarded_http_site_serves_on_uvloop() -> None:
    """Serve replicas run uvloop, whose transports are not ``asyncio.Transport`` instances:
    stoic's guarded site (the config-file ingress runs it there) still serves requests."""
    uvloop = pytest.importorskip("uvloop")
    import aiohttp
    from aiohttp import web

    from stoic.http import ServerLimits
    from stoic.http._limits import GuardedSite

    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def main() -> str:
        app = web.Application()
        app.router.add_get("/hello", hello)
        runner = web.AppRunner(app)
        await runner.setup()
        site = GuardedSite(runner, "127.0.0.1", 0, ServerLimits(), on_refuse=lambda _: None)
        await site.start()
        port = runner.addresses[0][1]
        try:
            async with (
                aiohttp.ClientSession() as http,
                http.get(f"http://127.0.0.1:{port}/hello") as response,
            ):
                return await response.text()
        finally:
            await runner.cleanup()

    assert uvloop.run(main()) == "ok"


def test_replicas_get_one_gpu_each_where_the_cluster_has_gpus() -> None:
    """``num_gpus="auto"`` (the default, and ``--replica-gpus``'s): one GPU per replica where
    Ray's cluster reports GPUs and the engine may use one; none on a CPU-only cluster or with
    ``--device cpu``; a number given stays; unresolved it cannot size a deployment."""
    config = EngineConfig()
    auto = ReplicaOptions(replicas=2)
    assert auto.num_gpus == "auto"
    with pytest.raises(ValueError, match="auto"):
        auto.serve_options(config)
    on_gpus = auto.resolve_gpus(8.0, "auto")
    assert on_gpus.serve_options(config)["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 1.0}
    assert auto.resolve_gpus(2.0, "cuda").gpus == 1.0
    assert auto.resolve_gpus(0.0, "auto").serve_options(config)["ray_actor_options"] == {
        "num_cpus": 1
    }
    assert auto.resolve_gpus(8.0, "cpu").gpus == 0.0
    assert ReplicaOptions(num_gpus=0.5).resolve_gpus(8.0, "auto").gpus == 0.5
    assert ReplicaOptions(num_gpus=0).resolve_gpus(8.0, "auto").gpus == 0.0
    with pytest.raises(ValueError, match="num_gpus"):
        ReplicaOptions(num_gpus=-1)


def test_replica_gpus_flag_is_auto_or_a_number() -> None:
    parser = build_parser()
    assert replica_options(parser.parse_args(["serve", "--replicas", "2"])).num_gpus == "auto"
    args = parser.parse_args(["serve", "--replicas", "2", "--replica-gpus", "0.5"])
    assert replica_options(args).num_gpus == 0.5
    for bad in ("-1", "one"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--replicas", "2", "--replica-gpus", bad])


@pytest.mark.parametrize(
    ("device", "gpus", "visible", "refused"),
    [
        ("auto", 1.0, 0, True),  # Ray reserved a GPU, torch sees none (a CPU build, or hidden)
        ("cuda", 0.0, 0, True),  # --device cuda without CUDA
        ("cuda:0", 0.5, 0, True),
        ("auto", 1.0, 1, False),
        ("cuda", 1.0, 1, False),
        ("auto", 0.0, 0, False),  # no GPU asked: the CPU is what was asked for
        ("cpu", 0.0, 0, False),
    ],
)
def test_a_replica_without_the_device_it_was_asked_for_is_refused(
    device: str, gpus: float, visible: int, refused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    build = "torch 2.13.0+cpu (a CPU-only build)"
    if not refused:
        check_replica_device(device, gpus, visible, build)
        return
    with pytest.raises(RuntimeError) as caught:
        check_replica_device(device, gpus, visible, build)
    message = str(caught.value)
    assert "\n" not in message  # one line
    assert build in message and "CUDA_VISIBLE_DEVICES=''" in message
    assert "refusing to serve on the CPU" in message


@pytest.mark.asyncio
async def test_a_replica_given_a_gpu_it_cannot_see_fails_before_loading(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The replica checks its device first: given a GPU while its torch sees none (injected: a
    CPU build), it raises that one line, never starts an engine (a model that does not exist
    would otherwise fail differently), and never serves on the CPU."""
    monkeypatch.setattr(
        "stoic.ray._replica.cuda_devices", lambda: (0, "torch 2.13.0+cpu (a CPU-only build)")
    )
    # __init__ run on a bare namespace: a real EngineReplica's async __del__ is Serve's to await
    replica = types.SimpleNamespace()
    config = EngineConfig(model="/nonexistent/model")
    with pytest.raises(
        RuntimeError, match=re.escape("given 1 GPU(s) from Ray but torch 2.13.0+cpu")
    ):
        await EngineReplica.__init__(replica, config, None, None, 1.0)  # type: ignore[arg-type]
    assert not hasattr(replica, "engine")


@pytest.mark.parametrize(
    ("gpus", "threads", "utilization", "want_threads"),
    [
        (0.5, None, 0.45, None),  # two replicas on one GPU: each sizes for half its memory
        (0.25, 3, 0.225, 3),
        (1.0, 2, 0.9, 2),  # a whole GPU (or more): the configured share of it
        (2.0, None, 0.9, None),
        (0.0, 4, 0.9, 4),  # no GPU: the CPU's sizing, untouched
    ],
)
def test_a_replica_on_a_fraction_of_a_gpu_sizes_for_its_share(
    gpus: float, threads: int | None, utilization: float, want_threads: int | None
) -> None:
    config = replica_config(EngineConfig(), threads, gpus)
    assert config.gpu_memory_utilization == pytest.approx(utilization)
    assert config.threads == want_threads
    mine = EngineConfig(threads=1, gpu_memory_utilization=0.8)
    assert replica_config(mine, 5, 0.5).threads == 1  # the user's own budget stands
    assert replica_config(mine, 5, 0.5).gpu_memory_utilization == pytest.approx(0.4)
