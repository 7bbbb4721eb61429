"""The paged forward pass on a tiny random model: equal to the model's own forward, and safe
against uninitialised cache memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stoic.model import PagedKVCache, load_model
from stoic.request import SamplingParams, SeqChunk, StepBatch
from stoic.worker import ModelRunner

GREEDY = SamplingParams(max_tokens=8, temperature=0)


@pytest.fixture(scope="module")
def runner(tiny_model_dir: Path) -> ModelRunner:
    return ModelRunner(load_model(str(tiny_model_dir), dtype="float32", device="cpu"))


def _greedy_reference(tiny_model_dir: Path, prompt: list[int], steps: int) -> list[int]:
    ref = load_model(str(tiny_model_dir), dtype="float32", device="cpu").model
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(steps):
            ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def _decode(
    runner: ModelRunner, cache: PagedKVCache, prompt: list[int], steps: int, zero: bool
) -> list[int]:
    table = (5, 2, 7)  # deliberately scattered blocks
    fresh = table if zero else ()
    out = runner.execute(
        StepBatch((SeqChunk(0, tuple(prompt), 0, table, True, GREEDY),), fresh), cache
    )
    tokens = [out.sampled[0].token_id]
    for i in range(steps - 1):
        pos = len(prompt) + i
        chunk = SeqChunk(0, (tokens[-1],), pos, table, True, GREEDY, num_generated=i + 1)
        tokens.append(runner.execute(StepBatch((chunk,)), cache).sampled[0].token_id)
    return tokens


def test_paged_decode_equals_the_models_own_forward(
    runner: ModelRunner, tiny_model_dir: Path
) -> None:
    """Greedy tokens through the paged cache equal argmax of full re-computation each step."""
    prompt = [17, 404, 9, 1200, 33, 5, 870]
    cache = PagedKVCache(runner.kv_spec(num_blocks=8, block_size=4))
    got = _decode(runner, cache, prompt, 6, zero=True)
    assert got == _greedy_reference(tiny_model_dir, prompt, 6)


def test_uninitialised_cache_memory_never_leaks_into_attention(runner: ModelRunner) -> None:
    """Pools full of NaN give the same tokens as clean ones once fresh blocks are zeroed."""
    prompt = [17, 404, 9, 1200, 33]
    clean = PagedKVCache(runner.kv_spec(num_blocks=8, block_size=4))
    for pool in (*clean.keys, *clean.values):
        pool.zero_()
    want = _decode(runner, clean, prompt, 5, zero=False)
    dirty = PagedKVCache(runner.kv_spec(num_blocks=8, block_size=4))
    for pool in (*dirty.keys, *dirty.values):
        pool.fill_(float("nan"))
    assert _decode(runner, dirty, prompt, 5, zero=True) == want


def test_a_released_cache_refuses_to_run(runner: ModelRunner) -> None:
    """After release (a drop), executing against the old cache raises instead of computing."""
    cache = PagedKVCache(runner.kv_spec(num_blocks=4, block_size=4))
    cache.release()
    assert cache.released
    with pytest.raises(RuntimeError, match="released"):
        runner.execute(StepBatch((SeqChunk(0, (1, 2), 0, (0,), True, GREEDY),)), cache)


def test_decode_groups_partition_the_batch_at_least_cost() -> None:
    """Every decode lands in exactly one group, and the split costs no more than any other split
    of the length-sorted batch into contiguous runs (checked exhaustively on small batches)."""
    import itertools
    import random

    from stoic.model._paged import group_decodes

    def cost(groups: list[list[int]], blocks: list[int], overhead: int) -> int:
        return sum(len(g) * max(blocks[i] for i in g) * 16 + overhead for g in groups)

    rng = random.Random(0)
    for _ in range(200):
        blocks = [rng.randint(1, 30) for _ in range(rng.randint(1, 9))]
        overhead = rng.choice([0, 100, 1500, 10**6])
        groups = group_decodes(blocks, 16, overhead)
        assert sorted(i for g in groups for i in g) == list(range(len(blocks)))
        values = sorted(set(blocks))
        best = min(
            cost(
                [
                    [i for i, b in enumerate(blocks) if lo < b <= hi]
                    for lo, hi in itertools.pairwise([0, *cuts, values[-1]])
                ],
                blocks,
                overhead,
            )
            for k in range(len(values))
            for cuts in itertools.combinations(values[:-1], k)
        )
        assert cost(groups, blocks, overhead) == best
    assert group_decodes([], 16) == []
    assert group_decodes([7] * 32, 16) == [list(range(32))]


def test_decode_groups_gather_no_more_than_the_sizing_reserves() -> None:
    """However the decoding sequences' context lengths mix, the keys the groups gather in all
    (each group padded to its longest) stay within :func:`decode_gather_keys` of the blocks they
    hold: the bound the KV sizing reserves memory by; and one group can gather more than the
    blocks held (the reserve of one layer's cache, once, was too small)."""
    import random

    from stoic.model import decode_gather_keys, group_decodes

    def gathered(blocks: list[int], overhead: int) -> int:
        groups = group_decodes(blocks, 16, overhead)
        return sum(len(g) * max(blocks[i] for i in g) * 16 for g in groups)

    rng = random.Random(1)
    for _ in range(500):
        longest = rng.choice([2, 8, 64, 512, 8192])
        blocks = [rng.randint(1, longest) for _ in range(rng.randint(1, 64))]
        for overhead in (0, 100, 1500, 10**5):
            bound = decode_gather_keys(sum(blocks), max(blocks), 16, overhead)
            assert gathered(blocks, overhead) <= bound
    # a short and a long context in one group: nearly twice the keys they hold
    assert gathered([1, 94], 1500) == 2 * 94 * 16 > 1.9 * (1 + 94) * 16


def test_decodes_split_into_groups_attend_like_one_group(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Grouping decodes by context length changes no token and no log-probability."""
    import stoic.model._paged as paged
    import stoic.worker._inputs as inputs

    params = SamplingParams(max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    lengths = [3, 5, 20, 41, 60, 9]
    cache = PagedKVCache(runner.kv_spec(num_blocks=64, block_size=4))
    tables, start = [], 0
    for n in lengths:
        count = -(-(n + 1) // 4)
        tables.append(tuple(range(start + count - 1, start - 1, -1)))  # scattered, reversed
        start += count
    prefill = StepBatch(
        tuple(
            SeqChunk(i, tuple(range(100 + i, 100 + i + n)), 0, tables[i], True, params)
            for i, n in enumerate(lengths)
        ),
        tuple(range(start)),
    )
    first = runner.execute(prefill, cache).sampled
    decode = StepBatch(
        tuple(
            SeqChunk(i, (first[i].token_id,), n, tables[i], True, params, num_generated=1)
            for i, n in enumerate(lengths)
        )
    )
    results = {}
    split = paged.group_decodes
    for overhead in (10**9, 0):  # one group; then as many groups as distinct lengths
        monkeypatch.setattr(inputs, "group_decodes", lambda b, s, o=overhead: split(b, s, o))
        assert len(inputs.group_decodes([-(-(n + 1) // 4) for n in lengths], 4)) == (
            1 if overhead else 6
        )
        results[overhead] = runner.execute(decode, cache).sampled
    one, many = results[10**9], results[0]
    for i in range(len(lengths)):
        assert one[i].token_id == many[i].token_id
        assert one[i].logprob == pytest.approx(many[i].logprob, abs=1e-5)
        assert [t for t, _ in one[i].top_logprobs] == [t for t, _ in many[i].top_logprobs]


@pytest.mark.parametrize(
    ("start_pos", "n", "window"),
    [(0, 43, None), (0, 48, None), (21, 43, None), (16, 37, None), (0, 43, 8), (21, 43, 8)],
)
def test_bfloat16_prompt_attention_padded_to_16_equals_the_unpadded(
    monkeypatch: pytest.MonkeyPatch, start_pos: int, n: int, window: int | None
) -> None:
    """Padding a bfloat16 chunk's queries and keys to a multiple of 16 changes each real row by
    bfloat16 rounding at most, and the pool's rows past the context (NaN here) are never read."""
    import stoic.model._paged as paged

    heads, kv_heads, dim, block, blocks = 6, 2, 16, 4, 32
    gen = torch.Generator().manual_seed(0)
    shape = (kv_heads * blocks, block, dim)
    k_pool = torch.full(shape, float("nan"))
    v_pool = torch.full(shape, float("nan"))
    length = start_pos + n
    table = torch.arange(-(-length // block))
    rows = torch.arange(kv_heads)[:, None] * blocks + table[None, :]  # [kv_heads, blocks]
    context = torch.randn(2, kv_heads, length, dim, generator=gen)
    for pool, values in zip((k_pool, v_pool), context, strict=True):
        flat = pool[rows.view(-1)].view(kv_heads, -1, dim)
        flat[:, :length] = values
        pool[rows.view(-1)] = flat.view(-1, block, dim)
    q = torch.randn(heads, n, dim, generator=gen).bfloat16()
    key = context[0][:, start_pos:].unsqueeze(0).bfloat16()
    value = context[1][:, start_pos:].unsqueeze(0).bfloat16()
    chunk = paged.PrefillChunk(0, n, start_pos, rows)

    def attend() -> torch.Tensor:
        return paged._prefill_attention(q, key, value, k_pool, v_pool, chunk, dim**-0.5, window)

    padded = attend()
    monkeypatch.setattr(paged, "PREFILL_ALIGN", 1)
    plain = attend()
    assert padded.shape == plain.shape == (n, heads, dim)
    assert not padded.isnan().any()
    torch.testing.assert_close(padded.float(), plain.float(), atol=2e-2, rtol=2e-2)
    # a float32 reference over the keys each query may see
    qf = q.float().view(kv_heads, heads // kv_heads, n, dim)
    scores = torch.einsum("gcnd,gsd->gcns", qf, context[0].bfloat16().float()) * dim**-0.5
    q_pos = torch.arange(start_pos, length)[:, None]
    k_pos = torch.arange(length)[None, :]
    seen = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
    weights = scores.masked_fill(~seen, float("-inf")).softmax(-1)
    want = torch.einsum("gcns,gsd->gcnd", weights, context[1].bfloat16().float())
    torch.testing.assert_close(
        padded.float(), want.reshape(heads, n, dim).transpose(0, 1), atol=3e-2, rtol=3e-2
    )
