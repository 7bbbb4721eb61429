"""Sampling parameters: what one request asks of the sampler and the stop conditions."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import InvalidRequest
from ._grammar import Constraint

__all__ = ["SamplingParams"]

_MAX_STOP_STRINGS = 16
_MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one sequence and when to stop it.

    Validation happens in :meth:`validate` (called by the engine's intake before admission), so
    a bad value is reported with the offending parameter's name and nothing is admitted.
    """

    #: upper bound on generated tokens; ``None`` means "up to the context length"
    max_tokens: int | None = 16
    #: tokens to generate before EOS or a stop token may end the sequence
    min_tokens: int = 0
    #: 0 means greedy
    temperature: float = 1.0
    top_p: float = 1.0
    #: 0 or -1 disables top-k
    top_k: int = 0
    #: per-request seed for reproducible sampling
    seed: int | None = None
    #: strings that end generation; they are cut from the output
    stop: tuple[str, ...] = ()
    #: token ids that end generation (kept in the token ids, not in the text)
    stop_token_ids: tuple[int, ...] = ()
    #: keep generating past EOS (benchmarks)
    ignore_eos: bool = False
    #: return the chosen token's logprob per token
    logprobs: bool = False
    #: number of most likely alternatives per token (needs ``logprobs``)
    top_logprobs: int = 0
    #: keep special tokens in the detokenised text
    skip_special_tokens: bool = True
    #: OpenAI: subtracted from the logit of every token generated at least once
    presence_penalty: float = 0.0
    #: OpenAI: subtracted from a token's logit once per time it was generated
    frequency_penalty: float = 0.0
    #: vLLM / transformers: logits of tokens seen in the prompt or the output are divided by it
    #: (positive ones) or multiplied by it (negative ones); 1 is off
    repetition_penalty: float = 1.0
    #: drop tokens whose probability is below ``min_p`` times the most likely one's; 0 is off
    min_p: float = 0.0
    #: ``(token id, bias)`` pairs: the bias (in [-100, 100]) is added to that token's logit
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: what the output must match (structured outputs); compiled by the intake at admission
    constraint: Constraint | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def counts_output(self) -> bool:
        """Whether sampling needs the tokens generated so far (a penalty is on)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def ends_at(self, token_id: int, position: int, eos_token_ids: frozenset[int]) -> bool:
        """Whether ``token_id``, generated as the ``position``-th token (counting from 1), ends
        the sequence: one of ``stop_token_ids``, or of the model's ``eos_token_ids`` unless
        ``ignore_eos``, once ``min_tokens`` tokens are generated (the one rule the scheduler
        applies to each sampled token and the intake to a continuation's ``generated``)."""
        return position >= self.min_tokens and token_id in self.stop_ids(eos_token_ids)

    def stop_ids(self, eos_token_ids: frozenset[int]) -> frozenset[int]:
        """The token ids that end this request's output (once ``min_tokens`` are generated):
        ``stop_token_ids``, and the model's ``eos_token_ids`` unless ``ignore_eos``."""
        stops = frozenset(self.stop_token_ids)
        return stops if self.ignore_eos else stops | eos_token_ids

    @property
    def counts_prompt(self) -> bool:
        """Whether sampling needs the prompt's tokens too (``repetition_penalty`` is on)."""
        return self.repetition_penalty != 1.0

    def validate(self, vocab_size: int | None = None) -> None:
        """Check every field's range; with ``vocab_size``, also that ``logit_bias`` names tokens
        of the vocabulary.

        :raises InvalidRequest: naming the first offending parameter.
        """
        if self.max_tokens is not None and (
            isinstance(self.max_tokens, bool)
            or not isinstance(self.max_tokens, int)
            or self.max_tokens < 1
        ):
            raise InvalidRequest("max_tokens must be an integer >= 1", param="max_tokens")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise InvalidRequest("min_tokens must be an integer >= 0", param="min_tokens")
        if self.min_tokens and self.constraint is not None:
            # the grammar may allow nothing but the end before min_tokens: no token would be
            # left to sample; refused rather than produce output that breaks the grammar
            raise InvalidRequest(
                "min_tokens cannot be combined with structured outputs", param="min_tokens"
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequest("min_tokens must not exceed max_tokens", param="min_tokens")
        if not _finite(self.temperature) or not 0.0 <= self.temperature <= 2.0:
            raise InvalidRequest("temperature must be between 0 and 2", param="temperature")
        if not _finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest("top_p must be in (0, 1]", param="top_p")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise InvalidRequest(
                "top_k must be -1, 0 (disabled) or a positive integer", param="top_k"
            )
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise InvalidRequest("seed must be a non-negative 64-bit integer", param="seed")
        if len(self.stop) > _MAX_STOP_STRINGS:
            raise InvalidRequest(f"at most {_MAX_STOP_STRINGS} stop strings", param="stop")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise InvalidRequest("stop strings must be non-empty strings", param="stop")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequest(
                "stop_token_ids must be non-negative integers", param="stop_token_ids"
            )
        if (
            not isinstance(self.top_logprobs, int)
            or not 0 <= self.top_logprobs <= _MAX_TOP_LOGPROBS
        ):
            raise InvalidRequest(
                f"top_logprobs must be between 0 and {_MAX_TOP_LOGPROBS}", param="top_logprobs"
            )
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs", param="top_logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _finite(value) or not -2.0 <= value <= 2.0:
                raise InvalidRequest(f"{name} must be between -2 and 2", param=name)
        if not _finite(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 2.0:
            raise InvalidRequest("repetition_penalty must be in (0, 2]", param="repetition_penalty")
        if not _finite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest("min_p must be between 0 and 1", param="min_p")
        self._validate_logit_bias(vocab_size)

    def _validate_logit_bias(self, vocab_size: int | None) -> None:
        seen: set[int] = set()
        for pair in self.logit_bias:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise InvalidRequest(
                    "logit_bias must be (token id, bias) pairs", param="logit_bias"
                )
            token, bias = pair
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise InvalidRequest(
                    f"logit_bias token id {token!r} is not a non-negative integer",
                    param="logit_bias",
                )
            if vocab_size is not None and token >= vocab_size:
                raise InvalidRequest(
                    f"logit_bias token id {token} is outside the vocabulary (size {vocab_size})",
                    param="logit_bias",
                )
            if token in seen:
                raise InvalidRequest(f"logit_bias names token id {token} twice", param="logit_bias")
            seen.add(token)
            if not _finite(bias) or not -100.0 <= bias <= 100.0:
                raise InvalidRequest(
                    f"logit_bias of token {token} must be between -100 and 100",
                    param="logit_bias",
                )


def _finite(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
