"""Shared fixtures: the real default model (converted once per machine) and tiny random models."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from hypothesis import settings

from stoic.model._loader import resolve_model_path

# Property tests: the default profile is derandomized, so a commit that passed keeps passing
# (CI must not turn red on an example nobody has seen); ``HYPOTHESIS_PROFILE=thorough`` searches
# fresh random examples, many more of them (run it after changing the scheduler or allocator).
settings.register_profile("default", max_examples=300, derandomize=True, deadline=None)
settings.register_profile("thorough", max_examples=20_000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


#: fixtures that load a real model (the default one, or the tiny one built from its tokenizer)
_MODEL_FIXTURES = {"default_model_dir", "tiny_model_dir", "engine"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that needs a model (through any fixture) ``model``: ``make test-fast``
    runs the rest (``-m "not model"``)."""
    for item in items:
        if _MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.model)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model converted from its GGUF file (cached across runs)."""
    _name, path = resolve_model_path("default")
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """A randomly initialised 2-layer Llama with the default model's tokenizer (fast to run)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    target = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(target)
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "special_tokens_map.json",
    ):
        src = default_model_dir / name
        if src.exists():
            shutil.copy(src, target / name)
    return target
