"""Qwen2 (q/k/v biases), Qwen3 (q/k norms), Mistral (sliding window), Phi-3 (fused qkv and
gate_up) and Gemma 3 (1 + w norms, post norms, GELU, two rotary tables) run on the fused path
(:mod:`stoic.model._fused`), from a Hugging Face directory and from a quantised GGUF file (on
its blocks): greedy tokens equal transformers' ``generate`` and logprobs are within 1e-4 of its
own, float32, alone, batched, in chunks and from the prefix cache; the generic forward is never
called."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from gguf_blocks import BYTE_VOCAB, write_model_gguf
from support import greedy_reference

import stoic
from stoic.gguf import _weights as _gguf_weights
from stoic.gguf import default_cache_dir
from stoic.model import load_model
from stoic.model._fused import FusedLlama
from stoic.worker import ModelRunner

#: family -> (config class, model class, config overrides, GGUF architecture)
FAMILIES: dict[str, tuple[Any, Any, dict[str, Any], str]] = {
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}, "qwen2"),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 128}, "qwen3"),
    # a window shorter than the prompts: the paged mask must honour it
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        {"sliding_window": 9},
        "llama",
    ),
    "phi3": (
        transformers.Phi3Config,
        transformers.Phi3ForCausalLM,
        {"pad_token_id": 0, "bos_token_id": 256, "eos_token_id": 257},
        "phi3",
    ),
    # sliding layers (window 9, their own rotary table) and a global one
    "gemma3": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        {
            "head_dim": 64,
            "sliding_window": 9,
            "layer_types": ["sliding_attention", "full_attention"],
            "pad_token_id": 0,
            "bos_token_id": 256,
            "eos_token_id": 257,
        },
        "gemma3",
    ),
}
#: prompts longer than a chunk (``max_num_batched_tokens``) and than Mistral's window; the
#: last two share a prefix of three KV blocks
PROMPTS = [
    [5, 77, 200, 12, 9, 101, 42, 8, 100, 3, 250, 17, 64, 33, 90, 2, 7, 150, 66, 44, 11],
    [9, 9, 120, 4],
    [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 1, 2, 3, 4, 5],
    [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 200, 201, 202],
]
TOKENS = 10


def _tiny(family: str) -> Any:
    """A random model of ``family``: 2 layers, width 256, weights large enough that the
    outputs depend on the context (initialiser 0.08), untied output."""
    config_cls, model_cls, extra, _ = FAMILIES[family]
    config = config_cls(
        vocab_size=BYTE_VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.08,
        tie_word_embeddings=False,
        **extra,
    )
    torch.manual_seed(0)
    model = model_cls(config).eval()
    if family == "qwen2":  # non-zero biases (transformers initialises them to zero)
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0.0, 0.5)
    return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_model(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    default_model_dir: Path,
) -> tuple[str, Path, Path]:
    """(family, its Hugging Face directory, its Q8_0 GGUF file)."""
    family = request.param
    root = tmp_path_factory.mktemp(family)
    model = _tiny(family)
    model.save_pretrained(root / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (root / "hf" / name).write_bytes((default_model_dir / name).read_bytes())
    gguf = write_model_gguf(root / "tiny.gguf", model, FAMILIES[family][3], "Q8_0")
    return family, root / "hf", gguf


def _never_generic(model: Any) -> None:
    """Make transformers' own decoder stack raise if it is ever called."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the generic transformers forward ran")

    for layer in model.base_model.layers:
        layer.forward = refuse


async def _engine_outputs(model: str, cache: Path, quantization: str) -> list[Any]:
    """Every prompt alone, then all four at once (chunks of 8 tokens; the shared prefix from
    the cache), through an engine in a thread."""
    config = stoic.EngineConfig(
        model=model,
        cache_dir=cache,
        quantization=quantization,  # type: ignore[arg-type]
        executor="thread",
        dtype="float32",
        num_kv_blocks=64,
        block_size=4,
        max_num_batched_tokens=8,
        max_num_seqs=4,
    )
    params = stoic.SamplingParams(
        max_tokens=TOKENS, min_tokens=TOKENS, temperature=0, logprobs=True
    )
    async with stoic.Engine.start(config) as engine:
        alone = [await engine.complete(ids, params) for ids in PROMPTS]
        together = await asyncio.gather(*(engine.complete(ids, params) for ids in PROMPTS))
    return [*alone, *together]


