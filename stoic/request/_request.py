"""The request: one value object from the HTTP layer (and Ray's ingress) to the intake.

Every layer that carries a request carries this object, not its fields: the HTTP routes build
it, :meth:`stoic.Engine.submit` takes it (its keyword arguments build one), a Ray replica receives
it pickled, the intake's ``Submit`` message holds it and :meth:`TokenCodec.tokenize` reads it. A
new request parameter is a new field here plus its use.
"""

from __future__ import annotations

import dataclasses
import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidRequest
from ._params import SamplingParams

__all__ = ["MAX_TENANT_LEN", "Request", "new_request_id"]

#: the longest tenant name (a header's value, or ``key-`` and an API key's digest)
MAX_TENANT_LEN = 128


def new_request_id() -> str:
    """A fresh request id (``req-`` and 16 hex digits)."""
    return f"req-{uuid.uuid4().hex[:16]}"


@dataclass(frozen=True, slots=True)
class Request:
    """What to generate from and how: a prompt (text or token ids) or chat ``messages``, and the
    :class:`SamplingParams`.

    Plain data, picklable (it crosses to Ray replicas as it is). The token ids of ``prompt``,
    the ``messages`` and ``generated`` are kept as tuples; an empty or missing ``request_id``
    gets a fresh one. Validation happens in the engine's intake (:meth:`stoic.Engine.submit`
    raises it).
    """

    #: text, or token ids (kept as a tuple); ``None`` with ``messages``
    prompt: str | Sequence[int] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    #: chat messages, rendered with the model's chat template (instead of ``prompt``)
    messages: Sequence[dict[str, Any]] | None = None
    #: the engine's id of the request (abort, logs); unique among the requests in flight
    request_id: str = ""
    #: extra variables for the chat template (vLLM's ``chat_template_kwargs``)
    chat_template_kwargs: dict[str, Any] | None = None
    #: a text prompt's tokenisation adds the tokenizer's special tokens (BOS); a chat template
    #: adds its own
    add_special_tokens: bool = True
    #: the chat template ends with the assistant's turn opening
    add_generation_prompt: bool = True
    #: tokens this request already generated (on a replica that died): the engine continues
    #: after them exactly as after its own ``--recovery resume``. They are output for every
    #: rule (they count toward ``max_tokens`` and ``min_tokens``, penalties see them, a
    #: ``seed``'s random stream continues at their count) but are not streamed again: the
    #: stream, its ``completion_tokens`` and a partial output carry the new tokens only. With
    #: a ``constraint`` they must be its output's beginning: the grammar goes on from them.
    generated: Sequence[int] = ()
    #: who the request is for (an API key's or a header's tenant: see docs/operations.md
    #: "Overload and tenants"); the scheduler shares step tokens fairly between tenants. ``""``
    #: is the default tenant
    tenant: str = ""
    #: vLLM's ``priority``: within a tenant, a lower value is admitted first and may preempt a
    #: higher one when KV blocks run out
    priority: int = 0
    #: seconds from submission within which the request must start and finish: refused at
    #: once (:class:`~stoic.errors.Overloaded`) when it cannot start in time, ended with
    #: ``finish_reason="timeout"`` and its partial output when the time passes. ``None``: the
    #: server's queue-wait limit only
    timeout: float | None = None

    def __post_init__(self) -> None:
        if self.prompt is not None and not isinstance(self.prompt, str | tuple):
            object.__setattr__(self, "prompt", tuple(self.prompt))
        if self.messages is not None and not isinstance(self.messages, tuple):
            object.__setattr__(self, "messages", tuple(self.messages))
        if not isinstance(self.generated, tuple):
            object.__setattr__(self, "generated", tuple(self.generated))
        if not self.request_id:
            object.__setattr__(self, "request_id", new_request_id())

    @classmethod
    def of(
        cls,
        request: Request | str | Sequence[int] | None = None,
        params: SamplingParams | None = None,
        **fields: Any,
    ) -> Request:
        """``request`` itself, or a request built from a prompt, ``params`` and the other fields
        by name: the one place keyword arguments become a request (:meth:`stoic.Engine.submit`
        and its siblings take them). Given a request, ``params`` and ``fields`` replace its own.

        :raises TypeError: a field that a request does not have.
        """
        if params is not None:
            fields["params"] = params
        if isinstance(request, Request):
            return dataclasses.replace(request, **fields) if fields else request
        return cls(**fields) if request is None else cls(request, **fields)

    def check_scheduling(self) -> None:
        """Check ``tenant``, ``priority`` and ``timeout``.

        :raises InvalidRequest: a tenant that is not a short printable name, a priority that is
            not an integer (within 32 bits), a timeout that is not a positive number of seconds.
        """
        tenant = self.tenant
        if not isinstance(tenant, str) or len(tenant) > MAX_TENANT_LEN or not tenant.isprintable():
            raise InvalidRequest(
                f"the tenant must be a printable name of at most {MAX_TENANT_LEN} characters",
                param="tenant",
            )
        priority = self.priority
        if isinstance(priority, bool) or not isinstance(priority, int) or abs(priority) >= 2**31:
            raise InvalidRequest("priority must be an integer (32 bits)", param="priority")
        timeout = self.timeout
        if timeout is not None and (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not 0 < timeout < math.inf
        ):
            raise InvalidRequest("timeout must be a positive number of seconds", param="timeout")

    @property
    def param(self) -> str:
        """The request parameter its prompt came in (named by an error about the prompt)."""
        return "prompt" if self.messages is None else "messages"
