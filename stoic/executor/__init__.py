"""The executor: one :class:`Executor` actor that runs the engine's steps on a
:class:`StepBackend`, a worker thread of this process (:class:`ThreadBackend`) or a worker
process (:class:`ProcessBackend`). The backend says everything that differs between the two
(who owns the KV tensors, whether a failure replaces the worker, the watchdog's margin, the
progress counter), so that nothing outside this package branches on ``EngineConfig.executor``:
the facade builds one with :func:`make_backend`.

Above :mod:`stoic.actors` (it speaks their messages) and below :mod:`stoic.engine`.
"""

from ._backend import Attached, ProcessBackend, StepBackend, ThreadBackend, make_backend
from ._executor import Executor
from ._failures import ExecutorFault, classify_failure, kv_survives
from ._thread import StepWorker

__all__ = [
    "Attached",
    "Executor",
    "ExecutorFault",
    "ProcessBackend",
    "StepBackend",
    "StepWorker",
    "ThreadBackend",
    "classify_failure",
    "kv_survives",
    "make_backend",
]
