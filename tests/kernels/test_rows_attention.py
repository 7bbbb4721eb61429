"""``stoic_prefill_attention`` (``_rows_attention.c``): runs of rows of one sequence (prefill
chunks, deterministic mode) attend together, and every row's result is bitwise what
``stoic_decode_attention`` computes for that row alone: head dims on and off the 16-lane
routine's, GQA groups of 1, 3 and 8, lengths on and off the 8-key groups and the tiles, one
thread or two, the machine's build and the AVX2 one."""

from __future__ import annotations

import pytest
import torch

from stoic.kernels import Kernels, load_kernels

BLOCK = 16
#: (first position, rows) of the runs of one step: chunks crossing the kernel's row tiles (16)
#: and key tiles (64), a run of one (a decode token), a chunk from position 0
RUNS = ((0, 37), (100, 21), (203, 1), (61, 3), (5, 18))


@pytest.fixture(scope="module")
def avx2_kernels(tmp_path_factory: pytest.TempPathFactory, kernels: Kernels) -> Kernels:
    """The kernels built without AVX-512 (the 8-lane attention, as on an AVX2 CPU)."""
    from stoic.kernels import _build

    flags = _build.cpu_flags() - {"avx512f"}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_build, "cpu_flags", lambda: flags)
        return load_kernels(tmp_path_factory.mktemp("avx2-kernels"))


class Step:
    """A step of the runs :data:`RUNS`, each of its own sequence, whose blocks lie shuffled in
    the pools (random keys and values before the step writes its tokens')."""

    def __init__(self, heads: int, kv_heads: int, dh: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.heads, self.kv_heads, self.dh = heads, kv_heads, dh
        per_seq = max(p + n for p, n in RUNS) // BLOCK + 1
        num_blocks = len(RUNS) * per_seq
        order = torch.randperm(num_blocks, generator=gen)
        owned = [order[i * per_seq : (i + 1) * per_seq] for i in range(len(RUNS))]
        self.k_pool = torch.randn(kv_heads * num_blocks, BLOCK, dh, generator=gen)
        self.v_pool = torch.randn(kv_heads * num_blocks, BLOCK, dh, generator=gen)
        tables, lens, write, runs = [], [], [], []
        for (pos, n), blocks in zip(RUNS, owned, strict=True):
            runs.append((len(lens), n))
            for t in range(pos, pos + n):
                tables.append([[h * num_blocks + int(b) for b in blocks] for h in range(kv_heads)])
                lens.append(t + 1)
        m = len(lens)
        for h in range(kv_heads):
            for table, length in zip(tables, lens, strict=True):
                t = length - 1
                write.append(table[h][t // BLOCK] * BLOCK + t % BLOCK)
        self.tables = torch.tensor(tables)
        self.lens = torch.tensor(lens)
        self.write = torch.tensor(write)
        self.runs = torch.tensor(runs)
        self.q = torch.randn(m, heads, dh, generator=gen)
        self.k = torch.randn(m, kv_heads, dh, generator=gen)
        self.v = torch.randn(m, kv_heads, dh, generator=gen)

    def _args(self, k_pool: torch.Tensor, v_pool: torch.Tensor) -> list[int]:
        return [
            self.q.data_ptr(), self.k.data_ptr(), self.v.data_ptr(), k_pool.data_ptr(),
            v_pool.data_ptr(), self.write.data_ptr(), self.tables.data_ptr(),
            self.lens.data_ptr(),
        ]  # fmt: skip

    def _shape(self) -> list[int]:
        m = int(self.lens.numel())
        return [m, self.heads, self.kv_heads, self.dh, BLOCK, int(self.tables.shape[2])]

    def one_row(self, kernels: Kernels, threads: int) -> torch.Tensor:
        """Every token a row of ``stoic_decode_attention``."""
        k_pool, v_pool = self.k_pool.clone(), self.v_pool.clone()
        out = torch.empty_like(self.q)
        rc = kernels.attention(
            *self._args(k_pool, v_pool), *self._shape(), 0.125, out.data_ptr(), threads, 0
        )
        assert rc == 0
        return out

    def rows(
        self, kernels: Kernels, threads: int, runs: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The runs through ``stoic_prefill_attention``."""
        runs = self.runs if runs is None else runs
        k_pool, v_pool = self.k_pool.clone(), self.v_pool.clone()
        out = torch.full_like(self.q, float("nan"))
        rc = kernels.prefill_attention(
            *self._args(k_pool, v_pool), runs.data_ptr(), int(runs.shape[0]), *self._shape(),
            0.125, out.data_ptr(), threads, 0,
        )  # fmt: skip
        assert rc == 0
        return out


@pytest.mark.parametrize("build", ["native", "avx2"])
@pytest.mark.parametrize("dh", [24, 64, 80, 128])
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (4, 4), (8, 1)])
def test_rows_of_a_run_are_bitwise_the_decode_kernels_rows(
    request: pytest.FixtureRequest, build: str, dh: int, heads: int, kv_heads: int
) -> None:
    kernels: Kernels = request.getfixturevalue("kernels" if build == "native" else "avx2_kernels")
    step = Step(heads, kv_heads, dh, seed=dh + heads)
    alone = step.one_row(kernels, threads=1)
    for threads in (1, 2):
        assert torch.equal(step.one_row(kernels, threads), alone)
        got = step.rows(kernels, threads)
        differ = (got != alone).any(-1).any(-1).nonzero().flatten().tolist()
        assert differ == [], f"rows {differ} differ ({threads} threads)"


def test_rows_attention_is_the_softmax_attention(kernels: Kernels) -> None:
    """Not merely the same as the decode kernel: causal softmax attention over the pools
    (float32 rounding apart)."""
    step = Step(9, 3, 64)
    got = step.rows(kernels, threads=2)
    k_pool, v_pool = step.k_pool.clone(), step.v_pool.clone()
    m, dh = step.q.shape[0], step.dh
    k_pool.view(-1, dh)[step.write] = step.k.transpose(0, 1).reshape(-1, dh)
    v_pool.view(-1, dh)[step.write] = step.v.transpose(0, 1).reshape(-1, dh)
    for i in range(m):
        for h in range(step.heads):
            g = h // (step.heads // step.kv_heads)
            n = int(step.lens[i])
            rows = step.tables[i, g][torch.arange(n) // BLOCK] * BLOCK + torch.arange(n) % BLOCK
            keys, values = k_pool.view(-1, dh)[rows], v_pool.view(-1, dh)[rows]
            weights = torch.softmax(keys @ step.q[i, h] * 0.125, 0)
            torch.testing.assert_close(got[i, h], weights @ values, rtol=1e-5, atol=1e-5)


def test_a_run_outside_the_step_is_refused(kernels: Kernels) -> None:
    step = Step(9, 3, 64)
    m = int(step.lens.numel())
    for bad in ([[0, m + 1]], [[-1, 2]], [[3, 0]]):
        runs = torch.tensor(bad)
        out = torch.empty_like(step.q)
        rc = kernels.prefill_attention(
            *step._args(step.k_pool.clone(), step.v_pool.clone()), runs.data_ptr(), 1,
            *step._shape(), 0.125, out.data_ptr(), 1, 0,
        )  # fmt: skip
        assert rc == -1, bad
