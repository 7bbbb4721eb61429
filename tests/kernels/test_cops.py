"""The bfloat16 prefill's elementwise operators in C (:mod:`stoic.kernels._cops`) and the packed
bfloat16 products (:mod:`stoic.gguf._packed`): torch's numbers up to bfloat16 rounding."""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from stoic.gguf import PackedLinear
from stoic.kernels import Kernels, PrefillOps
from stoic.model import load_model
from stoic.model._layers import _rotate
from stoic.request import SamplingParams, SeqChunk, StepBatch
from stoic.worker import ModelRunner
from stoic.worker.testing import final_hidden_states

#: one bfloat16 step (8 bits of mantissa): what rounding an intermediate once more can move
BF16 = {"rtol": 2**-7, "atol": 1e-6}


@pytest.fixture(scope="module")
def ops(kernels: Kernels) -> PrefillOps:
    return PrefillOps(kernels)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("rows", [1, 37])
def test_rms_norm_is_torchs_rounded_to_bfloat16(ops: PrefillOps, rows: int) -> None:
    """One pass gives ``F.rms_norm`` in float32 rounded to bfloat16: equal almost everywhere,
    within one bfloat16 step where the float32 sums' order moves a value across a rounding
    boundary; the input is left as it was."""
    x = torch.randn(1, rows, 576, generator=_gen(rows)) * 3
    weight = torch.randn(576, generator=_gen(7))
    before = x.clone()
    got = ops.rms_norm(x, weight, 1e-5)
    want = F.rms_norm(x, (576,), weight, 1e-5).bfloat16()
    assert got.dtype == torch.bfloat16 and got.shape == x.shape and torch.equal(x, before)
    torch.testing.assert_close(got.float(), want.float(), **BF16)
    assert (got == want).float().mean() > 0.99


@pytest.mark.parametrize("rows", [1, 29])
def test_rotate_turns_the_query_and_key_heads_in_place_and_leaves_the_values(
    ops: PrefillOps, rows: int
) -> None:
    """The first 12 heads of each row are rotated as transformers' Llama rotates them (float32
    arithmetic, rounded once); the 3 value heads after them are untouched."""
    angles = torch.rand(rows, 32, generator=_gen(1)) * 6
    cos = torch.cat([angles.cos()] * 2, -1)
    sin = torch.cat([angles.sin()] * 2, -1)
    y = torch.randn(1, rows, 15 * 64, generator=_gen(2)).bfloat16()
    original = y.clone()
    ops.rotate_(y, 12, 64, cos, sin)
    heads = original.float()[..., : 12 * 64].view(1, rows, 12, 64).transpose(1, 2)
    want = _rotate(heads, cos[None, None], sin[None, None]).transpose(1, 2).reshape(1, rows, -1)
    torch.testing.assert_close(y[..., : 12 * 64].float(), want.bfloat16().float(), **BF16)
    assert torch.equal(y[..., 12 * 64 :], original[..., 12 * 64 :])


@pytest.mark.parametrize("width", [1536, 27])
def test_silu_mul_of_a_fused_products_two_halves(ops: PrefillOps, width: int) -> None:
    """``silu(gate) * up`` over the two strided halves of one ``[N, 2F]`` result (as the fused
    ``[gate; up]`` product gives them) and over separate tensors, for a width of whole vectors
    and one that needs the scalar tail; large negative and positive gates included."""
    both = (torch.randn(1, 5, 2 * width, generator=_gen(width)) * 6).bfloat16()
    both[0, 0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])
    gate, up = both.chunk(2, -1)
    want = (F.silu(gate.float()) * up.float()).bfloat16()
    for g, u in ((gate, up), (gate.contiguous(), up.contiguous())):
        got = ops.silu_mul(g, u)
        assert got.dtype == torch.bfloat16 and got.is_contiguous()
        torch.testing.assert_close(got.float(), want.float(), **BF16)


