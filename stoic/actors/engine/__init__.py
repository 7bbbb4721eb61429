"""The engine's actors: intake, scheduler, cache manager and executor."""

from ._cache import BlockAllocator, CacheManager, OutOfBlocks
from ._executor import Executor, StepWorker, classify_failure
from ._faults import FaultInjector, InjectedFault
from ._guardian import Guardian
from ._intake import Intake, IntakeConfig
from ._scheduler import Scheduler, SchedulerConfig
from ._stream import Delta, FinishReason, ResultStream, TokenLogprob

__all__ = [
    "BlockAllocator",
    "CacheManager",
    "Delta",
    "Executor",
    "FaultInjector",
    "FinishReason",
    "Guardian",
    "InjectedFault",
    "Intake",
    "IntakeConfig",
    "OutOfBlocks",
    "ResultStream",
    "Scheduler",
    "SchedulerConfig",
    "StepWorker",
    "TokenLogprob",
    "classify_failure",
]
