"""What one engine step asks of the model, and what it gives back."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
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
    #: the last ``drafts`` of ``token_ids`` are proposed tokens to verify (speculative
    #: decoding): a token is sampled after each of the last ``drafts + 1`` positions, and the
    #: drafts the model's own tokens agree with are accepted (:attr:`StepOutput.accepted`)
    drafts: int = 0

    def draft_rows(self) -> tuple[SeqChunk, ...]:
        """What samples after each of the last ``drafts + 1`` positions of a chunk with drafts:
        row ``i`` is the chunk up to draft ``i`` (its ``token_ids`` end there, no drafts), as if
        drafts ``1..i`` had been sampled (``num_generated`` and ``output_ids`` count them: the
        seed's position, ``min_tokens``, the penalties). A chunk without drafts: itself."""
        if not self.drafts:
            return (self,)
        own = len(self.token_ids) - self.drafts
        proposed = self.token_ids[own:]
        return tuple(
            dataclasses.replace(
                self,
                token_ids=self.token_ids[: own + i],
                drafts=0,
                num_generated=self.num_generated + i,
                output_ids=(
                    self.output_ids + proposed[:i] if self.params.counts_output else self.output_ids
                ),
            )
            for i in range(self.drafts + 1)
        )

    def kept(self, rows: Sequence[SampledToken]) -> tuple[SampledToken, ...]:
        """The tokens after the first of ``rows`` (sampled by :meth:`draft_rows`, in order) that
        the output keeps: row ``i + 1`` is kept while row ``i``'s token equals draft ``i + 1``
        (the context it was sampled after is then the true one).

        Sampling every row with its own position's randomness and keeping the agreeing prefix
        is the rejection rule for a draft that proposes one token with certainty: draft ``d``
        is kept with probability ``p(d)``, and where it is not, the row's token is drawn from
        ``p`` without ``d``. So kept tokens follow the model's distribution, and a seeded
        request draws exactly the tokens it would draw one step at a time."""
        proposed = self.token_ids[len(self.token_ids) - self.drafts :]
        kept: list[SampledToken] = []
        for draft, token, following in zip(proposed, rows, rows[1:], strict=False):
            if token.token_id != draft:
                break
            kept.append(following)
        return tuple(kept)


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
    #: for a chunk with drafts: the tokens after :attr:`sampled`'s, in order (the drafts the
    #: model agreed with, then its own token where it first disagreed, or after the last)
    accepted: dict[int, tuple[SampledToken, ...]] = dataclasses.field(default_factory=dict)
