"""Batched steps on int8 activations (``_gemm8.c``) against the bfloat16 dense copy they replace.

The default mode with a fast dtype (``--dtype auto`` picking bfloat16): one model loaded twice in
one process, A with its batched products on the bfloat16 copy (as before ``_gemm8.c``), B on the
blocks with int8 activations (the default now). Times, alternating A and B (A B, B A, ...) so the
noise of a shared machine hits each alike:

- a prefill step of ``--prefill`` tokens (one sequence, from position 0: the work of a long
  prompt's chunk);
- decode steps of ``--batch`` sequences (128-token contexts; step_bench's ``Stream``).

Prints per file the median milliseconds of each, B / A (the median of the rounds' ratios), the
thread count and whether the decode steps chose the same greedy tokens (they may not: int8
activations are not the bfloat16 product).

    python benchmarks/batched_int8_bench.py default FILE.gguf [--prefill 256] [--batch 16 32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from step_bench import GREEDY, Stream

from stoic.kernels import Gemm8, _qkernels
from stoic.model import PagedKVCache, load_model
from stoic.request import SeqChunk, StepBatch
from stoic.worker import ModelRunner


def _runner(model: str, int8: bool) -> ModelRunner:
    loaded = load_model(model, dtype="float32", dense_dtype="bfloat16", device="cpu")
    if int8:
        return ModelRunner(loaded)
    original, alone = Gemm8.bind, _qkernels.G8_ALONE_TYPES
    Gemm8.bind = classmethod(lambda cls, *a, **k: None)  # type: ignore[method-assign,assignment]
    _qkernels.G8_ALONE_TYPES = frozenset()  # the blocks for few rows, as before the one layout
    try:
        return ModelRunner(loaded)
    finally:
        Gemm8.bind = original  # type: ignore[method-assign]
        _qkernels.G8_ALONE_TYPES = alone


def _prefill(runner: ModelRunner, tokens: int) -> float:
    blocks = -(-tokens // 16) + 1
    cache = PagedKVCache(runner.kv_spec(num_blocks=blocks, block_size=16))
    prompt = tuple((11 * j) % 5000 + 100 for j in range(tokens))
    chunk = SeqChunk(0, prompt, 0, tuple(range(blocks)), True, GREEDY)
    try:
        started = time.perf_counter()
        runner.execute(StepBatch((chunk,)), cache)
        return time.perf_counter() - started
    finally:
        cache.release()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--prefill", type=int, default=256)
    parser.add_argument("--batch", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    print(f"threads: {torch.get_num_threads()}")
    print("| model | step | A bf16 copy ms | B int8 ms | B/A | same tokens |")
    print("|---|---|---:|---:|---:|---|")
    for model in args.models:
        a, b = _runner(model, int8=False), _runner(model, int8=True)
        assert b.compute_path.int8_batched_projections > 0, "B has no int8 batched products"
        name = model.rsplit("/", 1)[-1]
        times: dict[str, list[float]] = {"A": [], "B": []}
        ratios = []
        for i in range(args.rounds + 1):
            order = (("A", a), ("B", b)) if i % 2 == 0 else (("B", b), ("A", a))
            got = {k: _prefill(r, args.prefill) for k, r in order}
            if i:  # the first round warms up
                for k, t in got.items():
                    times[k].append(t)
                ratios.append(got["B"] / got["A"])
        print(
            f"| {name} | prefill {args.prefill} | {statistics.median(times['A']) * 1e3:.1f} | "
            f"{statistics.median(times['B']) * 1e3:.1f} | {statistics.median(ratios):.3f} | - |"
        )
        for batch in args.batch:
            streams = {
                k: Stream(r, batch, 128, 3 * args.rounds + 3) for k, r in (("A", a), ("B", b))
            }
            for i in range(args.rounds + 1):
                order = ("A", "B") if i % 2 == 0 else ("B", "A")
                for k in order:
                    for _ in range(3):
                        streams[k].step()
            sa, sb = streams["A"].times[3:], streams["B"].times[3:]
            ratio = statistics.median(tb / ta for ta, tb in zip(sa, sb, strict=True))
            same = streams["A"].tokens == streams["B"].tokens
            print(
                f"| {name} | decode x{batch} | {statistics.median(sa) * 1e3:.1f} | "
                f"{statistics.median(sb) * 1e3:.1f} | {ratio:.3f} | {'yes' if same else 'no'} |"
            )


if __name__ == "__main__":
    main()
