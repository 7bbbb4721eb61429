"""The engine's actors: intake, scheduler (a pure core and an actor shell), cache manager and
guardian; their messages (the executor's too: it is :mod:`stoic.executor`), result streams,
sequences, health, fault injection and the step watchdog's rule.

Test helpers live in :mod:`stoic.actors.testing`.
"""

from ._allocator import BlockAllocator, OutOfBlocks
from ._cache import CacheManager
from ._core import SchedulerConfig, SchedulerCore, SchedulerStats
from ._faults import FaultInjector, InjectedFault, enact_fault
from ._guardian import Guardian
from ._health import STATES, EngineHealth, Health, State
from ._intake import Intake, IntakeConfig
from ._messages import (
    ASK_TIMEOUT,
    Abort,
    AcquireKV,
    CacheMsg,
    CacheStats,
    Drain,
    DropAll,
    EngineFailedNotice,
    ExecutorDown,
    ExecutorMsg,
    ExecutorReady,
    IntakeMsg,
    Recovered,
    RunStep,
    SchedulerMsg,
    StepResult,
    Submit,
    WorkerExited,
)
from ._plan import Planned, StepPlan
from ._scheduler import Scheduler
from ._sequence import SeqStatus, Sequence, block_hashes
from ._stream import Delta, FinishReason, ResultStream, TokenLogprob
from ._watchdog import ProgressWatch

__all__ = [
    "ASK_TIMEOUT",
    "STATES",
    "Abort",
    "AcquireKV",
    "BlockAllocator",
    "CacheManager",
    "CacheMsg",
    "CacheStats",
    "Delta",
    "Drain",
    "DropAll",
    "EngineFailedNotice",
    "EngineHealth",
    "ExecutorDown",
    "ExecutorMsg",
    "ExecutorReady",
    "FaultInjector",
    "FinishReason",
    "Guardian",
    "Health",
    "InjectedFault",
    "Intake",
    "IntakeConfig",
    "IntakeMsg",
    "OutOfBlocks",
    "Planned",
    "ProgressWatch",
    "Recovered",
    "ResultStream",
    "RunStep",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerCore",
    "SchedulerMsg",
    "SchedulerStats",
    "SeqStatus",
    "Sequence",
    "State",
    "StepPlan",
    "StepResult",
    "Submit",
    "TokenLogprob",
    "WorkerExited",
    "block_hashes",
    "enact_fault",
]
