"""The engine's actors: intake, scheduler (an actor shell over :mod:`stoic.scheduler`'s pure
core), cache manager (the KV tensors' lifetime) and guardian; their messages (the executor's
too: it is :mod:`stoic.executor`), result streams, health, fault injection and the step
watchdog's rule.

Test helpers live in :mod:`stoic.actors.testing`.
"""

from ._faults import FaultInjector, InjectedFault, enact_fault
from ._guardian import Guardian
from ._health import STATES, EngineHealth, Health, State
from ._intake import Intake, IntakeConfig
from ._kv_manager import KVCacheManager
from ._messages import (
    ASK_TIMEOUT,
    Abort,
    AcquireKV,
    CacheMsg,
    Drain,
    DropAll,
    EngineFailedNotice,
    ExecutorDown,
    ExecutorMsg,
    ExecutorReady,
    IntakeMsg,
    KVLease,
    Recovered,
    RunStep,
    SchedulerMsg,
    StepResult,
    Submit,
    WorkerExited,
)
from ._scheduler import Scheduler
from ._stream import Delta, FinishReason, ResultStream, TokenLogprob
from ._watchdog import ProgressWatch

__all__ = [
    "ASK_TIMEOUT",
    "STATES",
    "Abort",
    "AcquireKV",
    "CacheMsg",
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
    "KVCacheManager",
    "KVLease",
    "ProgressWatch",
    "Recovered",
    "ResultStream",
    "RunStep",
    "Scheduler",
    "SchedulerMsg",
    "State",
    "StepResult",
    "Submit",
    "TokenLogprob",
    "WorkerExited",
    "enact_fault",
]
