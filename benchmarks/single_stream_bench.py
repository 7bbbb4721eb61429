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

import engine_bench as eb
from serving import BIN, ROOT
from serving.cpu import cpu_flags, cpu_model, versions
from serving.load import Result, run_load
from serving.systems import System, free_port, llama_system, transformers_system
from serving.tables import fmt_ms, fmt_s

LEVELS = (1, 8, 32)
REQUESTS = {1: 8, 8: 32, 32: 64}
START, END = "<!-- single_stream_bench:start -->", "<!-- single_stream_bench:end -->"
GREEDY = {"temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}


def stoic_system(work: Path, name: str, flags: Sequence[str]) -> System:
    """``stoic serve`` with its defaults and ``flags``."""
    port = free_port()
    argv = [str(BIN / "stoic"), "serve", "--port", str(port), "--log-level", "warning", *flags]
    slug = name.replace(" ", "_").replace("-", "")
    return System(name, argv, port, "default", GREEDY, work / f"{slug}.log")


async def measure(system: System, prompts: Sequence[Any], c: int, tag: str) -> Result:
    bodies = [system.body(p, 64) for p in eb.tag_prompts(prompts, tag)]
    records, seconds = await run_load(system.url + "/v1/chat/completions", bodies, c, budget=600.0)
    return Result(system.name, c, len(prompts), records, seconds)


def table(results: list[Result], baseline: str) -> str:
    lines = [
        "| system | c | requests | tokens/s | vs llama-server | TTFT p50 (s) | TTFT p99 (s) "
        "| TPOT p50 (ms) | ITL p99 (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        base = next(
            (b for b in results if b.system == baseline and b.concurrency == r.concurrency), None
        )
        vs = f"{r.tokens_per_s / base.tokens_per_s:.2f}x" if base and base.tokens_per_s else "-"
        lines.append(
            f"| {r.system} | {r.concurrency} | {len(r.ok)}/{r.planned} | {r.tokens_per_s:.1f} "
            f"| {vs} | {fmt_s(r.ttft(0.5))} | {fmt_s(r.ttft(0.99))} | {fmt_ms(r.tpot(0.5))} "
            f"| {fmt_ms(r.itl(0.99))} |"
        )
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> str:
    import torch

    from stoic.model import default_gguf_path, resolve_dtype
    from stoic.model._loader import resolve_model_path

    work = Path(tempfile.mkdtemp(prefix="stoic-single-stream-"))
    systems = [
        stoic_system(work, "stoic serve", []),
        stoic_system(work, "stoic serve --quantization none", ["--quantization", "none"]),
    ]
    if args.llama_server:
        llama = llama_system(work, args.llama_server, default_gguf_path(), max(LEVELS))
        llama.name = "llama-server"
        systems.append(llama)
    if args.transformers:
        _, model_dir = resolve_model_path("default")
        tserve = transformers_system(work, model_dir, 64, cb=True)
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
            await measure(s, eb.mixed_prompts(4, seed=99), 4, "[warm-up] ")
        prompts = eb.mixed_prompts(max(REQUESTS.values()))
        for i, c in enumerate(LEVELS):
            order = systems[i % len(systems) :] + systems[: i % len(systems)]
            for s in order:
                r = await measure(s, prompts[: REQUESTS[c]], c, f"[pass {i}-{s.port}] ")
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
        f"Requests per level: {', '.join(f'{n} at c={c}' for c, n in REQUESTS.items())}; "
        "mixed chat prompts (`engine_bench.mixed_prompts`), streamed, greedy, `max_tokens` 64, "
        "EOS ignored. `stoic serve`: no flags but the port (its defaults: `--dtype auto`, "
        "`--quantization auto`, `--executor process`); llama-server: "
        f"`{' '.join(['llama-server', '-m', '<the default GGUF file>'] + (llama.argv[3:] if args.llama_server else []))}`"
        " on the same GGUF file.\n\n" + table(results, "llama-server") + "\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", help="path to llama.cpp's llama-server")
    parser.add_argument("--transformers", action="store_true", help="also transformers serve CB")
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
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
