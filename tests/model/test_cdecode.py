"""Decode steps' layers in C (:mod:`stoic.model._cdecode`): the same hidden states, cached keys
and values as the torch path, up to float32 rounding."""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import torch

from stoic.kernels import KernelsUnavailable, load_kernels
from stoic.model import PagedKVCache, load_model
from stoic.model._attention import TorchPagedAttention
from stoic.model.testing import scattered_block_tables
from stoic.request import SamplingParams, SeqChunk, StepBatch
from stoic.worker import ModelRunner
from stoic.worker.testing import final_hidden_states

pytestmark = pytest.mark.model
GREEDY = SamplingParams(max_tokens=64, temperature=0)


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    from stoic.gguf import default_cache_dir

    try:
        load_kernels(default_cache_dir())
    except KernelsUnavailable as e:
        pytest.skip(f"quantised kernels unavailable here: {e}")
    loaded = load_model("default", dtype="float32", device="cpu")
    runner = ModelRunner(loaded, quantization="gguf")
    assert runner._fused is not None and runner._fused.c_decoder is not None
    return runner


def _run(runner: ModelRunner, steps: list[StepBatch], c_path: bool) -> tuple[list[Any], Any]:
    """The hidden states of every sampling step and the cache, with or without the C layers."""
    fused = runner._fused
    assert fused is not None
    saved = fused.c_decoder
    if not c_path:
        fused.c_decoder = None
    try:
        return final_hidden_states(runner, steps, num_blocks=32, block_size=4)
    finally:
        fused.c_decoder = saved


def _assert_same(got_run: Any, want_run: Any, steps: int) -> None:
    """Two runs' hidden states and cached keys/values agree within float32 rounding."""
    (got, got_cache), (want, want_cache) = got_run, want_run
    assert len(got) == len(want) == steps
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    for g, w in zip(
        (*got_cache.keys, *got_cache.values), (*want_cache.keys, *want_cache.values), strict=True
    ):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_c_layers_equal_the_torch_path(runner: ModelRunner) -> None:
    """Three sequences of different lengths (5, 23 and 9 tokens: blocks of 4, several decode
    groups) prefilled on the torch path, then decode steps of all three and of two: every
    step's hidden states and the keys and values written agree within float32 rounding."""
    tables = [(0, 1, 2, 3, 4), (8, 9, 10, 11, 12, 13, 14, 15), (20, 21, 22, 23, 24)]
    prompts = [tuple(range(100, 105)), tuple(range(300, 323)), tuple(range(700, 709))]
    steps = [
        StepBatch(tuple(SeqChunk(i, p, 0, tables[i], True, GREEDY) for i, p in enumerate(prompts)))
    ]
    for n in range(4):
        chunks = [
            SeqChunk(i, (50 + n + i,), len(p) + n, tables[i], True, GREEDY)
            for i, p in enumerate(prompts)
            if n < 2 or i != 1  # the longest leaves after two steps
        ]
        steps.append(StepBatch(tuple(chunks)))
    _assert_same(_run(runner, steps, True), _run(runner, steps, False), len(steps))


def test_steps_of_few_tokens_take_the_c_path_and_bigger_ones_torch(runner: ModelRunner) -> None:
    """Any step of at most the kernels' rows takes the C layers (a short prompt, a decode, a
    chunk of draft tokens to verify); a step of more tokens takes the torch path."""
    fused = runner._fused
    assert fused is not None and fused.c_decoder is not None
    rows = fused.c_decoder.max_rows
    with mock.patch.object(fused.c_decoder, "forward", wraps=fused.c_decoder.forward) as calls:
        table = tuple(range(16))
        cache = PagedKVCache(runner.kv_spec(num_blocks=16, block_size=4))
        cache.zero_blocks(table)
        prompt = tuple(range(rows + 1))
        runner.execute(StepBatch((SeqChunk(0, prompt, 0, table, True, GREEDY),)), cache)
        assert calls.call_count == 0
        runner.execute(StepBatch((SeqChunk(0, (5,), len(prompt), table, True, GREEDY),)), cache)
        assert calls.call_count == 1
        chunk = SeqChunk(0, (6, 7, 8), len(prompt) + 1, table, True, GREEDY)
        runner.execute(StepBatch((chunk,)), cache)
        assert calls.call_count == 2


