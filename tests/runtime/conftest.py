"""Fixtures for the actor runtime tests."""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any

import pytest
from structlog.testing import capture_logs


@pytest.fixture(autouse=True)
def _captured_logs() -> Iterator[list[MutableMapping[str, Any]]]:
    """Capture structlog events instead of rendering them: rendering the (rich)
    tracebacks of the many deliberate failures would dominate the suite's runtime."""
    with capture_logs() as logs:
        yield logs
