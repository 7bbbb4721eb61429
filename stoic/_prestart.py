"""Starting the executor's worker interpreter, and ``stoic serve``'s early one.

A worker's imports (torch, transformers' model machinery: 3.4 s on two cores) used to start only
once the server had imported the same and read the model's metadata (another 3 s): the two ran
one after the other. ``stoic serve`` now starts the worker's interpreter (:func:`prestart`) as
soon as its arguments are checked, before it imports anything heavy itself, so that both import
at once; the server's worker pool adopts that interpreter as its first worker (:func:`take`).
An embedding application gets no early process: its engine spawns its workers as before.

At the top of the package and standard library only, like :mod:`stoic._entry`: the command
calls it before torch is imported. The worker is told nothing at its start but the socket and
the server's pid; its shared pages (step progress, KV pools) follow over the socket
(``SCM_RIGHTS``), so an interpreter started before the server has built them can be adopted.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from dataclasses import dataclass

__all__ = ["WORKER_MODULE", "Spawned", "discard", "prestart", "spawn", "take"]

#: what a worker process runs (``python -m``)
WORKER_MODULE = "stoic._procmain"


@dataclass
class Spawned:
    """A worker interpreter and the server's end of its socket."""

    proc: subprocess.Popen[bytes]
    sock: socket.socket
    #: the module it runs (``python -m``)
    module: str


def spawn(module: str) -> Spawned:
    """Start ``python -m module FD PID``: a fresh interpreter (what multiprocessing calls
    "spawn": nothing inherited from this process's state, CUDA-safe), started without
    multiprocessing, so the embedding application's ``__main__`` is never imported again in the
    child. Call it from the thread that runs the event loop (or from the main thread before the
    loop starts, which runs it then): the child's parent-death signal is tied to the thread that
    forked it."""
    ours, theirs = socket.socketpair()
    with theirs:  # only the child holds its end once started: its death is EOF on ours
        proc = subprocess.Popen(
            [sys.executable, "-m", module, str(theirs.fileno()), str(os.getpid())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            # whatever the worker prints (a native crash report, a library's warning) becomes
            # a log event of the server's: in JSON mode every line on stderr stays JSON
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            # a process group of its own: a terminal's Ctrl-C (SIGINT to the foreground group)
            # reaches only the server, which stops its workers; a worker still importing torch
            # would print a KeyboardInterrupt traceback. It still dies with the server
            # (PR_SET_PDEATHSIG).
            process_group=0,
        )
    return Spawned(proc, ours, module)


#: ``stoic serve``'s early interpreter, until the worker pool adopts it
_early: Spawned | None = None


def prestart(module: str = WORKER_MODULE) -> None:
    """Start the early worker interpreter (once; a second call does nothing)."""
    global _early
    if _early is None:
        _early = spawn(module)


def take(module: str) -> Spawned | None:
    """The early interpreter, once, if it runs ``module`` and is alive; else None (one that
    does not fit is stopped)."""
    global _early
    early, _early = _early, None
    if early is None:
        return None
    if early.module == module and early.proc.poll() is None:
        return early
    _stop(early)
    return None


def discard() -> None:
    """Stop the early interpreter if nobody adopted it (a start that failed first)."""
    global _early
    early, _early = _early, None
    if early is not None:
        _stop(early)


def _stop(spawned: Spawned) -> None:
    spawned.sock.close()  # EOF: a worker waiting for its pages exits
    with contextlib.suppress(ProcessLookupError):
        spawned.proc.kill()
    spawned.proc.wait()
    if spawned.proc.stdout is not None:
        spawned.proc.stdout.close()
