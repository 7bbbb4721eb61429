"""``stoic serve``'s server flags: the HTTP endpoint (address and port, access keys, request and
connection limits, the stored responses of ``POST /v1/responses``), its shutdown drain and its log
lines, and the objects they describe (:func:`http_options`, the config's ``drain_timeout``).

Keys given on the command line show in the process list; ``STOIC_API_KEY`` /
``STOIC_ADMIN_KEY`` or a key file (``--api-key-file``) keep them out of it.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import EngineConfig
from ._argtypes import ArgumentGroup, non_negative_float, port, positive_float, positive_int

if TYPE_CHECKING:
    from ..http import AccessPolicy, ServerLimits

__all__ = ["add_server_args", "http_options", "server_fields"]

_DEFAULTS = EngineConfig()
_MIB = 1024 * 1024


def add_server_args(p: argparse.ArgumentParser) -> None:
    """Add the ``server`` group of flags to ``p``."""
    g = p.add_argument_group(
        "server",
        "the HTTP endpoint: its address, access keys, request and connection limits, stored "
        "responses; the drain on shutdown; log lines",
    )
    _add_listen_args(g)
    _add_access_args(g)
    _add_limit_args(g)
    _add_responses_args(g)


def _add_listen_args(g: ArgumentGroup) -> None:
    """Where the server listens, how long it drains on a signal, what it logs."""
    g.add_argument("--host", default="127.0.0.1", help="(default %(default)s)")
    g.add_argument("--port", type=port, default=8000, help="(default %(default)s)")
    g.add_argument(
        "--drain-timeout",
        type=non_negative_float,
        default=_DEFAULTS.drain_timeout,
        help="seconds running requests get to finish on SIGINT/SIGTERM (default %(default)s)",
    )
    g.add_argument(
        "--log-format",
        choices=["console", "json"],
        default="console",
        help="log lines on stderr: readable, or one JSON object per line (default %(default)s)",
    )
    g.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        default="info",
        help="(default %(default)s)",
    )


def _add_access_args(g: ArgumentGroup) -> None:
    """API keys and the admin key."""
    g.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        help="every /v1/* route needs 'Authorization: Bearer KEY' (repeatable; default: "
        "$STOIC_API_KEY, else none: the API is open)",
    )
    g.add_argument(
        "--api-key-file",
        type=Path,
        action="append",
        metavar="PATH",
        help="more API keys, one per line ('#' starts a comment) (repeatable; default: none)",
    )
    g.add_argument(
        "--admin-key",
        metavar="KEY",
        help="the /admin/* routes need 'Authorization: Bearer KEY' (never an API key); "
        "without one they answer loopback clients only (default: $STOIC_ADMIN_KEY)",
    )
    g.add_argument(
        "--metrics-require-key",
        action="store_true",
        help="/metrics needs an API key (or the admin key) too (default: /metrics is open)",
    )


def _add_limit_args(g: ArgumentGroup) -> None:
    """Request body size and timeouts, idle and open connections."""
    g.add_argument(
        "--max-request-bytes",
        type=positive_int,
        default=32 * _MIB,
        metavar="N",
        help="largest request body; a larger one is a 413 (default %(default)s: 32 MiB, a "
        "128k-token prompt as token ids)",
    )
    g.add_argument(
        "--body-timeout",
        type=positive_float,
        default=60.0,
        metavar="S",
        help="seconds a client has to send a request body; then 408 (default %(default)s)",
    )
    g.add_argument(
        "--header-timeout",
        type=positive_float,
        default=10.0,
        metavar="S",
        help="seconds a client has to complete a request's headers once it started them; then "
        "the connection is closed (default %(default)s)",
    )
    g.add_argument(
        "--keepalive-timeout",
        type=positive_float,
        default=75.0,
        metavar="S",
        help="seconds an idle keep-alive connection stays open (default %(default)s)",
    )
    g.add_argument(
        "--max-connections",
        type=positive_int,
        default=1024,
        metavar="N",
        help="open connections at most; one more is answered 503 and closed (default %(default)s)",
    )


def _add_responses_args(g: ArgumentGroup) -> None:
    """The stored responses of ``POST /v1/responses``."""
    g.add_argument(
        "--responses-db",
        metavar="PATH",
        help="the SQLite database of stored responses (previous_response_id, GET "
        "/v1/responses/ID); ':memory:' keeps them only while the server runs (default: "
        "$STOIC_DATA_DIR/responses.sqlite3, else $XDG_DATA_HOME/stoic/..., else "
        "~/.local/share/stoic/responses.sqlite3)",
    )
    g.add_argument(
        "--responses-retention",
        type=positive_int,
        default=10_000,
        metavar="N",
        help="stored responses kept; storing one more deletes the oldest (default %(default)s)",
    )


def server_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`~stoic.EngineConfig` fields the server flags set (not yet validated: the
    config does that)."""
    return {"drain_timeout": args.drain_timeout}


def http_options(args: argparse.Namespace) -> tuple[AccessPolicy, ServerLimits]:
    """The access policy and limits ``args`` describe.

    :raises ValueError: for a bad key (empty, the admin key reused as an API key).
    :raises OSError: if a key file cannot be read.
    """
    from ..http import AccessPolicy, ServerLimits, load_keys

    admin = args.admin_key or os.environ.get("STOIC_ADMIN_KEY") or None
    access = AccessPolicy(
        api_keys=load_keys(args.api_key, args.api_key_file, "STOIC_API_KEY"),
        admin_key=admin.strip() if admin else None,
        metrics_require_key=args.metrics_require_key,
        tenant_header=args.tenant_header or None,
    )
    limits = ServerLimits(
        max_request_bytes=args.max_request_bytes,
        body_timeout=args.body_timeout,
        header_timeout=args.header_timeout,
        keepalive_timeout=args.keepalive_timeout,
        max_connections=args.max_connections,
    )
    return access, limits
