"""Throughput on a shared machine: quiet, next to a busy neighbour, and under a CPU quota.

Each system serves the same streaming load (``--requests`` chat requests of ``--max-tokens``
tokens at ``--concurrency`` clients, greedy, EOS ignored) three ways:

* **quiet**: the machine to itself;
* **neighbour**: while one CPU-bound Python process runs in another session (``setsid``: its own
  scheduler autogroup, so ``nice`` cannot shield the server from it: a co-tenant);
* **quota**: the server started inside a cgroup with a CPU quota of ``--quota`` CPUs (cgroup v1
  ``cpu.cfs_quota_us`` or v2 ``cpu.max``; needs a writable cgroup file system, else skipped).

The table gives tokens/s, its share of the same system's quiet figure (the target: >= 40% next
to the neighbour on 2 cores, 50% the ideal), TTFT and inter-token latency, and for stoic the
compute-thread changes its log reports. ``--model`` serves a GGUF file instead of the shipped
model. Systems: ``stoic`` (``stoic serve`` defaults: the
process executor, threads sized to the CPU budget and following contention), ``stoic-before``
(``--threads <CPU count> --no-adapt-threads``: every step on all the machine's CPUs whatever the
quota or the neighbours, as stoic ran before), ``stoic-deterministic`` (``--deterministic``:
docs/operations.md, "Deterministic mode"; its "vs stoic" column is the mode's cost),
``stoic-baseline`` (``stoic serve`` defaults from ``--baseline-tree``, a worktree of an earlier
commit: a speed change measured quiet and next to the neighbour in one run), and
llama.cpp's server with ``--llama-server PATH`` (built by ``benchmarks/build_llama_server.sh``;
``--threads`` = the CPU count, as its users run it). ``--concurrency`` takes several client
counts, each measured in turn.

    python benchmarks/contention_bench.py --llama-server "$(benchmarks/build_llama_server.sh)"
    python benchmarks/contention_bench.py --systems stoic stoic-deterministic \
        --conditions quiet neighbour --concurrency 1 32
    git worktree add /tmp/before <commit>
    python benchmarks/contention_bench.py --systems stoic stoic-baseline \
        --baseline-tree /tmp/before --model FILE.gguf --conditions quiet neighbour
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.cpu import cpu_model
from harness.load import Result, run_load
from harness.report import markdown
from harness.servers import System, llama_system, model_file, model_flags, stoic_server

CONDITIONS = ("quiet", "neighbour", "quota")
TOPICS = ("a lighthouse", "a bicycle", "the moon", "a library", "a river", "a clock", "snow")


def bodies(system: System, n: int, max_tokens: int, offset: int = 0) -> list[dict[str, object]]:
    out = []
    for i in range(offset, offset + n):
        text = f"Tell a short story about {TOPICS[i % len(TOPICS)]}, number {i}."
        out.append(system.body([{"role": "user", "content": text}], max_tokens))
    return out


@contextlib.contextmanager
def neighbour() -> Iterator[None]:
    """One CPU-bound process in a session of its own (its own autogroup)."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    try:
        time.sleep(1.0)
        yield
    finally:
        proc.kill()
        proc.wait()


def quota_cgroup(cpus: float) -> Path | None:
    """A fresh cgroup limited to ``cpus`` CPUs, or None where none can be made."""
    period = 100_000
    name = f"stoic-bench-{os.getpid()}"
    v1 = Path("/sys/fs/cgroup/cpu")
    v2 = Path("/sys/fs/cgroup")
    try:
        if (v1 / "cpu.cfs_quota_us").exists():
            group = v1 / name
            group.mkdir(exist_ok=True)
            (group / "cpu.cfs_period_us").write_text(str(period))
            (group / "cpu.cfs_quota_us").write_text(str(int(cpus * period)))
            return group
        if "cpu" in (v2 / "cgroup.controllers").read_text().split():
            with contextlib.suppress(OSError):
                (v2 / "cgroup.subtree_control").write_text("+cpu")
            group = v2 / name
            group.mkdir(exist_ok=True)
            (group / "cpu.max").write_text(f"{int(cpus * period)} {period}")
            return group
    except OSError as exc:
        print(f"no CPU quota here ({exc}): the quota condition is skipped", file=sys.stderr)
    return None


def in_cgroup(argv: list[str], group: Path) -> list[str]:
    """``argv`` started inside ``group`` (what it starts stays there too)."""
    script = f'echo $$ > {group / "cgroup.procs"} && exec "$@"'
    return ["sh", "-c", script, "sh", *argv]


def _busy_ticks() -> int:
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:9]
    values = [int(v) for v in fields]
    return sum(values) - values[3] - values[4]


async def settle(limit: float = 60.0) -> None:
    """Wait until the machine is idle (under 0.2 CPU busy for a second): a server that just
    started is still starting its spare and pre-started worker processes."""
    tick = 1.0 / os.sysconf("SC_CLK_TCK")
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        before = _busy_ticks()
        await asyncio.sleep(1.0)
        if (_busy_ticks() - before) * tick < 0.2:
            return


