"""A worker process whose start meets out-of-memory errors, as a replacement on a GPU does while
its killed predecessor's memory is not free yet: ``python -m oom_start_worker FD PARENT_PID``
(``tests/engine`` on ``PYTHONPATH``), run in place of ``stoic._procmain`` by
``test_process_executor.py``. Every worker after the first (``start_oom_wait`` > 0) raises
torch's own out-of-memory error from its load while the count in the file that
``STOIC_TEST_OOM_STARTS`` names is above zero, taking one off each time."""

from __future__ import annotations

import os
import sys
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from stoic.executor import _procworker

_load = _procworker._load


def _failing_load(spec: Any, governor: Any, progress: Any) -> Any:
    if spec.start_oom_wait > 0:
        counter = Path(os.environ["STOIC_TEST_OOM_STARTS"])
        left = int(counter.read_text())
        if left > 0:
            counter.write_text(str(left - 1))
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
                "79.19 GiB of which 1.06 GiB is free (a killed worker's memory, not yet freed)"
            )
    return _load(spec, governor, progress)


_procworker._load = _failing_load

if __name__ == "__main__":
    fd = int(sys.argv[1])
    os.set_inheritable(fd, False)
    _procworker.worker_main(Connection(fd), int(sys.argv[2]))
