"""Test helpers (public, like :mod:`stoic.actors.testing`): a tiny random model on disk.

A randomly initialised 2-layer Llama with the default model's tokenizer and chat template:
fast enough that what a test or a soak measures is the engine and the server, not the model,
and deterministic (seeded), so greedy float32 outputs can be compared exactly.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from ._batch import StepBatch
from ._loader import resolve_model_path
from ._paged import PagedKVCache
from ._runner import ModelRunner

__all__ = ["build_tiny_model", "final_hidden_states"]

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)


def build_tiny_model(target: Path, *, seed: int = 0) -> Path:
    """Write the tiny model to ``target`` (a Hugging Face model directory) and return it.

    The tokenizer files come from the default model (converted from its GGUF file on first
    use, then cached; nothing is downloaded).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    _name, default_dir = resolve_model_path("default")
    torch.manual_seed(seed)
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
    target.mkdir(parents=True, exist_ok=True)
    LlamaForCausalLM(config).save_pretrained(target)
    for name in _TOKENIZER_FILES:
        src = default_dir / name
        if src.exists():
            shutil.copy(src, target / name)
    return target


def final_hidden_states(
    runner: ModelRunner, steps: list[StepBatch], num_blocks: int, block_size: int
) -> tuple[list[torch.Tensor], PagedKVCache]:
    """Run ``steps`` in order on a fresh, zeroed cache of ``num_blocks`` blocks; return the
    final hidden states of the sampled rows of every step that samples (what the LM head is
    given), and the cache: what two forward paths are compared on."""
    cache = PagedKVCache(runner.kv_spec(num_blocks=num_blocks, block_size=block_size))
    cache.zero_blocks(tuple(range(num_blocks)))
    captured: list[torch.Tensor] = []
    head = runner._head

    def spy(x: torch.Tensor) -> torch.Tensor:
        captured.append(x.clone())
        return head(x)

    runner._head = spy  # type: ignore[assignment]
    try:
        for batch in steps:
            runner.execute(batch, cache)
    finally:
        runner._head = head
    return captured, cache
