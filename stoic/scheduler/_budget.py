"""The step budget in force: halved after an out-of-memory failure, doubled back after clean steps."""

from __future__ import annotations

__all__ = ["CLEAN_STEPS_PER_DOUBLING", "StepBudget"]

#: clean steps (no executor failure) after which a backed-off budget doubles toward the configured
CLEAN_STEPS_PER_DOUBLING = 64


class StepBudget:
    """Tokens per step and sequences running at once, as configured or backed off.

    An out-of-memory failure in the forward pass means the step asked for more activation memory
    than the device had: the same batch would fail again. :meth:`out_of_memory` halves both
    limits (never below one block of tokens and one sequence); every
    :data:`CLEAN_STEPS_PER_DOUBLING` clean steps double them back, up to the configured values.
    Both methods return True when the limits changed (the scheduler logs each change).
    """

    __slots__ = ("_clean", "max_batched_tokens", "max_seqs", "min_batched_tokens", "seqs", "tokens")

    def __init__(self, max_batched_tokens: int, max_seqs: int, min_batched_tokens: int) -> None:
        self.max_batched_tokens = max_batched_tokens
        self.max_seqs = max_seqs
        self.min_batched_tokens = min(min_batched_tokens, max_batched_tokens)
        #: the limits in force
        self.tokens = max_batched_tokens
        self.seqs = max_seqs
        self._clean = 0

    @property
    def backed_off(self) -> bool:
        return self.tokens < self.max_batched_tokens or self.seqs < self.max_seqs

    def out_of_memory(self) -> bool:
        """Halve the limits (floors: ``min_batched_tokens`` tokens, one sequence)."""
        self._clean = 0
        tokens, seqs = max(self.min_batched_tokens, self.tokens // 2), max(1, self.seqs // 2)
        changed = (tokens, seqs) != (self.tokens, self.seqs)
        self.tokens, self.seqs = tokens, seqs
        return changed

    def clean_step(self) -> bool:
        """Count a step that completed; double the limits back after enough of them."""
        if not self.backed_off:
            return False
        self._clean += 1
        if self._clean < CLEAN_STEPS_PER_DOUBLING:
            return False
        self._clean = 0
        self.tokens = min(self.max_batched_tokens, self.tokens * 2)
        self.seqs = min(self.max_seqs, self.seqs * 2)
        return True
