"""stoic: an LLM inference server that keeps serving through the failures that take its peers down."""

from . import errors
from .config import EngineConfig, FaultSpec
from .engine import (
    CompletionResult,
    Constraint,
    Delta,
    Engine,
    EngineStats,
    Health,
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
    "RequestStream",
    "SamplingParams",
    "TokenLogprob",
    "errors",
]
__version__ = "0.1.0"
