"""The report's engine-overhead section: exact step accounting, the py-spy breakdown and the
kernel's per-thread view."""

from __future__ import annotations

from collections.abc import Sequence

from harness.load import Result

from . import CONCURRENCY
from .bench import Bench
from .profile import EXECUTOR_CATS, LOOP_CATS
from .tables import find


def steps_table(bench: Bench) -> list[str]:
    """Exact step accounting of every stoic HTTP pass (from :func:`timed_serve`)."""
    lines = [
        "| pass | wall (s) | steps | inside steps | between steps | mean step (ms) | "
        "gap p50 (ms) | gap p90 (ms) | gap max (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    passes = [r for r in bench.results if r.system == "stoic serve"]
    passes += [bench.profiled_pass] if bench.profiled_pass else []
    for r in sorted(passes, key=lambda r: r.concurrency):
        st, share = r.steps, r.execute_share
        if not st or share is None:
            continue
        name = f"c={r.concurrency}" + (" under py-spy" if "py-spy" in r.system else "")
        mean = 1000 * st["execute_s"] / max(st["steps"], 1)
        lines.append(
            f"| {name} | {st.get('window_s') or r.seconds:.1f} | {st['steps']} | {share:.1%} | "
            f"{1 - share:.1%} | "
            f"{mean:.1f} | {st['gap_p50_ms']:.2f} | {st['gap_p90_ms']:.2f} | "
            f"{st['gap_max_ms']:.1f} |"
        )
    return lines


def profile_section(bench: Bench) -> str:
    top = max(CONCURRENCY)
    measured = find(bench.results, "stoic serve", top)
    share = measured.execute_share if measured else None
    lines = [
        "**Exact step accounting.** `stoic serve` runs under a thin wrapper "
        "(`serving_bench.py --timed-serve`: the same `stoic.cli.main`, with "
        "`ModelRunner.execute` timed; a SIGUSR1 between passes collects the numbers). *Inside "
        "steps* is the executor thread inside `ModelRunner.execute` (building step inputs, "
        "forward, sampling), as % of the pass's wall time; *between steps* is everything else "
        "(the result travelling to the scheduler, planning and allocating the next step, the "
        "hand-off back to the executor thread, and the ramp at the start and end of the pass):",
        "",
        *steps_table(bench),
    ]
    if share is not None:
        lines += [
            "",
            f"**Engine overhead at c={top}: {1 - share:.1%} of wall** is spent between steps "
            "(target < 5%).",
        ]
    p = bench.profile
    if p is None:
        lines += [
            "",
            "No py-spy profile (" + ("--no-profile" if not bench.s.profile else "see notes") + ").",
        ]
        return "\n".join(lines)
    pp = bench.profiled_pass
    lines += [
        "",
        f"**Where the time goes (py-spy).** A second stoic c={top} pass"
        + (f" ({pp.tokens_per_s:.1f} tokens/s under the profiler)" if pp else "")
        + f" was recorded with py-spy at {p.rate} Hz:",
        "",
        "```",
        p.command,
        "```",
        "",
        "`--idle` keeps the samples of waiting threads, so each thread's samples add up to the "
        "wall time; `--nonblocking` keeps py-spy from pausing the server (py-spy itself used "
        f"{p.profiler_cpu:.2f} of a core, the load generator {p.client_cpu:.2f}). Shares are of "
        "wall time, per thread (the two threads run in parallel).",
        "",
        "| thread | what it runs | % of wall (py-spy samples) |",
        "|---|---|---:|",
    ]
    for cat in EXECUTOR_CATS:
        lines.append(f"| executor (`stoic-executor`) | {cat} | {p.executor.get(cat, 0):.1%} |")
    for cat in LOOP_CATS:
        lines.append(f"| event loop (`MainThread`) | {cat} | {p.loop.get(cat, 0):.1%} |")
    lines.append(f"| other threads (busy, sum) | - | {p.other_threads_busy:.1%} |")
    pp_share = pp.execute_share if pp else None
    lines += [
        "",
        "Executor categories: *forward* = `ModelRunner.execute` minus the rest (transformers "
        "layers, paged attention, LM head); *sampling* = `stoic/sampling/_sampler.py:sample`; *step "
        "inputs* = `build_inputs` and KV block zeroing; *idle* = blocked on the step queue. Event "
        "loop: each sample goes to the innermost frame it recognises (detokenising: "
        "`Sequence.detokenize` and tokenizer calls; HTTP: `stoic/http`, aiohttp, JSON, pydantic; "
        "scheduling: `stoic/actors/*` except streams and messages; messaging: `stoic/runtime/*`, "
        "`stoic/engine/*`, result streams); *idle* = blocked in `epoll`. A thread waiting for "
        "the GIL is sampled where it stands, so GIL contention shows up inside its category.",
        "",
        f"Cross-check over the same window: py-spy puts the executor outside forward+sampling "
        f"for {p.overhead:.1%} of its samples (idle {p.executor['idle']:.1%})"
        + (
            f"; the step timer measured {1 - pp_share:.1%} of the window between steps"
            if pp_share is not None
            else ""
        )
        + ". Sampling at 100 Hz puts about ±1 point of noise on a 20 s window.",
        "",
        "The kernel's view of the server's threads (`/proc/<pid>/task/*/schedstat`): share of "
        "wall on a CPU, runnable but waiting for a CPU, and blocked (the rest), in the measured "
        f"c={top} pass and in the profiled one:",
        "",
        "| thread | on CPU | waiting for a CPU | blocked | on CPU (profiled) | waiting (profiled) "
        "| blocked (profiled) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, a, b in kernel_view(bench):
        cells = []
        for v in (a, b):
            cells += ["-"] * 3 if v is None else [f"{v[0]:.1%}", f"{v[1]:.1%}", f"{v[2]:.1%}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += frames_table("Top frames, executor (self time, % of wall):", p.top_executor)
    lines += frames_table("Top frames, event loop (self time, % of wall):", p.top_loop_self)
    lines += frames_table(
        "Event loop, inclusive time of stoic and aiohttp frames (% of wall):", p.top_loop_incl
    )
    return "\n".join(lines)


def frames_table(title: str, frames: Sequence[tuple[str, float]]) -> list[str]:
    """A titled table of profile frames and their share of wall."""
    return ["", title, "", "| frame | % |", "|---|---:|"] + [
        f"| `{f}` | {v:.1%} |" for f, v in frames
    ]


def kernel_view(
    bench: Bench,
) -> list[tuple[str, tuple[float, float, float] | None, tuple[float, float, float] | None]]:
    """Per stoic server thread: (on CPU, waiting for a CPU, blocked) in the measured and the
    profiled c=32 pass."""
    measured = find(bench.results, "stoic serve", max(CONCURRENCY))
    profiled = bench.profiled_pass
    names = bench.profile.tids if bench.profile else {}

    def table(r: Result | None) -> dict[int, tuple[float, float, float]]:
        if r is None:
            return {}
        return {tid: (run, wait, max(0.0, 1 - run - wait)) for tid, run, wait in r.sched}

    a, b = table(measured), table(profiled)
    order = sorted(set(a) | set(b), key=lambda t: -max(a.get(t, (0,))[0], b.get(t, (0,))[0]))
    rows = []
    for tid in order:
        default = "native thread (torch OpenMP worker)" if tid not in names else ""
        rows.append((f"{names.get(tid, default)} [{tid}]", a.get(tid), b.get(tid)))
    return rows
