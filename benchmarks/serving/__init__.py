"""The serving benchmark (``benchmarks/serving_bench.py``), split by concern.

- :mod:`.load`: the OpenAI-compatible streaming load generator and its per-pass results;
- :mod:`.systems`: the servers it starts (stoic, transformers serve, llama.cpp) and
  ``--timed-serve``;
- :mod:`.cpu`: CPU accounting from ``/proc`` (other processes, per-thread scheduling) and machine
  information;
- :mod:`.profile`: the py-spy profile of the stoic server, classified by thread and category;
- :mod:`.bench`: the run itself (HTTP phase, profiled pass, Python API phase) and ``--url``;
- :mod:`.worker`: the in-process measurements, each run in a fresh process (``--worker``);
- :mod:`.tables`, :mod:`.overhead`, :mod:`.report`: the markdown report and the plot.

``benchmarks/serving_bench.py`` is the entry point: it puts ``benchmarks/`` on ``sys.path`` (for
this package and ``engine_bench``) and is the script the benchmark spawns for its subprocesses.
"""

from __future__ import annotations

import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "serving_bench.py"
ROOT = SCRIPT.parent.parent
BIN = Path(sys.executable).parent
CONCURRENCY = (1, 8, 32)
# stoic's defaults on this machine, passed to every server so they hold the same KV capacity
BLOCK_SIZE = 16
NUM_KV_BLOCKS = 2912  # 1 GiB of bfloat16 KV for SmolLM2-135M: 46,592 tokens
MAX_BATCHED_TOKENS = (
    256  # stoic's CPU default; transformers serve gets the same (in one comparison its TTFT was
)
# lower at 256 than at 512 here, at the same throughput)
MAX_NUM_SEQS = 64
# a measurement during which other processes used more of the machine's CPU is repeated
MAX_OTHER_CPU = 0.15
QUIET_CPU = 0.10
