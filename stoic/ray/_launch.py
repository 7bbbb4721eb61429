"""Starting the Serve application: Ray (joined or started), the stats board, the engine
replicas, and the :class:`~stoic.ray.RayEngine` the HTTP application serves."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from .._logging import get_logger
from ..config import EngineConfig
from ..engine import EngineStats, load_token_codec
from ._board import BOARD_NAMESPACE, StatsBoard
from ._ingress import RayEngine
from ._replica import EngineReplica, ReplicaInfo
from ._routing import ROUTER_CLASS, ROUTINGS
from ._stats import ReplicaView

__all__ = ["ReplicaOptions", "engine_deployment", "front_end", "make_board", "run_replicas"]

_log = get_logger("stoic.ray")

#: the Serve application's default name
APP_NAME = "stoic"


@dataclass(frozen=True)
class ReplicaOptions:
    """How many engine replicas, and the Serve options of each.

    :param replicas: replicas to start with (the fixed count without autoscaling).
    :param max_replicas: with autoscaling: at most this many; ``None``: no autoscaling.
    :param min_replicas: with autoscaling: at least this many (default 1).
    :param target_ongoing_requests: with autoscaling: the ongoing requests per replica Serve
        scales to (default: half of ``max_ongoing_requests``).
    :param max_ongoing_requests: requests one replica holds at once (Serve queues the rest and
        routes each to the first replica with room); default the engine's ``max_num_seqs``, so
        a replica's batch is full and nothing queues inside one engine while another idles.
    :param num_cpus: CPUs Ray reserves per replica; ``threads``: its torch threads.
    :param num_gpus: GPUs per replica; ``"auto"`` (the default): 1 where the Ray cluster has
        GPUs and the engine's device is not the CPU, else 0 (:meth:`resolve_gpus`, which the
        launcher and :func:`~stoic.ray.build_app` call once Ray is up).
    :param health_check_period_s: how often Serve asks a replica's engine if it is failed.
    :param health_check_timeout_s: how long a health check may take before it counts failed.
    :param max_migrations: times one request may move to another replica.
    :param routing: ``"least-loaded"`` (Serve's power of two choices on load) or ``"prefix"``
        (the replica most likely to hold the request's prefix, bounded by load:
        :mod:`stoic.ray._routing`).
    """

    replicas: int = 1
    max_replicas: int | None = None
    min_replicas: int | None = None
    target_ongoing_requests: float | None = None
    max_ongoing_requests: int | None = None
    num_cpus: float | None = None
    threads: int | None = None
    num_gpus: float | Literal["auto"] = "auto"
    health_check_period_s: float = 2.0
    health_check_timeout_s: float = 30.0
    max_migrations: int = 3
    routing: str = "least-loaded"

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError("replicas must be >= 1")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, not {self.routing!r}")
        if self.max_replicas is not None and self.max_replicas < max(
            self.replicas, self.min_replicas or 0
        ):
            raise ValueError("max_replicas must be at least replicas and min_replicas")
        if self.num_gpus != "auto" and not (
            isinstance(self.num_gpus, int | float) and self.num_gpus >= 0
        ):
            raise ValueError(f"num_gpus must be 'auto' or a number >= 0, got {self.num_gpus!r}")

    def resolve_gpus(self, cluster_gpus: float, device: str) -> ReplicaOptions:
        """These options with ``num_gpus="auto"`` made a number: one GPU per replica where the
        cluster has any (``cluster_gpus``: Ray's ``cluster_resources()["GPU"]``) and the engine's
        ``device`` may be a GPU (``auto`` or ``cuda...``), else none. A number stays."""
        if self.num_gpus != "auto":
            return self
        wants_gpu = device == "auto" or device.startswith("cuda")
        return dataclasses.replace(self, num_gpus=1.0 if cluster_gpus >= 1 and wants_gpu else 0.0)

    def split_machine(self, cpus: int | None = None) -> ReplicaOptions:
        """These options with this machine's cores split between the replicas (for a local
        Ray): ``num_cpus`` and ``threads`` where not set."""
        cpus = cpus or os.cpu_count() or 1
        most = self.max_replicas or self.replicas
        share = cpus / most
        return dataclasses.replace(
            self,
            num_cpus=self.num_cpus if self.num_cpus is not None else share,
            threads=self.threads if self.threads is not None else max(1, int(share)),
        )

    @property
    def gpus(self) -> float:
        """``num_gpus`` once resolved.

        :raises ValueError: it is still ``"auto"`` (:meth:`resolve_gpus` first).
        """
        if self.num_gpus == "auto":
            raise ValueError("num_gpus='auto' is resolved against the Ray cluster first")
        return float(self.num_gpus)

    def serve_options(self, config: EngineConfig) -> dict[str, Any]:
        """The ``serve.deployment`` options of the engine replicas (``num_gpus`` resolved)."""
        ongoing = self.max_ongoing_requests or config.max_num_seqs
        actor: dict[str, Any] = {"num_cpus": self.num_cpus if self.num_cpus is not None else 1}
        if self.gpus:
            actor["num_gpus"] = self.gpus
        options: dict[str, Any] = {
            "ray_actor_options": actor,
            "max_ongoing_requests": ongoing,
            # beyond this many waiting for a replica, a 429 (the engine's --max-waiting, which
            # a replica never reaches: Serve holds the requests it has no room for)
            "max_queued_requests": config.max_waiting,
            "health_check_period_s": self.health_check_period_s,
            "health_check_timeout_s": self.health_check_timeout_s,
            # Serve stops routing to a stopping replica and waits for its requests; then the
            # engine's own drain (drain_timeout) runs in __del__
            "graceful_shutdown_wait_loop_s": 1.0,
            "graceful_shutdown_timeout_s": config.drain_timeout + 5.0,
        }
        if self.routing == "prefix":
            options["request_router_config"] = {
                "request_router_class": ROUTER_CLASS,
                "request_router_kwargs": {"epsilon": 0.25},
            }
        if self.max_replicas is None:
            options["num_replicas"] = self.replicas
        else:
            options["autoscaling_config"] = {
                "min_replicas": self.min_replicas if self.min_replicas is not None else 1,
                "initial_replicas": self.replicas,
                "max_replicas": self.max_replicas,
                "target_ongoing_requests": self.target_ongoing_requests or max(1, ongoing // 2),
            }
        return options


def engine_deployment(
    config: EngineConfig, options: ReplicaOptions, board: str | None, name: str = "EngineReplica"
) -> Any:
    """The engine replicas as a bound Serve application (``serve.run`` it, or bind it into an
    application of your own); ``num_gpus="auto"`` is resolved against the Ray cluster this
    process joined (none joined: no GPUs)."""
    from ray import serve

    options = options.resolve_gpus(cluster_gpus(), config.device)
    deployment = serve.deployment(name=name, **options.serve_options(config))(EngineReplica)
    return deployment.bind(config, options.threads, board, options.gpus)


def cluster_gpus() -> float:
    """The GPUs of the Ray cluster this process joined (0 when it joined none)."""
    import ray

    if not ray.is_initialized():
        return 0.0
    resources: dict[str, float] = ray.cluster_resources()  # type: ignore[no-untyped-call]
    return float(resources.get("GPU", 0.0))


def make_board(name: str) -> Any:
    """The named :class:`~stoic.ray._board.StatsBoard` actor (created, or found), on this
    process's node: the ingress reads it, and a node lost with the board on it would blind the
    ingress to the replicas that survive (the ingress's own node lost ends everything anyway).
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
    return (
        ray.remote(StatsBoard)
        .options(
            name=name,
            namespace=BOARD_NAMESPACE,
            num_cpus=0,
            get_if_exists=True,
            scheduling_strategy=here,
        )
        .remote()
    )


@contextlib.asynccontextmanager
async def front_end(
    handle: Any, config: EngineConfig, options: ReplicaOptions, board: Any
) -> AsyncIterator[RayEngine]:
    """The :class:`RayEngine` over the replicas behind ``handle`` (waits for one to answer),
    reading their ``board`` while in use.

    :raises ~stoic.errors.ModelUnavailable: the model's tokenizer cannot be loaded here.
    """
    codec = await asyncio.to_thread(load_token_codec, config)
    info: ReplicaInfo = await handle.info.remote()
    # what /metrics shows before any replica has reported
    idle = EngineStats.idle("starting", token_budget=config.max_num_batched_tokens or 0)
    view = ReplicaView(board, idle, routing=options.routing)
    with contextlib.suppress(Exception):
        await view.refresh()
    view_task = asyncio.create_task(view.run())
    try:
        yield RayEngine(
            handle,
            config,
            codec,
            model_name=info.model_name,
            max_model_len=info.max_model_len,
            view=view,
            max_migrations=options.max_migrations,
        )
    finally:
        view_task.cancel()


@contextlib.asynccontextmanager
async def run_replicas(
    config: EngineConfig,
    options: ReplicaOptions,
    *,
    address: str | None = None,
    app_name: str = APP_NAME,
    ray_init: dict[str, Any] | None = None,
) -> AsyncIterator[RayEngine]:
    """Run the engine replicas on Ray and yield the engine that serves through them; delete the
    application (draining every replica) on exit.

    Joins the Ray cluster at ``address`` (or ``$RAY_ADDRESS``, or the one this process already
    joined); with none, starts a local Ray (stopped on exit) and splits this machine's cores
    between the replicas. Returns once every replica serves.

    :raises RuntimeError: Serve could not deploy the replicas (e.g. a replica's engine could not
        start: the error is in the replica's log).
    :raises ~stoic.errors.ModelUnavailable: the model's tokenizer cannot be loaded here.
    """
    import ray
    from ray import serve

    started_ray = False
    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS")
        if address is None:
            options = options.split_machine()
            started_ray = True
        ray.init(address=address, **(ray_init or {}))
    options = options.resolve_gpus(cluster_gpus(), config.device)
    board_name = f"{app_name}-board"
    board = make_board(board_name)
    try:
        serve.start(proxy_location="Disabled")  # the ingress is stoic's own HTTP server
        app = engine_deployment(config, options, board_name)
        _log.info("ray.deploying", app=app_name, **options.serve_options(config))
        handle = await asyncio.to_thread(serve.run, app, name=app_name, route_prefix=None)
        async with front_end(handle, config, options, board) as engine:
            _log.info("ray.serving", app=app_name, model=engine.model_name)
            yield engine
    finally:
        with contextlib.suppress(Exception):
            await asyncio.to_thread(serve.delete, app_name)
        with contextlib.suppress(Exception):
            ray.kill(board)
        if started_ray:
            serve.shutdown()  # type: ignore[no-untyped-call]
            ray.shutdown()
