"""Deterministic-mode prefill: where a prompt's time goes, and the C layers' attention variants.

The model runner alone (no actors, no HTTP) with ``deterministic=True``, prefilling prompts in
steps of ``--budget`` tokens (the CPU scheduler's default step budget: one chunk a step), for two
workloads: ``4x256`` (four prompts of 256 tokens) and ``1x1024`` (one prompt of 1,024 tokens,
chunks attending over a growing prefix).

``--split`` times each workload once with the C layer kernels wrapped in timers and prints
where the time went: the products (each layer's four matrices re-multiplied alone by the same
numbers of rows: ``qmm``), the attention kernel, the rest of the two layer kernels (RMSNorm,
rotary, SiLU, residuals, copies) and everything outside them (embedding, rotary table, block
tables, final norm, logits, sampling, Python).

``--compare`` times the prefill with the attention variants of :data:`ATTENTION` alternately,
round by round in one process (A B, B A, ...), and prints each one's median and its ratio to
the first; it also checks that every variant gave bitwise the same sampled tokens and
logprobs. ``--kernel`` times the two attention kernels alone on one 256-row chunk at three
positions. On a shared machine take ``--threads 1``: with two threads each parallel region
waits for a thread the OS has parked, and the times come in multiples of a time slice::

    python benchmarks/deterministic_prefill_bench.py --threads 1 --kernel --split --compare
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from stoic.model import PagedKVCache, load_model
from stoic.model._cdecode import CDecoder
from stoic.request import SamplingParams, SeqChunk, StepBatch
from stoic.worker import ModelRunner

GREEDY = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logprobs=True)
BLOCK = 16
WORKLOADS = {"4x256": (4, 256), "1x1024": (1, 1024)}
#: attention variants for prefill rows: whether a chunk's rows go to the multi-row kernel
ATTENTION = {"rows": True, "one-row": False}


#: each workload's cache, made once (a fresh cache's first writes fault its pages in: a cost
#: a serving engine pays once, at its first requests)
_CACHES: dict[tuple[int, int], PagedKVCache] = {}


def prefill(runner: ModelRunner, prompts: int, length: int, budget: int) -> list[Any]:
    """Prefill ``prompts`` prompts of ``length`` tokens in steps of ``budget`` tokens (over the
    workload's cache, overwritten); returns each prompt's sampled token and logprob."""
    per_seq = -(-(length + 1) // BLOCK)
    cache = _CACHES.get((prompts, length))
    fresh = cache is None
    if cache is None:
        spec = runner.kv_spec(num_blocks=prompts * per_seq, block_size=BLOCK)
        cache = _CACHES[prompts, length] = PagedKVCache(spec)
    out = []
    for i in range(prompts):
        table = tuple(range(i * per_seq, (i + 1) * per_seq))
        prompt = tuple((7 * i + 13 * j) % 5000 + 100 for j in range(length))
        for start in range(0, length, budget):
            end = min(start + budget, length)
            chunk = SeqChunk(i, prompt[start:end], start, table, end == length, GREEDY)
            zero = table if fresh and start == 0 else ()
            got = runner.execute(StepBatch((chunk,), zero), cache)
        sampled = got.sampled[i]
        out.append((sampled.token_id, sampled.logprob))
    return out


def decoder(runner: ModelRunner) -> CDecoder:
    fused = runner._fused
    assert fused is not None and fused.c_decoder is not None
    return fused.c_decoder


def split(runner: ModelRunner, budget: int) -> None:
    """The ``--split`` table. Each layer kernel call is timed, and right after it the products
    it makes are timed alone on as many rows (so both see the same load on a shared machine);
    the products' own time is taken out of the total."""
    dec = decoder(runner)
    kernels = dec._k
    spent: dict[str, float] = {}
    #: the layer whose kernels run (layer_pre advances it, layer_post follows it)
    at = {"layer": -1}
    inputs: dict[tuple[int, int], torch.Tensor] = {}

    def timed(name: str, fn: Callable[..., int], rows_arg: int | None = None) -> Callable[..., int]:
        def call(*args: Any) -> int:
            started = time.perf_counter()
            rc = fn(*args)
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - started
            if rows_arg is None:
                return rc
            if name == "pre":
                at["layer"] = (at["layer"] + 1) % len(dec._layers)
            layer = dec._layers[at["layer"]]
            mats = [layer.qkv] if name == "pre" else [layer.o, layer.gate_up, layer.down]
            for product in mats:
                shape = (int(args[rows_arg]), product.cols)
                if shape not in inputs:
                    inputs[shape] = torch.randn(shape)
                x = inputs[shape]
                started = time.perf_counter()
                product(x)
                spent["qmm"] = spent.get("qmm", 0.0) + time.perf_counter() - started
            return rc

        return call

    original = (kernels.layer_pre, kernels.attention, kernels.layer_post, kernels.prefill_attention)
    print("| workload | attention | total s | qmm | attention | pre/post rest | outside C layers |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for (name, (prompts, length)), variant in itertools.product(WORKLOADS.items(), ATTENTION):
        dec.prefill_rows = ATTENTION[variant]
        prefill(runner, prompts, length, budget)  # warm-up
        spent.clear()
        at["layer"] = -1
        kernels.layer_pre = timed("pre", original[0], 1)
        kernels.attention = timed("attention", original[1])
        kernels.layer_post = timed("post", original[2], 2)
        kernels.prefill_attention = timed("attention", original[3])
        try:
            started = time.perf_counter()
            prefill(runner, prompts, length, budget)
            total = time.perf_counter() - started - spent["qmm"]
        finally:
            kernels.layer_pre, kernels.attention, kernels.layer_post = original[:3]
            kernels.prefill_attention = original[3]
        qmm = spent["qmm"]
        layer = spent["pre"] + spent["post"]
        attention = spent["attention"]
        parts = [qmm, attention, layer - qmm, total - layer - attention]
        cells = " | ".join(f"{p:.2f} ({p / total:.0%})" for p in parts)
        print(f"| {name} | {variant} | {total:.2f} | {cells} |")
    dec.prefill_rows = True


def compare(runner: ModelRunner, budget: int, rounds: int) -> None:
    """The ``--compare`` table."""
    dec = decoder(runner)
    print("| workload | variant | s (median) | vs first |")
    print("|---|---|---:|---:|")
    for name, (prompts, length) in WORKLOADS.items():
        times: dict[str, list[float]] = {v: [] for v in ATTENTION}
        results: dict[str, list[Any]] = {}
        order = list(ATTENTION)
        for variant in order:  # warm-up, not timed
            dec.prefill_rows = ATTENTION[variant]
            results[variant] = prefill(runner, prompts, length, budget)
        for _ in range(rounds):
            for variant in order:
                dec.prefill_rows = ATTENTION[variant]
                started = time.perf_counter()
                prefill(runner, prompts, length, budget)
                times[variant].append(time.perf_counter() - started)
            order.reverse()
        dec.prefill_rows = True
        first = statistics.median(times[next(iter(ATTENTION))])
        for variant, ts in times.items():
            med = statistics.median(ts)
            print(f"| {name} | {variant} | {med:.2f} | {med / first:.2f}x |")
        reference = results[next(iter(ATTENTION))]
        for variant, got in results.items():
            if got != reference:
                print(f"  note: {variant}'s tokens or logprobs differ")


def kernel(rounds: int) -> None:
    """The ``--kernel`` table: the attention of one 256-row chunk at several positions (9 query
    heads over 3 kv heads of 64, as the default model; blocks of 16), each kernel alone."""
    from stoic.gguf import default_cache_dir
    from stoic.kernels import load_kernels

    kernels = load_kernels(default_cache_dir())
    heads, kv_heads, dh, rows = 9, 3, 64, 256
    threads = torch.get_num_threads()
    print("| chunk positions | one-row ms | rows ms | rows / one-row |")
    print("|---|---:|---:|---:|")
    for first in (0, 256, 768):
        blocks = (first + rows) // BLOCK + 1
        gen = torch.Generator().manual_seed(first)
        k_pool = torch.randn(kv_heads * blocks, BLOCK, dh, generator=gen)
        v_pool = torch.randn(kv_heads * blocks, BLOCK, dh, generator=gen)
        q = torch.randn(rows, heads, dh, generator=gen)
        k, v = torch.randn(rows, kv_heads, dh), torch.randn(rows, kv_heads, dh)
        table = torch.arange(kv_heads)[:, None] * blocks + torch.arange(blocks)[None]
        tables = table[None].expand(rows, -1, -1).contiguous()
        lens = torch.arange(first + 1, first + rows + 1)
        write = (table[:, lens - 1 >> 4] * BLOCK + (lens - 1) % BLOCK).flatten().contiguous()
        runs = torch.tensor([[0, rows]])
        out = torch.empty_like(q)
        ptrs = [t.data_ptr() for t in (q, k, v, k_pool, v_pool, write, tables, lens)]
        shape = [rows, heads, kv_heads, dh, BLOCK, blocks, 0.125, out.data_ptr(), threads]
        calls = {
            "one-row": functools.partial(kernels.attention, *ptrs, *shape),
            "rows": functools.partial(kernels.prefill_attention, *ptrs, runs.data_ptr(), 1, *shape),
        }
        times: dict[str, list[float]] = {name: [] for name in calls}
        order = list(calls)
        for _ in range(rounds):
            for name in order:
                started = time.perf_counter()
                assert calls[name]() == 0
                times[name].append(time.perf_counter() - started)
            order.reverse()
        one, together = (statistics.median(times[n]) for n in ("one-row", "rows"))
        print(
            f"| {first}-{first + rows - 1} | {one * 1e3:.2f} | {together * 1e3:.2f} | {together / one:.2f}x |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="default")
    parser.add_argument("--budget", type=int, default=256, help="tokens a step")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's own)")
    parser.add_argument("--split", action="store_true")
    parser.add_argument("--compare", action="store_true")
    parser.add_argument("--kernel", action="store_true", help="the attention kernels alone")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.kernel:
        kernel(args.rounds * 6)
    if not (args.split or args.compare):
        return
    loaded = load_model(args.model, dtype="auto", device="cpu", deterministic=True)
    runner = ModelRunner(loaded, deterministic=True)
    print(f"threads {torch.get_num_threads()}, budget {args.budget}")
    with torch.inference_mode():
        if args.split:
            split(runner, args.budget)
        if args.compare:
            compare(runner, args.budget, args.rounds)


if __name__ == "__main__":
    main()
