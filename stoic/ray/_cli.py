"""``stoic serve --replicas N``: the command-line side of :mod:`stoic.ray` (importable without
Ray installed: ``stoic serve --help`` lists these flags everywhere)."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import TYPE_CHECKING, Any

from .._argtypes import (
    auto_or_non_negative_float,
    non_negative_float,
    non_negative_int,
    positive_int,
)
from .._logging import get_logger
from ..config import EngineConfig
from ..errors import StoicError

if TYPE_CHECKING:
    from ..http import AccessPolicy, ServerLimits
    from ._launch import ReplicaOptions

__all__ = ["add_ray_args", "replica_options", "serve_replicas"]

_log = get_logger("stoic.cli")


def add_ray_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "scale-out on Ray Serve (needs the ray extra: pip install -e '.[ray]'; docs/scale-out.md)"
    )
    g.add_argument(
        "--replicas",
        type=positive_int,
        metavar="N",
        help="serve N engine replicas on Ray Serve behind this server's endpoint; every engine "
        "flag applies to each replica; a request whose replica dies or fails continues on "
        "another (default: no Ray, one engine in this process)",
    )
    g.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="with --replicas: join this Ray cluster (default: $RAY_ADDRESS, else start a local "
        "Ray and split this machine's cores between the replicas)",
    )
    g.add_argument(
        "--replica-cpus",
        type=non_negative_float,
        metavar="C",
        help="CPUs Ray reserves per replica (and its torch threads) (default: a local Ray's "
        "cores divided by the replicas; 1 on a cluster)",
    )
    g.add_argument(
        "--replica-gpus",
        type=auto_or_non_negative_float,
        default="auto",
        metavar="G",
        help="GPUs Ray reserves per replica; a replica asked for GPUs that sees none fails at "
        "start instead of serving on the CPU (default %(default)s: 1 where the Ray cluster has "
        "GPUs and --device is not cpu, else 0)",
    )
    g.add_argument(
        "--max-ongoing-requests",
        type=positive_int,
        metavar="N",
        help="requests one replica holds at once; Serve queues the rest and routes each to a "
        "replica with room (default: --max-num-seqs, a full batch)",
    )
    g.add_argument(
        "--max-replicas",
        type=positive_int,
        metavar="N",
        help="autoscale on ongoing requests up to N replicas (--replicas is the initial count) "
        "(default: no autoscaling)",
    )
    g.add_argument(
        "--min-replicas",
        type=non_negative_int,
        metavar="N",
        help="with --max-replicas: never fewer than N replicas (default 1)",
    )
    g.add_argument(
        "--target-ongoing-requests",
        type=non_negative_float,
        metavar="R",
        help="with --max-replicas: ongoing requests per replica to scale to (default: half of "
        "--max-ongoing-requests)",
    )
    g.add_argument(
        "--max-migrations",
        type=non_negative_int,
        default=3,
        metavar="N",
        help="times one request may move to another replica when its replica dies or fails "
        "(default %(default)s)",
    )


def replica_options(args: argparse.Namespace) -> ReplicaOptions:
    """The :class:`~stoic.ray.ReplicaOptions` the flags describe.

    :raises ValueError: inconsistent replica counts.
    """
    from ._launch import ReplicaOptions

    cpus = args.replica_cpus
    return ReplicaOptions(
        replicas=args.replicas,
        max_replicas=args.max_replicas,
        min_replicas=args.min_replicas,
        target_ongoing_requests=args.target_ongoing_requests,
        max_ongoing_requests=args.max_ongoing_requests,
        num_cpus=cpus,
        threads=max(1, int(cpus)) if cpus else None,
        num_gpus=args.replica_gpus,
        max_migrations=args.max_migrations,
    )


async def serve_replicas(
    args: argparse.Namespace, config: EngineConfig, access: AccessPolicy, limits: ServerLimits
) -> int:
    """Run ``stoic serve --replicas N``: the replicas on Ray, stoic's HTTP server in this process.

    :returns: the exit status (0; 1 when Ray or the replicas cannot start; 2 when Ray is not
        installed).
    """
    try:
        # stoic.ray imports Ray only where it uses it, so check Ray Serve here, before any work:
        # `make serve` installs no Ray, and a missing extra is a clear exit 2, not a traceback
        for module in ("ray", "ray.serve"):  # each: a cached submodule skips its parent
            importlib.import_module(module)
        from ._launch import run_replicas
    except ImportError as exc:
        _log.error(
            "stoic.start_failed",
            error="ImportError",
            message=f"--replicas needs Ray Serve: in the checkout, {sys.executable} -m pip install "
            f"-e '.[ray]' ({exc})",
        )
        return 2
    from ..http import serve

    def ready(url: str, engine: Any) -> None:
        _log.info(
            "stoic.ready",
            url=url,
            model=engine.model_name,
            replicas=len(engine.view.postings),
            max_model_len=engine.max_model_len,
        )

    try:
        async with run_replicas(config, replica_options(args), address=args.ray_address) as engine:
            return await serve(
                engine,
                host=args.host,
                port=args.port,
                drain_timeout=args.drain_timeout,
                on_ready=ready,
                access=access,
                limits=limits,
            )
    except (StoicError, RuntimeError, OSError) as exc:
        _log.error("stoic.start_failed", error=type(exc).__name__, message=str(exc))
        return 1
