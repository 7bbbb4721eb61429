"""Decode-step benchmark: the model runner alone (no actors, no HTTP), time per decode step.

Prefills ``batch`` sequences of ``--context`` tokens, then times greedy decode steps of all of
them together. Variants of the runner are measured in one process, interleaved round by round
(A B, B A, ...) so that the noise of a shared machine hits each alike; the table gives each
variant's median milliseconds per step, tokens/s and its ratio to the first variant, and checks
that every variant produced the same tokens.

    python benchmarks/step_bench.py --dtype float32 --batch 1 32 --variants fused hf [--profile]

Variants: ``fused`` (the default runner: :mod:`stoic.model._fused` where the model supports it,
and, for a GGUF model, its quantised blocks for steps of few tokens: ``--quantization auto``),
``dequantized`` (the same on the de-quantised float weights only: ``--quantization none``),
``hf`` (transformers' own forward over the float weights), ``compiled`` (the dequantized runner with
both halves of each layer under ``torch.compile``: an experiment that did not pay, kept to be
re-measured; see docs/benchmarks.md).

``--products`` measures the quantised matrix products alone instead (a kernel micro-benchmark,
no model loaded): for each GGML type, random blocks of every matrix of ``--layers`` layers of a
model shaped like Qwen2.5-1.5B (hidden 1,536, 256-wide K and V, MLP 8,960: widths the K-quants
take), multiplied one after the other so that none stays in cache, by ``--rows`` rows of
activations; next to the float32 product over the de-quantised matrices and PyTorch's own
weight-only kernels (``_weight_int4pack_mm_for_cpu``, group 32; ``_weight_int8pack_mm``, one
scale a row: same shapes, random values; what docs/models.md, "K-quants", weighs them against):

    python benchmarks/step_bench.py --products [--types Q4_K Q5_K Q6_K Q4_1] [--rows 1 4 8 16 32]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from stoic.gguf import default_cache_dir
from stoic.kernels import GGML_TYPES, Kernels, load_kernels
from stoic.model import LoadedModel, PagedKVCache, load_model
from stoic.request import SamplingParams, SeqChunk, StepBatch
from stoic.worker import ModelRunner

GREEDY = SamplingParams(max_tokens=1 << 20, temperature=0, ignore_eos=True)
BLOCK = 16


def _compiled(loaded: LoadedModel) -> ModelRunner:
    """The fused runner with both halves of each layer compiled (inductor, dynamic shapes)."""
    from stoic.model import _layers

    runner = ModelRunner(loaded, quantization="none")
    assert runner._fused is not None
    runner._fused.attention_inputs = torch.compile(_layers.attention_inputs, dynamic=True)
    runner._fused.mlp_block = torch.compile(_layers.mlp_block, dynamic=True)
    return runner


VARIANTS: dict[str, Callable[[LoadedModel], ModelRunner]] = {
    "fused": lambda loaded: ModelRunner(loaded),
    "dequantized": lambda loaded: ModelRunner(loaded, quantization="none"),
    "hf": lambda loaded: ModelRunner(loaded, fused=False, quantization="none"),
    "compiled": _compiled,
}


class Stream:
    """``batch`` sequences decoding on one runner and its own cache."""

    def __init__(self, runner: ModelRunner, batch: int, context: int, steps: int) -> None:
        self.runner = runner
        self.context = context
        per_seq = -(-(context + steps + 1) // BLOCK)
        self.cache = PagedKVCache(runner.kv_spec(num_blocks=batch * per_seq, block_size=BLOCK))
        self.tables = [tuple(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
        self.last: list[int] = []
        self.tokens: list[list[int]] = []
        self.times: list[float] = []
        for i, table in enumerate(self.tables):
            prompt = tuple((7 * i + 13 * j) % 5000 + 100 for j in range(context))
            chunk = SeqChunk(i, prompt, 0, table, True, GREEDY)
            self.last.append(
                runner.execute(StepBatch((chunk,), table), self.cache).sampled[i].token_id
            )
        self.generated = 0

    def step(self) -> None:
        pos = self.context + self.generated
        chunks = tuple(
            SeqChunk(i, (self.last[i],), pos, t, True, GREEDY, num_generated=self.generated + 1)
            for i, t in enumerate(self.tables)
        )
        started = time.perf_counter()
        out = self.runner.execute(StepBatch(chunks), self.cache)
        self.times.append(time.perf_counter() - started)
        self.last = [out.sampled[i].token_id for i in range(len(self.tables))]
        self.tokens.append(self.last)
        self.generated += 1


#: one layer's matrices (rows, columns) of a model shaped like Qwen2.5-1.5B: q, k, v, o, gate, up,
#: down
LAYER_SHAPES = (
    (1536, 1536), (256, 1536), (256, 1536), (1536, 1536), (8960, 1536), (8960, 1536), (1536, 8960),
)  # fmt: skip


def random_blocks(kind: str, rows: int, cols: int, gen: np.random.Generator) -> torch.Tensor:
    """Random blocks of ``kind`` with small finite fp16 scales (what the products read; the
    values do not change their speed)."""
    ggml = GGML_TYPES[kind]
    raw = gen.integers(0, 256, size=(rows, cols // ggml.weights, ggml.block_bytes), dtype=np.uint8)
    scales = 2 if kind in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else 1
    at = slice(ggml.block_bytes - 2, None) if kind == "Q6_K" else slice(0, 2 * scales)
    raw[:, :, at] = np.full(scales, 0.01, dtype=np.float16).view(np.uint8)
    return torch.from_numpy(raw.reshape(rows, -1))


def product_variants(
    kernels: Kernels, kind: str, layers: int, gen: np.random.Generator
) -> dict[str, list[Callable[[torch.Tensor], torch.Tensor]]]:
    """Each variant's products, one a matrix of ``layers`` layers, in order."""
    import torch.nn.functional as F

    ops = torch.ops.aten
    out: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]] = {
        "stoic": [], "float32": [], "torch int4": [], "torch int8": [],
    }  # fmt: skip
    for n, k in LAYER_SHAPES * layers:
        blocks = random_blocks(kind, n, k, gen)
        out["stoic"].append(kernels.bind(kind, blocks, None))
        dense = kernels.dequantize(kind, blocks, k)
        out["float32"].append(lambda x, w=dense: F.linear(x, w))
        q4 = ops._convert_weight_to_int4pack_for_cpu(
            torch.randint(0, 16, (n, k), dtype=torch.int32), 1
        )
        sz = torch.rand(k // 32, n, 2) * 0.01
        out["torch int4"].append(lambda x, w=q4, s=sz: ops._weight_int4pack_mm_for_cpu(x, w, 32, s))
        q8 = torch.randint(-128, 128, (n, k), dtype=torch.int8)
        scale = torch.rand(n) * 0.01
        out["torch int8"].append(lambda x, w=q8, s=scale: ops._weight_int8pack_mm(x, w, s))
    return out


def products(types: list[str], rows: list[int], layers: int, rounds: int) -> None:
    """The ``--products`` table: microseconds a layer's products take, each variant."""
    kernels = load_kernels(default_cache_dir())
    gen = np.random.default_rng(0)
    print(f"threads {torch.get_num_threads()}, {layers} layers shaped {LAYER_SHAPES}")
    print("| type | rows | variant | us/layer (median) | weight GB/s | vs float32 |")
    print("|---|---:|---|---:|---:|---:|")
    for kind in types:
        variants = product_variants(kernels, kind, layers, gen)
        ggml = GGML_TYPES[kind]
        weights = sum(n * k for n, k in LAYER_SHAPES)
        layer_bytes = weights // ggml.weights * ggml.block_bytes
        for m in rows:
            x = torch.randn(m, max(k for _, k in LAYER_SHAPES))
            inputs = {k: x[:, :k].contiguous() for _, k in LAYER_SHAPES}
            times: dict[str, list[float]] = {name: [] for name in variants}
            order = list(variants)
            for fns in variants.values():  # warm-up, not timed
                for fn, (_, k) in zip(fns, LAYER_SHAPES * layers, strict=True):
                    fn(inputs[k])
            for _ in range(rounds):
                for name in order:
                    started = time.perf_counter()
                    for fn, (_, k) in zip(variants[name], LAYER_SHAPES * layers, strict=True):
                        fn(inputs[k])
                    times[name].append((time.perf_counter() - started) / layers)
                order.reverse()
            base = statistics.median(times["float32"])
            for name, ts in times.items():
                med = statistics.median(ts)
                rate = f"{layer_bytes / med / 1e9:.1f}" if name == "stoic" else ""
                print(f"| {kind} | {m} | {name} | {med * 1e6:.0f} | {rate} | {med / base:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16, auto (as serve)")
    parser.add_argument(
        "--dense-dtype", default=None, help="the weights' type in products over many rows"
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--round", type=int, default=4, help="steps per variant per round")
    parser.add_argument(
        "--variants", nargs="+", default=["fused", "dequantized", "hf"], choices=VARIANTS
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's own)")
    parser.add_argument("--profile", action="store_true", help="torch.profiler table per variant")
    parser.add_argument("--products", action="store_true", help="the matrix products alone")
    parser.add_argument(
        "--types", nargs="+", default=["Q4_K", "Q5_K", "Q6_K", "Q4_1", "Q8_0"], choices=GGML_TYPES
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    parser.add_argument("--layers", type=int, default=4, help="--products: layers of matrices")
    parser.add_argument("--rounds", type=int, default=20, help="--products: passes a variant")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.products:
        products(args.types, args.rows, args.layers, args.rounds)
        return
    loaded = load_model(args.model, dtype=args.dtype, device="cpu", dense_dtype=args.dense_dtype)
    runners = {name: VARIANTS[name](loaded) for name in args.variants}
    dense = loaded.dense_dtype or loaded.dtype
    print(
        f"dtype {loaded.dtype}, dense {dense}, context {args.context}, threads {torch.get_num_threads()}"
    )
    print("| batch | variant | ms/step (median) | p90 | tokens/s | vs first |")
    print("|---|---|---|---|---|---|")
    for batch in args.batch:
        streams = {}
        for name, runner in runners.items():
            started = time.perf_counter()
            streams[name] = Stream(runner, batch, args.context, args.steps)
            streams[name].step()
            print(f"  {name}: prefill and first step {time.perf_counter() - started:.1f} s")
        order = list(streams)
        for _ in range(2):  # warm-up, not timed
            for s in streams.values():
                s.step()
                s.times.clear()
        while streams[order[0]].generated < args.steps:
            for name in order:
                for _ in range(args.round):
                    streams[name].step()
            order.reverse()
        first = statistics.median(streams[args.variants[0]].times)
        for name, s in streams.items():
            med = statistics.median(s.times)
            p90 = sorted(s.times)[int(len(s.times) * 0.9)]
            print(
                f"| {batch} | {name} | {med * 1e3:.2f} | {p90 * 1e3:.2f} | {batch / med:.1f} "
                f"| {med / first:.2f}x |"
            )
        reference = streams[args.variants[0]].tokens
        for name, s in streams.items():
            if s.tokens != reference:
                print(f"  note: {name}'s tokens differ from {args.variants[0]}'s")
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            for name, s in streams.items():
                s.generated = 0
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    for _ in range(8):
                        s.step()
                print(f"profile of {name}, batch {batch}, 8 steps:")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
