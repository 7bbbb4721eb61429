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
* never past ``max_tokens`` or the step's token budget; not for a constrained request (a
  grammar's masks would be needed per row) or one with stop strings (a stop string inside the
  accepted tokens would end the text where a token-by-token run ends the tokens too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..config import Speculative
from ._ngram import NgramIndex

if TYPE_CHECKING:
    from ._sequence import Seq

__all__ = ["AUTO_MAX_BATCH", "MAX_PAUSE", "DraftPolicy", "SeqDrafts"]

#: ``auto`` drafts while at most this many sequences run
AUTO_MAX_BATCH = 4
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
        params = seq.params
        if params.constraint is not None or params.stop:
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
