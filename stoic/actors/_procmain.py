"""The executor's worker process: ``python -m stoic.actors._procmain FD PARENT_PID``.

A module of its own, imported by nobody, so ``-m`` runs it without importing it twice.
"""

import sys
from multiprocessing.connection import Connection

from stoic.actors._procworker import worker_main

if __name__ == "__main__":
    worker_main(Connection(int(sys.argv[1])), int(sys.argv[2]))
