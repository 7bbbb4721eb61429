"""``stoic serve``: the OpenAI-compatible server from the command line.

Exit status: 0 after a clean shutdown (SIGINT/SIGTERM, whenever it arrives: see :func:`main`),
1 when the engine cannot start for another reason (the port is taken, the device fails, the
first worker process dies), 2 for a usage or configuration error (bad arguments; a model that
is missing or unusable, reported on one line), 70 when the engine fails and ``--exit-on-fatal``
is set. ``stoic cache`` lists and prunes converted models (:mod:`stoic._cache_cli`).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
from pydantic import ValidationError

from ._argtypes import non_negative_float, non_negative_int, port, positive_int
from ._cli_signals import cancel_on_signals, exit_on_signals
from ._http_args import add_http_args, http_options
from ._logging import PROCESSORS, get_logger
from ._version import installed_version
from .config import EngineConfig, FaultSpec
from .errors import ModelUnavailable, StoicError
from .ray._cli import add_ray_args

__all__ = ["build_parser", "config_from_args", "configure_logging", "main"]

if TYPE_CHECKING:
    from .http import AccessPolicy, ServerLimits

_log = get_logger("stoic.cli")
_DEFAULTS = EngineConfig()


def configure_logging(fmt: str = "console", level: str = "info") -> None:
    """Route structlog and stdlib logging to stderr, one event per line in JSON mode.

    Every event carries a timestamp, level, logger name and the context variables bound for
    the current request (``request_id``). This is the ``stoic`` command's (an application's)
    choice: it replaces the root logger's handlers and structlog's configuration. The library
    itself configures neither (:mod:`stoic._logging`).
    """
    level_no = logging.getLevelNamesMapping()[level.upper()]
    # structlog's own events (stoic's and the application's) arrive as event dictionaries and
    # skip foreign_pre_chain; other libraries' records arrive as text and go through it
    enrich: list[Any] = [
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    # a traceback (only bugs carry one: expected failures are single events) shows the locals
    # of every frame only at debug level, where 20 lines a frame are what was asked for
    debug = level_no <= logging.DEBUG
    renderer: Any
    if fmt == "json":
        enrich.append(
            structlog.processors.ExceptionRenderer(
                structlog.tracebacks.ExceptionDictTransformer(show_locals=debug)
            )
        )
        renderer = structlog.processors.JSONRenderer()
        _quiet_progress_bars()
    else:
        renderer = structlog.dev.ConsoleRenderer(
            colors=sys.stderr.isatty(), exception_formatter=_exception_formatter(debug)
        )
    structlog.configure(
        processors=list(PROCESSORS),
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.contextvars.merge_contextvars],
            processors=[
                *enrich,
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                renderer,
            ],
        )
    )
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level_no)
    logging.captureWarnings(True)


def _exception_formatter(debug: bool) -> Any:
    """How the console shows a traceback: Python's own compact format, or at debug level rich's
    with every frame's locals (when rich is installed)."""
    if debug and importlib.util.find_spec("rich") is not None:
        return structlog.dev.RichTracebackFormatter(show_locals=True)
    return structlog.dev.plain_traceback


