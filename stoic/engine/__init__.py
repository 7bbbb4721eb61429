"""The facade an embedding application uses: start and stop the engine, submit, stream, abort,
stats, health.

    async with stoic.Engine.start(stoic.EngineConfig(model="default")) as engine:
        async for delta in engine.chat(messages, stoic.SamplingParams(max_tokens=64)):
            print(delta.text, end="")

The names other layers (``stoic.http``, applications) use are all here, and report this
module as theirs.
"""

from typing import get_args

from ..actors import STATES, Delta, FinishReason, Health, State, TokenLogprob
from ..errors import FailureKind
from ..model import cuda_devices, load_token_codec
from ..request import Constraint, Detokenizer, Request, SamplingParams, TokenCodec
from ._engine import Engine
from ._incidents import Activity, Incident, SequenceView
from ._stats import EngineStats
from ._stream import CompletionResult, RequestStream

#: every kind of executor failure (exported as metric labels)
FAILURE_KINDS: tuple[FailureKind, ...] = get_args(FailureKind)

__all__ = [
    "FAILURE_KINDS",
    "STATES",
    "Activity",
    "CompletionResult",
    "Constraint",
    "Delta",
    "Detokenizer",
    "Engine",
    "EngineStats",
    "FinishReason",
    "Health",
    "Incident",
    "Request",
    "RequestStream",
    "SamplingParams",
    "SequenceView",
    "State",
    "TokenCodec",
    "TokenLogprob",
    "cuda_devices",
    "load_token_codec",
]

# public names report their public module (as anyio and httpcore do), so reprs, docs and
# tracebacks show ``stoic.engine.Delta`` rather than a private module
for _name in __all__:
    if isinstance(globals()[_name], type):  # the classes (not the constants and Literals)
        globals()[_name].__module__ = __name__
del _name
