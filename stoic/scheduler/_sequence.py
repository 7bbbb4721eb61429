"""One sequence's state inside the scheduler: its tokens, its KV progress, its block table, and
what it reports to whoever awaits it (a :class:`SeqSink`: the actors' result stream)."""

from __future__ import annotations

import enum
import hashlib
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from ..errors import PartialOutput, StoicError
from ..request import Detokenizer, SampledToken, SamplingParams

if TYPE_CHECKING:
    from ._speculate import SeqDrafts

__all__ = ["FinishReason", "Seq", "SeqSink", "SeqStatus", "TokenLogprob", "block_hashes"]

#: ``"timeout"``: the request's own deadline (:attr:`stoic.Request.timeout`) passed first
FinishReason = Literal["stop", "length", "abort", "timeout"]


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The chosen token's log-probability and the most likely alternatives."""

    token_id: int
    token: str
    logprob: float
    #: ``(token_id, token, logprob)``, best first
    top: tuple[tuple[int, str, float], ...] = ()


class SeqSink(Protocol):
    """Where a sequence's output goes (:class:`stoic.actors.ResultStream`): the producer side,
    which never blocks. Exactly one of :meth:`finish` and :meth:`fail` takes effect."""

    request_id: str
    #: prompt tokens served from the prefix cache (set by the scheduler on first admission)
    cached_tokens: int

    @property
    def done(self) -> bool: ...

    def push(
        self,
        text: str,
        token_ids: tuple[int, ...] | list[int],
        logprobs: list[TokenLogprob] | None = None,
    ) -> None: ...

    def finish(self, reason: FinishReason, stop_reason: str | int | None = None) -> None: ...

    def fail(self, error: StoicError) -> None: ...


