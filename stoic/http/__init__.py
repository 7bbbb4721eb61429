"""The OpenAI-compatible HTTP server: an aiohttp application over a :class:`stoic.Engine`.

``create_app(engine)`` builds the application (mountable under a prefix in a host app);
``serve(engine, ...)`` runs it on a socket with graceful shutdown (what ``stoic serve`` uses).
"""

from ._app import create_app, drain
from ._auth import AccessPolicy, is_loopback, load_keys
from ._engine import EngineLike, RequestStreamLike
from ._errors import status_of
from ._limits import ServerLimits
from ._server import EXIT_ENGINE_FAILED, serve
from ._store import ResponseStore, default_responses_db

__all__ = [
    "EXIT_ENGINE_FAILED",
    "AccessPolicy",
    "EngineLike",
    "RequestStreamLike",
    "ResponseStore",
    "ServerLimits",
    "create_app",
    "default_responses_db",
    "drain",
    "is_loopback",
    "load_keys",
    "serve",
    "status_of",
]
