"""Single-stream and batch speed over HTTP: stoic with its default flags (and each speed option
that stays, off) next to llama.cpp's ``llama-server`` and ``transformers serve``.

    python benchmarks/single_stream_bench.py --llama-server "$(benchmarks/build_llama_server.sh)" \
        [--transformers] [--model default FILE.gguf ...] [--write-docs [SECTION]]

Each model (``--model``: GGUF files, ``default`` the shipped one) is served in turn by stoic and
llama-server on that file; its servers are started once and stay up while it is measured. At each
concurrency level (1, 8, 32 streaming closed-loop clients, mixed chat prompts, greedy,
``max_tokens`` 64 with EOS ignored) every system is measured in turn, the order rotating from
level to level, each pass with prompts tagged anew (no prefix cache reuses an earlier pass).
Ratios are taken against llama-server's tokens/s on the same file in the same run.
``--write-docs`` replaces the section between the ``single_stream_bench`` markers (or
``SECTION``'s) in docs/benchmarks.md with the tables printed.
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
from harness.servers import (
    System,
    llama_system,
    model_file,
    model_flags,
    stoic_server,
    transformers_system,
)

LEVELS = (1, 8, 32)
REQUESTS = {1: 8, 8: 32, 32: 64}
SECTION = "single_stream_bench"


async def measure(system: System, prompts: Sequence[Any], c: int, tag: str, tokens: int) -> Result:
    bodies = [system.body(p, tokens) for p in eb.tag_prompts(prompts, tag)]
    records, seconds = await run_load(system.url + "/v1/chat/completions", bodies, c, budget=600.0)
    return Result(system.name, c, len(prompts), records, seconds)


def table(results: list[tuple[str, Result]], baseline: str) -> str:
    """One row a ``(model, result)``, with its ratio to ``baseline`` on the same model and level;
    a model column where there is more than one model."""
    models = len({m for m, _ in results}) > 1
    head = ("model",) * models + ("system", "c", "requests", "tokens/s", "vs llama-server")
    head += ("TTFT p50 (s)", "TTFT p99 (s)", "TPOT p50 (ms)", "ITL p99 (ms)")
    rows = []
    for model, r in results:
        base = next(
            (
                b
                for m, b in results
                if m == model and b.system == baseline and b.concurrency == r.concurrency
            ),
            None,
        )
        vs = f"{r.tokens_per_s / base.tokens_per_s:.2f}x" if base and base.tokens_per_s else "-"
        rows.append(
            (model,) * models
            + (
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


def model_systems(args: argparse.Namespace, work: Path, gguf: Path, slots: int) -> list[System]:
    """The systems measured on ``gguf``: stoic serve with its defaults (and its options off),
    llama-server and transformers serve (the default model only) as asked."""
    import torch

    from stoic.model import resolve_dtype

    model = model_flags(gguf)
    work = work / gguf.stem
    systems = [stoic_server(work, "stoic serve", model)]
    for layouts in args.weight_layouts or ():
        flags = [*model, "--weight-layouts", layouts]
        systems.append(stoic_server(work, f"stoic serve --weight-layouts {layouts}", flags))
    for extra in args.stoic_flags or ():
        flags = [*model, *extra.split()]
        systems.append(stoic_server(work, f"stoic serve {extra}", flags))
    if not args.no_options:
        flags = [*model, "--quantization", "none"]
        systems.append(stoic_server(work, "stoic serve --quantization none", flags))
    if args.llama_server:
        llama = llama_system(work, args.llama_server, gguf, slots)
        llama.name = "llama-server"
        systems.append(llama)
    if args.transformers and not model:
        tserve = transformers_system(work, eb.default_model_dir(), args.max_tokens, cb=True)
        # the dtype stoic's --dtype auto chose here (serving_bench's bfloat16 suits other CPUs)
        dtype = str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
        tserve.argv[tserve.argv.index("--dtype") + 1] = dtype
        systems.append(tserve)
    return systems


async def measure_model(
    systems: list[System], levels: list[int], requests: dict[int, int], tokens: int
) -> list[Result]:
    """Start ``systems``, measure each at every level (the order rotating), stop them."""
    results: list[Result] = []
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
                r = await measure(s, prompts[: requests[c]], c, tag, tokens)
                print(
                    f"{s.name:34s} c={c:<3d} {r.tokens_per_s:7.1f} tok/s  TPOT p50 "
                    f"{fmt_ms(r.tpot(0.5))} ms  TTFT p50 {fmt_s(r.ttft(0.5))} s  errors {r.errors}",
                    flush=True,
                )
                results.append(r)
    finally:
        for s in systems:
            s.stop()
    names = [s.name for s in systems]
    return sorted(results, key=lambda r: (r.concurrency, names.index(r.system)))


async def run(args: argparse.Namespace) -> str:
    work = Path(tempfile.mkdtemp(prefix="stoic-single-stream-"))
    levels = sorted(set(args.levels))
    requests = {c: args.requests or REQUESTS.get(c, 2 * c) for c in levels}
    files = [model_file(name) for name in args.model]
    results: list[tuple[str, Result]] = []
    failed: list[str] = []
    started = time.time()
    llama_argv: list[str] = []
    for gguf in files:
        print(f"model {gguf}", flush=True)
        systems = model_systems(args, work, gguf, max(levels))
        llama_argv = next((s.argv for s in systems if s.name == "llama-server"), llama_argv)
        try:
            measured = await measure_model(systems, levels, requests, args.max_tokens)
        except RuntimeError as exc:  # a server that does not start on this file: say so, go on
            print(exc, flush=True)
            failed.append(f"{gguf.name}: {str(exc).splitlines()[0]}")
            continue
        results += [(gguf.name, r) for r in measured]
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    minutes = (time.time() - started) / 60
    one = len(files) == 1
    what = "the default GGUF file" if one and args.model == ["default"] else "the GGUF file"
    llama = " ".join(["llama-server", "-m", f"<{what}>", *llama_argv[3:]])
    return (
        f"Generated by `benchmarks/single_stream_bench.py` in {minutes:.1f} minutes "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average after: {load}):\n\n"
        f"```sh\npython benchmarks/single_stream_bench.py {' '.join(sys.argv[1:])}\n```\n\n"
        f"CPU: {cpu_model()}, {os.cpu_count()} cores ({cpu_flags()}). {versions()}. "
        f"Requests per level: {', '.join(f'{n} at c={c}' for c, n in requests.items())}; "
        "mixed chat prompts (`harness.workload.mixed_prompts`), streamed, greedy, "
        f"`max_tokens` {args.max_tokens}, EOS ignored. `stoic serve`: no flags but the port"
        + ("" if args.model == ["default"] else " and `--model`")
        + " (its defaults: `--dtype auto`, `--quantization auto`, `--executor process`)"
        + (f"; llama-server: `{llama}` on the same GGUF file" if llama_argv else "")
        + ".\n\n"
        + table(results, "llama-server")
        + "\n"
        + "".join(f"\nNot measured: {line}\n" for line in failed)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", help="path to llama.cpp's llama-server")
    parser.add_argument(
        "--transformers",
        action="store_true",
        help="also transformers serve CB (on the default model)",
    )
    parser.add_argument(
        "--write-docs",
        nargs="?",
        const=SECTION,
        metavar="SECTION",
        help=f"update docs/benchmarks.md between SECTION's markers ({SECTION})",
    )
    parser.add_argument(
        "--model",
        nargs="+",
        default=["default"],
        metavar="PATH",
        help="GGUF files served by stoic and llama-server in turn; 'default': the shipped one",
    )
    parser.add_argument(
        "--levels", type=int, nargs="+", default=list(LEVELS), help="concurrency levels (1 8 32)"
    )
    parser.add_argument("--requests", type=int, help="requests per level (8, 32, 64)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--no-options", action="store_true", help="stoic's defaults only (no --quantization none)"
    )
    parser.add_argument(
        "--weight-layouts",
        nargs="+",
        choices=["fast", "compact"],
        help="also stoic serve with each of these --weight-layouts",
    )
    parser.add_argument(
        "--stoic-flags",
        action="append",
        metavar="FLAGS",
        help="also stoic serve with these flags (one string; repeatable), e.g. "
        "'--speculative off' (a random-weight file's output is a loop every draft matches)",
    )
    args = parser.parse_args()
    text = asyncio.run(run(args))
    print(text)
    if args.write_docs:
        doc = ROOT / "docs" / "benchmarks.md"
        body = doc.read_text()
        start, end = f"<!-- {args.write_docs}:start -->", f"<!-- {args.write_docs}:end -->"
        if start not in body or end not in body:
            raise SystemExit(f"{doc} has no {start} ... {end} section")
        head, rest = body.split(start, 1)
        doc.write_text(head + start + "\n" + text + rest[rest.index(end) :])
        print(f"wrote {doc}")


if __name__ == "__main__":
    main()
