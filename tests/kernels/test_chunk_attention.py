"""``stoic_chunk_attention`` (``_chunk_attention.c``): a prompt chunk's causal attention over its
sequence's keys and values where they lie in the paged pools equals float64 softmax attention
within float32 rounding: chunks from position 0 and after a cached prefix, lengths on and off
the kernel's row (16) and key (16) tiles, GQA groups of 1, 3 and 8, head dims on the 64 and 128
value routines and off them, blocks of 4 and 16 shuffled in the pools, one thread or two.
Shapes it does not take are refused with nothing written; the ``c-paged`` backend hands such
chunks to SDPA."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from stoic.kernels import Kernels
from stoic.model import KVCacheSpec, PagedKVCache
from stoic.model._attention import CPagedAttention, TorchPagedAttention
from stoic.model._cattention import PagedCAttention
from stoic.request import SamplingParams, SeqChunk, StepBatch
from stoic.worker._inputs import build_inputs


class Chunk:
    """``n`` rows at positions ``start``.. of one sequence whose blocks lie shuffled in pools
    of random keys and values (the chunk's own already written, as the caller does first)."""

    def __init__(
        self,
        start: int,
        n: int,
        heads: int,
        kv_heads: int,
        dh: int,
        block: int,
        seed: int = 0,
        pool: torch.dtype = torch.float32,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.start, self.n, self.heads, self.kv_heads, self.dh = start, n, heads, kv_heads, dh
        self.block = block
        length = start + n
        self.nblocks = -(-length // block)
        total = self.nblocks + 7  # other sequences' blocks around this one's
        order = torch.randperm(total, generator=gen)[: self.nblocks]
        self.table = (torch.arange(kv_heads)[:, None] * total + order[None, :]).contiguous()
        self.k_pool = torch.randn(kv_heads * total, block, dh, generator=gen).to(pool)
        self.v_pool = torch.randn(kv_heads * total, block, dh, generator=gen).to(pool)
        self.q = torch.randn(n, heads, dh, generator=gen)
        self.scale = dh**-0.5

    def run(self, kernels: Kernels, threads: int, **override: int) -> tuple[int, torch.Tensor]:
        out = torch.full((self.n, self.heads, self.dh), 7.0)
        args = {
            "nblocks": self.nblocks, "start": self.start, "n": self.n, "heads": self.heads,
            "kv_heads": self.kv_heads, "dh": self.dh, "block": self.block, **override,
        }  # fmt: skip
        rc = kernels.chunk_attention(
            self.q.data_ptr(), self.k_pool.data_ptr(), self.v_pool.data_ptr(),
            self.table.data_ptr(), args["nblocks"], args["start"], args["n"], args["heads"],
            args["kv_heads"], args["dh"], args["block"], self.scale, out.data_ptr(), threads,
            int(self.k_pool.dtype == torch.bfloat16),
        )  # fmt: skip
        return rc, out

    def reference(self) -> torch.Tensor:
        """float64 softmax attention, causal from the chunk's first position, ``[n, heads,
        dh]`` (over the pools' values as they are: a bfloat16 pool's widen exactly)."""
        length = self.start + self.n
        rows = self.table.reshape(-1)
        keys = self.k_pool[rows].view(self.kv_heads, -1, self.dh)[:, :length].double()
        values = self.v_pool[rows].view(self.kv_heads, -1, self.dh)[:, :length].double()
        group = self.heads // self.kv_heads
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
        q = self.q.transpose(0, 1).double()  # [heads, n, dh]
        scores = q @ keys.transpose(1, 2) * self.scale
        allowed = torch.arange(length)[None, :] <= torch.arange(self.start, length)[:, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
        return (scores.softmax(-1) @ values).transpose(0, 1).float()


@pytest.fixture
def c_kernels(kernels: Kernels) -> Kernels:
    if not kernels.chunk_attention_available:
        pytest.skip("this build has no AVX-512: prompt chunks keep SDPA")
    return kernels


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("start", "n", "block"),
    [(0, 2, 16), (0, 17, 4), (0, 225, 16), (150, 243, 16), (33, 40, 4), (511, 5, 16)],
)
@pytest.mark.parametrize(("heads", "kv_heads", "dh"), [(9, 3, 64), (8, 8, 128), (16, 2, 96)])
@pytest.mark.parametrize("pool", [torch.float32, torch.bfloat16])
def test_chunk_attention_equals_float64_causal_attention(
    c_kernels: Kernels,
    threads: int,
    start: int,
    n: int,
    block: int,
    heads: int,
    kv_heads: int,
    dh: int,
    pool: torch.dtype,
) -> None:
    """Over float32 pools and bfloat16 ones (``--kv-cache-dtype bfloat16``: every value routine,
    64, 128 and any other head dim, reads them widened)."""
    chunk = Chunk(start, n, heads, kv_heads, dh, block, pool=pool)
    rc, got = chunk.run(c_kernels, threads)
    assert rc == 0
    torch.testing.assert_close(got, chunk.reference(), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize(
    "override",
    [
        {"dh": 24},  # not a multiple of 16
        {"dh": 272},  # past the kernels' largest head
        {"heads": 8},  # 8 query heads over 3 kv heads
        {"nblocks": 1},  # the table holds fewer positions than the chunk reaches
    ],
)
def test_shapes_the_kernel_does_not_take_are_refused_with_nothing_written(
    c_kernels: Kernels, override: dict[str, int]
) -> None:
    chunk = Chunk(20, 30, 9, 3, 64, 16)
    rc, out = chunk.run(c_kernels, 2, **override)
    assert rc == -1
    assert bool((out == 7.0).all())


def test_a_nan_key_poisons_only_the_rows_that_see_it(c_kernels: Kernels) -> None:
    """A NaN in key 40 (past the 8-key group and tile boundaries): rows at positions >= 40 are
    NaN, every earlier row is finite and equals the reference."""
    chunk = Chunk(30, 20, 9, 3, 64, 16)
    block, offset = int(chunk.table[1, 40 // 16]), 40 % 16
    chunk.k_pool[block, offset, 5] = float("nan")
    rc, got = chunk.run(c_kernels, 2)
    assert rc == 0
    before = 40 - chunk.start  # rows before position 40
    assert bool(torch.isfinite(got[:before]).all())
    torch.testing.assert_close(got[:before], chunk.reference()[:before], rtol=1e-5, atol=2e-6)
    kv1_heads = slice(3, 6)  # the query heads of kv head 1
    assert bool(got[before:, kv1_heads].isnan().all())
    assert bool(torch.isfinite(got[before:, :3]).all())


@pytest.mark.parametrize("dim", [64, 24])
@pytest.mark.parametrize("pool", [torch.float32, torch.bfloat16])
def test_the_c_backend_equals_torch_on_a_mixed_step_whatever_the_head_dim(
    kernels: Kernels, dim: int, pool: torch.dtype
) -> None:
    """The ``c-paged`` backend on a step of a prompt chunk after a cached prefix, a fresh one and
    two decode tokens gives torch's attention within float32 rounding, and writes the same keys
    and values: with a head dim of 64 the chunks take the C kernel, with 24 (a multiple of 8, not
    of 16: the decode kernel's, not the chunk kernel's) SDPA, without an error. Over a bfloat16
    cache, against torch over a float32 one holding the same values (keys and values that
    bfloat16 holds exactly): the C attention computes in float32 over the widened pools."""
    spec = KVCacheSpec(
        num_layers=1, num_kv_heads=2, head_dim=dim, block_size=4, num_blocks=32,
        dtype=torch.float32, device=torch.device("cpu"),
    )  # fmt: skip
    params = SamplingParams(max_tokens=4, temperature=0)
    batch = StepBatch(
        (
            SeqChunk(0, tuple(range(9)), 6, tuple(range(0, 8)), True, params),
            SeqChunk(1, (5,), 13, tuple(range(8, 16)), True, params, num_generated=1),
            SeqChunk(2, tuple(range(11)), 0, tuple(range(16, 24)), True, params),
            SeqChunk(3, (7,), 2, tuple(range(24, 32)), True, params, num_generated=1),
        )
    )
    gen = torch.Generator().manual_seed(dim)
    n = 9 + 1 + 11 + 1
    q = torch.randn(1, 6, n, dim, generator=gen)
    k, v, prior_k, prior_v = (
        torch.randn(shape, generator=gen).to(pool).float()
        for shape in ((1, 2, n, dim), (1, 2, n, dim), (2 * 32, 4, dim), (2 * 32, 4, dim))
    )
    attn = SimpleNamespace(layer_idx=0, scaling=dim**-0.5)
    results = {}
    for backend, on in (
        (CPagedAttention(kernels), pool),
        (TorchPagedAttention(), pool),
        (TorchPagedAttention(), torch.float32),
    ):
        cache = PagedKVCache(dataclasses.replace(spec, dtype=on))
        cache.keys[0].copy_(prior_k)
        cache.values[0].copy_(prior_v)
        step = build_inputs(batch, cache, torch.device("cpu")).meta
        plan = backend.plan(step, n)
        assert isinstance(plan, PagedCAttention) == (backend.name == "c-paged")
        results[backend.name, on] = (plan.forward(attn, q, k, v, scaling=None), cache)
    want, want_cache = results["torch-paged", torch.float32]
    # the C backend, and torch's over the same cache (it widens a bfloat16 one: float32 queries
    # are not rounded to the cache's type)
    for got, got_cache in (results["c-paged", pool], results["torch-paged", pool]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got_cache.keys[0].float(), want_cache.keys[0])
        assert torch.equal(got_cache.values[0].float(), want_cache.values[0])
