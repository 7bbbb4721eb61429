"""The batched int8 products' layouts (``_gemm8.c``) matrix by matrix, against what they replace.

For each matrix of a Q4_K_M file of the default model's shape (576 wide, 30 layers: Q5_0 for
q/k/v, o and gate/up, Q4_K or Q6_K for ``ffn_down``, Q8_0 for the head's width), the same random
blocks multiplied, alternated round by round on a shared machine:

- ``layout``: the layout :meth:`Kernels.g8_layout` picks (symmetric types without offsets; Q6_K
  with a scale per 16 weights);
- ``offsets``: the same blocks in the layout with a scale and an offset per block (what every
  type took before the symmetric variant; Q6_K: per half-block), where it differs;
- ``bf16``: the bfloat16 copy packed for oneDNN (what a matrix the layout could not hold
  multiplied by: Q6_K before).

``--copies`` copies of each matrix (10: more bytes than the L2 caches hold, as a step's 30
layers are) are multiplied in turn, each at ``--rows`` rows of bfloat16 activations, output
bfloat16 as the default mode's steps. Prints the median microseconds a matrix and the ratios.

    python benchmarks/g8_layouts_bench.py [--rows 31 256] [--rounds 15] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from step_bench import random_blocks

from stoic.gguf import PackedLinear, default_cache_dir
from stoic.kernels import GGML_TYPES, Gemm8, Kernels, load_kernels

#: (matrix, GGML type, output rows, input width)
MATRICES = [
    ("gate/up", "Q5_0", 3072, 576),
    ("q/k/v", "Q5_0", 960, 576),
    ("down", "Q4_K", 576, 1536),
    ("down", "Q6_K", 576, 1536),
    ("head (slice)", "Q8_0", 4096, 576),
]


def _with_offsets(kernels: Kernels, kind: str, blocks: torch.Tensor) -> Gemm8:
    """``blocks`` in the layout with a scale and an offset per block (half-block for Q6_K)."""
    g8 = kernels.layouts.g8
    layout = kernels.g8_layout([(kind, blocks)], g8 + 1 if kind == "Q6_K" else g8)
    ggml = GGML_TYPES[kind]
    rows, cols = blocks.shape[0], blocks.shape[1] // ggml.block_bytes * ggml.weights
    return Gemm8(kernels, layout, rows, cols, None)


def _bf16(kernels: Kernels, kind: str, blocks: torch.Tensor) -> Callable[..., torch.Tensor]:
    """The bfloat16 copy of ``blocks``' weights, packed for oneDNN."""
    gemm = Gemm8.bind(kernels, [(kind, blocks)], None)
    assert gemm is not None
    eye = torch.eye(gemm.cols)
    weight = gemm(eye).T.contiguous().bfloat16()  # W itself, up to the int8 rounding of I
    packed = PackedLinear.build(weight, None)
    assert packed is not None, "oneDNN packing is unavailable here"
    return lambda x, dtype: packed(x)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[31, 256])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--copies", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = load_kernels(default_cache_dir())
    if not kernels.int8_rows:
        raise SystemExit("this CPU has no AVX-512 VNNI: the int8 products do not run here")
    gen = np.random.default_rng(0)
    print(f"threads {args.threads}, {args.copies} copies a matrix, median of {args.rounds} rounds")
    print(
        "| matrix | type | rows | layout (us) | offsets (us) | bf16 (us) | vs offsets | vs bf16 |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name, kind, n, k in MATRICES:
        blocks = [random_blocks(kind, n, k, gen) for _ in range(args.copies)]
        variants: dict[str, list[Callable[..., torch.Tensor]]] = {
            "layout": [g for b in blocks if (g := Gemm8.bind(kernels, [(kind, b)], None))],
            "offsets": [_with_offsets(kernels, kind, b) for b in blocks],
            "bf16": [_bf16(kernels, kind, b) for b in blocks],
        }
        for rows in args.rows:
            x = torch.randn(rows, k).bfloat16()
            times: dict[str, list[float]] = {v: [] for v in variants}
            for r in range(args.rounds):
                order = list(variants) if r % 2 == 0 else list(reversed(variants))
                for v in order:
                    started = time.perf_counter()
                    for product in variants[v]:
                        product(x, torch.bfloat16)
                    times[v].append((time.perf_counter() - started) / args.copies)
            med = {v: statistics.median(t) * 1e6 for v, t in times.items()}
            print(
                f"| {name} | {kind} | {rows} | {med['layout']:.0f} | {med['offsets']:.0f} | "
                f"{med['bf16']:.0f} | {med['layout'] / med['offsets']:.2f} | "
                f"{med['layout'] / med['bf16']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
