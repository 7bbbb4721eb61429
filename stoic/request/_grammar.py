"""Structured outputs: what a request constrains its output to, and the interface of a grammar
backend (compile a constraint once; per sequence a matcher that gives the allowed tokens of the
next step, accepts a token, rolls back).

The one backend is llguidance (:mod:`stoic.sampling._llguidance`); another (xgrammar) would
implement :class:`GrammarBackend`, :class:`Grammar` and :class:`GrammarMatcher`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:  # an annotation only: the request side imports no torch
    import torch

__all__ = [
    "Constraint",
    "ConstraintKind",
    "Grammar",
    "GrammarBackend",
    "GrammarMatcher",
    "GrammarVocab",
]

#: ``json_schema``: ``text`` is a JSON Schema (JSON text); ``json_object``: any JSON object
#: (``text`` is ignored); ``regex``: a regular expression (Rust ``regex`` syntax); ``choice``:
#: ``text`` is a JSON list of strings, the output is exactly one of them; ``grammar``: a Lark
#: grammar or a GBNF grammar (llama.cpp's, told apart by ``::=``)
ConstraintKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a sequence's output must match. Hashable: compiled grammars are cached by it."""

    kind: ConstraintKind
    text: str
    #: the request field it came from, named in the 400 when it does not compile
    param: str = "response_format"


@dataclass(frozen=True, slots=True)
class GrammarVocab:
    """What a backend needs of the tokenizer, as plain values (it crosses the process boundary
    to the executor's worker)."""

    #: the Hugging Face fast tokenizer serialised (``tokenizer.json``)
    tokenizer_json: str
    #: width of the logits (may exceed the tokenizer's vocabulary: padded embeddings)
    n_vocab: int
    #: the tokens that end generation
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_tokenizer(
        cls, tokenizer: Any, n_vocab: int, eos_token_ids: frozenset[int]
    ) -> GrammarVocab:
        """:raises TypeError: if ``tokenizer`` is not a fast (``tokenizers``-backed) tokenizer."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise TypeError("structured outputs need a fast tokenizer")
        return cls(backend.to_str(), max(n_vocab, len(tokenizer)), tuple(sorted(eos_token_ids)))


class GrammarMatcher(Protocol):
    """One sequence's position in a grammar. Not thread-safe: one owner at a time."""

    @property
    def tokens(self) -> list[int]:
        """The tokens accepted so far (the sequence's generated tokens)."""
        ...

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False if the grammar does not allow it (the matcher is then in
        an error state and :meth:`fill_mask` allows only the end)."""
        ...

    def rollback(self, n: int) -> None:
        """Forget the last ``n`` accepted tokens."""
        ...

    def reset(self) -> None:
        """Back to the start (no token accepted)."""
        ...

    @property
    def is_finished(self) -> bool:
        """Nothing but the end of the sequence may follow (the grammar is complete, or the
        matcher is in an error state)."""
        ...


class Grammar(Protocol):
    """A compiled constraint: makes matchers."""

    def matcher(self) -> GrammarMatcher: ...


class GrammarBackend(Protocol):
    """Compiles constraints (cached) and fills token bitmasks for a batch of matchers."""

    @property
    def n_vocab(self) -> int: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    def compile(self, constraint: Constraint) -> Grammar:
        """:raises ~stoic.errors.InvalidRequest: naming ``constraint.param`` if it does not
        compile (bad JSON Schema, regex, grammar; unsupported feature)."""
        ...

    def fill_masks(self, matchers: list[GrammarMatcher], bitmask: torch.Tensor) -> None:
        """Write matcher ``i``'s allowed tokens into row ``i`` of ``bitmask`` (CPU, int32,
        ``[len(matchers), ceil(n_vocab / 32)]``, bit ``t % 32`` of word ``t // 32`` set when
        token ``t`` is allowed)."""
        ...
