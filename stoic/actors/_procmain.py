"""The executor's worker process: ``python -m stoic.actors._procmain FD PARENT_PID``.

A module of its own, imported by nobody, so ``-m`` runs it without importing it twice.
"""

import os
import sys
from multiprocessing.connection import Connection

from stoic.actors._procworker import worker_main

if __name__ == "__main__":
    fd = int(sys.argv[1])
    # a process this worker forks (a library's helper) must not hold the pipe open: the
    # server learns of the worker's death from the pipe's end
    os.set_inheritable(fd, False)
    worker_main(Connection(fd), int(sys.argv[2]))