def test_c_layers_equal_the_torch_path_on_small_prefill_and_mixed_steps(
    runner: ModelRunner,
) -> None:
    """Steps with prefill chunks of few tokens (whole short prompts, a continued chunk after
    cached tokens, and such chunks next to decodes: what a draft chunk to verify is) run
    through the C layers' rows attention with the hidden states and cached keys/values of the
    torch path, within float32 rounding."""
    tables = [tuple(range(8 * i, 8 * i + 8)) for i in range(4)]
    prompts = [tuple(range(100, 105)), tuple(range(300, 307)), tuple(range(700, 703))]
    steps = [
        StepBatch(tuple(SeqChunk(i, p, 0, tables[i], True, GREEDY) for i, p in enumerate(prompts)))
    ]
    decodes = [
        SeqChunk(i, (50 + i,), len(p), tables[i], True, GREEDY) for i, p in enumerate(prompts)
    ]
    steps.append(StepBatch(tuple(decodes)))
    verify = SeqChunk(0, (60, 61, 62, 63, 64), len(prompts[0]) + 1, tables[0], True, GREEDY)
    others = [
        SeqChunk(i, (60 + i,), len(p) + 1, tables[i], True, GREEDY)
        for i, p in enumerate(prompts)
        if i
    ]
    steps.append(
        StepBatch((verify, *others, SeqChunk(3, (900, 901, 902), 0, tables[3], False, GREEDY)))
    )
    steps.append(StepBatch((SeqChunk(3, (903, 904), 3, tables[3], True, GREEDY),)))
    fused = runner._fused
    assert fused is not None and fused.c_decoder is not None
    assert all(b.num_tokens <= fused.c_decoder.max_rows for b in steps)
    with mock.patch.object(fused.c_decoder, "forward", wraps=fused.c_decoder.forward) as calls:
        got = _run(runner, steps, True)
    assert calls.call_count == len(steps)
    _assert_same(got, _run(runner, steps, False), len(steps))


def _run_torch_path(runner: ModelRunner, steps: list[StepBatch], c_attention: bool) -> Any:
    """Hidden states and cache with the C layers off, the decode attention in C or in torch."""
    fused = runner._fused
    assert fused is not None
    saved = fused.c_decoder, fused.attention
    assert fused.attention.name == "c-paged"
    fused.c_decoder = None
    if not c_attention:
        fused.attention = TorchPagedAttention()
    try:
        return final_hidden_states(runner, steps, num_blocks=40, block_size=4)
    finally:
        fused.c_decoder, fused.attention = saved


def test_decode_attention_in_c_equals_torch_on_mixed_and_decode_steps(runner: ModelRunner) -> None:
    """On the torch path (steps the C layers do not take), decode tokens and prompt chunks
    attended by the C kernels over the paged blocks give the hidden states and cached
    keys/values torch's gathered attention (SDPA for the chunks) gives, within float32
    rounding: a prefill of three prompts, a decode-only step of the three sequences, and mixed
    steps where a new prompt is prefilled (in two chunks, the second attending to the first
    through the cache) next to those decodes."""
    tables = [tuple(range(8 * i, 8 * i + 8)) for i in range(4)]
    prompts = [tuple(range(100, 105)), tuple(range(300, 323)), tuple(range(700, 709))]
    steps = [
        StepBatch(tuple(SeqChunk(i, p, 0, tables[i], True, GREEDY) for i, p in enumerate(prompts)))
    ]
    decodes = [
        SeqChunk(i, (50 + i,), len(p), tables[i], True, GREEDY) for i, p in enumerate(prompts)
    ]
    steps.append(StepBatch(tuple(decodes)))
    new = tuple(range(900, 914))
    later = [
        SeqChunk(i, (60 + i,), len(p) + 1, tables[i], True, GREEDY) for i, p in enumerate(prompts)
    ]
    steps.append(StepBatch((*later, SeqChunk(3, new[:6], 0, tables[3], False, GREEDY))))
    last = [
        SeqChunk(i, (70 + i,), len(p) + 2, tables[i], True, GREEDY) for i, p in enumerate(prompts)
    ]
    steps.append(StepBatch((SeqChunk(3, new[6:], 6, tables[3], True, GREEDY), *last)))
    _assert_same(
        _run_torch_path(runner, steps, True), _run_torch_path(runner, steps, False), len(steps)
    )