def thread_changes(log: Path, since: int) -> tuple[int, str]:
    """How many times stoic's log says the compute threads changed past byte ``since``
    (``executor.threads`` events after the first), and the count in force at the end."""
    text = log.read_text(errors="replace")[since:]
    lines = [
        line
        for line in text.splitlines()
        if "executor.threads " in line and "before=0 " not in line
    ]
    last = lines[-1].split("threads=")[1].split()[0] if lines else "-"
    return len(lines), last


async def measure(
    system: System, condition: str, args: argparse.Namespace, group: Path | None, clients: int
) -> Result | None:
    if condition == "quota":
        if group is None:
            return None
        system.argv = in_cgroup(system.argv, group)
    await system.start()
    try:
        url = system.url + "/v1/chat/completions"
        await run_load(url, bodies(system, 8, 8, offset=1000), 8, budget=120)  # warm-up
        await settle()
        mark = system.log.stat().st_size
        with neighbour() if condition == "neighbour" else contextlib.nullcontext():
            records, seconds = await run_load(
                url,
                bodies(system, args.requests, args.max_tokens),
                clients,
                budget=args.budget,
            )
        result = Result(system.name, clients, args.requests, records, seconds)
        if system.name.startswith("stoic"):
            changes, last = thread_changes(system.log, mark)
            result.note = f"{changes} thread changes, last {last}"
        return result
    finally:
        system.stop()


def _ratio(r: Result, other: Result | None) -> str:
    return f"{r.tokens_per_s / other.tokens_per_s:.0%}" if other and other.tokens_per_s else "-"


def table(results: dict[tuple[str, str, int], Result]) -> str:
    rows = []
    for (name, condition, clients), r in results.items():
        share = _ratio(r, results.get((name, "quiet", clients)))
        # the same load on stoic's defaults (what --deterministic costs)
        against = _ratio(r, results.get(("stoic", condition, clients)))
        ttft = f"{r.ttft(0.5) or 0:.2f} / {r.ttft(0.99) or 0:.2f}"
        itl = f"{1000 * (r.itl(0.5) or 0):.0f} / {1000 * (r.itl(0.99) or 0):.0f}"
        tokens = f"{r.tokens_per_s:.1f}"
        note = r.note or "-"
        rows.append((name, condition, clients, tokens, share, against, ttft, itl, r.errors, note))
    head = ("system", "condition", "clients", "tokens/s", "vs quiet", "vs stoic")
    head += ("TTFT p50 / p99 s", "ITL p50 / p99 ms", "errors", "threads")
    return markdown(head, rows, align="l" * len(head))


#: stoic's flags for each stoic system
STOIC_FLAGS = {
    "stoic": [],
    "stoic-before": ["--threads", str(os.cpu_count() or 1), "--no-adapt-threads"],
    "stoic-deterministic": ["--deterministic"],
}


def make_system(work: Path, name: str, label: str, args: argparse.Namespace) -> System | None:
    """System ``name`` (None: llama-server without ``--llama-server``, stoic-baseline without
    ``--baseline-tree``)."""
    gguf = model_file(args.model)
    model = model_flags(gguf)
    if name in STOIC_FLAGS:
        return stoic_server(work, label, [*STOIC_FLAGS[name], *model], log_level="info")
    if name == "stoic-baseline" and args.baseline_tree:
        return stoic_server(work, label, model, log_level="info", tree=args.baseline_tree)
    if name == "llama-server" and args.llama_server:
        return llama_system(work, args.llama_server, gguf, 16)
    return None


async def main(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="stoic-contention-"))
    group = quota_cgroup(args.quota) if "quota" in args.conditions else None
    results: dict[tuple[str, str, int], Result] = {}
    for clients in args.concurrency:
        for name in args.systems:
            for condition in args.conditions:
                system = make_system(work, name, f"{name}-{condition}-{clients}", args)
                if system is None:
                    continue
                print(f"{name}: {condition}, {clients} clients ...", file=sys.stderr, flush=True)
                result = await measure(system, condition, args, group, clients)
                if result is not None:
                    results[(name, condition, clients)] = result
                    print(f"  {result.tokens_per_s:.1f} tokens/s", file=sys.stderr, flush=True)
    if group is not None:
        with contextlib.suppress(OSError):
            group.rmdir()
    cpu = cpu_model()
    print(
        f"\n{os.cpu_count()} CPUs ({cpu}); {args.requests} requests x {args.max_tokens} tokens at "
        f"{', '.join(map(str, args.concurrency))} clients; quota {args.quota} CPU\n"
    )
    print(table(results))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--systems",
        nargs="+",
        default=["stoic", "stoic-before", "llama-server"],
        choices=[*STOIC_FLAGS, "stoic-baseline", "llama-server"],
    )
    parser.add_argument("--model", default="default", help="a GGUF file (default: the shipped)")
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        help="stoic-baseline: stoic serve's defaults from this source tree (a git worktree of "
        "an earlier commit), next to this tree's in the same run",
    )
    parser.add_argument("--conditions", nargs="+", default=list(CONDITIONS), choices=CONDITIONS)
    parser.add_argument("--llama-server", help="path of a llama-server binary")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16], help="client counts")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--quota", type=float, default=1.0, help="CPUs of the quota condition")
    parser.add_argument(
        "--budget", type=float, default=120.0, help="no new request starts after this (s)"
    )
    asyncio.run(main(parser.parse_args()))
