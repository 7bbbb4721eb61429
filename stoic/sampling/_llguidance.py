"""The llguidance grammar backend (JSON Schema, regex, choice, Lark and GBNF grammars).

Building llguidance's tokenizer takes about a second, so it is built on first use. Compiling a
constraint builds one matcher and keeps it as a template: a sequence's matcher is a deep copy
of it, so each distinct constraint is compiled once (the cache is bounded, least recently used
first out).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import llguidance
import torch

from ..errors import InvalidRequest
from ..request import Constraint, GrammarMatcher, GrammarVocab

__all__ = ["LLGuidanceBackend"]

#: compiled constraints kept (each holds a built parser; a few hundred KiB at most)
_CACHE_SIZE = 256
#: JSON as compact as OpenAI's: no whitespace between tokens (small models otherwise loop on it)
_JSON_OPTIONS: Any = {"whitespace_flexible": False}


class _Matcher:
    """A :class:`~stoic.request._grammar.GrammarMatcher` over an ``llguidance.LLMatcher``."""

    __slots__ = ("_m", "tokens")

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._m = matcher
        self.tokens: list[int] = []

    def accept(self, token_id: int) -> bool:
        self.tokens.append(token_id)
        return bool(self._m.consume_token(token_id))

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        if not self._m.is_error() and self._m.rollback(n):
            del self.tokens[len(self.tokens) - n :]
            return
        kept = self.tokens[: len(self.tokens) - n]
        self.reset()
        for t in kept:
            self.accept(t)

    def reset(self) -> None:
        self._m.reset()
        self.tokens = []

    @property
    def is_finished(self) -> bool:
        return bool(self._m.is_stopped())

    @property
    def llmatcher(self) -> llguidance.LLMatcher:
        return self._m


class _Grammar:
    __slots__ = ("_template",)

    def __init__(self, template: llguidance.LLMatcher) -> None:
        self._template = template

    def matcher(self) -> GrammarMatcher:
        return _Matcher(self._template.deep_copy())


def grammar_text(constraint: Constraint) -> str:
    """llguidance's grammar definition of ``constraint``.

    :raises InvalidRequest: if the text cannot be read (not JSON where JSON is expected).
    """
    kind, text = constraint.kind, constraint.text
    try:
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                '{"type": "object"}', defaults=_JSON_OPTIONS
            )
        if kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=_JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(text)
        if kind == "choice":
            choices = json.loads(text)
            if (
                not isinstance(choices, list)
                or not choices
                or not all(isinstance(c, str) and c for c in choices)
            ):
                raise InvalidRequest(
                    "choice must be a non-empty list of non-empty strings", param=constraint.param
                )
            return llguidance.grammar_from("choice", choices)  # type: ignore[arg-type]
        return llguidance.grammar_from("grammar" if "::=" in text else "lark", text)
    except InvalidRequest:
        raise
    except ValueError as exc:
        raise InvalidRequest(f"invalid {kind}: {exc}", param=constraint.param) from exc


class LLGuidanceBackend:
    """A :class:`~stoic.request._grammar.GrammarBackend` backed by llguidance. Thread-safe."""

    def __init__(self, vocab: GrammarVocab) -> None:
        self._vocab = vocab
        self._lock = threading.Lock()
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[Constraint, _Grammar] = OrderedDict()
        self._executor: llguidance.LLExecutor | None = None

    @property
    def n_vocab(self) -> int:
        return self._vocab.n_vocab

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._vocab.eos_token_ids

    def _tok(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    self._vocab.tokenizer_json,
                    n_vocab=self._vocab.n_vocab,
                    eos_token=list(self._vocab.eos_token_ids),
                )
                self._executor = llguidance.LLExecutor()
            return self._tokenizer

    def compile(self, constraint: Constraint) -> _Grammar:
        """:raises InvalidRequest: naming ``constraint.param`` if it does not compile."""
        with self._lock:
            cached = self._cache.get(constraint)
            if cached is not None:
                self._cache.move_to_end(constraint)
                return cached
        tokenizer = self._tok()
        text = grammar_text(constraint)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, tokenizer)
        if is_error:
            raise InvalidRequest(
                f"invalid {constraint.kind}: {messages[0] if messages else 'does not compile'}",
                param=constraint.param,
            )
        template = llguidance.LLMatcher(tokenizer, text, log_level=0)
        if template.is_error():
            raise InvalidRequest(
                f"invalid {constraint.kind}: {template.get_error()}", param=constraint.param
            )
        grammar = _Grammar(template)
        with self._lock:
            self._cache[constraint] = grammar
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def fill_masks(self, matchers: list[GrammarMatcher], bitmask: torch.Tensor) -> None:
        assert bitmask.dtype == torch.int32 and bitmask.is_contiguous() and not bitmask.is_cuda
        self._tok()
        assert self._executor is not None
        rows = [(m.llmatcher, i) for i, m in enumerate(matchers) if isinstance(m, _Matcher)]
        assert len(rows) == len(matchers), "matchers of another backend"
        words = bitmask.shape[1]
        self._executor.unsafe_compute_mask_ptr(rows, bitmask.data_ptr(), words * 4, len(matchers))
