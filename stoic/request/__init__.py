"""What travels between the front end, the scheduler and the worker, as plain values: the
request, its sampling parameters and output constraints, a step's batch and its output, and the
text side of a tokenizer (prompt tokenisation, incremental detokenising, stop strings).

No torch here (an import contract in pyproject.toml holds it): the scheduler plans with these
types, and a front end that holds no model (the Ray ingress) decodes with them.
"""

from ._batch import SampledToken, SeqChunk, StepBatch, StepOutput
from ._chat import apply_chat_template
from ._grammar import (
    Constraint,
    ConstraintKind,
    Grammar,
    GrammarBackend,
    GrammarMatcher,
    GrammarVocab,
)
from ._params import SamplingParams
from ._request import MAX_TENANT_LEN, Request
from ._text import Detokenizer, StopStrings, TokenCodec

__all__ = [
    "MAX_TENANT_LEN",
    "Constraint",
    "ConstraintKind",
    "Detokenizer",
    "Grammar",
    "GrammarBackend",
    "GrammarMatcher",
    "GrammarVocab",
    "Request",
    "SampledToken",
    "SamplingParams",
    "SeqChunk",
    "StepBatch",
    "StepOutput",
    "StopStrings",
    "TokenCodec",
    "apply_chat_template",
]
