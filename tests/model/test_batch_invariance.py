"""Batch invariance of every kernel ``--deterministic`` computes with: one row computed alone is
bitwise the row computed inside batches of 2..64 rows (the fixed-order quantised products of
every block type, in bfloat16 where the CPU has AVX512_BF16 and in float32 in the builds
without it, a stacked projection of mixed types, the C attention over the paged cache, the C
layers, and the torch operators the step keeps: RMSNorm, softmax, the rotary table)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from gguf_blocks import random_blocks

from stoic.kernels import GGML_TYPES, Kernels, _build, _qkernels, load_kernels

#: batch sizes, on and off the kernels' 4- and 8-row tiles and the 16-lane routine's limit
SIZES = (2, 3, 4, 5, 8, 9, 15, 16, 17, 31, 32, 33, 48, 64)


def _rows(n: int, cols: int, seed: int) -> torch.Tensor:
    return torch.randn(n, cols, generator=torch.Generator().manual_seed(seed))


def _alone_equals_batched(product: object, cols: int) -> list[int]:
    """Batch sizes at which the first row's result differs from its result alone."""
    x = _rows(max(SIZES), cols, seed=cols)
    alone = product(x[:1].contiguous())  # type: ignore[operator]
    return [n for n in SIZES if not torch.equal(product(x[:n].contiguous())[:1], alone)]  # type: ignore[operator]


#: builds of the kernels for other flag sets than the machine's, made from nothing once per run
#: (``slow``: ``make test-fast`` leaves them out)
_OTHER_BUILDS = (
    pytest.param("avx512", marks=pytest.mark.slow, id="avx512"),
    pytest.param("avx2", marks=pytest.mark.slow, id="avx2"),
)


def _build_without(
    tmp_path_factory: pytest.TempPathFactory, hidden: set[str], name: str
) -> Kernels:
    flags = _build.cpu_flags() - hidden
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_build, "cpu_flags", lambda: flags)
        return load_kernels(tmp_path_factory.mktemp(name))


@pytest.fixture(scope="module")
def avx2_kernels(tmp_path_factory: pytest.TempPathFactory, kernels: Kernels) -> Kernels:
    """The kernels built without AVX-512 (8-lane products at every size, as on an AVX2 CPU)."""
    return _build_without(tmp_path_factory, {"avx512f"}, "avx2-kernels")


@pytest.fixture(scope="module")
def avx512_kernels(tmp_path_factory: pytest.TempPathFactory, kernels: Kernels) -> Kernels:
    """The kernels built with AVX-512F but without AVX512_BF16 (the float32 fixed order's
    16-lane tiles, as on a CPU without bfloat16 dot products)."""
    if "avx512f" not in _build.cpu_flags():
        pytest.skip("this CPU has no AVX-512F")
    return _build_without(tmp_path_factory, {"avx512_bf16"}, "avx512-kernels")


@pytest.fixture(scope="module")
def bf16_kernels(kernels: Kernels) -> Kernels:
    """The machine's build, where it has the bfloat16 fixed-order products."""
    if not kernels.bf16:
        pytest.skip("this CPU has no AVX512_BF16 (the float32 fixed order serves)")
    return kernels


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("build", ["native", *_OTHER_BUILDS])
@pytest.mark.parametrize("kind", sorted(GGML_TYPES))
def test_fixed_order_product_of_a_row_is_bitwise_the_same_in_any_batch(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, build: str, kind: str,
    threads: int,
) -> None:  # fmt: skip
    """A row multiplied alone equals that row multiplied in batches of 2..64 (every block type,
    with a bias; the machine's build, bfloat16 where it can, and the float32 ones without
    AVX512_BF16 and without AVX-512), and every row of a batch equals its product alone, on
    1 or 2 threads."""
    kernels: Kernels = request.getfixturevalue(
        f"{build}_kernels" if build != "native" else "kernels"
    )
    assert kernels.bf16 == (build == "native" and "avx512_bf16" in _build.cpu_flags())
    monkeypatch.setattr(_qkernels, "get_threads", lambda: threads)
    cols = 512
    blocks = random_blocks(kind, 40, cols, seed=3)
    bias = torch.randn(40)
    fixed = kernels.bind(kind, blocks, bias, fixed=True)
    assert fixed.bfloat16 == kernels.bf16
    assert _alone_equals_batched(fixed, cols) == []
    x = _rows(33, cols, seed=5)
    batched = fixed(x)
    for i in (0, 7, 16, 32):
        assert torch.equal(batched[i], fixed(x[i : i + 1].contiguous())[0])


