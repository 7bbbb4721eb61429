"""The engine's actors: intake, scheduler (a pure core and an actor shell), cache manager,
executor and guardian; their messages, result streams, sequences, health and fault injection.

Test helpers live in :mod:`stoic.actors.testing`.
"""

from ._allocator import BlockAllocator, OutOfBlocks
from ._cache import CacheManager
from ._core import SchedulerConfig, SchedulerCore, SchedulerStats
from ._executor import Executor, StepWorker
from ._failures import ExecutorFault, classify_failure
from ._faults import FaultInjector, InjectedFault
from ._guardian import Guardian
from ._health import STATES, EngineHealth, Health, State
from ._intake import Intake, IntakeConfig
from ._messages import (
    ASK_TIMEOUT,
    Abort,
    CacheMsg,
    CacheStats,
    Drain,
    DropAll,
    EngineFailedNotice,
    ExecutorDown,
    ExecutorMsg,
    IntakeMsg,
    Recovered,
    SchedulerMsg,
    Submit,
)
from ._plan import Planned, StepPlan
from ._proc_executor import ProcessExecutor
from ._process import WorkerPool, WorkerProcess
from ._procworker import WorkerSpec
from ._scheduler import Scheduler
from ._sequence import SeqStatus, Sequence, block_hashes
from ._stream import Delta, FinishReason, ResultStream, TokenLogprob

__all__ = [
    "ASK_TIMEOUT",
    "STATES",
    "Abort",
    "BlockAllocator",
    "CacheManager",
    "CacheMsg",
    "CacheStats",
    "Delta",
    "Drain",
    "DropAll",
    "EngineFailedNotice",
    "EngineHealth",
    "Executor",
    "ExecutorDown",
    "ExecutorFault",
    "ExecutorMsg",
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
    "ProcessExecutor",
    "Recovered",
    "ResultStream",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerCore",
    "SchedulerMsg",
    "SchedulerStats",
    "SeqStatus",
    "Sequence",
    "State",
    "StepPlan",
    "StepWorker",
    "Submit",
    "TokenLogprob",
    "WorkerPool",
    "WorkerProcess",
    "WorkerSpec",
    "block_hashes",
    "classify_failure",
]
