"""Steps with prefill, the model runner alone: what a burst's steps cost, per variant.

Four step shapes from a burst of mixed prompts (the default model, ``--dtype auto``'s split:
float32 activations, bfloat16 products over many rows): a 243-token prompt alone, the same
number of tokens continuing a prompt after 150 cached ones, that chunk next to 13 decodes
(contexts ~190), and 32 decodes of contexts 100-400 (above the blocks' 16 rows). Variants are
runners built in one process and measured in alternating rounds (median of each round's best of
3, over ``--rounds``):

* ``default``: what ``stoic serve`` runs;
* ``torch-ops``: the bfloat16 steps' norms, rotary and SiLU x up as torch operators
  (``stoic/model/_cops.py`` off);
* ``unpacked``: the bfloat16 copies multiplied by ``F.linear`` (``stoic/model/_packed.py`` off);
* ``neither``: both off;
* ``unaligned``: the default, its bfloat16 prompt attention not padded to a multiple of 16
  (``stoic/model/_paged.py``'s ``PREFILL_ALIGN``).

Usage: ``python benchmarks/prefill_step_bench.py [--rounds 6] [--variants default neither]``
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
from collections.abc import Iterator
from unittest import mock

import torch

from stoic.model import (
    ModelRunner,
    PagedKVCache,
    SamplingParams,
    SeqChunk,
    StepBatch,
    _paged,
    load_model,
)
from stoic.model._packed import PackedLinear

BLOCK, POOL = 16, 1456
VARIANTS = ("default", "torch-ops", "unpacked", "neither", "unaligned")


@contextlib.contextmanager
def _packing(on: bool) -> Iterator[None]:
    if on:
        yield
    else:
        with mock.patch.object(PackedLinear, "build", return_value=None):
            yield


def build(variant: str) -> ModelRunner:
    loaded = load_model("default", dtype="float32", device="cpu", dense_dtype="bfloat16")
    with _packing(variant in ("default", "torch-ops", "unaligned")):
        runner = ModelRunner(loaded)
    if variant in ("torch-ops", "neither"):
        assert runner._fused is not None
        runner._fused._ops = None
    return runner


def _aligned(variant: str) -> contextlib.AbstractContextManager[object]:
    if variant == "unaligned":
        return mock.patch.object(_paged, "PREFILL_ALIGN", 1)
    return contextlib.nullcontext()


def steps() -> dict[str, StepBatch]:
    rng, params, used = random.Random(0), SamplingParams(max_tokens=64, temperature=0), [0]

    def table(tokens: int) -> tuple[int, ...]:
        count = -(-tokens // BLOCK)
        used[0] += count
        return tuple(range(used[0] - count, used[0]))

    def decode(seq: int, ctx: int) -> SeqChunk:
        return SeqChunk(seq, (100,), ctx, table(ctx + 1), True, params)

    near = [decode(i, 190 + rng.randrange(-40, 40)) for i in range(13)]
    spread = [decode(100 + i, 100 + rng.randrange(300)) for i in range(32)]
    fresh = SeqChunk(500, tuple(range(200, 443)), 0, table(243), True, params)
    cont = SeqChunk(501, tuple(range(200, 443)), 150, table(393), True, params)
    return {
        "243-token prompt": StepBatch((fresh,)),
        "243 tokens after 150 cached": StepBatch((cont,)),
        "the same + 13 decodes": StepBatch((*near, cont)),
        "32 decodes": StepBatch(tuple(spread)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    args = parser.parse_args()
    runners = {v: build(v) for v in args.variants}
    first = next(iter(runners.values()))
    cache = PagedKVCache(first.kv_spec(POOL, BLOCK))
    cache.zero_blocks(tuple(range(POOL)))
    batches = steps()
    times: dict[tuple[str, str], list[float]] = {}
    for round_ in range(args.rounds):
        order = args.variants if round_ % 2 == 0 else args.variants[::-1]
        for variant in order:
            for name, batch in batches.items():
                with _aligned(variant):
                    runners[variant].execute(batch, cache)
                    best = []
                    for _ in range(3):
                        start = time.perf_counter()
                        runners[variant].execute(batch, cache)
                        best.append(time.perf_counter() - start)
                times.setdefault((name, variant), []).append(1000 * min(best))
    print(f"threads {torch.get_num_threads()}, {args.rounds} rounds; ms a step")
    print("| step | " + " | ".join(args.variants) + " |")
    print("|---|" + "---:|" * len(args.variants))
    for name in batches:
        cells = [f"{statistics.median(times[(name, v)]):.1f}" for v in args.variants]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
