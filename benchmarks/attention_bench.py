"""The C decode-attention kernel alone: microseconds a layer, and its error against float64.

``stoic_decode_attention`` (stoic/model/_qkernels.c) attends decode tokens over the paged KV
cache in place; it serves the C decode layers and the decode tokens of every other CPU step.
This times one call (one layer) for decode batches of the default model's shape (9 query heads,
3 kv heads, head_dim 64, 16-position blocks scattered over a 1,456-block pool as in a serving
engine), median of ``--repeats`` calls, and checks each output against softmax attention in
float64.

Usage: ``python benchmarks/attention_bench.py [--threads N] [--repeats 30]``
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from stoic.model import default_cache_dir
from stoic.model._qkernels import Kernels, load_kernels
from stoic.model.testing import scattered_block_tables

HEADS, KV_HEADS, DIM, BLOCK, POOL_BLOCKS, SCALE = 9, 3, 64, 16, 1456, 0.125
#: (sequences, context lengths drawn from [lo, hi))
CASES = [(1, 130, 131), (1, 400, 401), (4, 100, 300), (13, 150, 230), (32, 60, 430)]


def one_case(
    kernels: Kernels, pools: tuple[torch.Tensor, torch.Tensor], lens: list[int], repeats: int
) -> tuple[float, float]:
    """(median microseconds a call, max abs error against float64) for one decode batch."""
    k_pool, v_pool = pools
    m, blocks = len(lens), max(-(-n // BLOCK) for n in lens)
    tables, write = scattered_block_tables(lens, KV_HEADS, POOL_BLOCKS, BLOCK)
    q = torch.randn(m, HEADS, DIM) * 0.5
    k, v = torch.randn(m, KV_HEADS, DIM), torch.randn(m, KV_HEADS, DIM)
    lengths, out = torch.tensor(lens), torch.empty(m, HEADS, DIM)

    def call() -> None:
        rc = kernels.attention(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(),
            write.data_ptr(), tables.data_ptr(), lengths.data_ptr(), m, HEADS, KV_HEADS, DIM,
            BLOCK, blocks, SCALE, out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"stoic_decode_attention returned {rc}")

    call()
    error = 0.0
    for i, n in enumerate(lens):
        for h in range(HEADS):
            rows = tables[i, h // (HEADS // KV_HEADS), : -(-n // BLOCK)]
            keys = k_pool[rows].reshape(-1, DIM)[:n].double()
            values = v_pool[rows].reshape(-1, DIM)[:n].double()
            want = torch.softmax(keys @ q[i, h].double() * SCALE, 0) @ values
            error = max(error, float((out[i, h].double() - want).abs().max()))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times), error


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's own)")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    kernels = load_kernels(default_cache_dir())
    shape = (KV_HEADS * POOL_BLOCKS, BLOCK, DIM)
    pools = (torch.randn(shape), torch.randn(shape))
    rng = random.Random(0)
    print(f"threads {torch.get_num_threads()}")
    print("| sequences | contexts | us a layer | x 30 layers (ms) | max error vs float64 |")
    print("|---:|---|---:|---:|---:|")
    for m, lo, hi in CASES:
        us, error = one_case(
            kernels, pools, [rng.randrange(lo, hi) for _ in range(m)], args.repeats
        )
        span = f"{lo}" if hi == lo + 1 else f"{lo}-{hi - 1}"
        print(f"| {m} | {span} | {us:.1f} | {us * 30 / 1000:.2f} | {error:.1e} |", flush=True)


if __name__ == "__main__":
    main()
