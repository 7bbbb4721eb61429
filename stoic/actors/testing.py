"""Test kit for the engine's actors: drive the scheduler's core without a model.

* :func:`byte_tokenizer` -- a real ``tokenizers.Tokenizer`` with one token per byte (ids 0-255)
  and an ``<eos>`` token (id 256), built in memory;
* :func:`create_scheduler` -- a :class:`SchedulerHarness`: a
  :class:`~stoic.scheduler.SchedulerCore` (with its real
  :class:`~stoic.scheduler.BlockAllocator`) and real result streams, driven step by step the
  way the scheduler actor drives it, with fabricated step outputs.

    harness = create_scheduler(num_blocks=16, block_size=4)
    stream = harness.add("hello", max_tokens=5)
    harness.run_until_idle()
    harness.check()   # allocator invariant, nothing leaked
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from ..config import Speculative
from ..errors import StoicError
from ..request import SampledToken, SamplingParams, SeqChunk, StepBatch, StepOutput
from ..scheduler import (
    BlockAllocator,
    Recovered,
    SchedulerConfig,
    SchedulerCore,
    Step,
    TenantPolicy,
)
from ._stream import ResultStream

__all__ = [
    "EOS_ID",
    "SchedulerHarness",
    "byte_tokenizer",
    "create_scheduler",
    "drain",
    "next_letter",
]

#: the ``<eos>`` token of :func:`byte_tokenizer`
EOS_ID = 256


def byte_tokenizer() -> Tokenizer:
    """A byte-level tokenizer: token ``i < 256`` is byte ``i``; ``<eos>`` is :data:`EOS_ID`."""
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    vocab["<eos>"] = EOS_ID
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the rest are shifted
    past 255 in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), ord("\u00ff") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


def drain(stream: ResultStream) -> tuple[str, str | None, BaseException | None]:
    """Everything an ended stream delivered: its text, finish reason and error.

    Synchronous, without an event loop (the core's tests have none): reading an ended stream
    never waits.

    :raises AssertionError: if the stream has not ended (reading it would wait).
    """

    async def read() -> tuple[str, str | None, BaseException | None]:
        text, finish = "", None
        try:
            async for delta in stream:
                text += delta.text
                finish = delta.finish_reason or finish
        except StoicError as exc:
            return text, finish, exc
        return text, finish, None

    coro = read()
    try:
        coro.send(None)
    except StopIteration as done:
        result: tuple[str, str | None, BaseException | None] = done.value
        return result
    coro.close()
    raise AssertionError(f"{stream.request_id}: the stream has not ended")


def next_letter(chunk: SeqChunk) -> int:
    """A fabricated sample: the letter after the chunk's last token's position, ``a`` to ``z``."""
    return ord("a") + (chunk.start_pos + len(chunk.token_ids)) % 26


class SchedulerHarness:
    """A :class:`SchedulerCore` driven synchronously.

    :meth:`start_step` plans and starts a step (the core looks prefixes up and allocates on its
    own allocator, as in the actor); :meth:`finish_step` completes it with fabricated samples
    and emits the deltas.
    """

    def __init__(self, core: SchedulerCore, tokenizer: Any) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.incarnation = 0
        self.core.executor_ready(0)
        #: every stream added, in order
        self.streams: list[ResultStream] = []
        #: every batch started, in order
        self.batches: list[StepBatch] = []
        self.inflight: Step | None = None
        self._next_id = 0

    @property
    def allocator(self) -> BlockAllocator:
        """The core's block allocator (the KV cache's logical side)."""
        return self.core.allocator

    def add(
        self,
        prompt: str | list[int],
        max_tokens: int = 8,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        generated: tuple[int, ...] = (),
        tenant: str = "",
        priority: int = 0,
        timeout: float | None = None,
    ) -> ResultStream:
        """Admit a request (text is encoded with the harness's tokenizer), continuing after
        ``generated`` when given, for ``tenant`` with ``priority`` and ``timeout``."""
        ids = self.tokenizer.encode(prompt).ids if isinstance(prompt, str) else list(prompt)
        rid = request_id or f"req-{self._next_id}"
        self._next_id += 1
        stream = ResultStream(rid, len(ids))
        self.streams.append(stream)
        params = params or SamplingParams(max_tokens=max_tokens)
        self.core.add(
            rid,
            tuple(ids),
            params,
            max_tokens,
            stream,
            generated,
            tenant=tenant,
            priority=priority,
            timeout=timeout,
        )
        return stream

    def start_step(self) -> StepBatch | None:
        """Plan and start a step unless one is in flight (None if none can or need run)."""
        if self.inflight is None:
            step = self.core.schedule()
            if step is not None:
                self.inflight = step
                self.batches.append(step.batch)
        return self.inflight.batch if self.inflight is not None else None

    def output_for(
        self, batch: StepBatch, sample: Callable[[SeqChunk], int] = next_letter
    ) -> StepOutput:
        """A fabricated output: ``sample(chunk)`` for each chunk that samples (each row of a
        chunk with drafts, the drafts kept as the engine keeps them)."""
        sampled, accepted = {}, {}
        for chunk in batch.chunks:
            if chunk.sample:
                rows = [SampledToken(sample(row)) for row in chunk.draft_rows()]
                sampled[chunk.seq_id] = rows[0]
                if chunk.drafts:
                    accepted[chunk.seq_id] = chunk.kept(rows)
        return StepOutput(sampled, accepted=accepted)

    def finish_step(self, sample: Callable[[SeqChunk], int] = next_letter) -> bool:
        """Complete the step in flight with fabricated samples and emit; False if none was."""
        if self.inflight is None:
            return False
        step_id, incarnation, batch = self.inflight
        self.inflight = None
        touched = self.core.complete(step_id, incarnation, self.output_for(batch, sample))
        assert touched is not None, "the harness's own step was fenced"
        self.core.emit(touched)
        return True

    def step(self, sample: Callable[[SeqChunk], int] = next_letter) -> StepBatch | None:
        """Start a step and finish it."""
        batch = self.start_step()
        self.finish_step(sample)
        return batch

    def run_until_idle(
        self, max_steps: int = 10_000, sample: Callable[[SeqChunk], int] = next_letter
    ) -> int:
        """Step until nothing is waiting or running; returns the steps run.

        :raises AssertionError: if work remains but no step can start, or after ``max_steps``.
        """
        for n in range(max_steps):
            if self.core.idle:
                return n
            assert self.step(sample) is not None, "work remains but no step could start"
        raise AssertionError(f"not idle after {max_steps} steps")

    def executor_down(
        self,
        error: BaseException | None = None,
        kind: Any = "error",
        *,
        final_if_charged: str | None = None,
        keep_kv: bool = False,
    ) -> Recovered:
        """What recovery does: fence, drop the cache (or keep it: ``keep_kv``), fail (or
        resume) every sequence, restart. Call it while a step is in flight (:meth:`start_step`)
        to fail that step. With ``final_if_charged``, a failure charged to the engine fails it
        (the supervisor's last)."""
        count = self.core.executor_down(
            error or RuntimeError("injected"),
            kind,
            final_if_charged=final_if_charged,
            keep_kv=keep_kv,
        )
        self.inflight = None
        self.incarnation += 1
        self.core.executor_ready(self.incarnation)
        return count

    def held_blocks(self) -> set[int]:
        """Blocks in the block tables of the sequences the core knows."""
        return {b for seq in (*self.core.running, *self.core.waiting) for b in seq.block_table}

    def check(self) -> None:
        """Assert the invariants that hold between calls.

        The allocator's own invariant; the blocks in use are exactly those in the core's block
        tables, each sequence's table the allocator's (nothing leaked, nothing shared that is not
        recorded); a waiting sequence holds no blocks; a stream is open exactly while its
        sequence is known to the core.
        """
        self.allocator.check_invariant()
        held = self.held_blocks()
        assert self.allocator.used_blocks == len(held), (
            f"allocator uses {self.allocator.used_blocks} blocks, tables hold {len(held)}"
        )
        for seq in (*self.core.running, *self.core.waiting):
            assert seq.block_table == self.allocator.table(seq.seq_id), seq.request_id
        assert not any(seq.block_table for seq in self.core.waiting), (
            "a waiting sequence holds blocks"
        )
        known = {s.request_id for s in (*self.core.running, *self.core.waiting)}
        for stream in self.streams:
            assert stream.done != (stream.request_id in known), (
                f"{stream.request_id}: done={stream.done}, known={stream.request_id in known}"
            )


def create_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 32,
    prefix_caching: bool = True,
    eos_token_ids: frozenset[int] = frozenset({EOS_ID}),
    recovery: Literal["fail", "resume"] = "fail",
    max_resumes: int = 3,
    tenants: TenantPolicy | None = None,
    clock: Callable[[], float] = time.monotonic,
    speculative: Speculative = "off",
    num_speculative_tokens: int = 4,
) -> SchedulerHarness:
    """A :class:`SchedulerHarness` over a fresh core with the byte tokenizer (``clock``: the
    core's, for deadlines and step durations)."""
    tokenizer = byte_tokenizer()
    core = SchedulerCore(
        SchedulerConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            eos_token_ids=eos_token_ids,
            prefix_caching=prefix_caching,
            recovery=recovery,
            max_resumes=max_resumes,
            tenants=tenants or TenantPolicy(),
            speculative=speculative,
            num_speculative_tokens=num_speculative_tokens,
        ),
        tokenizer,
        clock,
    )
    return SchedulerHarness(core, tokenizer)
