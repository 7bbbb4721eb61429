"""The OpenAI-compatible HTTP server: an aiohttp application over a :class:`stoic.Engine`.

``create_app(engine)`` builds the application (mountable under a prefix in a host app);
``serve(engine, ...)`` runs it on a socket with graceful shutdown (what ``stoic serve`` uses).
"""

from ._app import create_app, drain
from ._engine import EngineLike, RequestStreamLike
from ._errors import status_of
from ._server import EXIT_ENGINE_FAILED, serve

__all__ = [
    "EXIT_ENGINE_FAILED",
    "EngineLike",
    "RequestStreamLike",
    "create_app",
    "drain",
    "serve",
    "status_of",
]
