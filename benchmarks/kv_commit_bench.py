"""Prompt chunks written into fresh KV blocks: a cache whose pages were committed ahead (the step
thread's idle work, ``PagedKVCache.commit_idle``) against one whose pages the steps fault in.

The model is loaded once (``--dtype auto``, as ``stoic serve``); one runner, two caches of
``stoic serve``'s default size on a CPU (1 GiB), A lazy (``torch.empty``'s address space) and B committed before the first step.
Each round prefills a new sequence of ``--tokens`` prompt tokens into blocks no step has
written in either cache, A then B, then B then A, so a shared machine's noise hits both alike.
Reported: median milliseconds a step, B / A, and the minor page faults a step took
(``getrusage``). What a first touch costs depends on the machine: on a virtual machine whose
host backs guest memory on first touch it is ~10-40 us a page, on common hardware under 1 us.

    python benchmarks/kv_commit_bench.py [MODEL] [--rounds 8] [--tokens 225]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

from stoic.gguf import default_cache_dir
from stoic.model import PagedKVCache, load_model
from stoic.request import SamplingParams, SeqChunk, StepBatch
from stoic.worker import ModelRunner

BLOCK = 16


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="default")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=225)
    args = parser.parse_args()
    loaded = load_model(args.model, dtype="auto", cache_root=default_cache_dir())
    runner = ModelRunner(loaded)
    per = -(-args.tokens // BLOCK)
    seqs = 2 * args.rounds + 1
    # sized as stoic serve's default 1 GiB cache: pools of its size come from fresh mappings,
    # where small ones may land on heap memory the load already faulted in
    one = runner.kv_spec(num_blocks=1, block_size=BLOCK).bytes_per_block
    spec = runner.kv_spec(num_blocks=max(seqs * per, 2**30 // one), block_size=BLOCK)
    lazy, committed = PagedKVCache(spec), PagedKVCache(spec)
    began = time.perf_counter()
    while committed.commit_idle():
        pass
    commit_s = time.perf_counter() - began
    greedy = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def step(cache: PagedKVCache, seq: int) -> tuple[float, int]:
        blocks = tuple(range(seq * per, (seq + 1) * per))
        prompt = tuple((7 * seq + 13 * j) % 5000 + 100 for j in range(args.tokens))
        batch = StepBatch((SeqChunk(seq, prompt, 0, blocks, True, greedy),))
        faults, t = _faults(), time.perf_counter()
        runner.execute(batch, cache)
        return time.perf_counter() - t, _faults() - faults

    step(lazy, seqs - 1)  # warm-up, both caches on the same last blocks
    step(committed, seqs - 1)
    times: dict[str, list[float]] = {"A": [], "B": []}
    faults: dict[str, list[int]] = {"A": [], "B": []}
    for r in range(args.rounds):
        order = (("A", lazy), ("B", committed)) if r % 2 == 0 else (("B", committed), ("A", lazy))
        for name, cache in order:
            s, f = step(cache, r)
            times[name].append(s)
            faults[name].append(f)
    a, b = statistics.median(times["A"]), statistics.median(times["B"])
    print(
        f"model {args.model}: {args.tokens}-token prompt chunks into fresh blocks, "
        f"{args.rounds} rounds; committing B's {committed.pages.committed / 2**20:.0f} MiB "
        f"took {commit_s:.2f} s ({committed.pages.failed or 'MADV_POPULATE_WRITE'})"
    )
    print("| cache | ms a step (median) | page faults a step (median) | B / A |")
    print("|---|---:|---:|---:|")
    print(
        f"| A: pages faulted in by the steps | {a * 1e3:.1f} | {statistics.median(faults['A'])} | |"
    )
    print(
        f"| B: committed ahead | {b * 1e3:.1f} | {statistics.median(faults['B'])} | {b / a:.2f} |"
    )


if __name__ == "__main__":
    main()
