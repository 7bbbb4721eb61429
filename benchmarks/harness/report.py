"""Numbers and tables: the one quantile every benchmark uses, value formats, markdown tables."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any


def quantile(values: Iterable[float], q: float) -> float | None:
    """Linear-interpolated quantile (``q`` in [0, 1]); ``None`` for no values."""
    s = sorted(values)
    if not s:
        return None
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def fmt_s(x: float | None) -> str:
    """Seconds, 3 decimals (``-`` for none)."""
    return "-" if x is None else f"{x:.3f}"


def fmt_ms(x: float | None) -> str:
    """Seconds shown as milliseconds, 1 decimal (``-`` for none)."""
    return "-" if x is None else f"{x * 1000:.1f}"


def fmt_pct(x: float | None) -> str:
    """A share as a whole percentage (``-`` for none)."""
    return "-" if x is None else f"{x:.0%}"


def median_worst_ms(values: Sequence[float]) -> str:
    """``median / worst`` of seconds, in whole milliseconds."""
    if not values:
        return "-"
    median = quantile(values, 0.5) or 0.0
    return f"{median * 1000:.0f} / {max(values) * 1000:.0f}"


def markdown(head: Sequence[str], rows: Iterable[Sequence[Any]], align: str = "") -> str:
    """A markdown table; ``align`` has one letter a column (``l`` left, ``r`` right; default:
    the first column left, the others right)."""
    align = align or "l" + "r" * (len(head) - 1)
    rule = "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"
    lines = ["| " + " | ".join(head) + " |", rule]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)
