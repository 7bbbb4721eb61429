"""Speculative decoding by prompt lookup: output tokens per second with ``--speculative ngram``
(or ``auto``) against ``off``, the same requests, the same run.

Workloads (chat requests, greedy, ``--tokens`` tokens, EOS ignored only with ``--ignore-eos``):

* ``grounded``: answers that copy from their input: rewrite a given code file with one change,
  answer with quotes from a given passage;
* ``open``: open-ended questions, nothing to copy.

For each ``--clients`` level and workload, engines with each mode run the same requests in turn
(``--rounds`` rounds alternating the order, so that neither always runs second); reported:
tokens/s of each (whole requests, and the decode phase: from each request's first token to its
last), their ratios (geometric means of the rounds' ratios), the drafts' acceptance rate, and
whether every text was equal (greedy: it must be).

    python benchmarks/spec_bench.py                                  # default model, 1 client
    python benchmarks/spec_bench.py --clients 1 32 --mode auto
    python benchmarks/spec_bench.py --model shapes/qwen2.5-1.5b --load-format dummy
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.report import markdown
from harness.workload import quiet_logs

import stoic

_CODE = '''def parse_config(path):
    """Read a key=value file into a dict, skipping comments and blank lines."""
    result = {}
    with open(path) as handle:
        for number, line in enumerate(handle, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if "=" not in line:
                raise ValueError(f"line {number}: expected key=value")
            key, value = line.split("=", 1)
            result[key.strip()] = value.strip()
    return result
'''
_PASSAGE = (
    "The lighthouse at Saint Clement was built in 1872 from granite quarried on the island "
    "itself. Its lamp, first fuelled by colza oil and later by paraffin, could be seen for "
    "eighteen nautical miles. The last keeper, Marguerite Olsen, left in 1987 when the light "
    "was automated; she kept a logbook of every ship that passed, which the town museum now "
    "holds. Visitors can climb the 114 steps on summer weekends."
)
GROUNDED = [
    f"Rewrite this Python function, renaming `result` to `settings`. Reply with the code only."
    f"\n\n{_CODE}",
    f"Read the passage, then answer by quoting the sentences that say when the lighthouse was "
    f"built and who its last keeper was.\n\n{_PASSAGE}",
    f"Copy the following function exactly, then add a docstring line at the end saying it "
    f"returns a dict.\n\n{_CODE}",
    f"Repeat the passage word for word, then say in one sentence what it is about.\n\n{_PASSAGE}",
]
OPEN = [
    "Write a short poem about autumn in a city.",
    "Give three tips for learning a new language.",
    "Explain why the sky is blue to a ten-year-old.",
    "Describe your ideal weekend in a few sentences.",
]


@dataclass
class Run:
    """One mode's run of the prompts."""

    #: output tokens over the run's wall time (prefills included)
    tokens_per_s: float
    #: tokens after each request's first over the time from its first token to its last,
    #: summed over requests: the decode phase, which drafts speed up (a long grounded prompt's
    #: prefill is a large, unchanged part of a short answer's time)
    decode_per_s: float
    texts: list[str]
    proposed: int
    kept: int


async def run_mode(args: argparse.Namespace, mode: str, prompts: list[str], clients: int) -> Run:
    """``prompts`` at ``clients`` in ``mode``."""
    config = stoic.EngineConfig(
        model=args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        speculative=mode,  # type: ignore[arg-type]
        num_speculative_tokens=args.k,
        max_queue_wait=None,
    )
    params = stoic.SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=args.ignore_eos)
    semaphore = asyncio.Semaphore(clients)
    async with stoic.Engine.start(config) as engine:
        await engine.complete("Hello", stoic.SamplingParams(max_tokens=4))  # warm-up
        before = engine.stats()

        async def one(prompt: str) -> tuple[str, int, float]:
            """(text, tokens, seconds from the first token to the last)."""
            async with semaphore:
                messages = [{"role": "user", "content": prompt}]
                text, tokens, first = [], 0, 0.0
                async for delta in engine.chat(messages, params):
                    if not tokens and delta.token_ids:
                        first = time.perf_counter()
                    text.append(delta.text)
                    tokens += len(delta.token_ids)
                return "".join(text), tokens, time.perf_counter() - first

        started = time.perf_counter()
        done = await asyncio.gather(*(one(p) for p in prompts))
        seconds = time.perf_counter() - started
        after = engine.stats()
    decoded = sum(max(0, n - 1) for _, n, _ in done)
    return Run(
        sum(n for _, n, _ in done) / seconds,
        decoded / max(1e-9, sum(s for _, _, s in done)),
        [t for t, _, _ in done],
        after.spec_draft_tokens - before.spec_draft_tokens,
        after.spec_accepted_tokens - before.spec_accepted_tokens,
    )


async def main(args: argparse.Namespace) -> None:
    quiet_logs()
    rows = []
    for clients in args.clients:
        for name, base in (("grounded", GROUNDED), ("open", OPEN)):
            prompts = (base * max(1, -(-clients * 2 // len(base))))[: max(len(base), clients * 2)]
            runs: dict[str, list[Run]] = {args.mode: [], "off": []}
            for r in range(args.rounds):
                order = (args.mode, "off") if r % 2 == 0 else ("off", args.mode)
                for mode in order:
                    runs[mode].append(await run_mode(args, mode, prompts, clients))
            on, off = runs[args.mode], runs["off"]
            whole = [a.tokens_per_s / b.tokens_per_s for a, b in zip(on, off, strict=True)]
            decode = [a.decode_per_s / b.decode_per_s for a, b in zip(on, off, strict=True)]
            proposed, kept = sum(x.proposed for x in on), sum(x.kept for x in on)
            equal = sum(a == b for a, b in zip(on[-1].texts, off[-1].texts, strict=True))
            rows.append(
                (
                    name,
                    str(clients),
                    f"{statistics.mean(x.tokens_per_s for x in off):.1f}",
                    f"{statistics.mean(x.tokens_per_s for x in on):.1f}",
                    f"{statistics.geometric_mean(whole):.2f}x",
                    f"{statistics.mean(x.decode_per_s for x in off):.1f}",
                    f"{statistics.mean(x.decode_per_s for x in on):.1f}",
                    f"{statistics.geometric_mean(decode):.2f}x",
                    f"{kept / proposed:.0%}" if proposed else "-",
                    f"{equal}/{len(prompts)}",
                )
            )
            print(rows[-1], file=sys.stderr, flush=True)
    print(
        f"\n{args.model} ({args.dtype}), {args.tokens} tokens, --speculative {args.mode} "
        f"(k={args.k}) against off, {args.rounds} rounds\n"
    )
    head = (
        "workload",
        "clients",
        "off tok/s",
        f"{args.mode} tok/s",
        "ratio",
        "off decode tok/s",
        f"{args.mode} decode tok/s",
        "decode ratio",
        "accepted",
        "same text",
    )
    print(markdown(head, rows, align="lrrrrrrrrr"))


def cli() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--mode", default="ngram", choices=["ngram", "auto"])
    parser.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    parser.add_argument("--clients", type=int, nargs="+", default=[1])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ignore-eos", action="store_true")
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(cli()))
