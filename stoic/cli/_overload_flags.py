"""``stoic serve``'s overload flags: the queue-wait limit (admission by deadline), the tenants'
weights and limits, and the header that names a tenant; the :class:`~stoic.EngineConfig` fields
they set (the tenant header is the HTTP layer's: :func:`~stoic.cli.http_options`)."""

from __future__ import annotations

import argparse
import math
from typing import Any

from ..config import EngineConfig
from ..request import MAX_TENANT_LEN
from ._argtypes import non_negative_float, positive_int

__all__ = ["add_overload_args", "overload_fields", "tenant_weight"]

_DEFAULTS = EngineConfig()


def tenant_weight(text: str) -> tuple[str, float]:
    """The ``--tenant-weight`` type: ``NAME=WEIGHT``, a weight > 0.

    :raises argparse.ArgumentTypeError: for anything else.
    """
    name, sep, value = text.rpartition("=")
    try:
        weight = float(value)
    except ValueError:
        weight = math.nan
    if not sep or not name or len(name) > MAX_TENANT_LEN or not 0 < weight < math.inf:
        raise argparse.ArgumentTypeError(
            f"expected NAME=WEIGHT with a weight > 0 (a name of at most {MAX_TENANT_LEN} "
            f"characters), got {text!r}"
        )
    return name, weight


def add_overload_args(p: argparse.ArgumentParser) -> None:
    """Add the ``overload`` group of flags to ``p``."""
    g = p.add_argument_group(
        "overload and tenants",
        "refusing what cannot start in time, and sharing the steps fairly between tenants "
        "(docs/operations.md, 'Overload and tenants')",
    )
    g.add_argument(
        "--max-queue-wait",
        type=non_negative_float,
        default=_DEFAULTS.max_queue_wait,
        metavar="SECONDS",
        help="refuse at once (429, Retry-After) a request that would wait longer than this to "
        "start, judged from the queue ahead of it and the measured step rate; a request's own "
        "timeout may ask for less; 0: no limit (default %(default)s)",
    )
    g.add_argument(
        "--decode-stretch",
        type=non_negative_float,
        default=0.0,
        metavar="RATIO",
        help="while sequences decode, steps carry prompt chunks only up to RATIO times a "
        "decode-only step's measured duration: a shorter inter-token tail for a longer prefill "
        "(e.g. 2.5); 0: prompt chunks up to --max-num-batched-tokens (default %(default)s)",
    )
    g.add_argument(
        "--tenant-header",
        metavar="NAME",
        help="the request header that names its tenant (e.g. x-tenant-id, set by a gateway); "
        "without it a request's tenant is its API key's ('key-' and 12 hex digits of its "
        "SHA-256), else the default tenant",
    )
    g.add_argument(
        "--tenant-weight",
        type=tenant_weight,
        action="append",
        metavar="NAME=WEIGHT",
        help="a tenant's weight in the fair share of step tokens (repeatable; default 1)",
    )
    g.add_argument(
        "--tenant-max-running",
        type=positive_int,
        metavar="N",
        help="sequences one tenant may have running at once (default: --max-num-seqs)",
    )
    g.add_argument(
        "--tenant-max-queued",
        type=positive_int,
        metavar="N",
        help="requests one tenant may have admitted and not finished; more are refused "
        "with 429 (default: --max-waiting)",
    )


def overload_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`~stoic.EngineConfig` fields the overload flags set."""
    return {
        "max_queue_wait": args.max_queue_wait or None,
        "decode_stretch": args.decode_stretch or None,
        "tenant_weights": dict(args.tenant_weight or ()),
        "tenant_max_running": args.tenant_max_running,
        "tenant_max_queued": args.tenant_max_queued,
    }
