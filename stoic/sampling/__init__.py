"""From a step's logits to its tokens: batched sampling (greedy, temperature, top-k/p, min-p,
penalties, logit bias, per-request seeds, logprobs) and structured outputs (the grammar matchers
of a step's constrained sequences, their allowed-token masks, the llguidance backend).

Works on logits tensors and the request's value types; knows no model, file or actor.
"""

from ._constrain import GrammarStates, apply_bitmask, finite_logprobs
from ._llguidance import LLGuidanceBackend
from ._sampler import adjust_logits, sample

__all__ = [
    "GrammarStates",
    "LLGuidanceBackend",
    "adjust_logits",
    "apply_bitmask",
    "finite_logprobs",
    "sample",
]
