"""Which decoding sequences get drafts to verify, and how many (speculative decoding by prompt
lookup, ``--speculative``).

A decode step reads every weight for one token a sequence; verifying ``k`` proposed tokens in
the same step costs about the same reads when the step is bandwidth-bound (few sequences), and
each draft the model agrees with is a token gained. :class:`DraftPolicy` proposes (from each
sequence's :class:`~stoic.scheduler._ngram.NgramIndex`) where that pays:

* ``off``: never; ``ngram``: for every eligible sequence; ``auto``: only while at most
  :data:`AUTO_MAX_BATCH` sequences run (more and the step is compute-bound on a CPU: the drafts'
  rows cost what they may save);
* a sequence whose drafts were all refused waits 1, 2, 4 ... (at most :data:`MAX_PAUSE`) of its
  decode steps before its next draft, and starts over once a draft is kept;
* never past ``max_tokens`` or the step's token budget, and a step's decodes with their drafts
  stay within :data:`MAX_STEP_ROWS` tokens (the oldest sequences' drafts first). A request with
  stop strings drafts too (the core detokenises its kept drafts one at a time and drops those
  after the token that completes a stop string), and so does a constrained one (the runner
  masks each row by the grammar's state after the drafts before it; a draft the grammar
  refuses is never kept).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..config import SPECULATIVE_AUTO_BATCH, Speculative
from ._ngram import NgramIndex

if TYPE_CHECKING:
    from ._sequence import Seq

__all__ = ["AUTO_MAX_BATCH", "MAX_PAUSE", "MAX_STEP_ROWS", "DraftPolicy", "SeqDrafts"]

#: ``auto`` drafts while at most this many sequences run (:data:`stoic.config.SPECULATIVE_AUTO_BATCH`)
AUTO_MAX_BATCH = SPECULATIVE_AUTO_BATCH
#: the most tokens a decode step with drafts carries (its decodes and their drafts): the steps
#: the quantised kernels' C layers take whole, with every product on the int8 tiles whose rows
#: are each bitwise a one-row product (:data:`stoic.gguf.DENSE_KERNEL_ROWS`; the scheduler is
#: pure and does not import the model). A bigger step takes the many-row products (bfloat16 /
#: batched int8): slower for few rows (a 1.5B model, 5 rows: 92 ms on the tiles against 102 ms
#: for 9 rows on the dense path) and not a decode's numbers, so its drafts would change greedy
#: text in the fast dtype. 1 sequence: k drafts; 2: up to 3 each; 4: one each.
MAX_STEP_ROWS = 8
#: the longest pause, in its own decode steps, of a sequence whose drafts keep being refused
MAX_PAUSE = 16


@dataclass
class SeqDrafts:
    """One sequence's drafting state."""

    index: NgramIndex = field(default_factory=NgramIndex)
    #: decode steps to skip before the next draft
    pause: int = 0
    #: drafts refused whole in a row
    misses: int = 0


@dataclass
class DraftPolicy:
    mode: Speculative = "off"
    #: the most drafts a sequence verifies in one step (``--num-speculative-tokens``)
    k: int = 4
    #: drafts proposed and kept so far (the counters of ``stoic_spec_*``)
    proposed: int = 0
    accepted: int = 0

    def drafts(self, seq: Seq, running: int, budget: int) -> tuple[int, ...]:
        """The tokens to verify after ``seq``'s next one (``()``: a plain decode), with
        ``running`` sequences in the engine and ``budget`` tokens left in the step."""
        if self.mode == "off" or (self.mode == "auto" and running > AUTO_MAX_BATCH):
            return ()
        room = min(self.k, seq.max_tokens - seq.num_generated - 1, budget - 1)
        if room < 1:
            return ()
        state = seq.drafts
        if state is None:
            state = seq.drafts = SeqDrafts()
        if state.pause:
            state.pause -= 1
            return ()
        # a sequence's tokens only grow; a stale proposal would cost a refused draft, never a
        # wrong token (drafts are verified)
        state.index.extend(seq.all_ids[len(state.index) :])
        return state.index.propose(room)

    def settle(self, seq: Seq, proposed: int, kept: int) -> None:
        """Count a verified step's ``proposed`` drafts and the ``kept`` ones; pause a sequence
        whose drafts were all refused."""
        self.proposed += proposed
        self.accepted += kept
        state = seq.drafts
        if state is None or not proposed:
            return
        if kept:
            state.misses = 0
        else:
            state.misses += 1
            state.pause = min(MAX_PAUSE, 2 ** (state.misses - 1))
