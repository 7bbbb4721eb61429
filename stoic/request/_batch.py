"""What one engine step asks of the model, and what it gives back."""

from __future__ import annotations

from dataclasses import dataclass

from ._params import SamplingParams

__all__ = ["SampledToken", "SeqChunk", "StepBatch", "StepOutput"]


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """The tokens of one sequence fed in one step (a prefill chunk or one decode token)."""

    seq_id: int
    token_ids: tuple[int, ...]
    #: position of ``token_ids[0]`` in the sequence
    start_pos: int
    #: the sequence's blocks, covering at least ``start_pos + len(token_ids)`` positions
    block_table: tuple[int, ...]
    #: sample a token after this chunk (the last prompt chunk, or a decode token)
    sample: bool
    params: SamplingParams
    #: tokens generated so far (for ``min_tokens`` and the per-token seed)
    num_generated: int = 0
    #: the tokens generated so far: given only to a sampling chunk whose params need them (a
    #: penalty on, :attr:`SamplingParams.counts_output`, or a constraint, whose grammar state is
    #: rebuilt from them wherever it is missing or stale), else empty
    output_ids: tuple[int, ...] = ()
    #: the prompt's tokens, given only with ``repetition_penalty`` on, else empty
    prompt_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class StepBatch:
    """One batched forward: every chunk packed into one row."""

    chunks: tuple[SeqChunk, ...]
    #: blocks handed out for the first time since the cache was (re)created: zeroed before use,
    #: so masked-out positions never hold uninitialised memory (the pools are allocated empty)
    zero_blocks: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@dataclass(frozen=True, slots=True)
class SampledToken:
    token_id: int
    #: log-probability of the chosen token (when logprobs were asked for)
    logprob: float | None = None
    #: most likely alternatives ``(token_id, logprob)``, best first
    top_logprobs: tuple[tuple[int, float], ...] = ()
    #: the sequence's constraint is complete with this token: nothing but the end may follow,
    #: so the sequence ends here (finish reason ``stop``)
    grammar_complete: bool = False


@dataclass(frozen=True, slots=True)
class StepOutput:
    """Sampled tokens of the chunks that asked for one, keyed by ``seq_id``."""

    sampled: dict[int, SampledToken]
    #: the compute threads the step ran on (:class:`~stoic.worker.ThreadGovernor`; 0: unknown)
    threads: int = 0
