"""Argument types for the command line: a bad value is a usage error naming it (exit 2).

Each type takes the flag's text and returns its value, or raises
:class:`argparse.ArgumentTypeError` (or :class:`ValueError`, for text that is not a number),
which argparse reports as ``error: argument --flag: ...`` with status 2.
"""

from __future__ import annotations

import argparse
from typing import TypeAlias

#: a titled group of flags in ``--help`` (what :meth:`argparse.ArgumentParser.add_argument_group`
#: returns; argparse names the class privately)
ArgumentGroup: TypeAlias = argparse._ArgumentGroup

__all__ = [
    "ArgumentGroup",
    "auto_or_non_negative_float",
    "non_negative_float",
    "non_negative_int",
    "port",
    "positive_float",
    "positive_int",
]


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def auto_or_non_negative_float(text: str) -> float | str:
    """``"auto"``, or a number >= 0."""
    return "auto" if text == "auto" else non_negative_float(text)


def port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"not a port: {value}")
    return value
