"""``stoic serve``'s model flags: what is served and how its weights compute (the model, its name,
device and dtype, quantised weights and their layouts, deterministic mode, context length, the
converted-model cache), and the :class:`~stoic.EngineConfig` fields they set."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..config import EngineConfig
from ._argtypes import ArgumentGroup, positive_int

__all__ = ["add_model_args", "model_fields"]

_DEFAULTS = EngineConfig()


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Add the ``model`` group of flags to ``p``."""
    g = p.add_argument_group(
        "model",
        "what is served and how its weights compute: the model, its device and dtype, a GGUF "
        "file's quantised weights, the cache of converted models",
    )
    _add_source_args(g)
    _add_precision_args(g)
    _add_gguf_args(g)


def _add_source_args(g: ArgumentGroup) -> None:
    """Which model, under which name, where its conversions are cached, its context length."""
    d = _DEFAULTS
    g.add_argument(
        "--model",
        default=d.model,
        help="a model directory, a .gguf file, or 'default': SmolLM2-135M-Instruct, shipped "
        "with stoic (default '%(default)s')",
    )
    g.add_argument("--served-model-name", help="the name clients use (default: the model's)")
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


def _add_precision_args(g: ArgumentGroup) -> None:
    """The device, the activations' dtype, deterministic mode."""
    d = _DEFAULTS
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
        "--deterministic",
        action="store_true",
        default=d.deterministic,
        help="every token's logits computed independently of its batch, of how its prompt was "
        "chunked and of whether its context came from the prefix cache or a re-prefill: the "
        "same greedy (or seeded) text alone or in any batch, and --recovery resume exact, in the "
        "dtype auto picks. Every step runs the C layers on the GGUF file's blocks in a fixed "
        "order (prefill slower); a model off that path is refused at start (default off)",
    )


def _add_gguf_args(g: ArgumentGroup) -> None:
    """How a GGUF file's quantised weights are used and held."""
    d = _DEFAULTS
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
        "--load-format",
        default=d.load_format,
        choices=["auto", "dummy"],
        help="where the weights come from. auto: the model's own (a .gguf file's blocks, a "
        "directory's safetensors); dummy: random weights made on the device in the compute "
        "dtype from the model's config.json (a directory needs no weight files; the outputs are "
        "meaningless, the shapes, memory and speed are the model's: for trying a device or a "
        "size without the weights, e.g. --model shapes/llama3.1-8b) (default %(default)s)",
    )
    g.add_argument(
        "--weight-layouts",
        default=d.weight_layouts,
        choices=["auto", "fast", "compact"],
        help="how a .gguf model's quantised weights are held (docs/operations.md, \"Weight "
        'layouts"). With AVX-512 VNNI and --dtype auto the 4-bit, 6-bit and 8-bit types (a '
        "Q4_K_M file) hold one int8-product layout that serves every step, about the file's "
        "bytes, whichever is chosen; the others (5-bit types, no VNNI) differ: fast: the blocks "
        "repacked for steps of few tokens, and for bigger ones (prefill, many sequences) the "
        "int8 layout or a dense copy; compact: the repacked blocks alone, every step on them, "
        "slower prefill; auto: fast where its layouts take at most half the memory free at "
        "load, else compact (default %(default)s)",
    )


def model_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`~stoic.EngineConfig` fields the model flags set (not yet validated: the
    config does that)."""
    return {
        "model": args.model,
        "served_model_name": args.served_model_name,
        "device": args.device,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "weight_layouts": args.weight_layouts,
        "load_format": args.load_format,
        "deterministic": args.deterministic,
        "max_model_len": args.max_model_len,
        "cache_dir": args.cache_dir,
    }