def block_hashes(
    token_ids: list[int], block_size: int, count: int, known: list[bytes]
) -> tuple[bytes, ...]:
    """Content hashes of the first ``count`` full blocks of ``token_ids``, extending ``known``.

    Block ``i``'s hash covers every token up to its end (a chain: ``blake2b(hash[i-1] +
    tokens of block i)``), so equal hashes mean equal prefixes, hence equal keys and values. A
    128-bit cryptographic hash rather than Python's ``hash()``: a collision would silently give a
    request another prompt's cache, and token ids are attacker-chosen input.
    """
    while len(known) < count:
        i = len(known)
        parent = known[-1] if known else b""
        block = array("i", token_ids[i * block_size : (i + 1) * block_size]).tobytes()
        known.append(hashlib.blake2b(parent + block, digest_size=16).digest())
    return tuple(known[:count])


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Seq:
    """Everything the scheduler tracks for one request.

    ``num_computed`` counts the tokens whose keys/values are in the cache; the tokens still to feed
    are ``all_ids[num_computed:]`` (the whole prompt at first, then the last sampled token; after a
    preemption everything again, recomputed).

    ``generated``: tokens the request generated before (:attr:`stoic.Request.generated`). The
    sequence starts as one resumed after them: they are output (``all_ids`` is the prompt and
    them, ``num_generated`` counts them) and its detokenizer is primed with them, but neither
    they nor their text reach the stream or :meth:`partial` (``continued`` counts them).
    """

    __slots__ = (
        "_continued_chars",
        "_detok",
        "_pending_ids",
        "_pending_logprobs",
        "_prompt_text",
        "all_ids",
        "block_table",
        "committed_blocks",
        "continued",
        "deadline",
        "drafts",
        "finish_reason",
        "hashes",
        "max_tokens",
        "num_computed",
        "params",
        "priority",
        "prompt_len",
        "request_id",
        "resume_debt",
        "resumes",
        "seq_id",
        "solo_failures",
        "status",
        "stop_reason",
        "stream",
        "strikes",
        "tenant",
    )

    def __init__(
        self,
        seq_id: int,
        request_id: str,
        prompt_ids: tuple[int, ...],
        params: SamplingParams,
        max_tokens: int,
        stream: SeqSink,
        tokenizer: Any,
        generated: tuple[int, ...] = (),
        *,
        tenant: str = "",
        priority: int = 0,
        deadline: float | None = None,
    ) -> None:
        self.seq_id = seq_id
        #: whose share of the steps it runs in (:class:`~stoic.scheduler.TenantShares`)
        self.tenant = tenant
        #: within its tenant, a lower value is admitted first (vLLM's meaning)
        self.priority = priority
        #: when it ends with ``"timeout"`` (the core's clock), if not done by then
        self.deadline = deadline
        self.request_id = request_id
        self.all_ids: list[int] = [*prompt_ids, *generated]
        self.prompt_len = len(prompt_ids)
        #: output tokens the request came with (generated before; never streamed from here)
        self.continued = len(generated)
        self.params = params
        self.max_tokens = max_tokens
        self.stream = stream
        self.num_computed = 0
        self.block_table: tuple[int, ...] = ()
        #: leading blocks of ``block_table`` already in the prefix cache
        self.committed_blocks = 0
        #: content hashes of full blocks, computed as needed (see :func:`block_hashes`)
        self.hashes: list[bytes] = []
        self.status = SeqStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None
        self._detok = Detokenizer(
            tokenizer,
            stop=params.stop,
            min_tokens=params.min_tokens,
            skip_special_tokens=params.skip_special_tokens,
            generated=generated,
        )
        #: characters of the primed text (``generated``'s): not part of :meth:`partial`
        self._continued_chars = len(self._detok.text)
        self._pending_ids: list[int] = []
        self._pending_logprobs: list[TokenLogprob] = []
        self._prompt_text: str | None = None
        #: times this sequence was resumed after an executor failure (``--recovery resume``)
        self.resumes = 0
        #: failed steps it was in since its last clean step (two or more: a suspect)
        self.strikes = 0
        #: failed steps it ran in alone, in a row (two: the cause of the failures)
        self.solo_failures = 0
        #: tokens it had computed (or was computing) when an executor failure restarted it:
        #: at its readmission what the prefix cache still holds of them counts as reused, the
        #: rest as recomputed (:meth:`~stoic.scheduler._recovery.Recovery.readmitted`)
        self.resume_debt = 0
        #: speculative decoding's state (:class:`~stoic.scheduler._speculate.SeqDrafts`), made
        #: at its first draft
        self.drafts: SeqDrafts | None = None

    @property
    def num_generated(self) -> int:
        return len(self.all_ids) - self.prompt_len

    @property
    def num_new(self) -> int:
        """Tokens generated here: ``num_generated`` less the ones the request came with."""
        return self.num_generated - self.continued

    @property
    def output_ids(self) -> list[int]:
        return self.all_ids[self.prompt_len :]

    @property
    def remaining(self) -> int:
        """Tokens not yet in the cache."""
        return len(self.all_ids) - self.num_computed

    @property
    def prompt_text(self) -> str:
        """The prompt as text (decoded on first use; for fault rehearsals that match on it)."""
        if self._prompt_text is None:
            self._prompt_text = self._detok.decode(self.all_ids[: self.prompt_len])
        return self._prompt_text

    @property
    def text(self) -> str:
        """The text generated so far (detokenised up to the last :meth:`detokenize`), the
        request's ``generated`` tokens' included."""
        return self._detok.text

    def partial(self) -> PartialOutput:
        """What the stream carried so far: the tokens generated here and their text (not the
        ``generated`` tokens the request came with)."""
        return PartialOutput(
            text=self.text[self._continued_chars :],
            token_ids=tuple(self.all_ids[self.prompt_len + self.continued :]),
        )

    def append(self, token: SampledToken, eos_ids: frozenset[int]) -> None:
        """Add a sampled token and apply the token-level stop conditions."""
        tid = token.token_id
        self.all_ids.append(tid)
        self._pending_ids.append(tid)
        if self.params.logprobs and token.logprob is not None:
            piece = self._detok.token_text
            self._pending_logprobs.append(
                TokenLogprob(
                    token_id=tid,
                    token=piece(tid),
                    logprob=token.logprob,
                    top=tuple((i, piece(i), lp) for i, lp in token.top_logprobs),
                )
            )
        n = self.num_generated
        if self.params.ends_at(tid, n, eos_ids):
            self.finish_reason, self.stop_reason = "stop", tid
        elif token.grammar_complete:  # the constraint allows nothing more
            self.finish_reason = "stop"
        if self.finish_reason is None and n >= self.max_tokens:
            self.finish_reason = "length"

    def detokenize(self) -> None:
        """Turn pending tokens into text, apply stop strings, push a delta to the stream."""
        if not self._pending_ids:
            return
        ids, self._pending_ids = self._pending_ids, []
        # the EOS / stop token itself is not part of the text
        text_ids = ids[:-1] if isinstance(self.stop_reason, int) else ids
        matched = self._detok.add(text_ids)
        if matched is not None:
            self.finish_reason, self.stop_reason = "stop", matched
        logprobs = self._pending_logprobs if self.params.logprobs else None
        self._pending_logprobs = []
        self.stream.push(self._detok.take(final=self.finish_reason is not None), ids, logprobs)
