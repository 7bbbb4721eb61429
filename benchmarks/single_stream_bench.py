"""Single-stream and batch speed over HTTP: stoic with its default flags (and each speed option
that stays, off) next to llama.cpp's ``llama-server`` and ``transformers serve``.

    python benchmarks/single_stream_bench.py --llama-server "$(benchmarks/build_llama_server.sh)" \
        [--transformers] [--write-docs]

Every server is started once and stays up; at each concurrency level (1, 8, 32 streaming
closed-loop clients, mixed chat prompts, greedy, ``max_tokens`` 64 with EOS ignored) every system
is measured in turn, the order rotating from level to level, each pass with prompts tagged anew
(no prefix cache reuses an earlier pass). Ratios are taken against llama-server's tokens/s in
the same run. ``--write-docs`` replaces the section between the ``single_stream_bench`` markers
in docs/benchmarks.md with the tables printed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness.workload as eb
from harness import ROOT
from harness.cpu import cpu_flags, cpu_model, versions
from harness.load import Result, run_load
from harness.report import fmt_ms, fmt_s, markdown
from harness.servers import System, llama_system, stoic_server, transformers_system

LEVELS = (1, 8, 32)
REQUESTS = {1: 8, 8: 32, 32: 64}
START, END = "<!-- single_stream_bench:start -->", "<!-- single_stream_bench:end -->"


async def measure(system: System, prompts: Sequence[Any], c: int, tag: str, tokens: int) -> Result:
    bodies = [system.body(p, tokens) for p in eb.tag_prompts(prompts, tag)]
    records, seconds = await run_load(system.url + "/v1/chat/completions", bodies, c, budget=600.0)
    return Result(system.name, c, len(prompts), records, seconds)


def table(results: list[Result], baseline: str) -> str:
    head = ("system", "c", "requests", "tokens/s", "vs llama-server", "TTFT p50 (s)")
    head += ("TTFT p99 (s)", "TPOT p50 (ms)", "ITL p99 (ms)")
    rows = []
    for r in results:
        base = next(
            (b for b in results if b.system == baseline and b.concurrency == r.concurrency), None
        )
        vs = f"{r.tokens_per_s / base.tokens_per_s:.2f}x" if base and base.tokens_per_s else "-"
        rows.append(
            (
                r.system,
                r.concurrency,
                f"{len(r.ok)}/{r.planned}",
                f"{r.tokens_per_s:.1f}",
                vs,
                fmt_s(r.ttft(0.5)),
                fmt_s(r.ttft(0.99)),
                fmt_ms(r.tpot(0.5)),
                fmt_ms(r.itl(0.99)),
            )
        )
    return markdown(head, rows)


async def run(args: argparse.Namespace) -> str:
    import torch

    from stoic.model import default_gguf_path, resolve_dtype

    work = Path(tempfile.mkdtemp(prefix="stoic-single-stream-"))
    levels = sorted(set(args.levels))
    requests = {c: args.requests or REQUESTS.get(c, 2 * c) for c in levels}
    systems = [stoic_server(work, "stoic serve")]
    if not args.no_options:
        systems.append(
            stoic_server(work, "stoic serve --quantization none", ["--quantization", "none"])
        )
    if args.llama_server:
        llama = llama_system(work, args.llama_server, default_gguf_path(), max(levels))
        llama.name = "llama-server"
        systems.append(llama)
    if args.transformers:
        tserve = transformers_system(work, eb.default_model_dir(), args.max_tokens, cb=True)
        # the dtype stoic's --dtype auto chose here (serving_bench's bfloat16 suits other CPUs)
        dtype = str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
        tserve.argv[tserve.argv.index("--dtype") + 1] = dtype
        systems.append(tserve)
    results: list[Result] = []
    started = time.time()
    try:
        for s in systems:
            print(f"starting {s.name}: {' '.join(s.argv)}", flush=True)
            await s.start(limit_s=600.0)
            await measure(s, eb.mixed_prompts(4, seed=99), 4, "[warm-up] ", 8)
        prompts = eb.mixed_prompts(max(requests.values()))
        for i, c in enumerate(levels):
            order = systems[i % len(systems) :] + systems[: i % len(systems)]
            for s in order:
                tag = f"[pass {i}-{s.port}] "
                r = await measure(s, prompts[: requests[c]], c, tag, args.max_tokens)
                print(
                    f"{s.name:34s} c={c:<3d} {r.tokens_per_s:7.1f} tok/s  TPOT p50 "
                    f"{fmt_ms(r.tpot(0.5))} ms  TTFT p50 {fmt_s(r.ttft(0.5))} s  errors {r.errors}",
                    flush=True,
                )
                results.append(r)
    finally:
        for s in systems:
            s.stop()
    results.sort(key=lambda r: (r.concurrency, [s.name for s in systems].index(r.system)))
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    minutes = (time.time() - started) / 60
    return (
        f"Generated by `benchmarks/single_stream_bench.py` in {minutes:.1f} minutes "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average after: {load}):\n\n"
        f"```sh\npython benchmarks/single_stream_bench.py {' '.join(sys.argv[1:])}\n```\n\n"
        f"CPU: {cpu_model()}, {os.cpu_count()} cores ({cpu_flags()}). {versions()}. "
        f"Requests per level: {', '.join(f'{n} at c={c}' for c, n in requests.items())}; "
        "mixed chat prompts (`harness.workload.mixed_prompts`), streamed, greedy, "
        f"`max_tokens` {args.max_tokens}, EOS ignored. `stoic serve`: no flags but the port (its defaults: `--dtype auto`, "
        "`--quantization auto`, `--executor process`); llama-server: "
        f"`{' '.join(['llama-server', '-m', '<the default GGUF file>'] + (llama.argv[3:] if args.llama_server else []))}`"
        " on the same GGUF file.\n\n" + table(results, "llama-server") + "\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", help="path to llama.cpp's llama-server")
    parser.add_argument("--transformers", action="store_true", help="also transformers serve CB")
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument(
        "--levels", type=int, nargs="+", default=list(LEVELS), help="concurrency levels (1 8 32)"
    )
    parser.add_argument("--requests", type=int, help="requests per level (8, 32, 64)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--no-options", action="store_true", help="stoic's defaults only (no --quantization none)"
    )
    args = parser.parse_args()
    text = asyncio.run(run(args))
    print(text)
    if args.write_docs:
        doc = ROOT / "docs" / "benchmarks.md"
        body = doc.read_text()
        if START not in body or END not in body:
            raise SystemExit(f"{doc} has no {START} ... {END} section")
        head, rest = body.split(START, 1)
        doc.write_text(head + START + "\n" + text + rest[rest.index(END) :])
        print(f"wrote {doc}")


if __name__ == "__main__":
    main()
