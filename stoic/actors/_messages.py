"""The engine actors' messages: frozen dataclasses, one union type per actor's mailbox."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..config import FaultSpec
from ..errors import FailureKind
from ..request import Request, SamplingParams, StepBatch, StepOutput
from ..runtime import ActorRef, Reply
from ..scheduler import Recovered

if TYPE_CHECKING:
    from ..model import PagedKVCache
    from ._stream import ResultStream

#: how long an actor waits for another's reply before giving up (caller-side, see ``ask``)
ASK_TIMEOUT = 30.0

__all__ = [
    "ASK_TIMEOUT",
    "Abort",
    "AcquireKV",
    "AddSequence",
    "CacheMsg",
    "Drain",
    "DrainDeadline",
    "DropAll",
    "EngineFailedNotice",
    "ExecutorDown",
    "ExecutorMsg",
    "ExecutorReady",
    "IntakeMsg",
    "KVLease",
    "Recovered",
    "RunStep",
    "SchedulerMsg",
    "StepResult",
    "StepTimeout",
    "Submit",
    "WorkerExited",
]


# ---- Intake --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Submit:
    """Validate, template, tokenise and admit ``request``; reply with its stream or a typed error."""

    request: Request
    reply: Reply[ResultStream]


IntakeMsg = Submit


# ---- Scheduler -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, match_args=False)
class AddSequence:
    """An admitted request: what the intake derived from it (its prompt's token ids, the tokens it
    may generate) and the stream its output goes to."""

    request: Request
    prompt_ids: tuple[int, ...]
    #: ``request.params.max_tokens``, or what the context leaves when that is None
    max_tokens: int
    stream: ResultStream

    #: a pattern reads the request's id and parameters as if they were fields (the properties)
    __match_args__ = ("request_id", "prompt_ids", "params", "max_tokens", "stream")

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def params(self) -> SamplingParams:
        return self.request.params


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class StepResult:
    step_id: int
    incarnation: int
    output: StepOutput


@dataclass(frozen=True, slots=True)
class StepTimeout:
    """The watchdog: step ``step_id`` made no progress for the step timeout."""

    step_id: int
    #: seconds since the step's last progress tick, and since it was sent
    since_progress: float = 0.0
    step_seconds: float = 0.0
    #: the step's progress ticks (1 at its start, then 1 per decoder layer)
    ticks: int = 0


@dataclass(frozen=True, slots=True)
class ExecutorDown:
    """Recovery step: fence ``incarnation`` and end (or resume) every sequence that started.

    Replies with what happened to them.
    """

    error: BaseException
    kind: FailureKind
    incarnation: int
    reply: Reply[Recovered]
    #: the engine fails with this failure (the supervisor will not restart the executor): end
    #: every sequence with :class:`~stoic.errors.EngineFailed` for this reason instead
    final: str | None = None
    #: the same, but only if the failure is charged to the engine (counted, it exceeds the
    #: restart intensity); one charged to a suspect (``Recovered.charged``) recovers
    final_if_charged: str | None = None
    #: the KV cache outlives the failure (its pools outlive the worker, and the failure kind
    #: cannot have corrupted them): the block tables and the prefix cache stay, and the
    #: sequences resume from the positions completed steps committed
    keep_kv: bool = False


@dataclass(frozen=True, slots=True)
class ExecutorReady:
    """Executor incarnation ``incarnation`` holds its KV cache; steps go to ``executor``."""

    incarnation: int
    executor: ActorRef[ExecutorMsg]


@dataclass(frozen=True, slots=True)
class EngineFailedNotice:
    """The engine is failed for good: end every sequence, refuse new ones."""

    reason: str


@dataclass(frozen=True, slots=True)
class Drain:
    """Stop admitting; reply once every sequence has ended (or ``deadline`` passed: fail the rest)."""

    timeout: float
    reply: Reply[int]


@dataclass(frozen=True, slots=True)
class DrainDeadline:
    """The scheduler's own timer: the drain's deadline passed; end what still runs."""


SchedulerMsg = (
    AddSequence
    | Abort
    | StepResult
    | StepTimeout
    | ExecutorDown
    | ExecutorReady
    | EngineFailedNotice
    | Drain
    | DrainDeadline
)


# ---- Cache manager -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class DropAll:
    """Release the KV tensors (the executor failed; the scheduler's core forgot every block).
    Replies whether this actor held them (False when they live in the executor's worker
    process, which drops its own)."""

    reply: Reply[bool]


@dataclass(frozen=True, slots=True)
class KVLease:
    """The cache manager's answer to :class:`AcquireKV`."""

    #: the KV tensors (re-created after a DropAll); None when they live in the executor's
    #: worker process
    kv: PagedKVCache | None
    #: the cache's contents were dropped since the last lease (or this is the first): a worker
    #: whose pools outlive it must not serve on from them. False after a failure the recovery
    #: kept the cache through (no DropAll): the block tables still say what each block holds
    dropped: bool


@dataclass(frozen=True, slots=True)
class AcquireKV:
    """The executor asks for the KV tensors: a :class:`KVLease`."""

    reply: Reply[KVLease]


CacheMsg = DropAll | AcquireKV


# ---- Executor ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RunStep:
    step_id: int
    incarnation: int
    batch: StepBatch
    #: a fault rehearsal's ``match`` spec that fires on this step (decided by the scheduler,
    #: which knows the prompts); other faults the executor decides itself
    fault: FaultSpec | None = None


@dataclass(frozen=True, slots=True)
class WorkerExited:
    """The executor's worker process ``pid`` is gone (the process executor)."""

    pid: int


ExecutorMsg = RunStep | WorkerExited
