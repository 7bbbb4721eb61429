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
        matchers = [self.matcher(c) for c in chunks]
        words = -(-self.backend.n_vocab // 32)
        buf = np.zeros((len(chunks), words), dtype=np.int32)
        out = torch.from_numpy(buf)  # shares the memory; no operator runs
        self.backend.fill_masks(matchers, out)
        empty = ~buf.any(axis=1)
        if empty.any():  # a matcher in an error state: only the end is left
            bits = buf.view(np.uint32)
            for t in self.backend.eos_token_ids:
                bits[empty, t // 32] |= np.uint32(1 << (t % 32))
        return out

    def advance(self, chunks: Sequence[SeqChunk], token_ids: Sequence[int]) -> list[bool]:
        """Accept each chunk's sampled token; True where the sequence's grammar is now complete
        (nothing but the end may follow: the sequence ends, even with ``ignore_eos``)."""
        done = []
        for chunk, t in zip(chunks, token_ids, strict=True):
            m = self._matchers.get(chunk.seq_id)
            if m is None or len(m.tokens) != len(chunk.output_ids):
                done.append(False)  # evicted meanwhile: the next step replays
                continue
            m.accept(t)
            done.append(m.is_finished)
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
