"""``stoic serve``'s scale-out flags: engine replicas on Ray Serve (their number, the cluster,
the CPUs and GPUs each reserves, autoscaling, how often a request may move between them).

Only flags: :func:`stoic.ray._cli.replica_options` turns them into the replicas' options and
:func:`stoic.ray._cli.serve_replicas` runs them. Here, not in :mod:`stoic.ray`, because the CLI
is the layer above it: ``stoic serve --help`` lists them with Ray not installed, and
:mod:`stoic.ray` imports nothing of the CLI's (its argument types included).
"""

from __future__ import annotations

import argparse

from ._argtypes import (
    ArgumentGroup,
    auto_or_non_negative_float,
    non_negative_float,
    non_negative_int,
    positive_int,
)

__all__ = ["add_scale_out_args"]


def add_scale_out_args(p: argparse.ArgumentParser) -> None:
    """Add the ``scale-out`` group of flags to ``p``."""
    g = p.add_argument_group(
        "scale-out",
        "engine replicas on Ray Serve (needs the ray extra: pip install -e '.[ray]'; "
        "docs/scale-out.md)",
    )
    _add_replica_args(g)
    _add_autoscaling_args(g)


def _add_replica_args(g: ArgumentGroup) -> None:
    """How many replicas, on which cluster, what each reserves and holds."""
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


def _add_autoscaling_args(g: ArgumentGroup) -> None:
    """Autoscaling between a minimum and a maximum, and migrations between replicas."""
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
    g.add_argument(
        "--routing",
        choices=["least-loaded", "prefix"],
        default="least-loaded",
        help="which replica a request goes to: the less loaded of two (least-loaded), or the "
        "one most likely to hold its prompt's prefix in its prefix cache, bounded by load "
        "(prefix) (default %(default)s)",
    )
