"""The scheduler core's configuration, statistics and recovery outcome records."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from ..config import Speculative
from ._tenants import TenantPolicy

__all__ = ["Recovered", "SchedulerConfig", "SchedulerStats"]


@dataclass(frozen=True)
class SchedulerConfig:
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    eos_token_ids: frozenset[int]
    #: share the KV blocks of equal prompt prefixes between sequences
    prefix_caching: bool = True
    #: on an executor failure: ``"fail"`` every sequence that started, or ``"resume"`` them
    recovery: Literal["fail", "resume"] = "fail"
    #: with ``"resume"``: times one sequence may be resumed before it fails as under ``"fail"``
    max_resumes: int = 3
    #: the tenants' weights and limits
    tenants: TenantPolicy = field(default_factory=TenantPolicy)
    #: while sequences decode, a step carries prompt chunks only up to this many times a
    #: decode-only step's measured duration (None: up to the token budget)
    decode_stretch: float | None = None
    #: speculative decoding (:mod:`stoic.scheduler._speculate`): ``"off"``, ``"ngram"`` or
    #: ``"auto"``, and the most drafts a sequence verifies in one step
    speculative: Speculative = "off"
    num_speculative_tokens: int = 4


class SchedulerStats(NamedTuple):
    """Counters read on the event loop (no message round trip)."""

    #: sequences being generated
    running: int
    #: sequences admitted but not yet scheduled (or preempted)
    waiting: int
    #: steps completed
    steps: int
    #: running sequences whose blocks were taken back (recomputed later)
    preemptions: int
    #: late results from a fenced step or executor incarnation, discarded
    fenced_results: int
    #: sequences ended by an executor failure, the engine failing or a drain deadline
    failed_sequences: int
    #: sequences in the last step
    last_batch_size: int
    #: most sequences seen in one step so far
    max_batch_size: int
    #: prompt tokens admitted
    prompt_tokens: int
    #: tokens sampled
    generated_tokens: int
    #: prompt tokens whose keys/values came from the prefix cache instead of being computed
    prefix_cached_tokens: int
    #: KV blocks in use (held by a sequence) out of ``kv_blocks_total``
    kv_blocks_used: int
    kv_blocks_total: int
    #: KV blocks held by the prefix cache (in use or evictable)
    kv_blocks_cached: int
    #: resumes after executor failures (``--recovery resume``), one per sequence per failure
    #: (a sequence is one engine request: the names are :class:`stoic.EngineStats`'s)
    requests_resumed: int
    #: sequences that failed because they had been resumed ``max_resumes`` times
    resumes_exhausted: int
    #: sequences found to cause repeated executor failures and ended alone
    requests_isolated: int
    #: executor failures of isolation probes (suspects run alone), charged to the suspect and
    #: not counted toward the engine's restart intensity
    isolation_failures: int
    #: tokens per step in force (below the configured budget after an out-of-memory failure)
    token_budget: int
    #: sequences running at once in force
    seq_budget: int
    #: sequences ended by their own deadline (``finish_reason="timeout"``)
    timed_out: int = 0
    #: resumed sequences' tokens whose keys and values outlived the executor failure (kept
    #: pools, or the prefix cache) and were not computed again
    resume_reused_tokens: int = 0
    #: resumed sequences' tokens computed (or being computed) before the failure and prefilled
    #: again after it
    resume_recomputed_tokens: int = 0
    #: speculative decoding: tokens proposed (drafts verified) and those the model agreed with
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


class Recovered(NamedTuple):
    """What an executor failure did to the sequences (``SchedulerCore.executor_down``)."""

    #: ended with the error (under ``"fail"``: every one that started)
    failed: int
    #: re-admitted to continue where they stopped (``"resume"``)
    resumed: int
    #: of ``failed``: their resumes were spent
    exhausted: int
    #: of ``failed``: found to cause the failures
    isolated: int
    #: the failure counts toward the engine's restart intensity; False: it is charged to a
    #: suspect instead (the failed step ran only suspects: an isolation probe)
    charged: bool = True
    #: KV blocks that were in use, forgotten with the dropped cache
    blocks_freed: int = 0
    #: the KV cache outlived the failure (kept: block tables and prefix cache stand)
    kv_kept: bool = False
    #: of the resumed sequences' tokens, those whose keys and values were kept, and those to
    #: compute again (a sequence restarted may still find some of these in the prefix cache:
    #: the scheduler's counters say what was)
    reused_tokens: int = 0
    recompute_tokens: int = 0
