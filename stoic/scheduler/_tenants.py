"""Fair shares of the step tokens between tenants, and each tenant's counters.

A tenant is whoever a request is for (an API key, or a header the operator names; ``""`` is the
default tenant). Each step's tokens go to tenants by weighted virtual time (start-time fair
queueing, as a network switch shares a link): every token a step computes for a tenant advances
its virtual time by ``1 / weight``, and the planner serves the tenant whose virtual time is
least first. Over any stretch in which two tenants both have work, their computed tokens
therefore converge to the ratio of their weights, whatever their request rates: one tenant's
flood cannot starve another's trickle. A tenant that had no work and gets some starts at the
least virtual time of the tenants with work (never below its own): idle time earns no credit
to spend later in a burst.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = ["MAX_TRACKED_TENANTS", "OTHER_TENANTS", "TenantPolicy", "TenantShares", "TenantStats"]

#: tenants counted under their own name; beyond them, counts go to :data:`OTHER_TENANTS` (a
#: header's value is the client's choice: its names must not grow the metrics without bound)
MAX_TRACKED_TENANTS = 256
#: the name the tenants beyond :data:`MAX_TRACKED_TENANTS` are counted under
OTHER_TENANTS = "(other)"


@dataclass(frozen=True)
class TenantPolicy:
    """The operator's tenant settings (``--tenant-weight``, ``--tenant-max-running``,
    ``--tenant-max-queued``)."""

    #: a tenant's share weight (one not named: 1.0); every weight is positive
    weights: Mapping[str, float] = field(default_factory=dict)
    #: sequences one tenant may have running at once (None: ``max_num_seqs`` only)
    max_running: int | None = None
    #: requests one tenant may have admitted and not ended (None: ``max_waiting`` only); the
    #: intake refuses beyond it (429)
    max_queued: int | None = None

    def __post_init__(self) -> None:
        bad = {name: w for name, w in self.weights.items() if not w > 0}
        if bad:
            raise ValueError(f"tenant weights must be positive: {bad}")
        for name, limit in (("max_running", self.max_running), ("max_queued", self.max_queued)):
            if limit is not None and limit < 1:
                raise ValueError(f"tenant {name} must be at least 1, not {limit}")

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)


@dataclass(slots=True)
class TenantStats:
    """One tenant's counters and gauges (``stoic_tenant_*`` on /metrics)."""

    weight: float
    #: sequences running, and admitted but not running (gauges)
    running: int = 0
    waiting: int = 0
    #: requests admitted
    admitted: int = 0
    #: requests refused at admission (its limits, or a deadline the queue cannot meet)
    refused: int = 0
    #: requests ended by their own deadline (``finish_reason="timeout"``)
    timed_out: int = 0
    #: tokens the steps computed for it (prompt chunks and decodes): what its share counts
    computed_tokens: int = 0


class TenantShares:
    """Each tenant's virtual time and counters (see the module).

    :meth:`joined` and :meth:`left` bracket a sequence's life in the scheduler (the queues call
    them), :meth:`charge` counts a planned chunk, :meth:`vtime` orders the tenants in a plan.
    """

    def __init__(self, policy: TenantPolicy | None = None) -> None:
        self.policy = policy or TenantPolicy()
        self._vtime: dict[str, float] = {}
        #: sequences each tenant has in the scheduler (waiting, running or held)
        self._live: dict[str, int] = {}
        self._stats: dict[str, TenantStats] = {}

    def vtime(self, tenant: str) -> float:
        """The tenant's virtual time: its computed tokens over its weight, since it had work."""
        return self._vtime.get(tenant, 0.0)

    def live(self, tenant: str) -> int:
        """Sequences the tenant has in the scheduler."""
        return self._live.get(tenant, 0)

    def joined(self, tenant: str) -> None:
        """A sequence of ``tenant`` entered the scheduler (admitted)."""
        if not self._live.get(tenant):
            active = [self._vtime[t] for t, n in self._live.items() if n and t != tenant]
            floor = min(active, default=self.vtime(tenant))
            self._vtime[tenant] = max(self.vtime(tenant), floor)
        self._live[tenant] = self._live.get(tenant, 0) + 1
        self.stats_of(tenant).admitted += 1

    def left(self, tenant: str) -> None:
        """A sequence of ``tenant`` left the scheduler (ended, whatever the way). A tenant with
        nothing left is forgotten but for its counters; if none has work, virtual time starts
        over from nothing (it only orders tenants that have work)."""
        n = self._live.get(tenant, 0) - 1
        if n > 0:
            self._live[tenant] = n
            return
        self._live.pop(tenant, None)
        if not self._live:
            self._vtime.clear()

    def charge(self, tenant: str, tokens: int) -> None:
        """A planned chunk computes ``tokens`` for ``tenant``."""
        self._vtime[tenant] = self.vtime(tenant) + tokens / self.policy.weight(tenant)
        self.stats_of(tenant).computed_tokens += tokens

    def timed_out(self) -> int:
        """Requests ended by their own deadline, every tenant's (``SchedulerStats.timed_out``)."""
        return sum(stats.timed_out for stats in self._stats.values())

    def stats_of(self, tenant: str) -> TenantStats:
        """The tenant's counters (those of :data:`OTHER_TENANTS` once enough names are known)."""
        stats = self._stats.get(tenant)
        if stats is None:
            if len(self._stats) >= MAX_TRACKED_TENANTS:
                tenant = OTHER_TENANTS
                stats = self._stats.get(tenant)
            if stats is None:
                stats = self._stats[tenant] = TenantStats(weight=self.policy.weight(tenant))
        return stats

    def snapshot(self, running: Iterable[str], waiting: Iterable[str]) -> dict[str, TenantStats]:
        """Every tenant's counters, with the gauges counted from the tenants of the sequences
        ``running`` and ``waiting``."""
        out = {
            name: dataclasses.replace(stats, running=0, waiting=0)
            for name, stats in self._stats.items()
        }
        for names, gauge in ((running, "running"), (waiting, "waiting")):
            for name in names:
                stats = out.get(name) or out.get(OTHER_TENANTS)
                if stats is not None:
                    setattr(stats, gauge, getattr(stats, gauge) + 1)
        return out
