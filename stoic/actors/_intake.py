"""Intake: validation, chat template, tokenisation and admission limits.

Every failure here reaches the caller as a typed error **before** the request is admitted, so the
HTTP layer can answer with a proper 4xx/5xx status even for streaming requests.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence
from dataclasses import dataclass
from typing import assert_never

from ..errors import ContextLengthExceeded, InvalidRequest, Overloaded, StoicError
from ..request import Constraint, GrammarBackend, Request, TokenCodec
from ..runtime import Actor, ActorRef, Reply
from ..scheduler import SchedulerCore
from ._health import EngineHealth
from ._messages import Abort, AddSequence, IntakeMsg, SchedulerMsg, Submit
from ._stream import ResultStream

__all__ = ["Intake", "IntakeConfig"]


@dataclass(frozen=True)
class IntakeConfig:
    max_model_len: int
    #: tokens the whole KV cache holds: one sequence can never be longer
    kv_capacity_tokens: int
    max_waiting: int
    #: seconds a request may wait to start (estimated at admission); None: no limit
    max_queue_wait: float | None = None
    #: requests one tenant may have admitted and not ended; None: ``max_waiting`` only
    tenant_max_queued: int | None = None


class Intake(Actor[IntakeMsg]):
    """Turns a :class:`Submit` into an admitted sequence or a typed error (replied, never raised
    into the actor: a bad request cannot fail the intake).
    """

    def __init__(
        self,
        config: IntakeConfig,
        codec: TokenCodec,
        scheduler: ActorRef[SchedulerMsg],
        health: EngineHealth,
        grammar: GrammarBackend | None = None,
        load: SchedulerCore | None = None,
    ) -> None:
        self.cfg = config
        #: the scheduler's core, read for the admission estimate and the tenants' counters
        #: (the same event loop; reads and a counter, never its queues)
        self._load = load
        self._grammar = grammar
        self._codec = codec
        self._scheduler = scheduler
        self._health = health
        self.outstanding = 0
        #: request ids admitted and not yet ended, and their tenants
        self._active: dict[str, str] = {}
        #: requests admitted and not yet ended, by tenant
        self._by_tenant: collections.Counter[str] = collections.Counter()

    async def receive(self, message: IntakeMsg) -> None:
        match message:
            case Submit(reply=reply):
                if reply.done:
                    return  # the caller gave up while queued
                try:
                    add = self._prepare(message)
                    constraint = add.params.constraint
                    if constraint is not None:
                        if self._grammar is None:
                            raise InvalidRequest(
                                "structured outputs are not available", param=constraint.param
                            )
                        # compiled off the event loop (cached: a known constraint is instant)
                        await asyncio.to_thread(
                            _check_grammar, self._grammar, constraint, add.request.generated
                        )
                except StoicError as exc:
                    reply.fail(exc)
                    return
                except Exception as exc:  # a bug or a tokenizer surprise: still the caller's error
                    self.context.log.exception(
                        "intake.unexpected_error", request_id=message.request.request_id
                    )
                    reply.fail(InvalidRequest(f"could not process the request: {exc}"))
                    return
                if _gone(reply):
                    return  # the caller gave up while we prepared it
                self.outstanding += 1
                if self._load is not None:
                    self._load.expect(
                        add.request_id,
                        add.request.tenant,
                        add.request.priority,
                        len(add.prompt_ids),
                    )
                self._active[add.request_id] = add.request.tenant
                self._by_tenant[add.request.tenant] += 1
                await self._scheduler.tell(add)
                if _gone(reply):  # the caller gave up while the scheduler's mailbox was full
                    await self._scheduler.tell(Abort(add.request_id))
                else:
                    reply.send(add.stream)
            case _:
                assert_never(message)

    def _prepare(self, msg: Submit) -> AddSequence:
        self._health.check_accepting()
        request = msg.request
        if request.request_id in self._active:
            raise InvalidRequest(
                f"request id {request.request_id!r} is already in use", param="request_id"
            )
        request.check_scheduling()
        params = request.params
        params.validate(vocab_size=self._codec.vocab_size)
        if self.outstanding >= self.cfg.max_waiting:
            self._refused(request.tenant)
            raise Overloaded(
                f"{self.outstanding} requests in flight (limit {self.cfg.max_waiting}); retry later"
            )
        queued = self._by_tenant[request.tenant]
        if self.cfg.tenant_max_queued is not None and queued >= self.cfg.tenant_max_queued:
            self._refused(request.tenant)
            raise Overloaded(
                f"tenant {request.tenant or '(default)'!r} has {queued} requests in flight "
                f"(limit {self.cfg.tenant_max_queued}); retry later"
            )
        # the wait of a one-token prompt is the least any prompt waits: a request refused
        # anyway is refused before its template and tokenisation (a flood's cheap answer)
        self._check_wait(request, 1)
        param = request.param
        if request.messages is None and request.prompt is not None and not request.prompt:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        ids = self._codec.tokenize(request)
        if not ids:
            raise InvalidRequest("the prompt tokenised to nothing", param=param)
        limit = min(self.cfg.max_model_len, self.cfg.kv_capacity_tokens)
        prompt_len = len(ids)
        if params.max_tokens is None:
            max_tokens = limit - prompt_len
            if max_tokens < 1:
                raise ContextLengthExceeded(
                    f"the prompt has {prompt_len} tokens; this model's context is {limit} tokens",
                    param=param,
                )
        else:
            max_tokens = params.max_tokens
            if prompt_len + max_tokens > limit:
                raise ContextLengthExceeded(
                    f"this model's maximum context length is {limit} tokens; the request asks for "
                    f"{prompt_len + max_tokens} ({prompt_len} in the prompt, {max_tokens} to generate)",
                    param=param,
                )
        if request.generated:
            self._check_generated(request, max_tokens)
        self._check_wait(request, prompt_len)
        stream = ResultStream(request.request_id, prompt_len, on_close=self._closed)
        return AddSequence(request, tuple(ids), max_tokens, stream)

    def _check_generated(self, request: Request, max_tokens: int) -> None:
        """Check a continued request's ``generated`` tokens against its budget and vocabulary.

        :raises ~stoic.errors.InvalidRequest: a token outside the vocabulary, as many tokens
            as ``max_tokens`` or more (nothing would be left to generate), a token that would
            have ended the output (a stop or EOS token past ``min_tokens``: the engine never
            generates past one). A constrained request's tokens are checked against its grammar
            where it is compiled (:func:`_check_grammar`).
        """
        generated = request.generated
        vocab = self._codec.vocab_size
        bad = next((t for t in generated if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(
                f"generated token id {bad} is outside the vocabulary (0 to {vocab - 1})",
                param="generated",
            )
        if len(generated) >= max_tokens:
            raise InvalidRequest(
                f"{len(generated)} tokens already generated leave nothing to generate within "
                f"max_tokens={max_tokens}",
                param="generated",
            )
        params = request.params
        eos = self._codec.eos_token_ids
        end = next((i for i, t in enumerate(generated, 1) if params.ends_at(t, i, eos)), None)
        if end is not None:
            raise InvalidRequest(
                f"generated token {end} (id {generated[end - 1]}) is a stop token: the output "
                "ended there, and nothing follows an end",
                param="generated",
            )

    def _check_wait(self, request: Request, prompt_len: int) -> None:
        """Refuse a request that cannot start within its timeout or the queue-wait limit.

        :raises ~stoic.errors.Overloaded: the estimated wait (the queue ahead of it at the
            measured step rate) exceeds the smaller of the two; ``retry_after``: the excess.
        """
        limits = [t for t in (request.timeout, self.cfg.max_queue_wait) if t is not None]
        if not limits or self._load is None:
            return
        allowed = min(limits)
        wait = self._load.queue_wait(request.tenant, request.priority, prompt_len)
        if wait > allowed:
            self._refused(request.tenant)
            which = "its timeout" if allowed == request.timeout else "the queue-wait limit"
            raise Overloaded(
                f"the request would wait about {wait:.1f}s for its first token, past {which} "
                f"({allowed:g}s); retry later",
                retry_after=wait - allowed,
            )

    def _refused(self, tenant: str) -> None:
        if self._load is not None:
            self._load.shares.stats_of(tenant).refused += 1

    def _closed(self, stream: ResultStream) -> None:
        self.outstanding -= 1
        tenant = self._active.pop(stream.request_id, None)
        if tenant is not None:
            self._by_tenant[tenant] -= 1
            if self._by_tenant[tenant] <= 0:
                del self._by_tenant[tenant]


def _check_grammar(
    grammar: GrammarBackend, constraint: Constraint, generated: Sequence[int]
) -> None:
    """Compile ``constraint`` (cached) and, for a continued request, walk its ``generated``
    tokens through a matcher: the executor's matcher replays them on the sequence's first step
    (a constrained stream that moved off a lost replica resumes in the grammar's state), so a
    token the grammar refuses is the request's error here, not a failed step there.

    :raises ~stoic.errors.InvalidRequest: the constraint does not compile, or the grammar
        refuses one of the tokens (``param="generated"``).
    """
    compiled = grammar.compile(constraint)
    if not generated:
        return
    matcher = compiled.matcher()
    for position, token in enumerate(generated, 1):
        if not matcher.accept(token):
            raise InvalidRequest(
                f"generated token {position} (id {token}) is not allowed by the request's "
                f"{constraint.param}: a continuation must be the constrained output's beginning",
                param="generated",
            )


def _gone(reply: Reply[ResultStream]) -> bool:
    """Whether the asker stopped waiting: a fresh read after each await (a plain ``reply.done``
    would be narrowed by the type checker from the first check on)."""
    return reply.done