def _quiet_progress_bars() -> None:
    """No progress bars on stderr: in JSON mode every line must be a JSON object."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover
        return
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]


def _fault(text: str) -> FaultSpec:
    from .http._util_schemas import FaultRequest

    try:
        body = FaultRequest.model_validate(json.loads(text))
        return FaultSpec(**body.model_dump())
    except (ValueError, ValidationError, StoicError) as exc:
        raise argparse.ArgumentTypeError(f"invalid fault {text!r}: {exc}") from None


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    d = _DEFAULTS
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        default=d.model,
        help="a model directory, a .gguf file, or 'default': SmolLM2-135M-Instruct, shipped "
        "with stoic (default '%(default)s')",
    )
    g.add_argument("--served-model-name", help="the name clients use (default: the model's)")
    g.add_argument(
        "--device",
        default=d.device,
        help="auto (cuda when present, else cpu), cpu, cuda, cuda:N (default %(default)s)",
    )
    g.add_argument(
        "--dtype",
        default=d.dtype,
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: bfloat16 on a GPU (float16 where bfloat16 is unsupported); on a CPU, float32 "
        "or bfloat16, whichever a short matrix-product probe measures faster (bfloat16 must "
        "win by 10%%; run once per CPU model and torch version, cached); a .gguf Llama model "
        "decoding on its quantised weights keeps float32 activations and KV cache and takes the "
        "probe's choice for its prefill products only (bfloat16 tiles on a CPU with AMX). "
        "float32 for exact results (default %(default)s)",
    )
    g.add_argument(
        "--quantization",
        default=d.quantization,
        choices=["auto", "gguf", "none"],
        help="a .gguf model's decode steps multiply by the file's own 4- to 8-bit weights (Q4_0, "
        "Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; each matrix on its own type), the same numbers "
        "as the de-quantised copy, up to 6x fewer bytes read a "
        "token. auto: where the CPU (x86-64 AVX2) and a C compiler allow (kernels built once, "
        "cached); gguf: required, the start fails without; none: de-quantised weights only "
        "(default %(default)s)",
    )
    g.add_argument(
        "--max-model-len",
        type=positive_int,
        help="context length, prompt plus generated tokens (default: the model's)",
    )
    g.add_argument(
        "--cache-dir",
        type=Path,
        help="where converted GGUF models are cached (default: $STOIC_CACHE_DIR, else "
        "~/.cache/stoic; see `stoic cache`)",
    )
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="(default %(default)s)")
    g.add_argument("--port", type=port, default=8000, help="(default %(default)s)")
    g.add_argument(
        "--drain-timeout",
        type=non_negative_float,
        default=d.drain_timeout,
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
    add_http_args(p)
    g = p.add_argument_group("scheduling and KV cache")
    g.add_argument(
        "--max-num-seqs",
        type=positive_int,
        default=d.max_num_seqs,
        help="sequences decoding at once (default %(default)s)",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=d.max_num_batched_tokens,
        help="tokens per step (default: 256 on a CPU, 2048 on a GPU, at least --max-num-seqs)",
    )
    g.add_argument(
        "--max-waiting",
        type=positive_int,
        default=d.max_waiting,
        help="requests admitted and not yet finished; more are refused with 429 "
        "(default %(default)s)",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=d.enable_prefix_caching,
        help="reuse the KV blocks of prompt prefixes already computed (default: on)",
    )
    g.add_argument(
        "--block-size",
        type=positive_int,
        default=d.block_size,
        help="tokens per KV block (default %(default)s)",
    )
    kv = g.add_mutually_exclusive_group()
    kv.add_argument(
        "--num-kv-blocks",
        type=positive_int,
        help="KV cache size in blocks (default: sized by --kv-cache-memory on a CPU, "
        "--gpu-memory-utilization on a GPU)",
    )
    kv.add_argument(
        "--kv-cache-memory",
        type=non_negative_float,
        metavar="GIB",
        help=f"KV cache size in GiB on CPU (default {d.kv_cache_memory_gib})",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=non_negative_float,
        help=f"fraction of free GPU memory for the KV cache (default {d.gpu_memory_utilization})",
    )
    g.add_argument(
        "--threads",
        type=positive_int,
        default=d.threads,
        metavar="N",
        help="compute threads of a step (default: the CPUs this process may use: its affinity "
        "mask, capped by its cgroup's CPU quota)",
    )
    g.add_argument(
        "--adapt-threads",
        action=argparse.BooleanOptionalAction,
        default=d.adapt_threads,
        help="run steps on fewer threads while other processes take CPUs from this one, and "
        "grow back when CPUs go idle: next to a busy neighbour a full-width pool collapses "
        "(default: on)",
    )
    g = p.add_argument_group("failure handling")
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
        default=d.executor_spares,
        metavar="N",
        help="with --executor process: N warm worker processes (weights loaded) that take over "
        "at once when the worker must be replaced (default %(default)s)",
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
    add_ray_args(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stoic", description="An LLM inference server that keeps serving through failures."
    )
    parser.add_argument("--version", action="version", version=f"stoic {installed_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    _add_serve_args(serve)
    from ._cache_cli import add_cache_parser  # imports stoic.model, and so torch

    add_cache_parser(sub)
    return parser


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The :class:`~stoic.EngineConfig` the ``serve`` arguments describe."""
    extra: dict[str, Any] = {}
    if args.kv_cache_memory is not None:
        extra["kv_cache_memory_gib"] = args.kv_cache_memory
    if args.gpu_memory_utilization is not None:
        extra["gpu_memory_utilization"] = args.gpu_memory_utilization
    return EngineConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        device=args.device,
        dtype=args.dtype,
        quantization=args.quantization,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_waiting=args.max_waiting,
        enable_prefix_caching=args.enable_prefix_caching,
        max_model_len=args.max_model_len,
        cache_dir=args.cache_dir,
        max_restarts=args.max_restarts,
        restart_window=args.restart_window,
        step_timeout=args.step_timeout,
        enable_fault_injection=args.enable_fault_injection,
        faults=tuple(args.fault),
        executor=args.executor,
        executor_spares=args.executor_spares,
        threads=args.threads,
        adapt_threads=args.adapt_threads,
        drain_timeout=args.drain_timeout,
        recovery=args.recovery,
        max_resumes=args.max_resumes,
        **extra,
    )


