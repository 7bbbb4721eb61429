"""A generation request's scheduling fields: its tenant, priority and timeout.

- **tenant**: set by the auth middleware (:data:`~stoic.http._auth.TENANT`): the operator's
  tenant header, else the API key's digest, else the default tenant.
- **priority**: the body's ``priority`` (vLLM's field: lower is served first within a tenant).
- **timeout**: the body's ``timeout`` (seconds), else the ``x-request-timeout`` header. The
  OpenAI SDKs' ``X-Stainless-Timeout`` is not read: it is the client's timeout of each read
  (a stream may run far longer), not a deadline for the whole answer.
"""

from __future__ import annotations

import math
from typing import Any

from aiohttp import web

from ..errors import InvalidRequest
from ._auth import TENANT

__all__ = ["TIMEOUT_HEADER", "scheduling_fields"]

#: the request header that gives a request's timeout in seconds (the body's ``timeout`` wins)
TIMEOUT_HEADER = "x-request-timeout"


def scheduling_fields(
    request: web.Request, *, priority: int | None = None, timeout: float | None = None
) -> dict[str, Any]:
    """The :class:`stoic.Request` fields ``tenant``, ``priority`` and ``timeout`` of ``request``
    (the body's ``priority`` and ``timeout`` given by the caller, when the body has them).

    :raises InvalidRequest: a timeout header that is not a positive number of seconds.
    """
    fields: dict[str, Any] = {"tenant": request.get(TENANT, "")}
    if priority is not None:
        fields["priority"] = priority
    if timeout is None and TIMEOUT_HEADER in request.headers:
        text = request.headers[TIMEOUT_HEADER]
        try:
            timeout = float(text)
        except ValueError:
            timeout = math.nan
        if not 0 < timeout < math.inf:
            raise InvalidRequest(
                f"the {TIMEOUT_HEADER} header must be a positive number of seconds, not {text!r}",
                param=TIMEOUT_HEADER,
            )
    if timeout is not None:
        fields["timeout"] = timeout
    return fields
