"""Who may call what: API keys for the OpenAI routes, an admin key for ``/admin/*``.

Every route is registered with an :data:`Access` class (see :func:`route_access`):

- ``open``: ``/health`` and ``/openapi.json``: probes and tooling never need a key;
- ``metrics``: ``/metrics``, open unless :attr:`AccessPolicy.metrics_require_key`;
- ``admin``: ``/admin/*``: the admin key, never an API key. With no admin key configured, the
  admin routes answer loopback clients only (they exist only with fault injection on, and a
  fault can kill the executor);
- ``console``: ``/console/stream`` (the operator's console's data): the admin key when one is
  set (an API key is then a 403), else an API key when any is configured, else open. The
  console's page and its script and style sheet are ``open``: they hold no data;
- ``api``: everything else, including unknown paths: an API key when any is configured.

Keys are compared in constant time (the SHA-256 digests of the offered and of every configured
key are compared with :func:`hmac.compare_digest`, all of them, so neither the position of a
match nor a key's length shows in the timing).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from .._logging import get_logger
from ._errors import auth_error_response
from ._state import STATE

__all__ = [
    "ACCESS",
    "OWNER",
    "TENANT",
    "Access",
    "AccessPolicy",
    "auth_middleware",
    "is_loopback",
    "load_keys",
    "route_access",
]

_log = get_logger("stoic.http")

Access = Literal["open", "metrics", "api", "admin", "console"]
#: each route's access class, filled by :func:`route_access`
ACCESS: web.AppKey[dict[web.AbstractResource | None, Access]] = web.AppKey("stoic_access", dict)
#: who owns what the request stores: the SHA-256 (hex) of its API key when the server has keys
#: (set by :func:`auth_middleware`), absent otherwise (stored responses are then shared)
OWNER = web.RequestKey("stoic_owner", str)
#: whom the request is for, in the scheduler's fair shares (set by :func:`auth_middleware`):
#: the value of the policy's tenant header when the request sends it, else ``key-`` and the
#: first 12 hex digits of its API key's SHA-256 (never the key itself: tenants are shown on
#: /metrics), else ``""`` (the default tenant)
TENANT = web.RequestKey("stoic_tenant", str)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class AccessPolicy:
    """The keys a server checks. The default (no keys) leaves every route open, except that
    the admin routes answer loopback clients only.

    :raises ValueError: if a key is empty or has surrounding whitespace, or the admin key is
        also an API key.
    """

    api_keys: tuple[str, ...] = ()
    admin_key: str | None = None
    #: ``/metrics`` needs an API key (or the admin key) too
    metrics_require_key: bool = False
    #: the request header that names a request's tenant (``--tenant-header``); without it (or
    #: when a request does not send it) the tenant is the API key's (see :data:`TENANT`)
    tenant_header: str | None = None
    _api: tuple[bytes, ...] = field(init=False, repr=False, compare=False)
    _admin: bytes | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        keys = [*self.api_keys, *([self.admin_key] if self.admin_key is not None else [])]
        for key in keys:
            if not key or key != key.strip():
                raise ValueError("API and admin keys must be non-empty, without whitespace")
        if self.admin_key is not None and self.admin_key in self.api_keys:
            raise ValueError("the admin key must differ from every API key")
        object.__setattr__(self, "_api", tuple(_digest(k) for k in self.api_keys))
        admin = _digest(self.admin_key) if self.admin_key is not None else None
        object.__setattr__(self, "_admin", admin)

    def __repr__(self) -> str:  # never log the keys themselves
        return (
            f"AccessPolicy(api_keys=<{len(self.api_keys)}>, "
            f"admin_key={'<set>' if self.admin_key else None}, "
            f"metrics_require_key={self.metrics_require_key}, "
            f"tenant_header={self.tenant_header!r})"
        )

    def is_api_key(self, offered: str) -> bool:
        """Whether ``offered`` is one of the API keys (constant time in the keys' content)."""
        given = _digest(offered)
        found = False
        for key in self._api:
            found |= hmac.compare_digest(given, key)
        return found

    def is_admin_key(self, offered: str) -> bool:
        """Whether ``offered`` is the admin key (constant time)."""
        return self._admin is not None and hmac.compare_digest(_digest(offered), self._admin)


def load_keys(values: list[str] | None, files: list[Path] | None, env: str) -> tuple[str, ...]:
    """Keys from the command line, else from the environment variable ``env``, plus the key
    files (one key per line; blank lines and lines starting with ``#`` are skipped).

    :raises OSError: if a key file cannot be read.
    """
    keys = list(values or [])
    if not keys and os.environ.get(env):
        keys.append(os.environ[env].strip())
    for path in files or []:
        for line in path.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                keys.append(line)
    return tuple(dict.fromkeys(keys))


def route_access(app: web.Application, route: web.AbstractRoute, access: Access) -> None:
    """Record the access class of ``route``'s resource (every method of the path, ``HEAD``
    included); resources not recorded, and unknown paths, are ``api``."""
    app.setdefault(ACCESS, {})[route.resource] = access


def _bearer(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def is_loopback(address: str | None) -> bool:
    """Whether ``address`` (an IP address, or ``localhost``) is this machine's loopback."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address or "").is_loopback
    except ValueError:
        return False


def _unauthorized(message: str) -> web.Response:
    return auth_error_response(401, message, "invalid_api_key", challenge=True)


def _check(policy: AccessPolicy, access: Access, request: web.Request) -> web.Response | None:
    """The error response for a request ``policy`` refuses, or None."""
    token = _bearer(request)
    if access == "console" and policy.admin_key is not None:
        access = "admin"  # the admin key guards the console when there is one
    if access == "admin":
        if policy.admin_key is None:
            if is_loopback(request.remote):
                return None
            return auth_error_response(
                403,
                "the admin routes answer only loopback clients when no admin key is set "
                "(start the server with --admin-key)",
                "admin_loopback_only",
            )
        if token is not None and policy.is_admin_key(token):
            return None
        if token is not None and policy.is_api_key(token):
            return auth_error_response(
                403, "the admin routes need the admin key, not an API key", "admin_key_required"
            )
        return _unauthorized("the admin routes need 'Authorization: Bearer <admin key>'")
    if access == "open" or not policy.api_keys:
        return None
    if access == "metrics" and not policy.metrics_require_key:
        return None
    if token is None:
        return _unauthorized(
            "missing API key: send 'Authorization: Bearer <key>' (the server was started "
            "with --api-key)"
        )
    if policy.is_api_key(token) or (access == "metrics" and policy.is_admin_key(token)):
        return None
    return _unauthorized("incorrect API key")


def auth_middleware(policy: AccessPolicy) -> Middleware:
    """A middleware enforcing ``policy`` on every route, by its recorded access class."""

    @web.middleware
    async def _auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        table: dict[web.AbstractResource | None, Access] = request.app.get(ACCESS, {})
        access = table.get(request.match_info.route.resource, "api")
        refused = _check(policy, access, request)
        if refused is not None:
            reason = "unauthorized" if refused.status == 401 else "forbidden"
            request.app[STATE].metrics.refused.labels(reason).inc()
            _log.info("http.refused", reason=reason, path=request.path, remote=request.remote)
            return refused
        token = _bearer(request)
        if access == "api" and policy.api_keys and token is not None:
            request[OWNER] = _digest(token).hex()
        named = request.headers.get(policy.tenant_header) if policy.tenant_header else None
        if named is not None:
            request[TENANT] = named.strip()
        elif OWNER in request:
            request[TENANT] = "key-" + request[OWNER][:12]
        return await handler(request)

    return _auth
