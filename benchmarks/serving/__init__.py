"""The serving benchmark (``benchmarks/serving_bench.py``), split by concern, over the shared
harness (``benchmarks/harness``: servers, load generator, workloads, CPU accounting, tables).

- :mod:`.timed`: ``--timed-serve`` (``stoic serve`` with ``ModelRunner.execute`` timed);
- :mod:`.profile`: the py-spy profile of the stoic server, classified by thread and category;
- :mod:`.bench`: the run itself (HTTP phase, profiled pass, Python API phase) and ``--url``;
- :mod:`.worker`: the in-process measurements, each run in a fresh process (``--worker``);
- :mod:`.tables`, :mod:`.overhead`, :mod:`.report`: the markdown report and the plot.

``benchmarks/serving_bench.py`` is the entry point and the script the benchmark spawns for its
subprocesses.
"""

from __future__ import annotations

from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "serving_bench.py"
CONCURRENCY = (1, 8, 32)
# a measurement during which other processes used more of the machine's CPU is repeated
MAX_OTHER_CPU = 0.15
QUIET_CPU = 0.10
