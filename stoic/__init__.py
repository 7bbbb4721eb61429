"""stoic: an LLM inference server that keeps serving through the failures that take its peers down."""

from typing import TYPE_CHECKING, Any

from . import errors
from .config import EngineConfig, FaultSpec

if TYPE_CHECKING:
    from .engine import (
        CompletionResult,
        Constraint,
        Delta,
        Engine,
        EngineStats,
        Health,
        Request,
        RequestStream,
        SamplingParams,
        TokenLogprob,
    )

__all__ = [
    "CompletionResult",
    "Constraint",
    "Delta",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "FaultSpec",
    "Health",
    "Request",
    "RequestStream",
    "SamplingParams",
    "TokenLogprob",
    "errors",
]
__version__ = "0.1.0"

#: imported from stoic.engine at first use: importing ``stoic`` (which every ``stoic.*`` module
#: does, ``stoic.cli`` included) must not import torch, so that ``stoic serve`` handles a Ctrl-C
#: that arrives while torch is imported (``stoic.cli.main``)
_ENGINE_NAMES = frozenset(__all__) - {"EngineConfig", "FaultSpec", "errors"}


def __getattr__(name: str) -> Any:
    if name in _ENGINE_NAMES:
        from . import engine

        value = getattr(engine, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'stoic' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _ENGINE_NAMES)
