"""Test helpers (public, like :mod:`stoic.actors.testing`): a tiny random model on disk.

A randomly initialised 2-layer Llama with the default model's tokenizer and chat template:
fast enough that what a test or a soak measures is the engine and the server, not the model,
and deterministic (seeded), so greedy float32 outputs can be compared exactly.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from ..gguf import commit_entry, default_cache_dir, find_entry, gguf_content_key, new_entry_dir
from ._loader import default_gguf_path, resolve_model_path
from ._source import check_gguf_file, load_errors

__all__ = [
    "build_tiny_model",
    "dequantized_model_dir",
    "scattered_block_tables",
]

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)


#: where :func:`dequantized_model_dir` keeps its copies, under the cache root
DEQUANTIZED = "dequantized-for-tests"


def dequantized_model_dir(gguf: Path | None = None, cache_root: Path | None = None) -> Path:
    """A Hugging Face model directory (float32 safetensors, config, tokenizer) of ``gguf`` (the
    default model's file if None), de-quantised by transformers once and cached under
    ``cache_root / DEQUANTIZED`` (keyed by the file's content, as the model cache is).

    stoic serves a GGUF file from its own bytes; tests use this to run the same weights as a
    model directory (transformers' reference outputs, the float path, the model-directory
    loader) without a network.

    :raises ModelUnavailable: if transformers cannot read the file.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf or default_gguf_path()
    root = (cache_root or default_cache_dir()) / DEQUANTIZED
    header = check_gguf_file(source)
    key = gguf_content_key(source, header)
    found = find_entry(root, key, source, header)
    if found is not None:
        return found
    with load_errors(f"cannot read the model in {source}", "check the file"):
        tokenizer = AutoTokenizer.from_pretrained(
            str(source.parent), gguf_file=source.name, local_files_only=True
        )
        model: Any = AutoModelForCausalLM.from_pretrained(
            str(source.parent), gguf_file=source.name, dtype=torch.float32, local_files_only=True
        )
    # the de-quantised weights are plain tensors; drop the GGUF quantizer so they can be saved
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = new_entry_dir(root)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        return commit_entry(tmp, root, key, source, header)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build_tiny_model(target: Path, *, seed: int = 0) -> Path:
    """Write the tiny model to ``target`` (a Hugging Face model directory) and return it.

    The tokenizer files come from the default model (built from its GGUF file's metadata on
    first use, then cached; nothing is downloaded).
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


def scattered_block_tables(
    lens: list[int] | tuple[int, ...],
    kv_heads: int,
    pool_blocks: int,
    block_size: int,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables as a serving cache hands them out: each sequence of length ``lens[i]`` gets
    its own blocks, drawn in random order from ``pool_blocks``; returns (tables ``[M, kv_heads,
    max_blocks]`` of pool rows, kv head ``g``'s row of block ``b`` being ``g * pool_blocks + b``,
    padded with row 0; write ``[kv_heads, M]``: the flat pool position of each sequence's last
    token), the layout ``stoic_decode_attention`` reads.

    :raises ValueError: if the sequences need more blocks than the pool holds.
    """
    blocks = [-(-n // block_size) for n in lens]
    if sum(blocks) > pool_blocks:
        raise ValueError(f"{sum(blocks)} blocks needed, the pool has {pool_blocks}")
    order = torch.randperm(pool_blocks, generator=generator)
    tables = torch.zeros(len(lens), kv_heads, max(blocks), dtype=torch.int64)
    write = torch.zeros(kv_heads, len(lens), dtype=torch.int64)
    used = 0
    for i, (n, count) in enumerate(zip(lens, blocks, strict=True)):
        mine = order[used : used + count]
        used += count
        for g in range(kv_heads):
            tables[i, g, :count] = g * pool_blocks + mine
            write[g, i] = (
                int(tables[i, g, (n - 1) // block_size]) * block_size + (n - 1) % block_size
            )
    return tables, write
