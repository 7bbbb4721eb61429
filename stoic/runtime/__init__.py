"""A small, generic actor runtime for asyncio: typed actors with bounded
mailboxes, ``tell``/``ask``, death watch, and OTP-style supervision trees with
sliding-window restart intensity, backoff and escalation.

It knows nothing about models or HTTP.  Test helpers live in
:mod:`stoic.runtime.testing`.
"""

from ._actor import Actor as Actor
from ._actor import ActorContext as ActorContext
from ._actor import Terminated as Terminated
from ._clock import Clock as Clock
from ._clock import MonotonicClock as MonotonicClock
from ._exceptions import ActorError as ActorError
from ._exceptions import ActorStopped as ActorStopped
from ._exceptions import AskTimeout as AskTimeout
from ._exceptions import MailboxFull as MailboxFull
from ._exceptions import SupervisorEscalation as SupervisorEscalation
from ._mailbox import MailboxStatistics as MailboxStatistics
from ._ref import ActorRef as ActorRef
from ._reply import Reply as Reply
from ._spec import Backoff as Backoff
from ._spec import ChildFailure as ChildFailure
from ._spec import ChildSpec as ChildSpec
from ._spec import Restart as Restart
from ._spec import Strategy as Strategy
from ._supervisor import Supervisor as Supervisor
from ._supervisor import SupervisorStatistics as SupervisorStatistics
from ._system import ActorSystem as ActorSystem
from ._system import SystemStatistics as SystemStatistics

__all__ = [
    "Actor",
    "ActorContext",
    "ActorError",
    "ActorRef",
    "ActorStopped",
    "ActorSystem",
    "AskTimeout",
    "Backoff",
    "ChildFailure",
    "ChildSpec",
    "Clock",
    "MailboxFull",
    "MailboxStatistics",
    "MonotonicClock",
    "Reply",
    "Restart",
    "Strategy",
    "Supervisor",
    "SupervisorEscalation",
    "SupervisorStatistics",
    "SystemStatistics",
    "Terminated",
]

# public names report their public module (as anyio and httpcore do), so reprs, docs and
# tracebacks show ``stoic.runtime.ActorSystem`` rather than a private module
for _name in __all__:
    globals()[_name].__module__ = __name__
del _name
