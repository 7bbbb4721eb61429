"""The version stoic reports (``--version``, the OpenAPI document)."""

from __future__ import annotations

import importlib.metadata

__all__ = ["installed_version"]


def installed_version() -> str:
    """The installed distribution's version (``stoic.__version__`` when run from a bare tree)."""
    try:
        return importlib.metadata.version("stoic")
    except importlib.metadata.PackageNotFoundError:
        from . import __version__

        return __version__
