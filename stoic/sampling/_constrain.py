"""The executor's side of structured outputs: one grammar matcher per constrained sequence, the
allowed-token masks of a step, and the matchers' advance by the sampled tokens.

A matcher is kept by sequence id and checked against the tokens the chunk says the sequence has
generated (``SeqChunk.output_ids``) before every use: on first sight (a new sequence, or a new
executor after a restart), or when the counts differ (a step whose result was discarded), it is
rolled back to the common prefix and replays the rest. So the state survives preemption and
executor restarts without the scheduler knowing it exists. Matchers of sequences no longer seen
leave a bounded least-recently-used table.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from ..request import GrammarBackend, GrammarMatcher, SampledToken, SeqChunk

__all__ = ["GrammarStates", "apply_bitmask", "finite_logprobs"]

#: what a disallowed token's logprob (-inf under the mask) is reported as (vLLM's convention;
#: JSON has no infinity)
MIN_LOGPROB = -9999.0

#: matchers kept (a sequence not stepped for this many others' first sights replays on return)
_CAPACITY = 1024


class GrammarStates:
    """Matchers of the constrained sequences, keyed by sequence id. One thread at a time."""

    def __init__(self, backend: GrammarBackend, capacity: int = _CAPACITY) -> None:
        self.backend = backend
        self._capacity = capacity
        self._matchers: OrderedDict[int, GrammarMatcher] = OrderedDict()

    def __len__(self) -> int:
        return len(self._matchers)

    def matcher(self, chunk: SeqChunk) -> GrammarMatcher:
        """``chunk``'s sequence's matcher, brought in line with ``chunk.output_ids``.

        :raises ~stoic.errors.InvalidRequest: if the constraint does not compile (the intake
            compiled it already, so only a backend bug gets here).
        """
        constraint = chunk.params.constraint
        assert constraint is not None
        m = self._matchers.get(chunk.seq_id)
        if m is None:
            m = self.backend.compile(constraint).matcher()
            self._matchers[chunk.seq_id] = m
            while len(self._matchers) > self._capacity:
                self._matchers.popitem(last=False)
        else:
            self._matchers.move_to_end(chunk.seq_id)
        have, want = m.tokens, chunk.output_ids
        common = 0
        limit = min(len(have), len(want))
        while common < limit and have[common] == want[common]:
            common += 1
        if common < len(have):
            m.rollback(len(have) - common)
        for t in want[common:]:
            m.accept(t)
        return m

    def bitmask(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        """The allowed tokens of each of ``chunks`` (all constrained) as an int32 bitmask,
        ``[len(chunks), ceil(n_vocab / 32)]``, on the CPU.

        Runs in the grammar thread while the forward pass runs, so it uses no torch operator:
        numpy works on one thread, where a torch operator here would start a second OpenMP
        team competing with the forward's for the same cores (on a small machine, a step
        several times slower).
        """
        words = -(-self.backend.n_vocab // 32)
        buf = np.zeros((sum(c.drafts + 1 for c in chunks), words), dtype=np.int32)
        out = torch.from_numpy(buf)  # shares the memory; no operator runs
        if not any(c.drafts for c in chunks):
            self.backend.fill_masks([self.matcher(c) for c in chunks], out)
        else:
            row = 0
            for c in chunks:
                row = self._draft_masks(c, out, row)
        empty = ~buf.any(axis=1)
        if empty.any():  # a matcher in an error state: only the end is left
            bits = buf.view(np.uint32)
            for t in self.backend.eos_token_ids:
                bits[empty, t // 32] |= np.uint32(1 << (t % 32))
        return out

    def _draft_masks(self, chunk: SeqChunk, out: torch.Tensor, row: int) -> int:
        """Fill ``chunk``'s ``drafts + 1`` rows of ``out`` from ``row`` on: the mask after its
        output, then after each of its drafts in turn; return the row after them. A draft the
        grammar does not allow (its bit clear in the row before) leaves the rows after it that
        row's mask: they are never kept (the token sampled under that mask is never the refused
        draft, so :meth:`SeqChunk.kept` stops there). The matcher ends where it began."""
        m = self.matcher(chunk)
        bits = out.numpy()  # the same memory (no torch operator in the grammar thread)
        proposed = chunk.token_ids[len(chunk.token_ids) - chunk.drafts :]
        taken = 0
        for i in range(chunk.drafts + 1):
            if taken < i:  # an earlier draft was refused: any mask will do
                bits[row + i] = bits[row + i - 1]
                continue
            self.backend.fill_masks([m], out[row + i : row + i + 1])
            if i < chunk.drafts:
                d = proposed[i]
                allowed = (int(bits[row + i, d // 32]) >> (d % 32)) & 1
                if allowed and m.accept(d):
                    taken += 1
                elif allowed:  # accepted by the mask, refused by the matcher: undo it
                    m.rollback(1)
        m.rollback(taken)
        return row + chunk.drafts + 1

    def advance(
        self, chunks: Sequence[SeqChunk], token_ids: Sequence[Sequence[int]]
    ) -> list[int | None]:
        """Accept each chunk's tokens of this step (the sampled one, then those kept after it:
        ``StepOutput.accepted``); per chunk the index of the token that completes the grammar
        (nothing but the end may follow: the sequence ends there, even with ``ignore_eos``), or
        None. Tokens after that one are not accepted (the sequence keeps none of them)."""
        done: list[int | None] = []
        for chunk, tokens in zip(chunks, token_ids, strict=True):
            m = self._matchers.get(chunk.seq_id)
            if m is None or len(m.tokens) != len(chunk.output_ids):
                done.append(None)  # evicted meanwhile: the next step replays
                continue
            complete = None
            for i, t in enumerate(tokens):
                m.accept(t)
                if m.is_finished:
                    complete = i
                    break
            done.append(complete)
        return done

    def drop(self, seq_id: int) -> None:
        self._matchers.pop(seq_id, None)


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` with the tokens that ``bitmask`` (rows aligned with ``rows``) does not allow set
    to ``-inf`` in rows ``rows``; columns past the mask's width are disallowed too."""
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().reshape(len(rows), -1)
    if allowed.shape[1] < vocab:
        pad = torch.zeros((len(rows), vocab - allowed.shape[1]), dtype=torch.bool)
        allowed = torch.cat([allowed, pad], dim=1)
    allowed = allowed[:, :vocab].to(logits.device)
    index = torch.tensor(rows, device=logits.device)
    out = logits.clone()
    out[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return out


def finite_logprobs(token: SampledToken) -> SampledToken:
    """``token`` with its logprobs (from masked logits) no lower than :data:`MIN_LOGPROB`."""
    if token.logprob is None:
        return token
    return dataclasses.replace(
        token,
        logprob=max(token.logprob, MIN_LOGPROB),
        top_logprobs=tuple((t, max(lp, MIN_LOGPROB)) for t, lp in token.top_logprobs),
    )
