"""The facade an embedding application uses: start and stop the engine, submit, stream, abort,
stats, health.

    async with stoic.Engine.start(stoic.EngineConfig(model="default")) as engine:
        async for delta in engine.chat(messages, stoic.SamplingParams(max_tokens=64)):
            print(delta.text, end="")

The names other layers (``stoic.http``, applications) use are all here, and report this
module as theirs.
"""

from ..actors import STATES, Delta, FinishReason, Health, State, TokenLogprob
from ..model import SamplingParams
from ._engine import Engine
from ._stats import EngineStats
from ._stream import CompletionResult, RequestStream

__all__ = [
    "STATES",
    "CompletionResult",
    "Delta",
    "Engine",
    "EngineStats",
    "FinishReason",
    "Health",
    "RequestStream",
    "SamplingParams",
    "State",
    "TokenLogprob",
]

# public names report their public module (as anyio and httpcore do), so reprs, docs and
# tracebacks show ``stoic.engine.Delta`` rather than a private module
for _name in (
    "CompletionResult",
    "Delta",
    "Engine",
    "EngineStats",
    "Health",
    "RequestStream",
    "SamplingParams",
    "TokenLogprob",
):
    globals()[_name].__module__ = __name__
del _name