async def _serve(args: argparse.Namespace, access: AccessPolicy, limits: ServerLimits) -> int:
    interrupted = cancel_on_signals()  # until serve() handles them
    try:
        return await _serve_until_stopped(args, access, limits)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if interrupted.is_set() and task is not None and task.uncancel() == 0:
            return 0
        raise


async def _serve_until_stopped(
    args: argparse.Namespace, access: AccessPolicy, limits: ServerLimits
) -> int:
    from .http import is_loopback, serve

    config = config_from_args(args)
    if args.replicas is not None:  # scale-out on Ray Serve (stoic.ray)
        from .ray._cli import serve_replicas

        return await serve_replicas(args, config, access, limits)
    if not access.api_keys and not is_loopback(args.host):
        _log.warning(
            "stoic.no_api_key",
            host=args.host,
            hint="anyone who reaches the port can generate: set --api-key or STOIC_API_KEY",
        )
    _log.info("stoic.starting", model=config.model, device=config.device, dtype=config.dtype)

    def ready(url: str, engine: Any) -> None:  # the Engine that serve() started
        stats = engine.stats()
        loaded = engine.loaded
        _log.info(
            "stoic.ready",
            url=url,
            model=engine.model_name,
            device=str(loaded.device),
            dtype=str(loaded.dtype).removeprefix("torch."),
            dense_dtype=str(loaded.dense_dtype or loaded.dtype).removeprefix("torch."),
            kv_blocks=stats.kv_blocks_total,
            kv_tokens=stats.kv_blocks_total * config.block_size,
            max_model_len=engine.max_model_len,
            fault_injection=config.enable_fault_injection,
            exit_on_fatal=args.exit_on_fatal,
            api_keys=len(access.api_keys),
            admin_key=access.admin_key is not None,
        )

    try:
        # the port is bound before the model loads: /health says "starting" meanwhile, and a
        # taken port fails at once
        return await serve(
            config,
            host=args.host,
            port=args.port,
            drain_timeout=args.drain_timeout,
            exit_on_fatal=args.exit_on_fatal,
            on_ready=ready,
            access=access,
            limits=limits,
        )
    except StoicError as exc:
        _log.error("stoic.start_failed", error=type(exc).__name__, message=exc.message)
        return 2 if isinstance(exc, ModelUnavailable) else 1  # a bad --model is a config error
    except OSError as exc:  # e.g. the port is taken
        _log.error("stoic.start_failed", error=type(exc).__name__, message=str(exc))
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``stoic`` command; returns the exit status.

    SIGINT or SIGTERM at any moment ends ``stoic serve`` with status 0 and no traceback
    (:mod:`stoic._cli_signals`).
    """
    with exit_on_signals() as restore:
        try:
            return _main(argv, restore)
        except KeyboardInterrupt:  # after the server: it leaves Python's default handler
            return 0


def _main(argv: Sequence[str] | None, restore_signals: Callable[..., None]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command != "serve":
        restore_signals()  # Ctrl-C in `stoic cache prune` is an interruption, not a success
    if args.command == "cache":
        from ._cache_cli import run_cache

        return run_cache(args)
    if args.command != "serve":
        parser.print_help(sys.stderr)
        return 2
    if args.fault and not args.enable_fault_injection:
        parser.error("--fault needs --enable-fault-injection")  # exits with status 2
    try:
        config_from_args(args)
        access, limits = http_options(args)  # key files are read once, here
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    configure_logging(args.log_format, args.log_level)
    if not _model_usable(args.model):
        return 2
    # SIGINT cancels asyncio.run's task until _serve installs its handlers; SIGTERM exits
    restore_signals(signal.SIGINT)
    return asyncio.run(_serve(args, access, limits))


def _model_usable(model: str) -> bool:
    """Check ``--model`` cheaply before anything starts (:func:`stoic.model.check_model_source`).

    An unusable model is logged as one ``stoic.start_failed`` line, the only output, saying what
    is wrong and what to do; returns False then.
    """
    from .model import check_model_source

    try:
        check_model_source(model)
    except ModelUnavailable as exc:
        _log.error("stoic.start_failed", error=type(exc).__name__, message=exc.message)
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
