"""stoic: an LLM inference server that keeps serving through the failures that take its peers down."""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from . import errors
    from .config import EngineConfig, FaultSpec
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

#: every public name is imported at first use (PEP 562), from the module that defines it:
#: ``import stoic`` (which every ``stoic.*`` module does, the command's entry point included)
#: imports nothing, so that ``stoic`` quiets SIGINT/SIGTERM before any heavy import
#: (:mod:`stoic._entry`), and torch is imported only by what needs the engine
_HOMES = {name: "engine" for name in __all__} | {
    "EngineConfig": "config",
    "FaultSpec": "config",
    "errors": "",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'stoic' has no attribute {name!r}")
    import importlib

    home = _HOMES[name]
    value = (
        importlib.import_module(f"{__name__}.{name}")
        if not home
        else getattr(importlib.import_module(f"{__name__}.{home}"), name)
    )
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
