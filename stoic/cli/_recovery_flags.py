"""``stoic serve``'s recovery flags: where the model runs and what happens when it fails (the
executor and its warm spares, restarts, the step watchdog, resuming requests, exiting on a
fatal failure) and the fault injection that exercises it, and the :class:`~stoic.EngineConfig`
fields they set."""

from __future__ import annotations

import argparse
import json
from typing import Any

from pydantic import ValidationError

from ..config import EngineConfig, FaultSpec
from ..errors import StoicError
from ._argtypes import ArgumentGroup, non_negative_float, non_negative_int

__all__ = ["add_recovery_args", "recovery_fields"]

_DEFAULTS = EngineConfig()


def _fault(text: str) -> FaultSpec:
    """The ``--fault`` type: a JSON object as ``POST /admin/faults`` takes it.

    :raises argparse.ArgumentTypeError: for text that is not such an object.
    """
    from ..http._util_schemas import FaultRequest

    try:
        body = FaultRequest.model_validate(json.loads(text))
        return FaultSpec(**body.model_dump())
    except (ValueError, ValidationError, StoicError) as exc:
        raise argparse.ArgumentTypeError(f"invalid fault {text!r}: {exc}") from None


def add_recovery_args(p: argparse.ArgumentParser) -> None:
    """Add the ``recovery`` group of flags to ``p``."""
    g = p.add_argument_group(
        "recovery",
        "where the model runs and what happens when it fails: the executor and its spares, "
        "restarts, the step watchdog, resuming requests; fault injection to exercise them",
    )
    _add_executor_args(g)
    _add_restart_args(g)
    _add_fault_args(g)


def _add_executor_args(g: ArgumentGroup) -> None:
    """Where the model runs: a worker process (with warm spares) or a thread."""
    g.add_argument(
        "--executor",
        choices=["process", "thread"],
        # a server runs the model in a worker process it can replace (docs/benchmarks.md: no
        # measurable throughput cost); EngineConfig's own default stays "thread", so that an
        # embedding application gets no child process unless it asks for one
        default="process",
        help="where the model runs: a worker process, replaced when it dies, segfaults, hangs or "
        "poisons its device; or a thread of the server (default %(default)s)",
    )
    g.add_argument(
        "--executor-spares",
        type=int,
        default=_DEFAULTS.executor_spares,
        metavar="N",
        help="with --executor process: N warm worker processes (weights loaded) that take over "
        "at once when the worker must be replaced (default %(default)s)",
    )
    g.add_argument(
        "--kv-outlives-worker",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --executor process on a CPU: the KV cache lives in memory the server owns "
        "and every worker maps, so after a worker is killed (kill -9, the OOM killer), hangs or "
        "fails a step, its replacement serves on from the same keys and values and resumed "
        "requests recompute only the failed step; a segfault, abort, out-of-memory error or "
        "poisoned device still drops the cache (default: on where possible)",
    )


def _add_restart_args(g: ArgumentGroup) -> None:
    """Restarts and their window, the step watchdog, the started requests' fate, exiting."""
    d = _DEFAULTS
    g.add_argument(
        "--max-restarts",
        type=int,
        default=d.max_restarts,
        metavar="R",
        help="executor restarts allowed within --restart-window (default %(default)s); with "
        "--recovery resume, failures of a suspect request run alone to isolate it are charged "
        "to it and not counted",
    )
    g.add_argument(
        "--restart-window",
        type=non_negative_float,
        default=d.restart_window,
        metavar="T",
        help="more than R executor failures within T seconds fail the engine (default %(default)s)",
    )
    g.add_argument(
        "--step-timeout",
        type=non_negative_float,
        default=d.step_timeout,
        metavar="S",
        help="a step with no progress for S seconds (none of its decoder layers done) is a "
        "hang: with --executor process the worker is killed and replaced, with thread the "
        "engine is failed; a slow step that keeps progressing is never stopped "
        "(default %(default)s)",
    )
    g.add_argument(
        "--recovery",
        choices=["fail", "resume"],
        default=d.recovery,
        help="on an executor failure, end every started request with the error and its partial "
        "output (fail), or re-admit them to continue where they stopped, invisibly to clients "
        "(resume) (default %(default)s)",
    )
    g.add_argument(
        "--max-resumes",
        type=non_negative_int,
        default=d.max_resumes,
        metavar="N",
        help="with --recovery resume: times one request may be resumed; then it fails as under "
        "fail (default %(default)s)",
    )
    g.add_argument(
        "--exit-on-fatal",
        action="store_true",
        help="exit with status 70 when the engine is failed (for an orchestrator to replace it) "
        "(default: off)",
    )


def _add_fault_args(g: ArgumentGroup) -> None:
    """Fault injection: the admin routes, and faults armed at start."""
    g.add_argument(
        "--enable-fault-injection",
        action="store_true",
        help="allow injected faults and the POST/DELETE /admin/faults routes (default: off)",
    )
    g.add_argument(
        "--fault",
        type=_fault,
        action="append",
        default=[],
        metavar="JSON",
        help='a fault armed at start, e.g. \'{"kind": "error", "after_steps": 5}\', or a poison '
        'request: \'{"kind": "error", "match": "XYZZY"}\' (repeatable; default: none)',
    )


def recovery_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`~stoic.EngineConfig` fields the recovery flags set (not yet validated: the
    config does that). ``--exit-on-fatal`` is the server's, not the config's."""
    return {
        "executor": args.executor,
        "executor_spares": args.executor_spares,
        "kv_outlives_worker": args.kv_outlives_worker,
        "max_restarts": args.max_restarts,
        "restart_window": args.restart_window,
        "step_timeout": args.step_timeout,
        "recovery": args.recovery,
        "max_resumes": args.max_resumes,
        "enable_fault_injection": args.enable_fault_injection,
        "faults": tuple(args.fault),
    }
