"""Fixtures of the model layer's tests."""

from __future__ import annotations

import pytest

from stoic.model import default_cache_dir
from stoic.model._qkernels import Kernels, KernelsUnavailable, load_kernels


@pytest.fixture(scope="session")
def kernels() -> Kernels:
    """The quantised kernels, built once into the default cache (skips where they cannot run:
    ``test_kernels_build_wherever_the_machine_allows`` says whether that is right)."""
    try:
        return load_kernels(default_cache_dir())
    except KernelsUnavailable as e:
        pytest.skip(f"quantised kernels unavailable here: {e}")
