"""``stoic serve --replicas N``: the command-line side of :mod:`stoic.ray`, from parsed flags to
running replicas (importable without Ray installed). The flags themselves are the CLI's
(:mod:`stoic.cli._scale_out_flags`: the layers above may import this one, not the reverse)."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import TYPE_CHECKING, Any

from .._logging import get_logger
from ..config import EngineConfig
from ..errors import StoicError

if TYPE_CHECKING:
    from ..http import AccessPolicy, ServerLimits
    from ._launch import ReplicaOptions

__all__ = ["replica_options", "serve_replicas"]

_log = get_logger("stoic.cli")


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
        routing=args.routing,
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
