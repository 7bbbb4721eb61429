"""Admission by deadline: how long a new request would wait for its first token, from the queue
ahead of it and the measured step rate.

The estimate is what the intake compares with a request's deadline and the server's queue-wait
limit, so that a request that cannot get its first token in time is refused at once (429,
``Retry-After``) instead of being admitted to be late. It counts, in the order the planner
serves (:func:`~stoic.scheduler.plan_step`), the prompt tokens computed before the request's
first token: its own tenant's waiting work of a priority as good or better, each other tenant's
work up to that tenant's share of the same stretch (weights), and its own prompt; divides them
by the prompt tokens a step has room for beside the running decodes (the token budget, or the
decode stretch's :func:`prompt_budget`); prices each step by the meter's cost (a least-squares
fit of the recent steps' durations to their decode rows and prompt tokens); and adds half a
step for the one in
flight. When the running sequences fill ``max_num_seqs``, it takes at least the time for enough
of them to end at the measured rate of sequences ending. With fewer than :data:`MIN_STEPS` steps
measured, or nothing
running and nothing ahead, it returns 0: a refusal needs evidence, and an idle engine takes
anything (were it refused on stale measurements, no step would ever renew them).
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from ._sequence import Seq
from ._tenants import TenantPolicy

__all__ = ["MIN_STEPS", "Expected", "LoadMeter", "StepCost", "prompt_budget", "queue_wait"]

#: steps measured before the meter prices a step: a few steps (a cold first one among them)
#: would be extrapolated to a full step many times over, and refuse on that
MIN_STEPS = 16


class Work(Protocol):
    """What the estimate reads of a sequence ahead (a :class:`Seq`, or an :class:`Expected`)."""

    @property
    def tenant(self) -> str: ...

    @property
    def priority(self) -> int: ...

    @property
    def remaining(self) -> int: ...


class Expected(NamedTuple):
    """A request the intake admitted whose sequence has not reached the scheduler yet (its
    message is in the scheduler's mailbox): counted as waiting, or a burst would be admitted on
    a view that misses itself."""

    tenant: str
    priority: int
    #: its prompt tokens
    remaining: int


@dataclass(frozen=True, slots=True)
class StepCost:
    """What a step costs: ``fixed + per_decode * decodes + per_prompt * prompt_tokens`` seconds
    (a decode row reads its sequence's whole context; a prompt token is one row of a chunk)."""

    fixed: float
    per_decode: float
    per_prompt: float

    def seconds(self, decodes: int, prompt_tokens: int) -> float:
        return self.fixed + self.per_decode * decodes + self.per_prompt * prompt_tokens


class LoadMeter:
    """The recent steps' decodes, prompt tokens and durations, and the times sequences ended."""

    def __init__(self, window: int = 64) -> None:
        self._steps: deque[tuple[int, int, float]] = deque(maxlen=window)
        self._ends: deque[float] = deque(maxlen=window)
        #: the fit of the steps now (None: to be fitted again)
        self._cost: StepCost | None = None

    def step(self, decodes: int, prompt_tokens: int, seconds: float) -> None:
        """A step of ``decodes`` decode rows and ``prompt_tokens`` prompt tokens took
        ``seconds`` (planned to result)."""
        self._steps.append((decodes, prompt_tokens, seconds))
        self._cost = None

    def ended(self, now: float, count: int = 1) -> None:
        """``count`` sequences ended at ``now``."""
        self._ends.extend(itertools.repeat(now, count))

    def cost(self) -> StepCost | None:
        """The recent steps' cost (None before :data:`MIN_STEPS` steps): least squares over ``1``,
        ``decodes`` and ``prompt_tokens``, each of the latter two only where the window varies
        it (else the intercept holds it), a coefficient that comes out negative dropped and the
        rest fitted again. Where the prompt tokens never varied, a prompt token is priced as a
        decode row (dearer: a cautious estimate), or, nothing having varied, every row at the
        mean cost per row."""
        if len(self._steps) < MIN_STEPS:
            return None
        if self._cost is None:
            self._cost = _fit(self._steps)
        return self._cost

    def seconds(self, decodes: int, prompt_tokens: int) -> float | None:
        """A step's expected duration (None before :data:`MIN_STEPS` steps)."""
        cost = self.cost()
        return None if cost is None else cost.seconds(decodes, prompt_tokens)

    def largest_prompt(self) -> int:
        """The most prompt tokens one recent step carried (0 before any step)."""
        return max((r for _, r, _ in self._steps), default=0)

    def end_rate(self, now: float) -> float | None:
        """Sequences ended per second over the recent ones (None with fewer than two)."""
        ends = self._ends
        if len(ends) < 2 or now <= ends[0]:
            return None
        return len(ends) / (now - ends[0])


def _fit(steps: deque[tuple[int, int, float]]) -> StepCost:
    decodes = [d for d, _, _ in steps]
    prompts = [r for _, r, _ in steps]
    seconds = [s for _, _, s in steps]
    columns = {"decode": decodes, "prompt": prompts}
    varied = [name for name, xs in columns.items() if max(xs) - min(xs) >= 2]
    coefs: dict[str, float] = {}
    while True:
        coefs = _least_squares(seconds, [columns[name] for name in varied], varied)
        negative = [name for name in varied if coefs[name] < 0]
        if not negative:
            break
        varied.remove(min(negative, key=coefs.__getitem__))
    fixed = coefs["1"]
    per_decode = coefs.get("decode", 0.0)
    per_prompt = coefs.get("prompt")
    if per_prompt is None:  # the prompt tokens never varied: the intercept holds them
        mean_prompt = sum(prompts) / len(prompts)
        if per_decode > 0:  # priced as decode rows
            per_prompt = per_decode
            fixed -= per_prompt * mean_prompt
        else:  # nothing varied: every row at the mean cost per row
            rows = sum(decodes) + sum(prompts)
            per_prompt = per_decode = sum(seconds) / rows if rows else 0.0
            fixed = 0.0 if rows else fixed
    return StepCost(max(0.0, fixed), per_decode, per_prompt)


def _least_squares(y: list[float], xs: list[list[int]], names: list[str]) -> dict[str, float]:
    """``{"1": intercept, name: coefficient...}`` minimising the squared error of ``y`` against
    an intercept and the columns ``xs`` (centred normal equations, Gaussian elimination)."""
    n = len(y)
    mean_y = sum(y) / n
    means = [sum(x) / n for x in xs]
    k = len(xs)
    a = [
        [sum((xs[i][t] - means[i]) * (xs[j][t] - means[j]) for t in range(n)) for j in range(k)]
        for i in range(k)
    ]
    b = [sum((xs[i][t] - means[i]) * (y[t] - mean_y) for t in range(n)) for i in range(k)]
    coef = _solve(a, b)
    out = dict(zip(names, coef, strict=True))
    out["1"] = mean_y - sum(c * m for c, m in zip(coef, means, strict=True))
    return out


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """``a x = b`` for a small symmetric ``a`` (a singular column gets 0)."""
    k = len(b)
    m = [[*row, rhs] for row, rhs in zip(a, b, strict=True)]
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            continue
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(k):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [v - f * w for v, w in zip(m[r], m[col], strict=True)]
    return [m[i][k] / m[i][i] if abs(m[i][i]) >= 1e-12 else 0.0 for i in range(k)]


def queue_wait(
    *,
    tenant: str,
    priority: int,
    prompt_tokens: int,
    running: Iterable[Seq],
    waiting: Iterable[Work],
    step_tokens: int,
    max_seqs: int,
    policy: TenantPolicy,
    meter: LoadMeter,
    now: float,
    stretch: float | None = None,
    floor: int = 1,
) -> float:
    """Seconds a request of ``tenant`` with ``priority`` and a prompt of ``prompt_tokens``
    would wait for its first token (see the module; ``stretch`` and ``floor``: the decode
    stretch in force and its least prompt budget, :func:`prompt_budget`)."""
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
    for work in waiting:
        if work.tenant == tenant:
            if work.priority <= priority:
                own_ahead += work.remaining
                own_count += 1
        else:
            tally = others.setdefault(work.tenant, [0, 0])
            tally[0] += work.remaining
            tally[1] += 1
    mine = own_ahead + prompt_tokens
    weight = policy.weight(tenant)
    ahead: float = own_ahead
    count = own_count
    for name, (tokens, seqs) in others.items():
        share = mine * policy.weight(name) / weight
        ahead += min(tokens, share)
        count += seqs if tokens <= share else math.ceil(seqs * share / tokens)
    cost = meter.cost()
    if cost is None or (not running and not ahead):
        # nothing measured, or nothing before it: an idle engine takes anything (its own
        # deadline ends it if its prompt alone is too long), and its steps renew the meter
        return 0.0
    room = max(1, step_tokens - decoding)
    cap = prompt_budget(meter, decoding, stretch, floor)
    if cap is not None:
        room = min(room, cap)
    if meter.largest_prompt() * 4 < room:
        # no recent step carried a quarter of the room: its prompt cost would be extrapolated
        # from small chunks (a cold first step among them) many times over; no evidence
        return 0.0
    step = cost.seconds(decoding, room)
    # the work ahead and its own prompt: its first token comes with its prompt's last chunk
    wait = math.ceil((ahead + prompt_tokens) / room) * step
    over = len(running) + count + 1 - max_seqs
    if over > 0:
        rate = meter.end_rate(now)
        if rate:
            wait = max(wait, over / rate)
    # the step in flight when it arrives: half of one, on average
    return wait + (step / 2 if running else 0.0)


def prompt_budget(meter: LoadMeter, decoding: int, stretch: float | None, floor: int) -> int | None:
    """The prompt tokens a step may carry beside ``decoding`` decodes so that it takes at most
    ``stretch`` times a decode-only step (the meter's cost), never fewer than ``floor``; None
    (the step budget alone) without decodes, a stretch, or a measured cost of prompt tokens."""
    if not stretch or not decoding:
        return None
    cost = meter.cost()
    if cost is None or cost.per_prompt <= 0:
        return None
    decode_only = cost.seconds(decoding, 0)
    return max(floor, int((stretch - 1.0) * decode_only / cost.per_prompt + 1e-9))