def _reference(kernels: Kernels, kind: str, blocks: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` in bfloat16 products summed exactly (float64): what the bfloat16 products
    compute up to the float32 rounding of their sums."""
    weight = kernels.dequantize(kind, blocks, x.shape[1])
    return x.bfloat16().double() @ weight.bfloat16().double().T


@pytest.mark.parametrize("kind", sorted(GGML_TYPES))
def test_bf16_product_from_registers_and_from_its_copy_agree_bitwise(
    bf16_kernels: Kernels, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """The two sources of a bfloat16 product's weights, the blocks de-quantised in registers
    (few rows, or no copy) and the bfloat16 copy made at load (more rows), give bitwise the
    same rows at every batch size and thread count; the copy is the de-quantised weights
    rounded to bfloat16 (in the product's element order); results are the bfloat16 products
    summed in float32."""
    kernels = bf16_kernels
    cols = 768 if kind.endswith("_K") else 544  # 3 super-blocks; 17 blocks (an odd count)
    blocks = random_blocks(kind, 29, cols, seed=7)  # 29 rows: off the 6-row column tiles
    bias = torch.randn(29)
    copied = kernels.bind(kind, blocks, bias, fixed=True)
    registers = kernels.bind(kind, blocks, bias, fixed=True, bf16_copy=False)
    assert copied.bf16_copy is not None and registers.bf16_copy is None
    weight = kernels.dequantize(kind, blocks, cols).bfloat16()
    if kind in ("Q4_0", "Q4_1"):  # the 16-lane 4-bit order: 0-7, 16-23, 8-15, 24-31
        weight = weight.view(29, -1, 4, 8)[:, :, [0, 2, 1, 3]].reshape(29, cols)
    assert torch.equal(copied.bf16_copy.view(torch.int16), weight.view(torch.int16))
    x = _rows(max(SIZES), cols, seed=8)
    for threads in (1, 2):
        monkeypatch.setattr(_qkernels, "get_threads", lambda t=threads: t)
        for n in (1, *SIZES):
            got = copied(x[:n].contiguous())
            assert torch.equal(got, registers(x[:n].contiguous())), (n, threads)
    want = _reference(kernels, kind, blocks, x) + bias.double()
    terms = x.bfloat16().double().abs() @ weight.double().abs().T
    assert torch.all((got.double() - want).abs() <= cols * 2**-24 * terms + 1e-30)


def test_bf16_product_differs_from_the_float32_product(bf16_kernels: Kernels) -> None:
    """The bfloat16 products round x and the weights to bfloat16 (the float32 fixed order does
    not): the results differ by more than float32 rounding, and match the bfloat16 reference."""
    blocks = random_blocks("Q8_0", 16, 512, seed=4)
    x = _rows(4, 512, seed=6)
    got = bf16_kernels.bind("Q8_0", blocks, None, fixed=True)(x).double()
    exact = x.double() @ bf16_kernels.dequantize("Q8_0", blocks, 512).double().T
    assert (got - exact).abs().max() > 1e-3 * exact.abs().max()
    assert torch.allclose(got, _reference(bf16_kernels, "Q8_0", blocks, x), rtol=1e-5, atol=1e-4)


def test_default_order_product_is_not_batch_invariant(kernels: Kernels) -> None:
    """The default products are not: one row takes the factored routine (and, past 16 rows, the
    8-lane tiles), which sum in another order (what the fixed order exists for)."""
    blocks = random_blocks("Q4_1", 40, 512, seed=3)
    assert _alone_equals_batched(kernels.bind("Q4_1", blocks, None), 512) != []


@pytest.mark.parametrize("build", ["native", _OTHER_BUILDS[0]])
def test_fixed_order_stacked_product_of_mixed_types_is_batch_invariant(
    request: pytest.FixtureRequest, build: str
) -> None:
    """A fused projection of parts of different types (Q4_K over Q6_K, as in Q4_K_M; and a
    4-bit Q4_0 part, whose bfloat16 element order differs), with a bias: in bfloat16 its parts
    are each a bfloat16 product, and each part's columns equal that part's product."""
    kernels: Kernels = request.getfixturevalue("kernels" if build == "native" else "avx512_kernels")
    parts = [
        ("Q4_K", random_blocks("Q4_K", 24, 512, 1)),
        ("Q6_K", random_blocks("Q6_K", 8, 512, 2)),
        ("Q4_0", random_blocks("Q4_0", 6, 512, 3)),
    ]
    bias = torch.randn(38)
    stacked = kernels.bind_stack(parts, bias, fixed=True)
    assert stacked.bfloat16 == kernels.bf16
    assert _alone_equals_batched(stacked, 512) == []
    x = _rows(20, 512, seed=4)
    y, row = stacked(x), 0
    for (kind, blocks), b in zip(parts, bias.split([24, 8, 6]), strict=True):
        part = kernels.bind(kind, blocks, b.clone(), fixed=True)(x)
        assert torch.equal(y[:, row : row + part.shape[1]], part)
        row += part.shape[1]


@functools.cache
def _pools(rows: int, block: int, dh: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return torch.randn(rows, block, dh, generator=gen), torch.randn(rows, block, dh, generator=gen)


def _attention(kernels: Kernels, lens: list[int], threads: int) -> torch.Tensor:
    """``stoic_decode_attention`` of tokens whose sequences have ``lens`` positions (9 query heads
    over 3 kv heads of 64, as the default model; each token's key and value written at its last
    position first, the same values every call): ``[tokens, 9, 64]``."""
    heads, kv_heads, dh, block, blocks_each = 9, 3, 64, 16, 20
    m = len(lens)
    num_blocks = 64 * blocks_each
    k_pool, v_pool = _pools(kv_heads * num_blocks, block, dh)
    # token i's sequence owns blocks [i * blocks_each, (i + 1) * blocks_each), in reverse order
    own = [list(range((i + 1) * blocks_each - 1, i * blocks_each - 1, -1)) for i in range(m)]
    tables = torch.tensor(
        [[[h * num_blocks + b for b in own[i]] for h in range(kv_heads)] for i in range(m)]
    )
    write = torch.tensor(
        [
            (h * num_blocks + own[i][(lens[i] - 1) // block]) * block + (lens[i] - 1) % block
            for h in range(kv_heads)
            for i in range(m)
        ]
    )
    q = torch.stack(
        [torch.randn(heads, dh, generator=torch.Generator().manual_seed(i)) for i in range(m)]
    )
    k = torch.stack(
        [
            torch.randn(kv_heads, dh, generator=torch.Generator().manual_seed(100 + i))
            for i in range(m)
        ]
    )
    v = torch.stack(
        [
            torch.randn(kv_heads, dh, generator=torch.Generator().manual_seed(200 + i))
            for i in range(m)
        ]
    )
    out = torch.empty(m, heads, dh)
    lens_t = torch.tensor(lens)
    rc = kernels.attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(),
        write.data_ptr(), tables.data_ptr(), lens_t.data_ptr(), m, heads, kv_heads, dh, block,
        blocks_each, 0.125, out.data_ptr(), threads, 0,
    )  # fmt: skip
    assert rc == 0
    return out


def test_attention_of_a_token_is_bitwise_the_same_in_any_batch(kernels: Kernels) -> None:
    """A token's attention over its context (lengths 1..300, on and off the 8-key groups and
    the 16-position blocks) alone equals it inside batches of 2..64 tokens of other lengths, on
    one thread or two (which changes how the heads are shared out)."""
    lens = [(37 * i + 5) % 300 + 1 for i in range(max(SIZES))]
    for first in (1, 8, 17, 203, 300):
        batch = [first, *lens]
        alone = _attention(kernels, [first], threads=1)[0]
        for n in SIZES:
            for threads in (1, 2):
                assert torch.equal(_attention(kernels, batch[:n], threads)[0], alone), (first, n)


def _layer_products(kernels: Kernels) -> dict[str, object]:
    """Fixed-order Q4_1 products of a small layer: width 128, 2 heads of 32 over 1 kv head, an
    MLP of 256."""

    def bind(rows: int, cols: int, seed: int) -> object:
        return kernels.bind("Q4_1", random_blocks("Q4_1", rows, cols, seed), None, fixed=True)

    return {
        "qkv": bind(128, 128, 1),
        "o": bind(128, 64, 2),
        "gu": bind(512, 128, 3),
        "down": bind(128, 256, 4),
    }


def test_c_layer_kernels_of_a_row_are_bitwise_the_same_in_any_batch(kernels: Kernels) -> None:
    """``stoic_layer_pre`` (norm, [q; k; v] product, rotary) and ``stoic_layer_post`` (output
    product, residual, norm, gated MLP, residual) on fixed-order products: a row alone equals
    that row inside batches of 2..64."""
    p = _layer_products(kernels)
    width, dh = 128, 32
    norm = torch.rand(width) + 0.5
    hidden = _rows(max(SIZES), width, seed=9)
    cos, sin = torch.rand(max(SIZES), dh), torch.rand(max(SIZES), dh)
    attn = _rows(max(SIZES), 64, seed=10) * 0.1

    def pre(n: int) -> torch.Tensor:
        q, k, v = torch.empty(n, 2, dh), torch.empty(n, 1, dh), torch.empty(n, 1, dh)
        rc = kernels.layer_pre(
            hidden.data_ptr(), n, width, norm.data_ptr(), 1e-5, p["qkv"].layout,  # type: ignore[attr-defined]
            p["qkv"].pointer, None, 2, 1, dh, cos.data_ptr(), sin.data_ptr(),  # type: ignore[attr-defined]
            q.data_ptr(), k.data_ptr(), v.data_ptr(), 2,
        )  # fmt: skip
        assert rc == 0
        return torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], 1)

    def post(n: int) -> torch.Tensor:
        h = hidden[:n].clone()
        rc = kernels.layer_post(
            h.data_ptr(), attn.data_ptr(), n, width, 64, p["o"].layout, p["o"].pointer,  # type: ignore[attr-defined]
            norm.data_ptr(), 1e-5, p["gu"].layout, p["gu"].pointer, 256, p["down"].layout,  # type: ignore[attr-defined]
            p["down"].pointer, 2,  # type: ignore[attr-defined]
        )  # fmt: skip
        assert rc == 0
        return h

    for layer in (pre, post):
        alone = layer(1)[0]
        assert [n for n in SIZES if not torch.equal(layer(n)[0], alone)] == []


def test_torch_row_operators_are_bitwise_the_same_in_any_batch() -> None:
    """The operators deterministic steps keep in torch: the final RMSNorm (of the default
    model's width), softmax and log-softmax over its vocabulary (sampling, logprobs)."""
    norm = torch.rand(576) + 0.5
    hidden = _rows(max(SIZES), 576, seed=12) * 4
    logits = _rows(max(SIZES), 49152, seed=13) * 8
    ops = [
        (hidden, lambda x: F.rms_norm(x[None], (576,), norm, 1e-5)[0]),
        (logits, lambda x: torch.softmax(x, -1)),
        (logits, lambda x: torch.log_softmax(x, -1)),
    ]
    for x, op in ops:
        alone = op(x[:1])[0]
        assert [n for n in SIZES if not torch.equal(op(x[:n])[0], alone)] == []


def test_rotary_table_gives_a_position_the_same_values_whatever_step_asks() -> None:
    """:class:`RotaryTable`: a position's cos/sin are the same asked alone, first or last, in
    any step (each piece of positions computed once), and the model's rotary module's values."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from stoic.model._deterministic import ROTARY_PIECE, RotaryTable

    rotary = LlamaRotaryEmbedding(LlamaConfig(hidden_size=256, num_attention_heads=4))
    hidden = torch.zeros(1, 1, 256)
    late = RotaryTable(rotary)
    late(hidden, torch.tensor([[2 * ROTARY_PIECE + 3]]))
    early = RotaryTable(rotary)
    span = torch.arange(3 * ROTARY_PIECE)[None]
    cos, sin = early(hidden, span)
    for p in (0, 5, ROTARY_PIECE - 1, ROTARY_PIECE, 2 * ROTARY_PIECE + 3):
        one = torch.tensor([[p]])
        for table in (early, late):
            c, s = table(hidden, one)
            assert torch.equal(c[0, 0], cos[0, p]) and torch.equal(s[0, 0], sin[0, p])
    want_cos, _ = rotary(hidden, torch.arange(ROTARY_PIECE)[None])
    assert torch.equal(cos[0, :ROTARY_PIECE], want_cos[0])