def test_bad_arguments_are_refused_before_anything_is_written(ops: PrefillOps) -> None:
    """Wrong dtypes, shapes or layouts raise ValueError and leave the tensors as they were."""
    x = torch.randn(2, 576)
    with pytest.raises(ValueError, match="float32"):
        ops.rms_norm(x.bfloat16(), torch.ones(576), 1e-5)
    with pytest.raises(ValueError, match="weight"):
        ops.rms_norm(x, torch.ones(575), 1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        ops.rms_norm(torch.randn(576, 2).t(), torch.ones(576), 1e-5)
    y = torch.randn(3, 960).bfloat16()
    before = y.clone()
    with pytest.raises(ValueError, match="cos"):
        ops.rotate_(y, 12, 64, torch.ones(2, 64), torch.ones(3, 64))
    with pytest.raises(ValueError, match="heads"):
        ops.rotate_(y, 16, 64, torch.ones(3, 64), torch.ones(3, 64))
    assert torch.equal(y, before)
    with pytest.raises(ValueError, match="differ"):
        ops.silu_mul(y, y[:, :10])
    with pytest.raises(ValueError, match="bfloat16"):
        ops.silu_mul(y.float(), y.float())
    with pytest.raises(ValueError, match="rows"):
        ops.silu_mul(y.t(), y.t())


def test_packed_products_equal_f_linear_bit_for_bit() -> None:
    """A bfloat16 weight packed for oneDNN, whole or as two row halves, with and without a bias,
    gives exactly ``F.linear``'s result at every number of rows; a float32 weight is not
    packed (its products stay MKL's)."""
    weight = torch.randn(96, 64, generator=_gen(3)).bfloat16()
    bias = torch.randn(96, generator=_gen(4)).bfloat16()
    assert PackedLinear.build(weight.float(), None) is None
    if PackedLinear.build(weight, None) is None:  # logged: model.packing.off
        pytest.skip("this torch's oneDNN cannot pack bfloat16 on this CPU (no AVX-512)")
    for b in (None, bias):
        for parts in (1, 2):
            packed = PackedLinear.build(weight, b, parts)
            assert packed is not None and packed.parts == parts
            for rows in (1, 17, 300):
                x = torch.randn(1, rows, 64, generator=_gen(rows)).bfloat16()
                got = torch.cat(packed(x), -1)
                assert torch.equal(got, F.linear(x, weight, b))


@pytest.mark.model
def test_the_split_runner_prefills_with_the_c_operators(kernels: Kernels) -> None:
    """With a bfloat16 dense dtype, a prefill step runs every layer's SiLU x up (and norms and
    rotary) in C; its final hidden state is the torch operators' within bfloat16 rounding."""
    loaded = load_model("default", dtype="float32", device="cpu", dense_dtype="bfloat16")
    runner = ModelRunner(loaded, quantization="gguf")
    fused = runner._fused
    assert fused is not None and fused._ops is not None
    ops = fused._ops
    calls: list[int] = []
    real = ops.silu_mul

    def counting(*args: Any) -> torch.Tensor:
        calls.append(1)
        return real(*args)

    ops.silu_mul = counting  # type: ignore[method-assign]
    prompt = tuple(range(500, 540))
    steps = [
        StepBatch((SeqChunk(0, prompt, 0, tuple(range(10)), True, SamplingParams(max_tokens=1)),))
    ]
    (with_c,), _ = final_hidden_states(runner, steps, num_blocks=10, block_size=4)
    assert len(calls) == len(fused._layers)
    fused._ops = None
    try:
        (with_torch,), _ = final_hidden_states(runner, steps, num_blocks=10, block_size=4)
    finally:
        fused._ops = ops
    assert F.cosine_similarity(with_c, with_torch, dim=-1).min() > 0.999


@pytest.mark.model
def test_a_bfloat16_gguf_model_keeps_torchs_operators(kernels: Kernels) -> None:
    """A whole-bfloat16 model (``--dtype bfloat16``) with the GGUF kernels prefills and decodes:
    the C operators take the split's float32 residual only, so its steps keep torch's."""
    loaded = load_model("default", dtype="bfloat16", device="cpu")
    runner = ModelRunner(loaded, quantization="gguf")
    fused = runner._fused
    assert fused is not None and fused._ops is not None
    norm = mock.patch.object(fused._ops, "rms_norm", wraps=fused._ops.rms_norm)
    greedy = SamplingParams(max_tokens=4, temperature=0)
    table = tuple(range(12))
    steps = [
        StepBatch((SeqChunk(0, tuple(range(500, 540)), 0, table, True, greedy),)),
        StepBatch((SeqChunk(0, (600,), 40, table, True, greedy),)),
    ]
    with norm as calls:
        states, _ = final_hidden_states(runner, steps, num_blocks=12, block_size=4)
    assert len(states) == 2 and all(torch.isfinite(s).all() for s in states)
    assert calls.call_count == 0
