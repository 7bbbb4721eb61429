"""Formatting helpers and the result tables (HTTP passes, Python API measurements)."""

from __future__ import annotations

from collections.abc import Sequence

import harness.workload as eb
from harness.load import Result
from harness.report import fmt_ms, fmt_pct, fmt_s


def results_table(results: Sequence[Result]) -> str:
    head = (
        "| system | c | requests | errors | output tokens | seconds | tokens/s | requests/s | "
        "TTFT p50 (s) | TTFT p90 (s) | TTFT p99 (s) | ITL p50 (ms) | ITL p99 (ms) | "
        "TPOT p50 (ms) | E2E p50 (s) | E2E p99 (s) | other CPU |"
    )
    lines = [head, "|---|---:" + "|---:" * 15 + "|"]
    for r in sorted(results, key=lambda r: (r.concurrency, system_rank(r.system))):
        ceiling = r.system.startswith("torch")
        lines.append(
            f"| {r.system} | {r.concurrency} | "
            f"{'-' if ceiling else f'{len(r.ok)}/{r.planned}'} | "
            f"{'-' if ceiling else r.errors} | {r.output_tokens} | {r.seconds:.1f} | "
            f"{r.tokens_per_s:.1f} | {'-' if ceiling else f'{r.requests_per_s:.2f}'} | "
            f"{fmt_s(r.ttft(0.5))} | {fmt_s(r.ttft(0.9))} | {fmt_s(r.ttft(0.99))} | "
            f"{fmt_ms(r.itl(0.5))} | {fmt_ms(r.itl(0.99))} | {fmt_ms(r.tpot(0.5))} | "
            f"{'-' if ceiling else fmt_s(r.e2e(0.5))} | {'-' if ceiling else fmt_s(r.e2e(0.99))} | "
            f"{fmt_pct(r.other_cpu)} |"
        )
    return "\n".join(lines)


def system_rank(name: str) -> int:
    for i, prefix in enumerate(("stoic serve", "transformers", "llama", "torch")):
        if name.startswith(prefix):
            return i
    return 9


def find(results: Sequence[Result], prefix: str, c: int) -> Result | None:
    return next((r for r in results if r.system.startswith(prefix) and r.concurrency == c), None)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def api_table(rows: Sequence[eb.Row], other: Sequence[float | None]) -> str:
    lines = [
        "| system | workload | concurrency | requests | output tokens | seconds | tokens/s | "
        "other CPU |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r, o in zip(rows, other, strict=True):
        lines.append(
            f"| {r.system} | {r.workload} | {r.concurrency} | {r.requests} | {r.output_tokens} | "
            f"{r.seconds:.2f} | {r.tokens_per_s:.1f} | {fmt_pct(o)} |"
        )
    return "\n".join(lines)
