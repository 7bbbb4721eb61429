"""``--deterministic``'s matrix products against the default mode's, over the default model.

A decode step's products (every layer's fused ``[q; k; v]``, output, fused ``[gate; up]`` and
down projections, and the LM head) of the default model, at each ``--rows``, three ways,
alternating round by round in one process (A B C, C B A, ...) so that a busy machine's noise
hits each alike:

* ``f32 fixed``: ``FIXED_ORDER``'s float32 tiles on the blocks (deterministic mode without
  AVX512_BF16, and on every CPU before ``_bf16fixed.c``);
* ``bf16 fixed``: ``_bf16fixed.c``'s bfloat16 products (deterministic mode where the CPU has
  AVX512_BF16);
* ``default``: the product the default mode's runner builds (:class:`QLinear`: the blocks for
  few rows, its dense copy for more).

The table gives the median milliseconds of one step's products and the ratios. With
``--step`` it times whole deterministic decode steps (``benchmarks/step_bench.py``'s
``Stream``) with each fixed-order product instead.

    python benchmarks/det_products_bench.py [--rows 1 4 8 16 32 64] [--rounds 7] [--step 32]
        [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from stoic.gguf import default_cache_dir
from stoic.kernels import Kernels, _qkernels, load_kernels
from stoic.model import load_model
from stoic.worker import ModelRunner

Fn = Callable[[torch.Tensor], torch.Tensor]


def _fixed(kernels: Kernels, bf16: bool, linear: object) -> Fn:
    """``linear``'s blocks bound in the fixed order, in bfloat16 or float32."""
    kernels.bf16, before = bf16, kernels.bf16
    try:
        bias = getattr(linear, "bias", None)
        bias32 = None if bias is None else bias.detach().float()
        return linear.quantized.bind(kernels, bias32, fixed=True)  # type: ignore[attr-defined,no-any-return]
    finally:
        kernels.bf16 = before


def variants(runner: ModelRunner, kernels: Kernels) -> dict[str, list[tuple[int, Fn]]]:
    """Each variant's products of one step, with their input widths."""
    fused = runner._fused
    assert fused is not None
    linears = [p for lay in fused._layers for p in (lay.qkv, lay.o, lay.gate_up, lay.down)]
    linears.append(runner._head)
    out: dict[str, list[tuple[int, Fn]]] = {"f32 fixed": [], "bf16 fixed": [], "default": []}
    for lin in linears:
        cols = int(lin.weight.shape[1])
        out["f32 fixed"].append((cols, _fixed(kernels, False, lin)))
        out["bf16 fixed"].append((cols, _fixed(kernels, True, lin)))
        out["default"].append((cols, lin))
    return out


def products(rows: list[int], rounds: int) -> None:
    loaded = load_model("default")
    runner = ModelRunner(loaded)
    kernels = load_kernels(default_cache_dir())
    if not kernels.bf16:
        sys.exit("this build has no bfloat16 fixed-order products (no AVX512_BF16)")
    fns = variants(runner, kernels)
    widths = {c for c, _ in fns["default"]}
    print(f"threads {torch.get_num_threads()}, default model, {len(fns['default'])} products/step")
    print("| rows | f32 fixed ms | bf16 fixed ms | default ms | bf16/f32 | bf16/default |")
    print("|---:|---:|---:|---:|---:|---:|")
    with torch.inference_mode():
        for m in rows:
            xs = {c: torch.randn(m, c) for c in widths}
            times: dict[str, list[float]] = {name: [] for name in fns}
            order = list(fns)
            for name in order:  # warm-up
                for c, fn in fns[name]:
                    fn(xs[c])
            for _ in range(rounds):
                for name in order:
                    started = time.perf_counter()
                    for c, fn in fns[name]:
                        fn(xs[c])
                    times[name].append(time.perf_counter() - started)
                order.reverse()
            med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
            f32, bf, dflt = med["f32 fixed"], med["bf16 fixed"], med["default"]
            print(f"| {m} | {f32:.2f} | {bf:.2f} | {dflt:.2f} | {bf / f32:.2f} | {bf / dflt:.2f} |")


def steps(batch: int, rounds: int, context: int) -> None:
    """Whole deterministic decode steps of ``batch`` sequences: float32 against bfloat16
    fixed-order products (and the default mode's runner)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from step_bench import Stream

    loaded = load_model("default", deterministic=True)  # a float32 KV cache, as the mode keeps
    init = _qkernels.Kernels.__init__

    def f32_init(self: Kernels, *args: object) -> None:
        init(self, *args)  # type: ignore[arg-type]
        self.bf16 = False

    _qkernels.Kernels.__init__ = f32_init  # type: ignore[method-assign]
    f32 = ModelRunner(loaded, deterministic=True)
    _qkernels.Kernels.__init__ = init  # type: ignore[method-assign]
    bf16 = ModelRunner(loaded, deterministic=True)
    default = ModelRunner(loaded)
    per = 4
    total = rounds * per * 2 + 2
    streams = {
        name: Stream(r, batch, context, total)
        for name, r in (("f32 fixed", f32), ("bf16 fixed", bf16), ("default", default))
    }
    order = list(streams)
    with torch.inference_mode():
        for s in streams.values():
            s.step()
        for _ in range(rounds):
            for name in order:
                for _ in range(per):
                    streams[name].step()
            order.reverse()
    med = {n: statistics.median(s.times[1:]) * 1e3 for n, s in streams.items()}
    print(f"decode steps of {batch} sequences (context {context}), median ms a step")
    print("| variant | ms/step | vs f32 fixed | vs default |")
    print("|---|---:|---:|---:|")
    for name, ms in med.items():
        print(f"| {name} | {ms:.1f} | {ms / med['f32 fixed']:.2f} | {ms / med['default']:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--step", type=int, default=0, help="time whole steps of this batch")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's own)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.step:
        steps(args.step, args.rounds, args.context)
    else:
        products(args.rows, args.rounds)


if __name__ == "__main__":
    main()
