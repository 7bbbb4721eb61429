"""A/B serving benchmark: this working tree against another revision, in one run.

For a change that should not change speed (a refactor), the question is "within noise of
before?". Both trees are served in turn by ``stoic serve`` (same flags, same interpreter and
packages; the other revision is a ``git worktree`` put first on ``PYTHONPATH``), and driven by the
serving benchmark's load generator with the same mixed prompts, ``max_tokens`` 64, EOS ignored,
greedy. The order alternates every round (A B, B A, ...) so drift hits both alike; the table
gives each pass and the ratio of medians.

    python benchmarks/ab_bench.py --base HEAD~1 [--head HEAD] --concurrency 32 --rounds 3

``--system-words N`` gives every request of a pass one shared system prompt of N words (an
agent's instructions), which the prefix cache serves.

Two configurations of one tree compare the same way (``--base-flags``/``--head-flags``, e.g.
``--head-flags "--executor process"``). Needs nothing beyond the dev install.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_bench as eb
from serving import MAX_BATCHED_TOKENS, MAX_NUM_SEQS, NUM_KV_BLOCKS
from serving.load import Result, run_load
from serving.systems import System, free_port

ROOT = Path(__file__).resolve().parent.parent


def _system(name: str, tree: Path | None, work: Path, flags: list[str]) -> System:
    port = free_port()
    argv = [sys.executable, "-m", "stoic", "serve", "--model", "default", *flags]
    argv += ["--port", str(port), "--log-level", "warning"]
    argv += ["--num-kv-blocks", str(NUM_KV_BLOCKS)]
    argv += ["--max-num-batched-tokens", str(MAX_BATCHED_TOKENS)]
    argv += ["--max-num-seqs", str(MAX_NUM_SEQS)]
    if tree is not None:
        # the other revision's package shadows the installed (editable) one
        argv = ["env", f"PYTHONPATH={tree}", *argv]
    extra = {"temperature": 0, "ignore_eos": True}
    return System(name, argv, port, "default", extra, work / f"{name}.log")


def _system_text(words: int) -> str:
    """A fixed instruction text of ``words`` words."""
    lines = [
        "You are a careful assistant with tools.",
        "Call get_weather(city) for weather, search(query) for facts, and add(a, b) for sums.",
        "Answer briefly, cite the tool you used, and never invent a tool's result.",
    ]
    text: list[str] = []
    while len(text) < words:
        text.extend(" ".join(lines).split())
    return " ".join(text[:words])


async def _pass(
    system: System,
    concurrency: int,
    requests: int,
    tag: str,
    settle: float,
    system_words: int = 0,
) -> Result:
    await system.start()
    try:
        # what a server does right after start (a worker process's spare interpreter importing
        # torch, say) is not what is measured
        await asyncio.sleep(settle)
        prompts = eb.tag_prompts(eb.mixed_prompts(requests), f"[{tag}] ")
        if system_words:
            # one long system prompt shared by the pass's requests (an agent's instructions
            # and tools): what the prefix cache serves; tagged, so no pass reuses another's
            shared = {"role": "system", "content": f"[{tag}] " + _system_text(system_words)}
            prompts = [[shared, *(m for m in p if m["role"] != "system")] for p in prompts]
        bodies = [system.body(p, 64) for p in prompts]
        url = system.url + "/v1/chat/completions"
        # a short warm-up pass (first-step costs, allocator growth) that is not measured
        await run_load(url, bodies[: max(2, concurrency // 4)], concurrency, budget=60.0)
        records, seconds = await run_load(url, bodies, concurrency, budget=600.0)
        return Result(system.name, concurrency, requests, records, seconds)
    finally:
        system.stop()


async def compare(
    args: argparse.Namespace, base_tree: Path | None, head_tree: Path | None, work: Path
) -> None:
    systems = {
        "base": _system("base", base_tree, work, args.base_flags.split()),
        "head": _system("head", head_tree, work, args.head_flags.split()),
    }
    results: dict[str, list[Result]] = {"base": [], "head": []}
    for r in range(args.rounds):
        order = ["base", "head"] if r % 2 == 0 else ["head", "base"]
        for name in order:
            result = await _pass(
                systems[name],
                args.concurrency,
                args.requests,
                f"r{r}",
                args.settle,
                args.system_words,
            )
            results[name].append(result)
            print(
                f"round {r} {name}: {result.tokens_per_s:.1f} tok/s, "
                f"TTFT p50 {result.ttft(0.5) or 0:.3f} s, p99 {result.ttft(0.99) or 0:.3f} s, "
                f"errors {result.errors}",
                flush=True,
            )
    print()
    print(
        f"base = {args.base or 'working tree'}, head = {args.head or 'working tree'}; "
        f"c={args.concurrency}, "
        f"{args.requests} requests per pass, max_tokens 64, "
        f"shared system prompt of {args.system_words} words; "
        f"base flags {args.base_flags!r}, head flags {args.head_flags!r}"
    )
    print()
    print(
        "| tree | output tok/s per pass | median tok/s | median TTFT p50 (s) "
        "| median TTFT p99 (s) |"
    )
    print("| --- | --- | --- | --- | --- |")
    med: dict[str, float] = {}
    for name in ("base", "head"):
        tps = [x.tokens_per_s for x in results[name]]
        ttft = [x.ttft(0.5) or 0.0 for x in results[name]]
        tail = [x.ttft(0.99) or 0.0 for x in results[name]]
        med[name] = statistics.median(tps)
        passes = ", ".join(f"{t:.1f}" for t in tps)
        print(
            f"| {name} | {passes} | {med[name]:.1f} | {statistics.median(ttft):.3f} "
            f"| {statistics.median(tail):.3f} |"
        )
    print()
    print(f"head / base (median tok/s): {med['head'] / med['base']:.3f}")


def main(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="stoic-ab-"))
    base_tree = work / "base" if args.base else None
    head_tree = work / "head" if args.head else None
    git = ["git", "-C", str(ROOT), "worktree"]
    trees = [(t, rev) for t, rev in ((base_tree, args.base), (head_tree, args.head)) if t and rev]
    for tree, rev in trees:
        subprocess.run([*git, "add", "--detach", str(tree), rev], check=True)
    try:
        asyncio.run(compare(args, base_tree, head_tree, work))
    finally:
        for tree, _rev in trees:
            subprocess.run([*git, "remove", "--force", str(tree)], check=False)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", help="the revision to compare against (default: working tree)")
    parser.add_argument("--head", help="a revision to compare (default: the working tree)")
    parser.add_argument("--base-flags", default="", help="extra `stoic serve` flags for base")
    parser.add_argument("--head-flags", default="", help="extra `stoic serve` flags for head")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=96, help="requests per pass")
    parser.add_argument(
        "--system-words",
        type=int,
        default=0,
        help="a shared system prompt of this many words in every request (0: the template's)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--settle", type=float, default=15.0, help="seconds between a server's start and its pass"
    )
    main(parser.parse_args())
