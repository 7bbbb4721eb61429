"""G6 (Q6_K in six bits, ``_gemm8.c``) built with GFNI and without, matrix by matrix.

On a CPU with ``gfni`` the kernels build with ``-mgfni`` and G6's tiles read in place (up to 4
rows) rebuild the six-bit values with affine byte transforms; a build without (as on an AVX-512
VNNI CPU before Ice Lake) uses shifts and masks. Both builds are made here (the second under
``--cache``), the same random Q6_K blocks of 1.5B's shapes packed by each, and the two
alternated round by round (the first of a round alternating too) with G8 with halves and
symmetric (what G6 replaced, 1.25 bytes a weight) beside them. Prints median milliseconds.

    python benchmarks/g6_gfni_bench.py [--rows 1 4 5 8 64] [--rounds 4] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from step_bench import random_blocks

from stoic.gguf import default_cache_dir
from stoic.kernels import Gemm8, _build, load_kernels

#: (output rows, input width): 1.5B's ffn_down and its gate/up's transpose shape
SHAPES = [(1536, 8960), (8960, 1536)]


def median_ms(product: Gemm8, x: torch.Tensor, reps: int) -> float:
    product(x)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        product(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 5, 8, 64])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/stoic-g6-gfni-bench"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu = _build.cpu_flags()
    if "gfni" not in cpu:
        raise SystemExit("this CPU has no GFNI: there is one build only")
    native = load_kernels(default_cache_dir())
    _build.cpu_flags = lambda: cpu - {"gfni"}
    plain = load_kernels(args.cache)
    if not native.int8_rows:
        raise SystemExit("this CPU has no AVX-512 VNNI: no G6")
    print("| matrix | rows | G6, GFNI | G6, shifts | G8 + H + S | GFNI / shifts |")
    print("|---|---:|---:|---:|---:|---:|")
    for n, k in SHAPES:
        blocks = random_blocks("Q6_K", n, k, np.random.default_rng(5))
        products = {
            "gfni": Gemm8(native, native.g8_layout([("Q6_K", blocks)]), n, k, None),
            "shifts": Gemm8(plain, plain.g8_layout([("Q6_K", blocks)]), n, k, None),
            "g8": Gemm8(
                native, native.g8_layout([("Q6_K", blocks)], native.layouts.g8 + 3), n, k, None
            ),
        }
        for rows in args.rows:
            x = torch.randn(rows, k)
            times: dict[str, list[float]] = {name: [] for name in products}
            for r in range(args.rounds):
                order = list(products.items())
                for name, product in order if r % 2 else order[::-1]:
                    times[name].append(median_ms(product, x, 7 if rows < 64 else 3))
            best = {name: min(t) for name, t in times.items()}
            print(
                f"| {n} x {k} | {rows} | {best['gfni']:.3f} | {best['shifts']:.3f} "
                f"| {best['g8']:.3f} | {best['gfni'] / best['shifts']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
