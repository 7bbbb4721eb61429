"""``stoic serve``'s engine flags (model, cache, scheduling, supervision, faults, executor, Ray)
and the :class:`~stoic.EngineConfig` they describe. The access and limit flags are in
:mod:`stoic._http_args`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ._argtypes import non_negative_float, non_negative_int, port, positive_float, positive_int
from ._http_args import add_http_args, add_responses_args
from .config import KV_CACHE_DTYPES, EngineConfig, FaultSpec
from .errors import StoicError
from .ray._cli import add_ray_args

__all__ = ["add_serve_args", "config_from_args"]

_DEFAULTS = EngineConfig()


def _fault(text: str) -> FaultSpec:
    from .http._util_schemas import FaultRequest

    try:
        body = FaultRequest.model_validate(json.loads(text))
        return FaultSpec(**body.model_dump())
    except (ValueError, ValidationError, StoicError) as exc:
        raise argparse.ArgumentTypeError(f"invalid fault {text!r}: {exc}") from None


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Every ``stoic serve`` flag, grouped as ``stoic serve --help`` shows them."""
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
        "decoding on its quantised weights keeps float32 activations (a bfloat16 KV cache: "
        "--kv-cache-dtype) and takes the "
        "probe's choice for its prefill products only (bfloat16 tiles on a CPU with AMX). "
        "float32 for exact results (default %(default)s)",
    )
    g.add_argument(
        "--quantization",
        default=d.quantization,
        choices=["auto", "gguf", "none"],
        help="a .gguf model's decode steps multiply by the file's own 4- to 8-bit weights (Q4_0, "
        "Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; each matrix on its own type), the same numbers "
        "as the de-quantised copy, up to 6x fewer bytes read a token. auto: where the CPU (x86-64 AVX2) and a C compiler allow (kernels built once, "
        "cached); gguf: required, the start fails without; none: de-quantised weights only "
        "(default %(default)s)",
    )
    g.add_argument(
        "--weight-layouts",
        default=d.weight_layouts,
        choices=["auto", "fast", "compact"],
        help="how a .gguf model's quantised weights are held (docs/operations.md, \"Weight "
        'layouts"). fast: the blocks repacked for steps of few tokens, and for bigger ones '
        "(prefill, many sequences) the int8 layout (AVX-512 VNNI) or a dense copy: 2-3x the "
        "file's bytes; compact: the repacked blocks alone, every step on them: about the file's "
        "bytes, slower prefill; auto: fast where its layouts take at most half the memory "
        "free at load, else compact (default %(default)s)",
    )
    g.add_argument(
        "--deterministic",
        action="store_true",
        default=d.deterministic,
        help="every token's logits computed independently of its batch, of how its prompt was "
        "chunked and of whether its context came from the prefix cache or a re-prefill: the "
        "same greedy (or seeded) text alone or in any batch, and --recovery resume exact, in the "
        "dtype auto picks. Every step runs the C layers on the GGUF file's blocks in a fixed "
        "order (prefill slower); a model off that path is refused at start (default off)",
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
    add_responses_args(p)
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
    g.add_argument(
        "--kv-cache-dtype",
        default=d.kv_cache_dtype,
        choices=list(KV_CACHE_DTYPES),
        help="what the KV cache holds. auto: bfloat16 for a .gguf model decoding on its quantised "
        "weights with --dtype auto (the C attention widens it to float32; half the bytes a "
        "decode step's attention reads: twice the tokens in the same memory), float32 with "
        "--deterministic, else --dtype's type. float32 for exact results (default %(default)s)",
    )
    kv = g.add_mutually_exclusive_group()
    kv.add_argument(
        "--num-kv-blocks",
        type=positive_int,
        help="KV cache size in blocks (default: the worker sizes it after loading the weights, "
        "from what --gpu-memory-utilization leaves once a profiling step ran)",
    )
    kv.add_argument(
        "--kv-cache-memory",
        type=positive_float,
        metavar="GIB",
        help="a cap on the KV cache in GiB (default: 1 on a CPU, whose RAM is the machine's; "
        "none on a GPU)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=non_negative_float,
        metavar="FRACTION",
        help="fraction of the device's TOTAL memory this instance may use: weights, a step's "
        "activations and the KV cache together (vLLM's meaning; on a CPU, of RAM); each warm "
        "spare worker uses as much again, so with --executor-spares N on a GPU it must be "
        f"at most 1/(N+1) (default {d.gpu_memory_utilization})",
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
        weight_layouts=args.weight_layouts,
        deterministic=args.deterministic,
        kv_cache_dtype=args.kv_cache_dtype,
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
