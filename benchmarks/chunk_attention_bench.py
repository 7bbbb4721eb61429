"""Prompt chunks' attention in C (``_chunk_attention.c``) against SDPA, which it replaced.

Two tables, each variant alternated with the other (A B, B A, ...) so the noise of a shared
machine hits both alike:

- **the kernel alone**: one chunk of ``n`` rows at position ``start`` over a paged pool (9 query
  heads over 3, head dim 64, blocks of 16 shuffled), ``stoic_chunk_attention`` against torch's
  SDPA in float32 and in bfloat16 over the keys already gathered (what the torch path does
  after its gather), median microseconds;
- **the model's steps**: each model (``default`` or a GGUF file) loaded once, ``--dtype auto``'s
  split (bfloat16 products), two runners on it, A with the prompt chunks on SDPA (the backend's
  kernels told the chunk kernel is absent) and B on the C kernel (the default): a mixed step
  (31 sequences decoding at context ~200 and a 225-token chunk), a 256-token prefill and the 31
  decodes alone; median milliseconds and B / A.

    python benchmarks/chunk_attention_bench.py [MODEL ...] [--rounds 10]
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from step_bench import BLOCK, GREEDY

from stoic.gguf import default_cache_dir
from stoic.kernels import Kernels, load_kernels
from stoic.model import PagedKVCache, load_model
from stoic.request import SeqChunk, StepBatch
from stoic.worker import ModelRunner

#: (first position, rows) of the chunks the kernel table times
CHUNKS = ((0, 225), (0, 256), (150, 243), (512, 256))
#: query heads, kv heads, head dim of the kernel table (SmolLM2-135M's and the Qwen2 file's)
HEADS = (9, 3, 64)


def _alternate(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Each function's median seconds over ``rounds`` calls, the order reversed every round."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns)
    for _ in range(rounds):
        for name in order:
            started = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - started)
        order.reverse()
    return {name: statistics.median(ts) for name, ts in times.items()}


def _kernel_times(
    kernels: Kernels, start: int, n: int, gen: torch.Generator, rounds: int
) -> dict[str, float]:
    """One chunk's median seconds: the C kernel, SDPA in float32 and in bfloat16."""
    heads, kv_heads, dh = HEADS
    length = start + n
    nblocks = -(-length // BLOCK)
    total = nblocks + 8
    order = torch.randperm(total, generator=gen)[:nblocks]
    table = (torch.arange(kv_heads)[:, None] * total + order[None, :]).contiguous()
    k_pool = torch.randn(kv_heads * total, BLOCK, dh, generator=gen)
    v_pool = torch.randn(kv_heads * total, BLOCK, dh, generator=gen)
    q = torch.randn(n, heads, dh, generator=gen)
    out = torch.empty(n, heads, dh)
    rows = table.reshape(-1)
    keys = k_pool[rows].view(1, kv_heads, -1, dh)[:, :, :length]
    values = v_pool[rows].view(1, kv_heads, -1, dh)[:, :, :length]
    qh = q.transpose(0, 1)[None]
    mask = torch.arange(length)[None, :] <= torch.arange(start, length)[:, None]
    attn_mask = mask if start else None

    def c() -> None:
        rc = kernels.chunk_attention(
            q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), table.data_ptr(), nblocks,
            start, n, heads, kv_heads, dh, BLOCK, dh**-0.5, out.data_ptr(),
            torch.get_num_threads(), 0,
        )  # fmt: skip
        assert rc == 0, rc

    def sdpa(dtype: torch.dtype) -> Callable[[], object]:
        a, b, v = qh.to(dtype), keys.to(dtype), values.to(dtype)
        return lambda: F.scaled_dot_product_attention(
            a, b, v, attn_mask=attn_mask, is_causal=not start, enable_gqa=True
        )

    return _alternate(
        {"c": c, "f32": sdpa(torch.float32), "bf16": sdpa(torch.bfloat16)}, rounds * 3
    )


