"""``stoic serve``'s engine flags: batching and admission limits, the KV cache (its blocks, dtype
and memory) and the compute threads, and the :class:`~stoic.EngineConfig` fields they set."""

from __future__ import annotations

import argparse
from typing import Any

from ..config import KV_CACHE_DTYPES, SPECULATIVE_AUTO_BATCH, SPECULATIVE_MODES, EngineConfig
from ._argtypes import ArgumentGroup, non_negative_float, positive_float, positive_int

__all__ = ["add_engine_args", "engine_fields"]

_DEFAULTS = EngineConfig()


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Add the ``engine`` group of flags to ``p``."""
    g = p.add_argument_group(
        "engine",
        "how requests are batched and admitted, the KV cache and the memory it takes, the "
        "compute threads of a step",
    )
    _add_batching_args(g)
    _add_kv_cache_args(g)
    _add_thread_args(g)


def _add_batching_args(g: ArgumentGroup) -> None:
    """Sequences and tokens a step takes; requests admitted at once."""
    d = _DEFAULTS
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
        "--speculative",
        choices=SPECULATIVE_MODES,
        default=d.speculative,
        help="speculative decoding by prompt lookup: a decoding sequence verifies tokens "
        "proposed from its own prompt and output in the same step; ngram: whenever one is "
        f"found, auto: only while at most {SPECULATIVE_AUTO_BATCH} sequences run "
        "(default %(default)s)",
    )
    g.add_argument(
        "--num-speculative-tokens",
        type=positive_int,
        default=d.num_speculative_tokens,
        help="the most proposed tokens a sequence verifies in one step, 1 to 16 "
        "(default %(default)s)",
    )
    g.add_argument(
        "--max-waiting",
        type=positive_int,
        default=d.max_waiting,
        help="requests admitted and not yet finished; more are refused with 429 "
        "(default %(default)s)",
    )


def _add_kv_cache_args(g: ArgumentGroup) -> None:
    """The KV cache: prefix reuse, block size, dtype, and its size (blocks, GiB or a fraction)."""
    d = _DEFAULTS
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
    size = g.add_mutually_exclusive_group()
    size.add_argument(
        "--num-kv-blocks",
        type=positive_int,
        help="KV cache size in blocks (default: the worker sizes it after loading the weights, "
        "from what --gpu-memory-utilization leaves once a profiling step ran)",
    )
    size.add_argument(
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


def _add_thread_args(g: ArgumentGroup) -> None:
    """The compute threads of a step, and whether their number follows the idle CPUs."""
    d = _DEFAULTS
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


def engine_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`~stoic.EngineConfig` fields the engine flags set (not yet validated: the
    config does that). ``--kv-cache-memory`` and ``--gpu-memory-utilization`` only when given,
    so that the config's own defaults apply otherwise."""
    fields: dict[str, Any] = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_waiting": args.max_waiting,
        "speculative": args.speculative,
        "num_speculative_tokens": args.num_speculative_tokens,
        "enable_prefix_caching": args.enable_prefix_caching,
        "block_size": args.block_size,
        "kv_cache_dtype": args.kv_cache_dtype,
        "num_kv_blocks": args.num_kv_blocks,
        "threads": args.threads,
        "adapt_threads": args.adapt_threads,
    }
    if args.kv_cache_memory is not None:
        fields["kv_cache_memory_gib"] = args.kv_cache_memory
    if args.gpu_memory_utilization is not None:
        fields["gpu_memory_utilization"] = args.gpu_memory_utilization
    return fields
