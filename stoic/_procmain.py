"""The executor's worker process: ``python -m stoic._procmain FD PARENT_PID``
(:mod:`stoic.executor._procworker` is its code, :mod:`stoic.executor._process` starts it).

At the top of the package, not in :mod:`stoic.executor`: ``-m`` imports every parent package
before the module's first statement, and ``stoic.executor`` imports torch (seconds), while
``stoic`` imports nothing heavy. So this module's first statements run at once: SIGINT is
ignored and the process title set before any import can be interrupted. Imported by nobody, so
``-m`` runs it without importing it twice. Nor in :mod:`stoic.cli`: no user runs it (the
executor does), and ``stoic.cli``'s ``__init__`` imports the whole command line.
"""

import signal

# the server's Ctrl-C or SIGINT is the server's to handle: it stops its workers (a terminal's
# never arrives: a worker has a process group of its own)
signal.signal(signal.SIGINT, signal.SIG_IGN)

from stoic._proctitle import set_title  # noqa: E402  (after the line above, on purpose)

set_title("starting")

import os  # noqa: E402
import sys  # noqa: E402
from multiprocessing.connection import Connection  # noqa: E402

from stoic.executor._procworker import worker_main  # noqa: E402  (torch: seconds)

if __name__ == "__main__":
    fd = int(sys.argv[1])
    # a process this worker forks (a library's helper) must not hold the pipe open: the
    # server learns of the worker's death from the pipe's end
    os.set_inheritable(fd, False)
    worker_main(Connection(fd), int(sys.argv[2]))