def kernel_table(kernels: Kernels, rounds: int) -> None:
    heads, kv_heads, dh = HEADS
    gen = torch.Generator().manual_seed(0)
    print(f"threads {torch.get_num_threads()}; {heads} query heads over {kv_heads}, head dim {dh}")
    print("| start | rows | C us | SDPA float32 us | SDPA bfloat16 us | C / SDPA float32 |")
    print("|---:|---:|---:|---:|---:|---:|")
    for start, n in CHUNKS:
        t = _kernel_times(kernels, start, n, gen, rounds)
        print(
            f"| {start} | {n} | {t['c'] * 1e6:.0f} | {t['f32'] * 1e6:.0f} | "
            f"{t['bf16'] * 1e6:.0f} | {t['c'] / t['f32']:.2f} |"
        )


class Bed:
    """31 sequences decoding at ``context`` (200) on one runner and its cache, and fresh
    prompts."""

    def __init__(self, runner: ModelRunner, context: int = 200) -> None:
        self.runner = runner
        self.context = context
        per = 40
        self.cache = PagedKVCache(runner.kv_spec(num_blocks=80 * per, block_size=BLOCK))
        self.tables = [tuple(range(i * per, (i + 1) * per)) for i in range(80)]
        self.last: dict[int, int] = {}
        self.k = 0
        for i in range(31):
            chunk = SeqChunk(i, self._prompt(i, context), 0, self.tables[i], True, GREEDY)
            out = runner.execute(StepBatch((chunk,)), self.cache)
            self.last[i] = out.sampled[i].token_id

    @staticmethod
    def _prompt(i: int, n: int) -> tuple[int, ...]:
        return tuple((7 * i + 13 * j) % 5000 + 100 for j in range(n))

    def _decodes(self) -> list[SeqChunk]:
        k = self.k
        return [
            SeqChunk(
                i, (last,), self.context + k, self.tables[i], True, GREEDY, num_generated=k + 1
            )
            for i, last in self.last.items()
        ]

    def _fresh(self, n: int) -> SeqChunk:
        j = 40 + self.k % 40
        return SeqChunk(j, self._prompt(j, n), 0, self.tables[j], True, GREEDY)

    def run(self, kind: str) -> None:
        chunks = {
            "mixed 31 + 225": [*self._decodes(), self._fresh(225)],
            "prefill 256": [self._fresh(256)],
            "decode 31": self._decodes(),
        }[kind]
        self.runner.execute(StepBatch(tuple(chunks)), self.cache)
        self.k += 1


def steps_table(models: list[str], rounds: int) -> None:
    print("| model | step | A SDPA chunks ms | B C chunks ms | B / A |")
    print("|---|---|---:|---:|---:|")
    for model in models:
        loaded = load_model(model, dtype="auto")
        sdpa = ModelRunner(loaded)
        backend = sdpa.attention
        kernels = copy.copy(getattr(backend, "_kernels", None))
        if kernels is None or not kernels.chunk_attention_available:
            print(f"| {model} | - | the C chunk attention does not run here ({backend.name}) | | |")
            continue
        kernels.chunk_attention_available = False
        backend._kernels = kernels  # type: ignore[attr-defined]
        beds = {"A": Bed(sdpa), "B": Bed(ModelRunner(loaded))}
        for kind in ("mixed 31 + 225", "prefill 256", "decode 31"):
            t = _alternate(
                {name: functools.partial(bed.run, kind) for name, bed in beds.items()}, rounds
            )
            print(
                f"| {model.rsplit('/', 1)[-1]} | {kind} | {t['A'] * 1e3:.1f} | "
                f"{t['B'] * 1e3:.1f} | {t['B'] / t['A']:.2f} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", default=["default"])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    kernels = load_kernels(default_cache_dir())
    if not kernels.chunk_attention_available:
        raise SystemExit("this build of the kernels has no chunk attention (no AVX-512)")
    with torch.inference_mode():
        kernel_table(kernels, args.rounds)
        print()
        steps_table(args.models, args.rounds)


if __name__ == "__main__":
    main()
