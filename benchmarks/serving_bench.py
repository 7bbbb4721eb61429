"""Serving benchmark: stoic's HTTP server next to transformers serve (continuous batching) and a
plain batched torch decode loop (the ceiling), on the same requests, in one run.

A load generator drives any OpenAI-compatible ``/v1/chat/completions`` endpoint with C concurrent
*streaming* clients (aiohttp, SSE parsing) over a fixed, seeded prompt set of mixed lengths
(``harness.workload.mixed_prompts``), ``max_tokens`` 64 with EOS ignored, and reports output tokens/s,
requests/s, TTFT p50/p90/p99, inter-token latency p50/p99 (gaps between content events as the
client sees them), time per output token, end-to-end latency and errors.

The full run (``python benchmarks/serving_bench.py``, ~10-20 minutes on 2 CPU cores):

1. **mixed, over HTTP**, at concurrency 1, 8 and 32: ``stoic serve`` and ``transformers serve
   --continuous-batching`` (same model directory, bfloat16, CPU, same KV capacity and tokens per
   step) run side by side, idle when not measured; at each concurrency level every system is
   measured in turn (the order rotates per level) so drift hits all alike. The ceiling is the
   batched torch decode loop at batch = concurrency (decode only, no prefill, no HTTP; the faster
   of SDPA and eager attention). llama.cpp's ``llama-server`` joins when it is on PATH or given
   with ``--llama-server``.
2. **engine overhead** at concurrency 32: stoic runs under ``--timed-serve`` (``stoic.cli.main``
   with ``ModelRunner.execute`` timed), so every pass reports the exact share of wall time the
   executor spends inside steps; a second c=32 pass is sampled by ``py-spy record --threads
   --idle -f raw`` to break the time down by what the executor thread and the event loop run,
   next to the kernel's per-thread CPU accounting.
3. **through the Python API** (servers stopped): steady decode (32 sequences, 128-token prompts,
   128 new tokens) against the torch loop, and concurrency 1 against transformers ``generate`` one
   request at a time; plus a float32/bfloat16 check of the torch loop (why bfloat16). Each runs
   in a fresh process (see :func:`serving.worker.worker_main`).

Every measurement records the CPU other processes used meanwhile and is repeated (up to twice)
after waiting for quiet when that exceeds 15% of the machine.

It writes its report, ``serving-report.md``, and ``img/serving_bench.png`` under ``--out``
(default ``$TMPDIR/stoic-serving-bench``); docs/benchmarks.md quotes the figures a user needs
from it. ``--quick`` runs fewer requests (a smoke test). Drive an endpoint of your own with
``--url http://127.0.0.1:8000 --model NAME``.

The code lives in ``benchmarks/serving`` (one module per concern) over the shared harness
(``benchmarks/harness``); this script is the entry point, and the one the benchmark spawns for
its subprocesses.

Needs the ``bench`` extra: ``pip install -e '.[bench]'`` (transformers serve, matplotlib, py-spy).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: F401  (first: offline before anything imports transformers)
from serving import CONCURRENCY
from serving.bench import Bench, Settings, drive_endpoint
from serving.report import plot, print_summary, report, write_doc
from serving.timed import timed_serve
from serving.worker import worker_main

REPORT = "serving-report.md"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few requests: a smoke test")
    parser.add_argument("--requests", type=int, help="requests per concurrency level")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--budget", type=float, help="seconds per system and level before no new request starts"
    )
    parser.add_argument("--llama-server", help="path to llama.cpp's llama-server")
    parser.add_argument("--no-profile", action="store_true", help="skip the py-spy pass")
    parser.add_argument(
        "--wait-quiet",
        type=float,
        help="seconds to wait for other processes to leave the CPU first (900; --quick: 0)",
    )
    parser.add_argument("--profile-rate", type=int, default=100, help="py-spy samples/s")
    parser.add_argument(
        "--out", type=Path, help="where serving-report.md and img/ go ($TMPDIR/stoic-serving-bench)"
    )
    parser.add_argument("--url", help="only drive this OpenAI-compatible endpoint")
    parser.add_argument("--model", default="default", help="with --url: the model field")
    parser.add_argument("--extra-body", help="with --url: JSON merged into every request")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--timed-serve", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        worker_main(args.worker, json.loads(args.spec))
        return
    if args.timed_serve:
        sys.exit(timed_serve(args.timed_serve[0], args.timed_serve[1:]))

    if args.url:
        args.budget = args.budget or 600.0
        asyncio.run(drive_endpoint(args))
        return

    if args.quick:
        requests = {c: args.requests or max(4, c) for c in CONCURRENCY}
    else:
        requests = {c: args.requests or {1: 16, 8: 64, 32: 128}[c] for c in CONCURRENCY}
    docs = args.out or Path(tempfile.gettempdir()) / "stoic-serving-bench"
    (docs / REPORT).unlink(missing_ok=True)  # every run writes a report of its own
    llama = args.llama_server or shutil.which("llama-server")
    work = Path(tempfile.mkdtemp(prefix="stoic-serving-bench-"))
    settings = Settings(
        quick=args.quick,
        requests=requests,
        api_requests=4 if args.quick else 16,
        max_tokens=args.max_tokens,
        budget=args.budget or (60.0 if args.quick else 240.0),
        docs=docs,
        work=work,
        llama_server=llama,
        profile=not args.no_profile,
        rate=args.profile_rate,
        retries=0 if args.quick else 2,
        wait_quiet=args.wait_quiet if args.wait_quiet is not None else (0 if args.quick else 900),
    )
    # a SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so no server is left behind
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    bench = Bench(settings)
    bench.log(f"load average: {' '.join(bench.load_before)}")
    try:
        asyncio.run(bench.run())
        bench.load_after = Path("/proc/loadavg").read_text().split()[:3]
    finally:
        # never leave a server behind, whatever happened
        for child in _children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
    png = docs / "img" / "serving_bench.png"
    plot(bench, png)
    command = "python benchmarks/serving_bench.py" + (" " + " ".join(sys.argv[1:])).rstrip()
    write_doc(docs / REPORT, report(bench, command, png, docs))
    print_summary(bench)
    bench.log(f"wrote {docs / REPORT} and {png}; logs and raw profile in {work}")


def _children() -> Iterator[int]:
    """Our direct child processes still alive (servers, py-spy)."""
    me = str(os.getpid())
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError):
            fields = stat.read_text().rpartition(")")[2].split()
            if fields[1] == me and fields[0] != "Z":
                yield int(stat.parent.name)


if __name__ == "__main__":
    main()