@pytest.mark.model
@pytest.mark.parametrize("source", ["hf", "gguf"])
async def test_a_family_runs_fused_and_decodes_like_transformers(
    family_model: tuple[str, Path, Path], source: str, tmp_path: Path
) -> None:
    """The family's model (its directory, or its Q8_0 GGUF file on the file's blocks) runs on
    the fused path, never on transformers' decoder layers, and gives transformers' greedy
    tokens with logprobs within 1e-4, each prompt alone and all together, prefilled in chunks
    and from the prefix cache."""
    family, hf, gguf = family_model
    path = str(hf if source == "hf" else gguf)
    quantization = "none" if source == "hf" else "gguf"
    if source == "gguf":
        from stoic.kernels import KernelsUnavailable, load_kernels

        try:
            load_kernels(default_cache_dir())
        except KernelsUnavailable as e:
            pytest.skip(f"quantised kernels unavailable here: {e}")
    cache = tmp_path / "cache"
    loaded = load_model(path, dtype="float32", device="cpu", cache_root=cache)
    # transformers' own, on the de-quantised weights for GGUF (every tensor made dense: the
    # direct load leaves the projections on the blocks)
    dense = load_model(path, dtype="float32", device="cpu", cache_root=cache, quantization="none")
    want_tokens, want_logprobs = zip(*greedy_reference(dense.model, PROMPTS, TOKENS), strict=True)
    assert len({tuple(t) for t in want_tokens}) == len(PROMPTS)  # outputs depend on the prompt
    runner = ModelRunner(loaded, quantization=quantization)  # type: ignore[arg-type]
    assert isinstance(runner._fused, FusedLlama)
    if source == "gguf":  # every projection and the output on the file's blocks
        summary = runner.quantized
        assert summary["projections"] == summary["of"] == 8 and summary["head"] == "Q8_0"
        # the C decode layers where the layer is Llama's plus a window or q/k/v biases (not
        # with norms of q and k or Gemma's)
        assert summary["c_layers"] == (family in ("mistral", "phi3", "qwen2"))

    original = transformers.AutoModelForCausalLM.from_pretrained
    skeleton = _gguf_weights._skeleton
    with pytest.MonkeyPatch.context() as patch:

        def loading(*args: Any, **kwargs: Any) -> Any:
            loaded = original(*args, **kwargs)
            # with output_loading_info (the loader checks the head was loaded) a pair
            _never_generic(loaded[0] if isinstance(loaded, tuple) else loaded)
            return loaded

        def building(*args: Any) -> Any:  # a GGUF file's model (:mod:`._gguf_weights`)
            built = skeleton(*args)
            _never_generic(built)
            return built

        patch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", loading)
        patch.setattr(_gguf_weights, "_skeleton", building)
        results = await _engine_outputs(path, cache, quantization)
    for i, result in enumerate(results):
        index = i % len(PROMPTS)
        assert list(result.token_ids) == want_tokens[index], (family, source, i)
        got = [lp.logprob for lp in result.logprobs]
        assert got == pytest.approx(want_logprobs[index], abs=1e-4), (family, source, i)


def test_architectures_outside_the_list_keep_the_generic_path(tmp_path: Path) -> None:
    """A GPT-2 model is not fused, nor a Phi-3 of partial rotary, nor a Gemma 3 whose
    attention is soft-capped (the paged attention here has no cap)."""
    from stoic.model._fused import fuse_llama

    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=300)
    )
    assert fuse_llama(gpt2, gpt2.config) is None
    config = transformers.Phi3Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        pad_token_id=0,
        partial_rotary_factor=0.5,
    )
    phi = transformers.Phi3ForCausalLM(config)
    assert fuse_llama(phi, config) is None
    soft = transformers.Gemma3TextConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        pad_token_id=0,
        attn_logit_softcapping=30.0,
    )
    gemma = transformers.Gemma3ForCausalLM(soft)
    assert fuse_llama(gemma, soft) is None
    soft.attn_logit_softcapping = None  # the same model without the cap is fused
    assert fuse_llama(gemma, soft) is not None
