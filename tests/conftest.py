"""Shared fixtures: the real default model (as a model directory, de-quantised once per machine)
and tiny random models."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from stoic.gguf import default_cache_dir
from stoic.kernels import Kernels, KernelsUnavailable, load_kernels
from stoic.model.testing import dequantized_model_dir

# Property tests: the default profile is derandomized, so a commit that passed keeps passing
# (CI must not turn red on an example nobody has seen); ``HYPOTHESIS_PROFILE=thorough`` searches
# fresh random examples, many more of them (run it after changing the scheduler or allocator).
settings.register_profile("default", max_examples=300, derandomize=True, deadline=None)
settings.register_profile("thorough", max_examples=20_000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


_TESTS = Path(__file__).resolve().parent
#: fixtures that load a real model (the default one, or the tiny one built from its tokenizer)
_MODEL_FIXTURES = {"default_model_dir", "tiny_model_dir", "engine"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that needs a model (through any fixture) ``model``: ``make test-fast``
    runs the rest but those marked ``slow`` (``-m "not model and not slow"``: the kernels built
    from nothing for another flag set, real CPU contention); ``make test`` runs everything."""
    for item in items:
        if _MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.model)
        # under pytest-xdist (``--dist loadgroup``) a test file runs whole on one worker, so a
        # module's shared engine or server is started once (make unit runs the Ray tests apart)
        path = Path(str(item.path)).relative_to(_TESTS)
        item.add_marker(pytest.mark.xdist_group(str(path)))


@pytest.fixture(scope="session", autouse=True)
def _data_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Servers the tests start (``stoic serve`` processes included) keep their data (the
    responses database) in a temporary directory, not the user's."""
    patch = pytest.MonkeyPatch()
    patch.setenv("STOIC_DATA_DIR", str(tmp_path_factory.mktemp("data")))
    yield
    patch.undo()


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model de-quantised from its GGUF file into a model directory (float32
    safetensors; cached across runs): the same weights through the model-directory loader."""
    return dequantized_model_dir()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """A randomly initialised 2-layer Llama with the default model's tokenizer (fast to run)."""
    from stoic.model.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def kernels() -> Kernels:
    """The C kernels, built once per run into the default cache (skips where they cannot run:
    ``test_kernels_build_wherever_the_machine_allows`` says whether that is right)."""
    try:
        return load_kernels(default_cache_dir())
    except KernelsUnavailable as e:
        pytest.skip(f"quantised kernels unavailable here: {e}")
