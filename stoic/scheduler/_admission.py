"""Admission by deadline: how long a new request would wait to start, from the queue ahead of it
and the measured step rate.

The estimate is what the intake compares with a request's deadline and the server's queue-wait
limit, so that a request that cannot start in time is refused at once (429, ``Retry-After``)
instead of being admitted to be late. It counts, in the order the planner serves
(:func:`~stoic.scheduler.plan_step`), the prompt tokens that start before the request's first
chunk: its own tenant's waiting work of a priority as good or better, and each other tenant's
work up to that tenant's share of the same stretch (weights); divides them by the prompt tokens
a step has room for beside the running decodes; and prices each step at a full step's measured
duration (a robust line through the recent steps' durations against their tokens).
When the running sequences fill ``max_num_seqs``, it adds the time for enough of them to end at
the measured rate of sequences ending. With no step measured yet it returns 0: a refusal needs
evidence.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import deque
from collections.abc import Iterable

from ._sequence import Seq
from ._tenants import TenantPolicy

__all__ = ["LoadMeter", "prompt_budget", "queue_wait"]


class LoadMeter:
    """The recent steps' durations and token counts, and the times sequences ended."""

    def __init__(self, window: int = 32) -> None:
        # 32 steps: about a second of a busy engine, and 496 pairs for the fit
        self._steps: deque[tuple[int, float]] = deque(maxlen=window)
        self._ends: deque[float] = deque(maxlen=window)
        #: ``(intercept, slope)`` of the steps now (None: to be fitted again)
        self._fit: tuple[float, float] | None = None

    def step(self, tokens: int, seconds: float) -> None:
        """A step of ``tokens`` tokens took ``seconds`` (planned to result)."""
        self._steps.append((tokens, seconds))
        self._fit = None

    def ended(self, now: float) -> None:
        """A sequence ended at ``now``."""
        self._ends.append(now)

    def step_seconds(self, tokens: int) -> float | None:
        """A step of ``tokens`` tokens' expected duration (None before any step).

        The line ``a + b * tokens`` through the recent steps by Theil and Sen's estimator (the
        median of the slopes between pairs of steps, the median intercept): a few odd steps (the
        first, slow ones; a neighbour's burst) do not tilt it, as they would a least-squares
        line. With one step size only, the duration scales with the tokens.
        """
        line = self.line()
        if line is None:
            return None
        intercept, slope = line
        return intercept + slope * tokens

    def line(self) -> tuple[float, float] | None:
        """``(intercept, slope)``: a step's fixed seconds and seconds per token (None before
        any step; see :meth:`step_seconds`)."""
        if not self._steps:
            return None
        if self._fit is None:
            self._fit = _theil_sen(self._steps)
        return self._fit

    def end_rate(self, now: float) -> float | None:
        """Sequences ended per second over the recent ones (None with fewer than two)."""
        ends = self._ends
        if len(ends) < 2 or now <= ends[0]:
            return None
        return len(ends) / (now - ends[0])


def _theil_sen(steps: deque[tuple[int, float]]) -> tuple[float, float]:
    """``(intercept, slope)`` of ``seconds`` against ``tokens``, neither negative."""
    slopes = [
        (s2 - s1) / (t2 - t1)
        for i, (t1, s1) in enumerate(steps)
        for t2, s2 in itertools.islice(steps, i + 1, None)
        if t2 != t1
    ]
    if not slopes:  # one size: the duration per token, scaled
        tokens = max(1, steps[0][0])
        return 0.0, statistics.median(s for _, s in steps) / tokens
    slope = max(0.0, statistics.median(slopes))
    intercept = max(0.0, statistics.median(s - slope * t for t, s in steps))
    return intercept, slope


def queue_wait(
    *,
    tenant: str,
    priority: int,
    prompt_tokens: int,
    running: Iterable[Seq],
    waiting: Iterable[Seq],
    step_tokens: int,
    max_seqs: int,
    policy: TenantPolicy,
    meter: LoadMeter,
    now: float,
) -> float:
    """Seconds a request of ``tenant`` with ``priority`` and a prompt of ``prompt_tokens``
    would wait for its first step (see the module)."""
    own_ahead, own_count = 0, 0
    others: dict[str, list[int]] = {}
    decoding = 0
    running = list(running)
    for seq in running:
        if seq.remaining == 1:
            decoding += 1
        elif seq.tenant == tenant:
            own_ahead += seq.remaining
        else:
            others.setdefault(seq.tenant, [0, 0])[0] += seq.remaining
    for seq in waiting:
        if seq.tenant == tenant:
            if seq.priority <= priority:
                own_ahead += seq.remaining
                own_count += 1
        else:
            tally = others.setdefault(seq.tenant, [0, 0])
            tally[0] += seq.remaining
            tally[1] += 1
    mine = own_ahead + prompt_tokens
    weight = policy.weight(tenant)
    ahead: float = own_ahead
    count = own_count
    for name, (tokens, seqs) in others.items():
        share = mine * policy.weight(name) / weight
        ahead += min(tokens, share)
        count += seqs if tokens <= share else math.ceil(seqs * share / tokens)
    full_step = meter.step_seconds(step_tokens)
    if full_step is None:
        return 0.0
    room = max(1, step_tokens - decoding)
    wait = math.ceil(ahead / room) * full_step
    over = len(running) + count + 1 - max_seqs
    if over > 0:
        rate = meter.end_rate(now)
        if rate:
            wait = max(wait, over / rate)
    in_flight = meter.step_seconds(decoding + min(math.ceil(ahead), room)) or 0.0
    return wait + in_flight


def prompt_budget(meter: LoadMeter, decoding: int, stretch: float | None, floor: int) -> int | None:
    """The prompt tokens a step may carry beside ``decoding`` decodes so that it takes at most
    ``stretch`` times a decode-only step (the meter's line), never fewer than ``floor``; None
    (the step budget alone) without decodes, a stretch, or a measured line with a slope."""
    if not stretch or not decoding:
        return None
    line = meter.line()
    if line is None or line[1] <= 0:
        return None
    intercept, slope = line
    decode_only = intercept + slope * decoding
    return max(floor, int((stretch - 1.0) * decode_only / slope))
