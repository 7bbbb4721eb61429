"""Overload benchmark (issue 47): open-loop arrivals, deadlines and tenants against stoic serve.

What one ``stoic serve`` does when more arrives than it can serve, with open-loop (Poisson)
clients, request deadlines and two tenants, in one run.

Against one server (its defaults plus ``--stoic-flags``, by default ``--tenant-header x-tenant``),
on the seeded mixed chat prompts (``harness.workload.mixed_prompts``, every request its own tag),
``max_tokens`` 64 with EOS ignored, streaming:

0. **capacity**: 32 closed-loop clients for ~40 s: requests/s and output tokens/s.
1. **(a) steady open loop**: Poisson arrivals (seeded exponential gaps, each request its own
   asyncio task whether or not earlier ones finished, 1024 connections) at 70% of the capacity's
   requests/s for ~60 s: TTFT p50/p99 and their ratio, inter-token latency p50/p99 and ratio.
2. **(b) overload**: Poisson arrivals at 2x capacity for ~40 s, every request with a deadline
   (the body field ``timeout``, 3 s; the header ``x-request-timeout`` instead when the server
   refuses the field): requests completed within their deadline, completed late, ended with
   ``finish_reason: "timeout"``, refused (429/503), abandoned by the client (no answer by the
   deadline + ``--grace``) and other errors; for refusals the time from send to the refusal and
   whether it carried ``Retry-After``; goodput (output tokens of the requests completed within
   their deadline, per second of the arrival window) against the capacity; TTFT p99 of the
   admitted requests (one admitted and given no token counts with its whole time: a lower bound).
3. **(c) fairness** (stoic and ``--url`` only): tenant B (``x-tenant: B``) alone, one request after
   another, for ~20 s: its TTFT; then tenant A floods with 32 closed-loop clients while B goes on
   one at a time for ~30 s: B's TTFT p50/p99, A's throughput, and B's TTFT p50 with the flood
   against alone.

Targets (the summary prints each with PASS/FAIL; n/a with no refusal or no part (c)): (b) every
refusal within 0.25 s and with a ``Retry-After`` header, goodput >= 0.9x capacity, admitted TTFT
p99 <= 3 s; (c) B's TTFT p50 with the flood <= 2x alone.

Run it from the repository root::

    python benchmarks/overload_bench.py                          # ~5 minutes
    python benchmarks/overload_bench.py --quick                  # smoke test, ~2 minutes
    python benchmarks/overload_bench.py --stoic-flags "--tenant-header x-tenant --max-queue-wait 3"
    python benchmarks/overload_bench.py --stoic-flags ""         # a server without those flags
    python benchmarks/overload_bench.py --url http://127.0.0.1:8000 --model NAME
    python benchmarks/overload_bench.py --llama-server "$(benchmarks/build_llama_server.sh)"

A flag the server does not know stops the run with its error. llama.cpp's ``llama-server`` (on
PATH, or ``--llama-server PATH``, on ``--gguf FILE``, by default the shipped model's file) runs
parts 0-2 the same way; it has neither tenants nor deadlines (it ignores the fields), so part (c)
is skipped for it and its (b) shows a server without admission control.

It prints a table per part and the summary, and writes ``overload-report.md`` and
``overload-raw.json`` (every request: arrival, status, TTFT, ITLs, output tokens, finish reason,
``Retry-After``, time to the answer) under ``--out`` (default ``$TMPDIR/stoic-overload-bench``).
The client runs on the same machine as the server: the "send lag" column (how late the latest
arrival was sent) and "other CPU" (what other processes took) say when that disturbed a number.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: F401  (first: offline before anything imports transformers)
from harness.cpu import CpuWatch, cpu_model
from harness.load import RequestRecord, Result, one_request, run_load
from harness.report import fmt_ms, fmt_pct, fmt_s, markdown, quantile
from harness.servers import GREEDY, System, llama_system, stoic_server
from harness.workload import mixed_prompts, tag_prompts

REPORT = "overload-report.md"
RAW = "overload-raw.json"
#: targets
REFUSAL_S = 0.25  # every refusal answered within this
GOODPUT_MIN = 0.9  # goodput under overload, a share of the closed-loop capacity
TTFT_P99_MAX = 3.0  # admitted requests' TTFT p99 under overload
FAIRNESS_MAX = 2.0  # B's TTFT p50 with A's flood over B's alone
#: a request completed this long after its deadline (as the client measures it) still met it
DEADLINE_SLACK_S = 0.25
CONNECTIONS = 1024  # open loop: the client never throttles
POOL = 997  # distinct base prompts, cycled with a per-request tag
RAMP_S = 2.0  # (c): A floods this long before B starts


@dataclass
class Plan:
    quick: bool
    max_tokens: int
    clients: int
    capacity_s: float
    load: float
    steady_s: float
    overload: float
    overload_s: float
    deadline: float
    grace: float
    alone_s: float
    flood_s: float
    tenant_header: str
    b_priority: int | None
    seed: int


@dataclass
class Target:
    """An endpoint under test."""

    name: str
    base: str
    model: str
    extra: dict[str, Any]
    tenants: bool  # part (c) runs
    pid: int = 0
    argv: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    deadline_field: bool = True  # the body field ``timeout`` (else the header)

    @property
    def chat(self) -> str:
        return self.base + "/v1/chat/completions"

    def body(self, messages: Any, max_tokens: int, **fields: Any) -> dict[str, Any]:
        return {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "stream": True,
            **self.extra,
            **fields,
        }


@dataclass
class Phase:
    """One open-loop pass: its records, each with its arrival offset."""

    records: list[RequestRecord]
    arrivals: list[float]
    window: float  # seconds arrivals were drawn over
    span: float  # first send to last answer
    rate: float
    lag: float  # the latest send behind its Poisson time
    other_cpu: float | None


def prompts(tag: str, n: int, seed: int) -> list[Any]:
    """``n`` mixed prompts, each tagged ``[tag i]``: no two share more than the template."""
    base = mixed_prompts(min(n, POOL), seed=seed)
    return [tag_prompts([base[i % len(base)]], f"[{tag} {i}] ")[0] for i in range(n)]


def family(pid: int) -> list[int]:
    """``pid`` and its descendants (stoic's executors are child processes of ``stoic serve``):
    the processes whose CPU is the server's, not another's."""
    if not pid:
        return []
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            parents[int(stat.parent.name)] = int(stat.read_text().rpartition(")")[2].split()[1])
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += [child for child, parent in parents.items() if parent == p]
    return out


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def fmt_x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "FAIL")


# ---------------------------------------------------------------------------------------------
# the passes


async def closed_loop(
    t: Target,
    tag: str,
    clients: int,
    seconds: float,
    plan: Plan,
    headers: dict[str, str] | None = None,
    fields: dict[str, Any] | None = None,
) -> Result:
    # enough bodies for 8 requests/s a client (a GPU); the budget ends the pass, not the bodies
    n = max(16, int(clients * seconds * 8))
    bodies = [t.body(m, plan.max_tokens, **(fields or {})) for m in prompts(tag, n, plan.seed)]
    watch = CpuWatch(family(t.pid))
    # a refused client waits what Retry-After says, as the OpenAI SDKs do (not a retry storm)
    records, span = await run_load(
        t.chat, bodies, clients, budget=seconds, headers=headers, backoff=True
    )
    result = Result(t.name, clients, n, records, span, watch.stop())
    if len(records) == n:
        result.note = "ran out of prompts before the budget"
    return result


async def open_loop(
    t: Target,
    tag: str,
    rate: float,
    seconds: float,
    plan: Plan,
    *,
    limit_s: float,
    fields: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
) -> Phase:
    """Poisson arrivals at ``rate`` req/s over ``seconds``, each sent at its time, whatever the
    earlier ones are doing; waits for every answer (at most ``limit_s`` each)."""
    rng = random.Random(plan.seed * 1000 + int(rate * 1000))
    times: list[float] = []
    at = rng.expovariate(rate)
    while at < seconds:
        times.append(at)
        at += rng.expovariate(rate)
    bodies = [
        t.body(m, plan.max_tokens, **(fields or {})) for m in prompts(tag, len(times), plan.seed)
    ]
    watch = CpuWatch(family(t.pid))
    lag = 0.0
    connector = aiohttp.TCPConnector(limit=CONNECTIONS, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()
        tasks = []
        for at, body in zip(times, bodies, strict=True):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            lag = max(lag, time.perf_counter() - start - at)
            tasks.append(asyncio.create_task(one_request(session, t.chat, body, limit_s, headers)))
        records = list(await asyncio.gather(*tasks))
        span = time.perf_counter() - start
    arrivals = [r.start - start for r in records]
    return Phase(records, arrivals, seconds, span, rate, lag, watch.stop())


def outcome(r: RequestRecord, deadline: float | None) -> str:
    """completed, late, timeout, refused, abandoned or error."""
    if r.status in (429, 503):
        return "refused"
    if r.error is None and r.status == 200:
        if r.finish_reason == "timeout":
            return "timeout"
        if r.output_tokens > 0:
            if deadline is not None and r.e2e > deadline + DEADLINE_SLACK_S:
                return "late"
            return "completed"
    if r.error is not None and r.error.startswith("TimeoutError"):
        return "abandoned"
    return "error"


async def probe_fields(t: Target) -> None:
    """Does the server take the body fields ``timeout`` and ``priority``? (stoic before them
    answers 400 "unknown parameter"): else the deadline goes as ``x-request-timeout``."""
    fields = {"timeout": 60.0, "priority": 0}
    body = t.body([{"role": "user", "content": "Say hi."}], 1, **fields)
    async with aiohttp.ClientSession() as session:
        rec = await one_request(session, t.chat, body, 60.0)
    if rec.status == 400:
        t.deadline_field = False
        t.notes.append(
            "the server refused the body fields `timeout`/`priority` "
            f"({(rec.error or '')[:120]}); the deadline went as the `x-request-timeout` "
            "header instead, and no `priority` was sent"
        )
        log(f"{t.name}: {t.notes[-1]}")
    elif not rec.ok:
        raise SystemExit(f"{t.name}: a probe request failed: {rec.error}")


async def warm(t: Target) -> None:
    bodies = [t.body(m, 8) for m in prompts("warm", 8, 99)]
    records, _ = await run_load(t.chat, bodies, 8, budget=120.0)
    bad = [r for r in records if not r.ok]
    if bad:
        raise SystemExit(f"{t.name}: warm-up failed: {bad[0].error}")


async def measure(t: Target, plan: Plan) -> dict[str, Any]:
    out: dict[str, Any] = {}
    await warm(t)
    await probe_fields(t)

    cap = await closed_loop(t, "capacity", plan.clients, plan.capacity_s, plan)
    out["capacity"] = cap
    log(
        f"{t.name} capacity: {cap.requests_per_s:.2f} req/s, {cap.tokens_per_s:.1f} tok/s "
        f"({len(cap.ok)} requests in {cap.seconds:.1f} s, {cap.errors} errors)"
    )
    if not cap.requests_per_s:
        raise SystemExit(f"{t.name}: no request completed at capacity: {cap.summary()}")
    await asyncio.sleep(1.0)

    rate = plan.load * cap.requests_per_s
    steady = await open_loop(t, "steady", rate, plan.steady_s, plan, limit_s=120.0)
    out["steady"] = steady
    log(f"{t.name} (a) {rate:.2f} req/s: {len(steady.records)} sent, {steady.span:.1f} s")
    await asyncio.sleep(1.0)

    rate = plan.overload * cap.requests_per_s
    fields: dict[str, Any] = {}
    headers = None
    if not plan.deadline:  # the server's --max-queue-wait alone bounds the wait
        pass
    elif t.deadline_field:
        fields = {"timeout": plan.deadline}
    else:
        headers = {"x-request-timeout": f"{plan.deadline:g}"}
    over = await open_loop(
        t,
        "overload",
        rate,
        plan.overload_s,
        plan,
        limit_s=(plan.deadline + plan.grace) if plan.deadline else 300.0,
        fields=fields,
        headers=headers,
    )
    out["overload"] = over
    counts = count_outcomes(over, plan.deadline or None)
    log(f"{t.name} (b) {rate:.2f} req/s: {counts}")
    await asyncio.sleep(1.0)

    if t.tenants:
        out["fairness"] = await fairness(t, plan)
    return out


async def fairness(t: Target, plan: Plan) -> dict[str, Result]:
    h = plan.tenant_header
    b_fields: dict[str, Any] = {}
    if plan.b_priority is not None and t.deadline_field:
        b_fields = {"priority": plan.b_priority}
    alone = await closed_loop(t, "b-alone", 1, plan.alone_s, plan, {h: "B"}, b_fields)
    log(f"{t.name} (c) B alone: TTFT p50 {fmt_s(alone.ttft(0.5))} ({len(alone.ok)} requests)")
    await asyncio.sleep(1.0)
    flood = asyncio.create_task(
        closed_loop(t, "a-flood", plan.clients, RAMP_S + plan.flood_s, plan, {h: "A"})
    )
    await asyncio.sleep(RAMP_S)
    b = await closed_loop(t, "b-flood", 1, plan.flood_s, plan, {h: "B"}, b_fields)
    a = await flood
    log(
        f"{t.name} (c) with A's flood: B TTFT p50 {fmt_s(b.ttft(0.5))}, "
        f"A {a.tokens_per_s:.1f} tok/s"
    )
    return {"alone": alone, "b": b, "a": a}


# ---------------------------------------------------------------------------------------------
# numbers and tables


def count_outcomes(phase: Phase, deadline: float | None) -> dict[str, int]:
    kinds = ("completed", "late", "timeout", "refused", "abandoned", "error")
    counts = dict.fromkeys(kinds, 0)
    for r in phase.records:
        counts[outcome(r, deadline)] += 1
    return counts


def steady_numbers(phase: Phase) -> dict[str, Any]:
    ok = [r for r in phase.records if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [x for r in ok for x in r.itls]
    out = {
        "rate": phase.rate,
        "sent": len(phase.records),
        "completed": len(ok),
        "errors": len(phase.records) - len(ok),
        "ttft_p50": quantile(ttft, 0.5),
        "ttft_p99": quantile(ttft, 0.99),
        "itl_p50": quantile(itl, 0.5),
        "itl_p99": quantile(itl, 0.99),
        "tokens_per_s": sum(r.output_tokens for r in ok) / phase.span if phase.span else 0.0,
        "lag": phase.lag,
        "other_cpu": phase.other_cpu,
    }
    out["ttft_ratio"] = ratio(out["ttft_p99"], out["ttft_p50"])
    out["itl_ratio"] = ratio(out["itl_p99"], out["itl_p50"])
    return out


def overload_numbers(phase: Phase, plan: Plan, capacity: Result) -> dict[str, Any]:
    kinds = [outcome(r, plan.deadline or None) for r in phase.records]
    refused = [r for r, k in zip(phase.records, kinds, strict=True) if k == "refused"]
    good = [r for r, k in zip(phase.records, kinds, strict=True) if k == "completed"]
    admitted = [r for r in phase.records if r.status not in (429, 503)]
    # one admitted and given no token counts with its whole time (a lower bound of its TTFT)
    ttft = [r.ttft if r.ttft is not None else r.e2e for r in admitted]
    goodput = sum(r.output_tokens for r in good) / phase.window
    answered = [r for r in phase.records if r.status == 200]
    out: dict[str, Any] = {
        "rate": phase.rate,
        "sent": len(phase.records),
        **count_outcomes(phase, plan.deadline or None),
        "refusal_p50": quantile([r.e2e for r in refused], 0.5),
        "refusal_max": max((r.e2e for r in refused), default=None),
        "retry_after": sum(1 for r in refused if r.retry_after is not None),
        "retry_after_values": sorted({r.retry_after for r in refused if r.retry_after}),
        "goodput": goodput,
        "goodput_ratio": ratio(goodput, capacity.tokens_per_s),
        "throughput": sum(r.output_tokens for r in answered) / phase.span if phase.span else 0,
        "admitted_ttft_p50": quantile(ttft, 0.5),
        "admitted_ttft_p99": quantile(ttft, 0.99),
        "lag": phase.lag,
        "other_cpu": phase.other_cpu,
        "first_error": next(
            (r.error for r, k in zip(phase.records, kinds, strict=True) if k == "error"), None
        ),
    }
    return out


def fairness_numbers(parts: dict[str, Result]) -> dict[str, Any]:
    alone, b, a = parts["alone"], parts["b"], parts["a"]
    return {
        "b_alone_requests": len(alone.ok),
        "b_alone_ttft_p50": alone.ttft(0.5),
        "b_alone_ttft_p99": alone.ttft(0.99),
        "b_flood_requests": len(b.ok),
        "b_flood_ttft_p50": b.ttft(0.5),
        "b_flood_ttft_p99": b.ttft(0.99),
        "a_requests": len(a.ok),
        "a_tokens_per_s": a.tokens_per_s,
        "a_requests_per_s": a.requests_per_s,
        "a_ttft_p50": a.ttft(0.5),
        "errors": alone.errors + b.errors + a.errors,
        "ratio": ratio(b.ttft(0.5), alone.ttft(0.5)),
        "other_cpu": b.other_cpu,
    }


def targets(num: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    """(target, value, met) for one system."""
    rows: list[tuple[str, str, bool | None]] = []
    o = num["overload"]
    if o["refused"]:
        rows.append(
            (
                f"(b) every refusal within {REFUSAL_S:g} s",
                f"max {fmt_ms(o['refusal_max'])} ms of {o['refused']}",
                o["refusal_max"] <= REFUSAL_S,
            )
        )
        rows.append(
            (
                "(b) every refusal has Retry-After",
                f"{o['retry_after']}/{o['refused']}",
                o["retry_after"] == o["refused"],
            )
        )
    else:
        rows.append((f"(b) every refusal within {REFUSAL_S:g} s", "no request refused", None))
        rows.append(("(b) every refusal has Retry-After", "no request refused", None))
    rows.append(
        (
            f"(b) goodput >= {GOODPUT_MIN:g}x capacity",
            f"{o['goodput']:.1f} tok/s = {fmt_x(o['goodput_ratio'])}",
            o["goodput_ratio"] is not None and o["goodput_ratio"] >= GOODPUT_MIN,
        )
    )
    p99 = o["admitted_ttft_p99"]
    rows.append(
        (
            f"(b) admitted TTFT p99 <= {TTFT_P99_MAX:g} s",
            f"{fmt_s(p99)} s",
            p99 is not None and p99 <= TTFT_P99_MAX,
        )
    )
    f = num.get("fairness")
    if f is None:
        rows.append((f"(c) B's TTFT p50 with A's flood <= {FAIRNESS_MAX:g}x alone", "-", None))
    else:
        rows.append(
            (
                f"(c) B's TTFT p50 with A's flood <= {FAIRNESS_MAX:g}x alone",
                f"{fmt_s(f['b_flood_ttft_p50'])} / {fmt_s(f['b_alone_ttft_p50'])} s = "
                f"{fmt_x(f['ratio'])}",
                f["ratio"] is not None and f["ratio"] <= FAIRNESS_MAX,
            )
        )
    return rows


Column = tuple[str, Callable[[dict[str, Any]], Any]]


def table(columns: Sequence[Column], rows: Iterable[tuple[str, dict[str, Any]]]) -> str:
    """One row a system: its name, then each column's value of its numbers."""
    return markdown(
        ["system", *(head for head, _ in columns)],
        ([name, *(value(d) for _, value in columns)] for name, d in rows),
    )


CAPACITY: list[Column] = [
    ("requests", lambda c: c["requests"]),
    ("seconds", lambda c: f"{c['seconds']:.1f}"),
    ("req/s", lambda c: f"{c['requests_per_s']:.2f}"),
    ("output tok/s", lambda c: f"{c['tokens_per_s']:.1f}"),
    ("TTFT p50 s", lambda c: fmt_s(c["ttft_p50"])),
    ("errors", lambda c: c["errors"]),
    ("other CPU", lambda c: fmt_pct(c["other_cpu"])),
]
STEADY: list[Column] = [
    ("req/s", lambda s: f"{s['rate']:.2f}"),
    ("sent", lambda s: s["sent"]),
    ("completed", lambda s: s["completed"]),
    ("errors", lambda s: s["errors"]),
    ("TTFT p50 ms", lambda s: fmt_ms(s["ttft_p50"])),
    ("p99 ms", lambda s: fmt_ms(s["ttft_p99"])),
    ("p99/p50", lambda s: fmt_x(s["ttft_ratio"])),
    ("ITL p50 ms", lambda s: fmt_ms(s["itl_p50"])),
    ("p99 ms", lambda s: fmt_ms(s["itl_p99"])),
    ("p99/p50", lambda s: fmt_x(s["itl_ratio"])),
    ("tok/s", lambda s: f"{s['tokens_per_s']:.1f}"),
    ("send lag ms", lambda s: fmt_ms(s["lag"])),
    ("other CPU", lambda s: fmt_pct(s["other_cpu"])),
]
OUTCOMES: list[Column] = [
    ("req/s", lambda o: f"{o['rate']:.2f}"),
    ("sent", lambda o: o["sent"]),
    ("completed", lambda o: o["completed"]),
    ("late", lambda o: o["late"]),
    ("timeout", lambda o: o["timeout"]),
    ("refused", lambda o: o["refused"]),
    ("abandoned", lambda o: o["abandoned"]),
    ("errors", lambda o: o["error"]),
]
OVERLOAD: list[Column] = [
    ("refusal p50 ms", lambda o: fmt_ms(o["refusal_p50"])),
    ("max ms", lambda o: fmt_ms(o["refusal_max"])),
    ("Retry-After", lambda o: f"{o['retry_after']}/{o['refused']}"),
    ("goodput tok/s", lambda o: f"{o['goodput']:.1f}"),
    ("vs capacity", lambda o: fmt_x(o["goodput_ratio"])),
    ("all tok/s", lambda o: f"{o['throughput']:.1f}"),
    ("admitted TTFT p50 s", lambda o: fmt_s(o["admitted_ttft_p50"])),
    ("p99 s", lambda o: fmt_s(o["admitted_ttft_p99"])),
    ("send lag ms", lambda o: fmt_ms(o["lag"])),
    ("other CPU", lambda o: fmt_pct(o["other_cpu"])),
]
FAIRNESS: list[Column] = [
    ("B alone: requests", lambda f: f["b_alone_requests"]),
    ("TTFT p50 s", lambda f: fmt_s(f["b_alone_ttft_p50"])),
    ("p99 s", lambda f: fmt_s(f["b_alone_ttft_p99"])),
    ("B with flood: requests", lambda f: f["b_flood_requests"]),
    ("TTFT p50 s", lambda f: fmt_s(f["b_flood_ttft_p50"])),
    ("p99 s", lambda f: fmt_s(f["b_flood_ttft_p99"])),
    ("ratio p50", lambda f: fmt_x(f["ratio"])),
    ("A tok/s", lambda f: f"{f['a_tokens_per_s']:.1f}"),
    ("A req/s", lambda f: f"{f['a_requests_per_s']:.2f}"),
    ("A TTFT p50 s", lambda f: fmt_s(f["a_ttft_p50"])),
    ("errors", lambda f: f["errors"]),
    ("other CPU", lambda f: fmt_pct(f["other_cpu"])),
]


def tables(numbers: dict[str, dict[str, Any]], plan: Plan) -> str:
    def part(key: str) -> list[tuple[str, dict[str, Any]]]:
        return [(name, n[key]) for name, n in numbers.items() if n.get(key)]

    parts = [
        f"### 0. Capacity: {plan.clients} closed-loop clients, {plan.capacity_s:g} s\n\n"
        + table(CAPACITY, part("capacity")),
        f"### (a) Open loop at {plan.load:.0%} of capacity, Poisson, {plan.steady_s:g} s\n\n"
        + table(STEADY, part("steady")),
        f"### (b) Overload: Poisson at {plan.overload:g}x capacity, {plan.overload_s:g} s, "
        f"deadline {plan.deadline:g} s\n\n"
        f"Outcomes: completed within the deadline (+{DEADLINE_SLACK_S:g} s), completed late, "
        'ended with `finish_reason: "timeout"`, refused (429/503), abandoned by the client (no '
        f"end by deadline + {plan.grace:g} s), other errors.\n\n"
        + table(OUTCOMES, part("overload"))
        + "\n\n"
        + table(OVERLOAD, part("overload")),
    ]
    if part("fairness"):
        parts.append(
            f"### (c) Fairness: B one at a time, alone ({plan.alone_s:g} s) and under A's "
            f"{plan.clients} closed-loop clients ({plan.flood_s:g} s)\n\n"
            + table(FAIRNESS, part("fairness"))
        )
    summary = markdown(
        ("system", "target", "value", "result"),
        (
            (name, what, value, verdict(met))
            for name, n in numbers.items()
            for what, value, met in targets(n)
        ),
        "llll",
    )
    parts.append("### Summary\n\n" + summary)
    return "\n\n".join(parts)


def record_json(r: RequestRecord, at: float | None, deadline: float | None) -> dict[str, Any]:
    d = asdict(r)
    del d["start"]
    d["at"] = None if at is None else round(at, 4)
    d["outcome"] = outcome(r, deadline)
    d["itls"] = [round(x, 5) for x in r.itls]
    for key in ("e2e", "ttft"):
        if d[key] is not None:
            d[key] = round(d[key], 5)
    return d


def raw(measured: dict[str, Any], plan: Plan) -> dict[str, Any]:
    def closed(res: Result) -> dict[str, Any]:
        t0 = min((r.start for r in res.records), default=0.0)
        return {
            "summary": res.summary(),
            "records": [record_json(r, r.start - t0, None) for r in res.records],
        }

    def opened(p: Phase, deadline: float | None) -> dict[str, Any]:
        keys = ("window", "span", "rate", "lag", "other_cpu")
        return {
            **{k: getattr(p, k) for k in keys},
            "records": [
                record_json(r, at, deadline) for r, at in zip(p.records, p.arrivals, strict=True)
            ],
        }

    out: dict[str, Any] = {}
    for name, m in measured.items():
        t: Target = m["target"]
        entry: dict[str, Any] = {
            "argv": t.argv,
            "url": t.base,
            "notes": t.notes,
            "deadline_via": "body" if t.deadline_field else "x-request-timeout",
            "numbers": m["numbers"],
            "capacity": closed(m["capacity"]),
            "steady": opened(m["steady"], None),
            "overload": opened(m["overload"], plan.deadline or None),
        }
        if m.get("fairness"):
            entry["fairness"] = {k: closed(v) for k, v in m["fairness"].items()}
        out[name] = entry
    return out


# ---------------------------------------------------------------------------------------------
# the run


def plan_from(args: argparse.Namespace) -> Plan:
    q = args.quick

    def pick(value: float | None, full: float, quick: float) -> float:
        return value if value is not None else (quick if q else full)

    return Plan(
        quick=q,
        max_tokens=args.max_tokens,
        clients=args.clients,
        capacity_s=pick(args.capacity_seconds, 40, 10),
        load=args.load,
        steady_s=pick(args.steady_seconds, 60, 15),
        overload=args.overload,
        overload_s=pick(args.overload_seconds, 40, 12),
        deadline=args.deadline,
        grace=args.grace,
        alone_s=pick(args.alone_seconds, 20, 8),
        flood_s=pick(args.flood_seconds, 30, 12),
        tenant_header=args.tenant_header,
        b_priority=args.b_priority,
        seed=args.seed,
    )


async def start(system: System, what: str) -> None:
    log(f"starting {system.name}: {shlex.join(system.argv)}")
    try:
        await system.start()
    except RuntimeError as exc:
        raise SystemExit(
            f"{what} did not start:\n{exc}\n(a flag it does not know? --stoic-flags sets them, "
            "'' for none)"
        ) from None


async def run(args: argparse.Namespace, plan: Plan, work: Path) -> dict[str, Any]:
    measured: dict[str, Any] = {}
    targets_: list[tuple[Target, System | None]] = []
    if args.url:
        t = Target(args.url, args.url.rstrip("/"), args.model, dict(GREEDY), tenants=True)
        targets_.append((t, None))
    else:
        flags = (
            shlex.split(args.stoic_flags)
            if args.stoic_flags is not None
            else ["--tenant-header", plan.tenant_header, "--max-queue-wait", "3"]
        )
        srv = stoic_server(work, "stoic", flags)
        t = Target("stoic", srv.url, srv.model, srv.extra, True, argv=srv.argv)
        if flags:
            t.notes.append(f"stoic serve flags: `{shlex.join(flags)}`")
        targets_.append((t, srv))
        llama = args.llama_server or shutil.which("llama-server")
        if llama:
            from stoic.model import default_gguf_path

            gguf = Path(args.gguf) if args.gguf else default_gguf_path()
            lsrv = llama_system(work, llama, gguf, plan.clients)
            lsrv.name = "llama-server"
            lt = Target("llama-server", lsrv.url, lsrv.model, lsrv.extra, False, argv=lsrv.argv)
            lt.notes.append(
                "llama-server has no tenants and no deadlines (the `timeout` field is ignored): "
                "part (c) is not run, and its (b) is a server without admission control"
            )
            targets_.append((lt, lsrv))
    for t, server in targets_:
        try:
            if server is not None:
                await start(server, f"{t.name} ({shlex.join(server.argv)})")
                t.pid = server.proc.pid if server.proc else 0
            m = await measure(t, plan)
        finally:
            if server is not None:
                server.stop()
        numbers: dict[str, Any] = {
            "capacity": m["capacity"].summary(),
            "steady": steady_numbers(m["steady"]),
            "overload": overload_numbers(m["overload"], plan, m["capacity"]),
        }
        if "fairness" in m:
            numbers["fairness"] = fairness_numbers(m["fairness"])
        measured[t.name] = {"target": t, "numbers": numbers, **m}
    return measured


def report(measured: dict[str, Any], plan: Plan, command: str, body: str) -> str:
    lines = [
        "# Overload benchmark",
        "",
        f"`{command}`, {time.strftime('%Y-%m-%d %H:%M')}, {cpu_model()}, "
        f"{os.cpu_count()} CPUs. Mixed prompts, max_tokens {plan.max_tokens} (EOS ignored), "
        f"greedy, streaming; seed {plan.seed}.",
        "",
    ]
    for name, m in measured.items():
        t: Target = m["target"]
        if t.argv:
            lines.append(f"- {name}: `{shlex.join(t.argv)}`")
        else:
            lines.append(f"- {name}: `{t.base}`, model `{t.model}`")
        lines += [f"  - {note}" for note in t.notes]
    lines += ["", body, ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="short phases: a ~2 minute smoke test")
    parser.add_argument("--out", type=Path, help="report directory ($TMPDIR/stoic-overload-bench)")
    parser.add_argument(
        "--stoic-flags",
        help="stoic serve's flags after its defaults (default: '--tenant-header x-tenant'; "
        "'' for none)",
    )
    parser.add_argument("--url", help="drive this OpenAI-compatible endpoint instead")
    parser.add_argument("--model", default="default", help="with --url: the model field")
    parser.add_argument("--llama-server", help="llama.cpp's llama-server (else from PATH)")
    parser.add_argument("--gguf", help="the GGUF file llama-server serves (the shipped one)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--clients", type=int, default=32, help="capacity and flood clients")
    parser.add_argument("--capacity-seconds", type=float, help="part 0 (40; --quick 10)")
    parser.add_argument("--load", type=float, default=0.7, help="(a) share of capacity")
    parser.add_argument("--steady-seconds", type=float, help="(a) (60; --quick 15)")
    parser.add_argument("--overload", type=float, default=2.0, help="(b) multiple of capacity")
    parser.add_argument("--overload-seconds", type=float, help="(b) (40; --quick 12)")
    parser.add_argument(
        "--deadline",
        type=float,
        default=0.0,
        help="(b) each request's timeout (default 0: none; the server's --max-queue-wait, 3 s "
        "in the default flags, bounds the wait for the first token)",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=5.0,
        help="(b) the client abandons a request this long after its deadline",
    )
    parser.add_argument("--alone-seconds", type=float, help="(c) B alone (20; --quick 8)")
    parser.add_argument(
        "--flood-seconds", type=float, help="(c) B under A's flood (30; --quick 12)"
    )
    parser.add_argument("--tenant-header", default="x-tenant", help="(c) the tenant header")
    parser.add_argument("--b-priority", type=int, help="(c) the priority field of B's requests")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    plan = plan_from(args)
    out = args.out or Path(tempfile.gettempdir()) / "stoic-overload-bench"
    out.mkdir(parents=True, exist_ok=True)
    (out / REPORT).unlink(missing_ok=True)
    work = Path(tempfile.mkdtemp(prefix="stoic-overload-bench-"))
    # a SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so no server is left behind
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        measured = asyncio.run(run(args, plan, work))
    finally:
        for child in _children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
    numbers = {name: m["numbers"] for name, m in measured.items()}
    body = tables(numbers, plan)
    command = "python benchmarks/overload_bench.py" + (" " + shlex.join(sys.argv[1:])).rstrip()
    (out / REPORT).write_text(report(measured, plan, command, body))
    (out / RAW).write_text(json.dumps({"plan": asdict(plan), **raw(measured, plan)}, indent=1))
    print()
    for name, m in measured.items():
        for note in m["target"].notes:
            print(f"- {name}: {note}")
    print()
    print(body)
    print()
    log(f"wrote {out / REPORT} and {out / RAW}; server logs in {work}")


def _children() -> list[int]:
    """Our direct child processes still alive (the servers)."""
    me = str(os.getpid())
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError):
            fields = stat.read_text().rpartition(")")[2].split()
            if fields[1] == me and fields[0] != "Z":
                out.append(int(stat.parent.name))
    return out


if __name__ == "__main__":
    main()
