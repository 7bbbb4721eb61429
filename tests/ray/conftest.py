"""Engine replicas on a local Ray (``num_cpus=2``), the tiny model, behind stoic's HTTP app.

Every test here is marked ``ray`` (``pytest -m ray`` selects them, ``-m "not ray"`` skips them);
they need the ``stoic[ray]`` extra.
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/ray/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.ray)
