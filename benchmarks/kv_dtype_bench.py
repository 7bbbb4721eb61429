"""The KV cache in bfloat16 (``--kv-cache-dtype auto`` on a GGUF model on the C layers) against
float32: the decode attention alone, and the model's steps.

**The kernel**: ``stoic_decode_attention`` for 31 sequences (9 query heads over 3, head dim 64,
30 layers' pools of 2,900 blocks of 16, each sequence's blocks scattered in them: a 1 GiB
cache's layout) at contexts 200 and 400, float32 pools against bfloat16 ones, alternated; the
fastest of ``rounds`` passes, milliseconds for the 30 layers.

**The steps**: each model (``default`` or a GGUF file) is loaded once with ``--dtype auto``; two runners share
its weights, A over a float32 cache and B over a bfloat16 one, each with 31 sequences decoding
at a context of 200 and of 400 (mixed-length agents' contexts), and their steps alternated (A B,
B A, ...) so the noise of a shared machine hits both alike: the 31 decodes alone (the decode
attention streams every sequence's keys and values), the 31 decodes with a 225-token prompt
chunk, and a 256-token prefill. Median milliseconds and B / A.

    python benchmarks/kv_dtype_bench.py [MODEL ...] [--rounds 10]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from collections.abc import Callable

import torch
from chunk_attention_bench import Bed, _alternate

from stoic.gguf import default_cache_dir
from stoic.kernels import Kernels, load_kernels
from stoic.model import load_model
from stoic.worker import ModelRunner

#: the steps timed (``Bed.run``'s kinds)
STEPS = ("decode 31", "mixed 31 + 225", "prefill 256")


def _decode_pass(kernels: Kernels, context: int, dtype: torch.dtype) -> Callable[[], None]:
    """One pass of 30 layers' decode attention of 31 sequences at ``context`` over ``dtype``
    pools."""
    gen = torch.Generator().manual_seed(context)
    seqs, heads, kv_heads, dh, block, blocks, layers = 31, 9, 3, 64, 16, 2900, 30
    per = -(-(context + 1) // block)
    shape = (kv_heads * blocks, block, dh)
    pools = [
        (torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))
        for _ in range(layers)
    ]
    order = torch.randperm(blocks, generator=gen)[: seqs * per].view(seqs, 1, per)
    tables = (order + torch.arange(kv_heads).view(1, kv_heads, 1) * blocks).contiguous()
    lens = torch.full((seqs,), context + 1, dtype=torch.int64)
    at = context // block, context % block
    write = (tables[:, :, at[0]] * block + at[1]).t().contiguous()  # [kv_heads, seqs]
    q = torch.randn(seqs, heads, dh, generator=gen)
    k, v = torch.randn(seqs, kv_heads, dh), torch.randn(seqs, kv_heads, dh)
    out = torch.empty(seqs, heads, dh)
    bf16, threads = int(dtype == torch.bfloat16), torch.get_num_threads()

    def run() -> None:
        for kp, vp in pools:
            rc = kernels.attention(
                q.data_ptr(), k.data_ptr(), v.data_ptr(), kp.data_ptr(), vp.data_ptr(),
                write.data_ptr(), tables.data_ptr(), lens.data_ptr(), seqs, heads, kv_heads, dh,
                block, per, dh**-0.5, out.data_ptr(), threads, bf16,
            )  # fmt: skip
            assert rc == 0, rc

    return run


def kernel_table(contexts: list[int], rounds: int) -> None:
    kernels = load_kernels(default_cache_dir())
    print("| context | float32 pools ms | bfloat16 pools ms | bfloat16 / float32 |")
    print("|---:|---:|---:|---:|")
    for context in contexts:
        runs = {dt: _decode_pass(kernels, context, dt) for dt in (torch.float32, torch.bfloat16)}
        best = {dt: float("inf") for dt in runs}
        for _ in range(rounds):
            for dt, run in runs.items():
                run()  # the previous pass's pools left the caches
                started = time.perf_counter()
                run()
                best[dt] = min(best[dt], time.perf_counter() - started)
        f32, b16 = best[torch.float32], best[torch.bfloat16]
        print(f"| {context} | {f32 * 1e3:.1f} | {b16 * 1e3:.1f} | {b16 / f32:.2f} |", flush=True)


def steps_table(models: list[str], contexts: list[int], rounds: int) -> None:
    print("| model | context | step | A float32 cache ms | B bfloat16 cache ms | B / A |")
    print("|---|---:|---|---:|---:|---:|")
    for model in models:
        loaded = load_model(model, dtype="auto", kv_cache_dtype="float32")
        half = dataclasses.replace(loaded, kv_dtype=torch.bfloat16)
        runners = {"A": ModelRunner(loaded), "B": ModelRunner(half)}
        for context in contexts:
            beds = {name: Bed(runner, context) for name, runner in runners.items()}
            for kind in STEPS:
                t = _alternate(
                    {name: functools.partial(bed.run, kind) for name, bed in beds.items()},
                    rounds,
                )
                print(
                    f"| {model.rsplit('/', 1)[-1]} | {context} | {kind} | {t['A'] * 1e3:.1f} | "
                    f"{t['B'] * 1e3:.1f} | {t['B'] / t['A']:.2f} |",
                    flush=True,
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", default=["default"])
    parser.add_argument("--contexts", type=int, nargs="+", default=[200, 400])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    with torch.inference_mode():
        print(f"threads {torch.get_num_threads()}")
        kernel_table(args.contexts, args.rounds)
        print()
        steps_table(args.models, args.contexts, args.rounds)


if __name__ == "__main__":
    main()
