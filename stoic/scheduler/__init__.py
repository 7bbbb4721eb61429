"""Pure scheduling logic: sequences, the step plan, the block allocator with its prefix cache,
the step budget and the errors a failure ends sequences with. No actors, no awaits, no torch:
the scheduler actor (:mod:`stoic.actors`) is a thin shell that drives
:class:`SchedulerCore` and does its I/O.

The core plans each step on the true KV cache state: the prefix lookup, the blocks' allocation
and the step's plan happen in one synchronous call (:meth:`SchedulerCore.schedule`), against
the :class:`BlockAllocator` the core owns. The cache manager actor owns the physical KV
tensors' lifetime and their drop after a failure.
"""

from ._admission import MIN_STEPS, LoadMeter, prompt_budget, queue_wait
from ._allocator import BlockAllocator, OutOfBlocks
from ._budget import CLEAN_STEPS_PER_DOUBLING, StepBudget
from ._core import SchedulerCore, Step
from ._plan import Planned, StepPlan, blocks_for, chunks_of, plan_step, prefix_blocks
from ._records import Recovered, SchedulerConfig, SchedulerStats
from ._sequence import FinishReason, Seq, SeqSink, SeqStatus, TokenLogprob, block_hashes
from ._tenants import OTHER_TENANTS, TenantPolicy, TenantShares, TenantStats

__all__ = [
    "CLEAN_STEPS_PER_DOUBLING",
    "MIN_STEPS",
    "OTHER_TENANTS",
    "BlockAllocator",
    "FinishReason",
    "LoadMeter",
    "OutOfBlocks",
    "Planned",
    "Recovered",
    "SchedulerConfig",
    "SchedulerCore",
    "SchedulerStats",
    "Seq",
    "SeqSink",
    "SeqStatus",
    "Step",
    "StepBudget",
    "StepPlan",
    "TenantPolicy",
    "TenantShares",
    "TenantStats",
    "TokenLogprob",
    "block_hashes",
    "blocks_for",
    "chunks_of",
    "plan_step",
    "prefix_blocks",
    "prompt_budget",
    "queue_wait",
]
