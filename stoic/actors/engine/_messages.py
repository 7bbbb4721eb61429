"""The engine actors' messages: frozen dataclasses, one union type per actor's mailbox."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...model import SamplingParams, StepBatch, StepOutput
from .. import Reply

if TYPE_CHECKING:
    from ...model import PagedKVCache
    from ._stream import ResultStream

__all__ = [
    "Abort",
    "AcquireKV",
    "AddSequence",
    "AllocateBlocks",
    "Allocation",
    "CacheMsg",
    "CacheStats",
    "CommitBlocks",
    "Drain",
    "DropAll",
    "EngineFailedNotice",
    "ExecutorDown",
    "ExecutorMsg",
    "ExecutorReady",
    "FreeBlocks",
    "GetCacheStats",
    "IntakeMsg",
    "RunStep",
    "SchedulerMsg",
    "SchedulerStats",
    "StepResult",
    "StepTimeout",
    "Submit",
]


# ---- Intake --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Submit:
    """Validate, template, tokenise and admit one request; reply with its stream or a typed error."""

    request_id: str
    prompt: str | tuple[int, ...] | None
    messages: tuple[dict[str, Any], ...] | None
    params: SamplingParams
    chat_template_kwargs: dict[str, Any] | None
    reply: Reply[ResultStream]


IntakeMsg = Submit


# ---- Scheduler -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AddSequence:
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    max_tokens: int
    stream: ResultStream


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
    """The watchdog: step ``step_id`` outlived the step timeout."""

    step_id: int


@dataclass(frozen=True, slots=True)
class ExecutorDown:
    """Recovery step: fence ``incarnation`` and end every sequence with ``error``.

    Replies with the number of sequences failed.
    """

    error: BaseException
    kind: str
    incarnation: int
    reply: Reply[int]


@dataclass(frozen=True, slots=True)
class ExecutorReady:
    incarnation: int


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
class SchedulerStats:
    running: int
    waiting: int
    steps: int
    preemptions: int
    fenced_results: int
    failed_sequences: int
    #: sequences in the last step
    last_batch_size: int
    #: most sequences seen in one step so far
    max_batch_size: int
    prompt_tokens: int
    generated_tokens: int
    #: prompt tokens whose keys/values came from the prefix cache instead of being computed
    prefix_cached_tokens: int = 0


SchedulerMsg = (
    AddSequence
    | Abort
    | StepResult
    | StepTimeout
    | ExecutorDown
    | ExecutorReady
    | EngineFailedNotice
    | Drain
)


# ---- Cache manager -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Allocation:
    #: every grown sequence's full block table
    tables: dict[int, tuple[int, ...]]
    free_blocks: int
    #: blocks granted for the first time since the tensors were (re)created
    fresh_blocks: tuple[int, ...] = ()
    #: per sequence that asked with a prefix: how many leading blocks it shares from the cache
    cached_blocks: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class AllocateBlocks:
    """Grow each ``(seq_id, total_blocks)`` table to that size; all-or-nothing. Replies
    :class:`Allocation` (or fails with ``OutOfBlocks``, allocating nothing).

    ``prefixes``: ``(seq_id, block_hashes)`` of sequences with no blocks yet; each first takes the
    cached blocks of its longest cached prefix (prefix caching), then grows.
    """

    grants: tuple[tuple[int, int], ...]
    reply: Reply[Allocation]
    prefixes: tuple[tuple[int, tuple[bytes, ...]], ...] = ()


@dataclass(frozen=True, slots=True)
class CommitBlocks:
    """``(seq_id, first_block_index, block_hashes)``: those blocks are full and written by a
    completed step; cache them for reuse by later sequences with the same prefix."""

    entries: tuple[tuple[int, int, tuple[bytes, ...]], ...]


@dataclass(frozen=True, slots=True)
class FreeBlocks:
    seq_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class DropAll:
    """Free every block and release the KV tensors. Replies with the number of blocks freed."""

    reply: Reply[int]


@dataclass(frozen=True, slots=True)
class AcquireKV:
    """The executor asks for the KV tensors (re-created after a DropAll)."""

    reply: Reply[PagedKVCache]


@dataclass(frozen=True, slots=True)
class CacheStats:
    blocks_total: int
    blocks_used: int
    block_size: int
    sequences: int
    tensors_allocated: bool
    drops: int
    #: blocks held by the prefix cache (in use or evictable)
    cached_blocks: int = 0
    #: cached blocks handed out again because no block was free
    evictions: int = 0

    @property
    def usage(self) -> float:
        return self.blocks_used / self.blocks_total if self.blocks_total else 0.0


@dataclass(frozen=True, slots=True)
class GetCacheStats:
    reply: Reply[CacheStats]


CacheMsg = AllocateBlocks | CommitBlocks | FreeBlocks | DropAll | AcquireKV | GetCacheStats


# ---- Executor ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RunStep:
    step_id: int
    incarnation: int
    batch: StepBatch


ExecutorMsg = RunStep
