"""Engine statistics: one typed snapshot read on the event loop (no message round trip)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ..actors import EngineHealth as _Health
from ..actors import FaultInjector, State
from ..errors import FailureKind
from ..model import ComputePath
from ..scheduler import SchedulerCore, TenantStats

__all__ = ["EngineStats", "collect_stats"]


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine's counters and gauges: the one record the scheduler's counts
    reach ``/metrics`` and Ray's summed statistics in (the HTTP layer and the tests use this
    type, not a restatement of it).

    Every field annotated plain ``int`` is a count or gauge that is 0 on an engine that has run
    nothing: :meth:`idle` zero-fills them, so a new counter is a field here, its line in
    :func:`collect_stats` and its metric (``stoic/http/_metrics.py``). A field of another type
    needs a value in :meth:`idle` (or a default).
    """

    #: sequences being generated
    running: int
    #: sequences admitted but not yet scheduled
    waiting: int
    #: KV blocks in use (held by a sequence) out of ``kv_blocks_total``
    kv_blocks_used: int
    kv_blocks_total: int
    #: the executor's incarnation (0 at start, +1 per restart)
    incarnation: int
    #: executor restarts so far
    restarts: int
    #: sequences ended with an error (executor failure, engine failure, stop deadline)
    failed_sequences: int
    #: steps completed
    steps: int
    #: most sequences in one step so far
    max_batch_size: int
    #: running sequences preempted (their blocks taken back, recomputed later)
    preemptions: int
    #: late results from fenced executor incarnations, discarded
    fenced_results: int
    #: prompt tokens admitted
    prompt_tokens: int
    #: tokens generated
    generated_tokens: int
    #: faults injected so far
    faults_injected: int
    #: the engine's health state
    state: State
    #: prompt tokens whose keys/values came from the prefix cache (not computed)
    prefix_cached_tokens: int
    #: KV blocks held by the prefix cache (in use or evictable)
    kv_blocks_cached: int
    #: the process the model runs in (the server's own with the thread executor)
    executor_pid: int | None
    #: executor restarts by the kind of failure that caused them
    restarts_by_kind: tuple[tuple[FailureKind, int], ...]
    #: resumes after executor failures (``recovery="resume"``), one per request per failure
    requests_resumed: int
    #: requests that failed because their resumes were spent
    resumes_exhausted: int
    #: requests found to cause repeated executor failures, ended alone
    requests_isolated: int
    #: executor failures of isolation probes (a suspect run alone), charged to the suspect and
    #: not counted toward the restart intensity
    isolation_failures: int
    #: tokens per step in force (halved after an out-of-memory failure, then restored)
    token_budget: int
    #: requests ended by their own deadline (``finish_reason="timeout"``)
    timed_out: int
    #: how the executor's model computes (precision, quantised kernels); None until the first
    #: executor was ready
    compute: ComputePath | None = None
    #: the compute threads of the last step: the CPU budget, fewer while other processes take
    #: CPUs (0 before the first step)
    compute_threads: int = 0
    #: each tenant's counters, by name (sorted)
    tenants: tuple[tuple[str, TenantStats], ...] = ()
    #: resumed requests' tokens whose keys and values outlived an executor failure (pools that
    #: outlive the worker, the prefix cache) and were not computed again
    resume_reused_tokens: int = 0
    #: resumed requests' tokens computed before a failure and prefilled again after it
    resume_recomputed_tokens: int = 0
    #: speculative decoding (``--speculative``): drafts verified, and those kept
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @classmethod
    def idle(cls, state: State = "starting", *, token_budget: int = 0) -> EngineStats:
        """The record of an engine that has run nothing: every count 0, no executor process,
        no restarts, no compute path yet; ``token_budget`` the configured tokens per step.

        What ``/metrics`` shows while the server's model loads and before any Ray replica has
        reported; tests override fields of it with :func:`dataclasses.replace`.
        """
        record: dict[str, Any] = {f.name: 0 for f in fields(cls) if f.type in ("int", int)}
        record.update(
            state=state,
            executor_pid=None,
            restarts_by_kind=(),
            token_budget=token_budget,
            compute=None,
        )
        return cls(**record)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the KV blocks in use (0 to 1)."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        """Fraction of the prompt tokens admitted whose keys and values came from the prefix
        cache (0 to 1; 0 before any prompt)."""
        return self.prefix_cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def collect_stats(core: SchedulerCore, health: _Health, faults: FaultInjector) -> EngineStats:
    sched, now = core.stats(), health.snapshot()
    return EngineStats(
        running=sched.running,
        waiting=sched.waiting,
        kv_blocks_used=sched.kv_blocks_used,
        kv_blocks_total=sched.kv_blocks_total,
        incarnation=now.incarnation,
        restarts=now.restarts,
        failed_sequences=sched.failed_sequences,
        steps=sched.steps,
        max_batch_size=sched.max_batch_size,
        preemptions=sched.preemptions,
        fenced_results=sched.fenced_results,
        prompt_tokens=sched.prompt_tokens,
        generated_tokens=sched.generated_tokens,
        faults_injected=faults.injected,
        state=now.state,
        prefix_cached_tokens=sched.prefix_cached_tokens,
        kv_blocks_cached=sched.kv_blocks_cached,
        executor_pid=now.executor_pid,
        restarts_by_kind=now.restarts_by_kind,
        requests_resumed=sched.requests_resumed,
        resumes_exhausted=sched.resumes_exhausted,
        requests_isolated=sched.requests_isolated,
        isolation_failures=sched.isolation_failures,
        token_budget=sched.token_budget,
        timed_out=sched.timed_out,
        compute=now.compute,
        compute_threads=now.threads,
        tenants=tuple(sorted(core.tenant_stats().items())),
        resume_reused_tokens=sched.resume_reused_tokens,
        resume_recomputed_tokens=sched.resume_recomputed_tokens,
        spec_draft_tokens=sched.spec_draft_tokens,
        spec_accepted_tokens=sched.spec_accepted_tokens,
    )
