"""Every ``stoic serve`` flag, in the groups ``stoic serve --help`` shows, and the
:class:`~stoic.EngineConfig` they describe.

Each group is a module that owns its flags and the config fields they set: model
(:mod:`._model_flags`), engine (:mod:`._engine_flags`), overload and tenants
(:mod:`._overload_flags`), server (:mod:`._server_flags`, with the
access policy and limits), recovery (:mod:`._recovery_flags`), scale-out
(:mod:`._scale_out_flags`). This module puts them together.
"""

from __future__ import annotations

import argparse

from ..config import EngineConfig
from ._engine_flags import add_engine_args, engine_fields
from ._model_flags import add_model_args, model_fields
from ._overload_flags import add_overload_args, overload_fields
from ._recovery_flags import add_recovery_args, recovery_fields
from ._scale_out_flags import add_scale_out_args
from ._server_flags import add_server_args, server_fields

__all__ = ["add_serve_args", "config_from_args"]


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Add every ``stoic serve`` flag to ``p``, a titled argument group per job."""
    add_model_args(p)
    add_engine_args(p)
    add_overload_args(p)
    add_server_args(p)
    add_recovery_args(p)
    add_scale_out_args(p)


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The :class:`~stoic.EngineConfig` the ``serve`` arguments describe.

    :raises ValueError: for values the config refuses (:class:`~stoic.EngineConfig` checks
        them), e.g. ``--fault`` without ``--enable-fault-injection``, ``--executor-spares`` with
        ``--executor thread``, ``--gpu-memory-utilization`` above 1.
    """
    return EngineConfig(
        **model_fields(args),
        **engine_fields(args),
        **overload_fields(args),
        **server_fields(args),
        **recovery_fields(args),
    )
