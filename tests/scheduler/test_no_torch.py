"""The scheduler is pure logic over plain values: importing it (and the request types it plans
with) loads neither torch nor transformers, in a fresh interpreter. The import contract in
pyproject.toml says the same statically; this checks what really happens at run time."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_the_scheduler_and_the_request_types_import_no_torch() -> None:
    code = textwrap.dedent(
        """
        import sys
        import stoic.request
        import stoic.scheduler
        from stoic.request import SamplingParams, StepBatch
        SamplingParams(max_tokens=4).validate()
        print(sorted(m for m in ("torch", "transformers", "numpy") if m in sys.modules))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
