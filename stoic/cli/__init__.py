"""The ``stoic`` command: ``stoic serve`` and ``stoic cache``, the top layer of stoic.

The command starts in :mod:`stoic._entry` (its console script, and ``python -m stoic``), which
quiets SIGINT/SIGTERM before importing this package. Here:

- :mod:`._main`: the parser and dispatch (:func:`build_parser`, :func:`main`, exit statuses);
- :mod:`._serve`: running ``stoic serve`` once its arguments are valid;
- :mod:`._serve_flags`: every ``serve`` flag and the :class:`~stoic.EngineConfig` they describe
  (:func:`config_from_args`), a module per group of ``stoic serve --help``:
  :mod:`._model_flags`, :mod:`._engine_flags`, :mod:`._server_flags` (and the access policy and
  limits: :func:`http_options`), :mod:`._recovery_flags`, :mod:`._scale_out_flags`;
- :mod:`._argtypes`: the flags' value types; :mod:`._signals`: SIGINT/SIGTERM until the server
  handles them; :mod:`._logs`: :func:`configure_logging`; :mod:`._cache`: ``stoic cache``.
"""

from ._logs import configure_logging
from ._main import build_parser, main
from ._serve_flags import config_from_args
from ._server_flags import http_options

__all__ = ["build_parser", "config_from_args", "configure_logging", "http_options", "main"]
