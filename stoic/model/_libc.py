"""The C library's calls that Python's ``os`` and ``mmap`` modules do not offer."""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["libc_function"]


def libc_function(name: str, *argtypes: Any) -> Callable[..., int] | None:
    """Linux's libc ``name`` taking ``argtypes`` and returning an ``int`` (``errno`` kept for
    :func:`ctypes.get_errno`); None on another platform or a libc without it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = list(argtypes)
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]
