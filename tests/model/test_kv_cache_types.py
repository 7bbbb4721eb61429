"""The KV cache's type (``--kv-cache-dtype``) on every attention path of the default model: a
float16 cache (which the C kernels do not read) keeps torch's layers and attention and gives the
float32 cache's results within float16 rounding; a deterministic runner refuses any cache but
float32, in one line, at its construction."""

from __future__ import annotations

import pytest
import torch

from stoic.errors import ModelUnavailable
from stoic.kernels import Kernels
from stoic.model import load_model
from stoic.request import SamplingParams, SeqChunk, StepBatch
from stoic.worker import ModelRunner
from stoic.worker.testing import final_hidden_states

GREEDY = SamplingParams(max_tokens=8, temperature=0)
BLOCK = 16


def _steps() -> list[StepBatch]:
    """Two prompts prefilled, then three decode steps of both (one row each: the C layers' kind
    of step)."""
    prompts = [tuple(range(100, 140)), tuple(range(500, 521))]
    tables = [tuple(range(0, 8)), tuple(range(8, 16))]
    steps = [
        StepBatch(tuple(SeqChunk(i, p, 0, tables[i], True, GREEDY) for i, p in enumerate(prompts)))
    ]
    for k in range(3):
        steps.append(
            StepBatch(
                tuple(
                    SeqChunk(i, (7 + k,), len(p) + k, tables[i], True, GREEDY, num_generated=k + 1)
                    for i, p in enumerate(prompts)
                )
            )
        )
    return steps


@pytest.mark.model
def test_a_float16_cache_keeps_torch_attention_and_the_float32_caches_results(
    kernels: Kernels,
) -> None:
    """float32 activations over a float16 cache: the decode steps that the C layers would take
    go through torch's layers (the kernels read float32 or bfloat16 pools only; before this was
    checked the C layers wrote float32 rows into the half-size pools), and the hidden states
    equal those over a float32 cache within float16 rounding of the keys and values."""
    exact = ModelRunner(load_model("default", dtype="float32", kv_cache_dtype="float32"))
    half = ModelRunner(load_model("default", dtype="float32", kv_cache_dtype="float16"))
    assert half.loaded.cache_dtype == torch.float16
    assert half.compute_path.kv_cache_dtype == "float16"
    want, _ = final_hidden_states(exact, _steps(), 16, BLOCK)
    got, cache = final_hidden_states(half, _steps(), 16, BLOCK)
    assert cache.keys[0].dtype == torch.float16
    assert len(got) == len(want) == 4
    for g, w in zip(got, want, strict=True):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, rtol=0.02, atol=0.02)


@pytest.mark.model
def test_a_deterministic_runner_refuses_a_cache_other_than_float32(kernels: Kernels) -> None:
    """The rows kernel reads float32 pools: a model loaded with the default mode's bfloat16 cache
    is refused by a deterministic runner in one line naming the fix; loaded for the mode
    (``deterministic=True``), ``auto`` gives float32 and the runner starts."""
    loaded = load_model("default", dtype="auto")
    assert loaded.cache_dtype == torch.bfloat16
    with pytest.raises(ModelUnavailable, match="reads a float32 KV cache, not bfloat16") as caught:
        ModelRunner(loaded, deterministic=True)
    assert "\n" not in str(caught.value)
    fit = load_model("default", dtype="auto", deterministic=True)
    assert fit.cache_dtype == torch.float32
    assert ModelRunner(fit, deterministic=True).deterministic
