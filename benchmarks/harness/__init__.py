"""The benchmarks' one harness: every entry point in ``benchmarks/`` builds on it.

- :mod:`.servers`: the servers a benchmark starts and stops (``stoic serve`` with any flags,
  llama.cpp's ``llama-server``, ``transformers serve``), all greedy with EOS ignored;
- :mod:`.load`: the streaming load generator (closed-loop clients over
  ``/v1/chat/completions``) and one pass's statistics (tokens/s, TTFT, ITL, TPOT, E2E);
- :mod:`.workload`: the prompts (seeded mixed chat prompts, per-pass tags, the fixed list of the
  recovery and soak runs) and the in-process measurements (``Engine``, ``generate``, the torch
  decode loop);
- :mod:`.cpu`: CPU other processes take while a measurement runs, and what the machine is;
- :mod:`.report`: the one quantile, value formats and markdown tables.

An entry point run as ``python benchmarks/X.py`` has ``benchmarks/`` on ``sys.path``, so it
imports ``harness`` (and the serving benchmark's ``serving`` package) directly.

Importing it makes the process offline: transformers and the hub read their caches only, here
and in the servers a benchmark starts (they inherit the environment); so an entry point imports
``harness`` before anything imports transformers.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