@pytest.mark.parametrize("pool", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 24])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("lens", [(1,), (7, 8, 9, 33, 64, 130), (300,) * 3])
def test_decode_attention_kernel_equals_float64_softmax_attention(
    kernels: Any, threads: int, lens: tuple[int, ...], dim: int, pool: torch.dtype
) -> None:
    """``stoic_decode_attention`` writes each token's key and value at its slot, then gives
    softmax(q k^T * scale) v over each sequence's own blocks (scattered in the pool), equal to
    float64 arithmetic within float32 rounding: for lengths below, at and across the 8-key
    tiles and 16-position blocks, one job per head (one token) and per kv head (many), and
    scores far enough apart (scale 3) that most exponentials underflow to 0; head_dim 64 (the
    16-lane loop where the build has AVX-512) and 24 (the 8-lane one everywhere). Over bfloat16
    pools (``--kv-cache-dtype bfloat16``) the new keys and values are written rounded as torch
    rounds them (bitwise), and the attention is the same float64 arithmetic over the pools'
    values: the kernel widens them exactly."""
    gen = torch.Generator().manual_seed(len(lens) * 10 + threads)
    heads, kv_heads, block, pool_blocks = 9, 3, 16, 200
    shape = (kv_heads * pool_blocks, block, dim)
    k_pool = torch.randn(shape, generator=gen).to(pool)
    v_pool = torch.randn(shape, generator=gen).to(pool)
    m, blocks = len(lens), max(-(-n // block) for n in lens)
    tables, write = scattered_block_tables(lens, kv_heads, pool_blocks, block, gen)
    q = torch.randn(m, heads, dim, generator=gen)
    k, v = (
        torch.randn(m, kv_heads, dim, generator=gen),
        torch.randn(m, kv_heads, dim, generator=gen),
    )
    out = torch.full((m, heads, dim), float("nan"))
    lengths = torch.tensor(lens)
    rc = kernels.attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(),
        write.data_ptr(), tables.data_ptr(), lengths.data_ptr(), m, heads, kv_heads,
        dim, block, blocks, 3.0, out.data_ptr(), threads, int(pool == torch.bfloat16),
    )  # fmt: skip
    assert rc == 0
    for i, n in enumerate(lens):
        for g in range(kv_heads):
            rows = tables[i, g, : -(-n // block)]
            keys = k_pool[rows].reshape(-1, dim)[:n].double()
            values = v_pool[rows].reshape(-1, dim)[:n].double()
            # written (rounded to the pool's type as torch rounds), then attended
            assert torch.equal(keys[-1], k[i, g].to(pool).double())
            assert torch.equal(values[-1], v[i, g].to(pool).double())
            for h in range(g * heads // kv_heads, (g + 1) * heads // kv_heads):
                want = torch.softmax(keys @ q[i, h].double() * 3.0, 0) @ values
                torch.testing.assert_close(out[i, h].double(), want, rtol=1e-5, atol=1e-5)


def test_a_nan_key_makes_its_sequences_attention_nan_and_no_other(kernels: Any) -> None:
    """A NaN in one sequence's cached keys reaches that sequence's outputs as NaN (as torch's
    softmax gives), instead of being weighted ~0 by a clamped exponential; the other
    sequence's outputs stay finite."""
    heads, kv_heads, dim, block, pool_blocks = 9, 3, 64, 16, 40
    gen = torch.Generator().manual_seed(11)
    shape = (kv_heads * pool_blocks, block, dim)
    k_pool, v_pool = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    lens = (40, 40)
    tables, write = scattered_block_tables(lens, kv_heads, pool_blocks, block, gen)
    k_pool.view(-1, dim)[int(tables[0, 1, 0]) * block + 3, 5] = float("nan")  # seq 0, kv head 1
    q = torch.randn(2, heads, dim, generator=gen)
    k, v = (
        torch.randn(2, kv_heads, dim, generator=gen),
        torch.randn(2, kv_heads, dim, generator=gen),
    )
    out, lengths = torch.zeros(2, heads, dim), torch.tensor(lens)
    rc = kernels.attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(),
        write.data_ptr(), tables.data_ptr(), lengths.data_ptr(), 2, heads, kv_heads, dim, block,
        tables.shape[2], 0.125, out.data_ptr(), 2, 0,
    )  # fmt: skip
    assert rc == 0
    assert torch.isnan(out[0, 3:6]).all()  # the query heads of kv head 1
    assert torch.isfinite(out[0, :3]).all() and torch.isfinite(out[0, 6:]).all()
    assert torch.isfinite(out[1]).all()
