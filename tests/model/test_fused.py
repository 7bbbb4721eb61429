"""The fused Llama forward (:mod:`stoic.model._fused`): the same numbers as transformers' forward
through the same paged cache, with no weight held twice."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from stoic.model import PagedKVCache, load_model
from stoic.model._fused import fuse_llama
from stoic.model._layers import SPLIT_MLP_ROWS
from stoic.request import SamplingParams, SeqChunk, StepBatch
from stoic.worker import ModelRunner
from stoic.worker.testing import final_hidden_states

GREEDY = SamplingParams(max_tokens=8, temperature=0)


@pytest.fixture(scope="module")
def runners(tiny_model_dir: Path) -> tuple[ModelRunner, ModelRunner]:
    """(fused, transformers) runners over one loaded model: the second sees the fused views."""
    loaded = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    return ModelRunner(loaded), ModelRunner(loaded, fused=False)


def _hidden_states(
    runner: ModelRunner, steps: list[StepBatch]
) -> tuple[list[torch.Tensor], PagedKVCache]:
    return final_hidden_states(runner, steps, num_blocks=16, block_size=4)


def test_fused_forward_equals_transformers_forward_bitwise(
    runners: tuple[ModelRunner, ModelRunner],
) -> None:
    """Chunked prefill of two sequences, then batched decodes (steps below and above the row
    count where gate and up split): the fused path's hidden states and the keys and values it
    caches equal transformers' bit for bit in float32."""
    fused, reference = runners
    assert fused._fused is not None and reference._fused is None
    a, b = tuple(range(100, 120)), tuple(range(300, 306))
    ta, tb = (0, 1, 2, 3, 4, 5), (6, 7, 8)
    steps = [
        StepBatch((SeqChunk(0, a[:7], 0, ta, False, GREEDY),)),
        # 19 tokens: at least SPLIT_MLP_ROWS, so gate and up run as two products
        StepBatch((SeqChunk(0, a[7:], 7, ta, True, GREEDY), SeqChunk(1, b, 0, tb, True, GREEDY))),
    ]
    assert steps[1].num_tokens >= SPLIT_MLP_ROWS > steps[0].num_tokens
    for i in range(3):
        steps.append(
            StepBatch(
                (
                    SeqChunk(0, (40 + i,), 20 + i, ta, True, GREEDY),
                    SeqChunk(1, (50 + i,), 6 + i, tb, True, GREEDY),
                )
            )
        )
    (got, got_cache), (want, want_cache) = (
        _hidden_states(fused, steps),
        _hidden_states(reference, steps),
    )
    assert len(got) == len(want) == len(steps) - 1  # the first chunk samples nothing
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    for g, w in zip(
        (*got_cache.keys, *got_cache.values), (*want_cache.keys, *want_cache.values), strict=True
    ):
        assert torch.equal(g, w)


def test_fused_projections_share_the_models_weights(
    runners: tuple[ModelRunner, ModelRunner],
) -> None:
    """Every q/k/v and gate/up weight is a view into its layer's fused tensor: nothing is held
    twice, and the model's own modules read the very same numbers."""
    fused, _ = runners
    assert fused._fused is not None
    base = fused.loaded.model.base_model
    for module, layer in zip(base.layers, fused._fused._layers, strict=True):
        attn, mlp = module.self_attn, module.mlp
        q_rows = attn.q_proj.weight.shape[0]
        assert attn.q_proj.weight.data_ptr() == layer.qkv.weight.data_ptr()
        assert torch.equal(
            layer.qkv.weight[q_rows:][: attn.k_proj.weight.shape[0]], attn.k_proj.weight
        )
        assert attn.v_proj.weight.untyped_storage().data_ptr() == (
            layer.qkv.weight.untyped_storage().data_ptr()
        )
        assert mlp.up_proj.weight.untyped_storage().data_ptr() == (
            layer.gate_up.weight.untyped_storage().data_ptr()
        )


def test_other_architectures_keep_the_transformers_forward() -> None:
    """A model type the fused path does not implement gets None (the runner's generic path)."""
    config = SimpleNamespace(model_type="qwen3", hidden_act="silu")
    model = SimpleNamespace(base_model=SimpleNamespace(layers=[object()]))
    assert fuse_llama(model, config) is None


def test_decode_only_steps_attend_like_mixed_steps(
    runners: tuple[ModelRunner, ModelRunner],
) -> None:
    """Two sequences' decode tokens give the same hidden states whether the step holds only
    them (the decode-only attention path) or also a third sequence's prefill (the general path,
    which gathers queries and scatters outputs); only the matrix products' row count differs."""
    fused, _ = runners
    a, b = tuple(range(100, 109)), tuple(range(300, 305))
    prefill = StepBatch(
        (
            SeqChunk(0, a, 0, (0, 1, 2), True, GREEDY),
            SeqChunk(1, b, 0, (4, 5), True, GREEDY),
        )
    )
    decodes = (
        SeqChunk(0, (41,), 9, (0, 1, 2), True, GREEDY),
        SeqChunk(1, (51,), 5, (4, 5), True, GREEDY),
    )
    third = SeqChunk(2, tuple(range(200, 206)), 0, (8, 9), True, GREEDY)
    alone, _ = _hidden_states(fused, [prefill, StepBatch(decodes)])
    mixed, _ = _hidden_states(fused, [prefill, StepBatch((decodes[0], third, decodes[1]))])
    assert torch.allclose(alone[1], mixed[1][[0, 2]], rtol=1e-5, atol=1e-5)
