"""Products of many rows on int8 activations (``_gemm8.c``; AVX-512 VNNI): each row of x
quantised per block of 32 as the one-row products do, times the file's integers, within float32
rounding of that product, for every type the layout holds and for a stack of parts of different
types (Q6_K with a scale per 16 weights: G8H); what it refuses (no VNNI); and the default model's prefill and batched decode in a
fast dtype close to its float32 path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf_blocks import gguf_py, random_blocks
from test_int8rows import assert_int8_product, quantized_x, vnni_kernels

from stoic.gguf import QLinear, QuantizedMatrix
from stoic.kernels import G4_TYPES, G8_TYPES, Gemm8, Kernels, _qkernels, load_kernels
from stoic.model import PagedKVCache, load_model
from stoic.request import SamplingParams, SeqChunk, StepBatch
from stoic.worker import ModelRunner

__all__ = ["vnni_kernels"]  # the fixture, used by name

TYPES = sorted(G8_TYPES)


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 40])
def test_many_rows_multiply_the_int8_rows_of_x(vnni_kernels: Kernels, kind: str, rows: int) -> None:
    """N not a multiple of the 16-column tile, K of several blocks (a K-quant: two super-blocks),
    M across the 8-row tile and its remainders; a block of zeros in x (scale 0): the quantised
    x's product plus the bias, and not the float product."""
    n, k = 37, 512
    blocks = random_blocks(kind, n, k, seed=3)
    weight = gguf_py(kind, blocks)
    bias = torch.randn(n)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    x[0, 32:64] = 0.0
    gemm = Gemm8.bind(vnni_kernels, [(kind, blocks)], bias)
    assert gemm is not None and (gemm.rows, gemm.cols) == (n, k)
    got = gemm(x) - bias
    assert_int8_product(got, x, weight)
    exact = x.double() @ weight.double().T
    assert (got.double() - exact).abs().max() > 1e-4 * exact.abs().max()


#: the types whose every block's offset is -128 d once their values are centred on 128
SYMMETRIC = ("Q4_0", "Q5_0", "Q8_0", "Q6_K")


@pytest.mark.parametrize(
    ("kinds", "block_bytes"),
    [
        (("Q4_1", "Q5_1", "Q4_K", "Q5_K"), 640),  # G8: a scale and an offset per 32 weights
        (("Q4_0", "Q5_0", "Q8_0"), 576),  # symmetric: no offsets
        (("Q5_0", "Q6_K", "Q8_0"), 640),  # symmetric, a scale per 16 weights
        (tuple(TYPES), 768),  # a scale and an offset per 16 weights
    ],
)
def test_a_stack_of_types_equals_its_parts(
    vnni_kernels: Kernels, kinds: tuple[str, ...], block_bytes: int
) -> None:
    """A matrix stacked from parts of different types (a fused projection of a Q4_K_M file)
    takes the one layout all its blocks fit (the bytes of a block of 16 rows by 32 weights say
    which) and gives each part's columns: bitwise where the part alone takes the same layout,
    within float32 rounding where it takes another (an offset added apart, or each half of a
    block scaled apart)."""
    parts = [(kind, random_blocks(kind, 24, 256, seed=i)) for i, kind in enumerate(kinds)]
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(len(kinds)))
    stack = Gemm8.bind(vnni_kernels, parts, None)
    assert stack is not None and stack.rows == 24 * len(kinds)
    assert stack.nbytes == -(-stack.rows // 16) * 8 * block_bytes
    y = stack(x)
    for i, part in enumerate(parts):
        alone = Gemm8.bind(vnni_kernels, [part], None)
        assert alone is not None
        got, want = y[:, 24 * i : 24 * (i + 1)], alone(x)
        if alone.layout == stack.layout:
            assert torch.equal(got, want), part[0]
        else:  # another order of roundings: both within rounding of the quantised product
            assert_int8_product(got, x, gguf_py(*part))
            assert_int8_product(want, x, gguf_py(*part))


def test_the_symmetric_layout_sums_the_offset_exactly(vnni_kernels: Kernels) -> None:
    """Where every offset is -128 d (Q4_0, Q5_0, Q8_0, Q6_K) the layout keeps no offsets and
    adds -128 sum(xq) to the exact integer sum: closer to the quantised x's product than adding
    the offset apart, which a stack with an asymmetric part (Q4_1) does."""
    for kind in SYMMETRIC:
        if kind in G4_TYPES:  # its own values go in nibbles (below): no symmetric variant
            continue
        blocks = random_blocks(kind, 48, 512, seed=21)
        filler = ("Q4_1", random_blocks("Q4_1", 16, 512, seed=22))
        alone = Gemm8.bind(vnni_kernels, [(kind, blocks)], None)
        mixed = Gemm8.bind(vnni_kernels, [(kind, blocks), filler], None)
        assert alone is not None and mixed is not None
        assert alone.nbytes < mixed.nbytes * 48 / 64
        x = torch.randn(16, 512, generator=torch.Generator().manual_seed(23))
        want = quantized_x(x) @ gguf_py(kind, blocks).double().T
        err_alone = (alone(x).double() - want).abs().sum()
        err_mixed = (mixed(x)[:, :48].double() - want).abs().sum()
        assert err_alone < err_mixed, kind


def test_a_layout_the_blocks_do_not_fit_is_refused(vnni_kernels: Kernels) -> None:
    """Packing refuses a variant the decoded blocks do not fit (asymmetric blocks without
    offsets; Q6_K's per-16 scales in a per-32 layout) and an unknown layout has no bytes."""
    g8 = Gemm8.bind(vnni_kernels, [("Q4_1", random_blocks("Q4_1", 16, 64, seed=41))], None)
    assert g8 is not None
    for kind, layout in (("Q4_1", g8.layout + 2), ("Q6_K", g8.layout)):
        with pytest.raises(ValueError, match=f"layout {layout}"):
            vnni_kernels.g8_layout([(kind, random_blocks(kind, 16, 256, seed=42))], layout)
    assert vnni_kernels.g8_bytes(16, 256, g8.layout + 5) == 0
    with pytest.raises(ValueError, match=f"layout {vnni_kernels.layouts.g4}"):  # 5 bits
        vnni_kernels.g8_layout(
            [("Q5_0", random_blocks("Q5_0", 16, 256, seed=43))], vnni_kernels.layouts.g4
        )


@pytest.mark.parametrize("rows", [16, 37])
def test_q6k_in_six_bits_multiplies_bitwise_as_its_decoded_g8_layout(
    vnni_kernels: Kernels, rows: int
) -> None:
    """Q6_K goes into G6 straight from its blocks: 0.83 bytes a weight (a 16-row tile of 512
    columns 16 x 416 + 2 x 64 bytes; G8 with halves 1.25), and every product, one row to
    many (few rows read in place, more expanded into G8 first), padding rows and all, is
    bitwise the product over the decoded blocks in G8 with halves and symmetric; a stack of
    Q6_K parts is the same layout."""
    layouts = vnni_kernels.layouts
    blocks = random_blocks("Q6_K", rows, 512, seed=47)
    g6 = vnni_kernels.g8_layout([("Q6_K", blocks)])
    g8 = vnni_kernels.g8_layout([("Q6_K", blocks)], layouts.g8 + 3)
    assert g6.layout == layouts.g6 and g8.layout == layouts.g8 + 3
    assert g6.packed.numel() == -(-rows // 16) * (16 * 416 + 2 * 64)
    assert g6.packed.numel() < 0.67 * g8.packed.numel()
    six, wide = Gemm8(vnni_kernels, g6, rows, 512, None), Gemm8(vnni_kernels, g8, rows, 512, None)
    for m in (1, 3, 4, 5, 8, 21):
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
        assert torch.equal(six(x), wide(x)), m
    stacked = vnni_kernels.g8_layout([("Q6_K", blocks[:5]), ("Q6_K", blocks[5:])])
    assert torch.equal(stacked.packed, g6.packed)


@pytest.mark.slow
def test_g6_products_are_bitwise_the_same_built_with_or_without_gfni(
    vnni_kernels: Kernels, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CPU with GFNI rebuilds G6's six-bit values with affine byte transforms, one without
    (an AVX-512 VNNI CPU before Ice Lake) with shifts and masks: ``-mgfni`` is passed only where
    the CPU lists ``gfni`` (and has the int8 products); a compiler that rejects it builds
    without (``model.kernels.no_gfni``); and the two builds' G6 products, one row to many (read
    in place up to 4 rows without GFNI, 12 with; more expanded), are bitwise the same."""
    import structlog
    from support import compiler_rejecting

    from stoic.kernels import _build

    cpu = _build.cpu_flags()
    monkeypatch.setattr(_build, "cpu_flags", lambda: cpu - {"gfni"})
    assert "-mgfni" not in _build.flags()
    monkeypatch.setattr(_build, "cpu_flags", lambda: cpu - {"avx512_vnni"})
    assert "-mgfni" not in _build.flags()
    monkeypatch.setattr(_build, "cpu_flags", lambda: cpu)
    if "gfni" not in cpu:
        pytest.skip("this CPU has no GFNI: its kernels are the build without")
    assert "-mgfni" in _build.flags()
    monkeypatch.setenv("CC", str(compiler_rejecting("-mgfni", tmp_path)))
    with structlog.testing.capture_logs() as logs:
        plain = load_kernels(tmp_path / "cache")
    assert "model.kernels.no_gfni" in [e["event"] for e in logs]
    assert plain.int8_rows and plain.path != vnni_kernels.path
    blocks = random_blocks("Q6_K", 37, 512, seed=53)
    ours, theirs = (
        Gemm8(k, k.g8_layout([("Q6_K", blocks)]), 37, 512, None) for k in (vnni_kernels, plain)
    )
    for m in (1, 4, 9, 13):
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
        assert torch.equal(ours(x), theirs(x)), m


@pytest.mark.parametrize("kind", sorted(G4_TYPES))
def test_the_nibble_layout_is_g8s_numbers_in_half_the_bytes(
    vnni_kernels: Kernels, kind: str
) -> None:
    """A 4-bit type's matrix goes in G4 (two values a byte): 0.75 bytes a weight (0.6x G8's),
    Q4_K in G4K (G4 with the file's super-block scales: 0.59, a 16-row tile of 512 columns
    16 x 288 + 2 x 128 bytes); every row bitwise G8's own where the type has offsets (Q4_1,
    Q4_K: the same integer sums, scales and offsets), Q4_0 (stored as q - 8 with its offset
    -8 d) within the int8 numerics of both, and each row the same alone or in any batch; rows
    past a multiple of 16 padded."""
    layouts = vnni_kernels.layouts
    blocks = random_blocks(kind, 40, 512, seed=44)
    g4 = Gemm8.bind(vnni_kernels, [(kind, blocks)], None)
    g8 = vnni_kernels.g8_layout([(kind, blocks)], layouts.g8 + (2 if kind == "Q4_0" else 0))
    assert g4 is not None and g4.layout == (layouts.g4k if kind == "Q4_K" else layouts.g4)
    tile = 16 * 288 + 2 * 128 if kind == "Q4_K" else 16 * 384
    assert g4.nbytes == 3 * tile and g4.nbytes < 0.67 * g8.packed.numel()
    if kind == "Q4_K":  # G4 holds the same numbers in float32 scales
        plain = vnni_kernels.g8_layout([(kind, blocks)], layouts.g4)
        x3 = torch.randn(3, 512, generator=torch.Generator().manual_seed(46))
        assert torch.equal(Gemm8(vnni_kernels, plain, 40, 512, None)(x3), g4(x3))
    wide = Gemm8(vnni_kernels, g8, 40, 512, None)
    x = torch.randn(21, 512, generator=torch.Generator().manual_seed(45))
    got = g4(x)
    if kind == "Q4_0":
        assert_int8_product(got, x, gguf_py(kind, blocks))
    else:
        assert torch.equal(got, wide(x))
    for r in (0, 7, 20):
        assert torch.equal(g4(x[r : r + 1]), got[r : r + 1])


@pytest.mark.parametrize("kind", ["Q4_1", "Q5_0", "Q6_K"])
def test_the_thread_count_changes_no_bit(vnni_kernels: Kernels, kind: str) -> None:
    """One, two and more threads than column groups (a 16-row matrix has one) give the same
    product bitwise: each thread takes whole groups, each element one instruction sequence."""
    wide = Gemm8.bind(vnni_kernels, [(kind, random_blocks(kind, 200, 512, seed=43))], None)
    narrow = Gemm8.bind(vnni_kernels, [(kind, random_blocks(kind, 16, 512, seed=44))], None)
    assert wide is not None and narrow is not None
    x = torch.randn(37, 512, generator=torch.Generator().manual_seed(45))
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append((wide(x), narrow(x)))
    finally:
        torch.set_num_threads(before)
    for got in results[1:]:
        assert torch.equal(got[0], results[0][0]) and torch.equal(got[1], results[0][1])


def test_bad_shapes_are_refused_before_any_product(vnni_kernels: Kernels) -> None:
    """x of another width, dtype or a strided x; parts of different widths; a bias of the wrong
    length: ValueError, nothing computed."""
    blocks = random_blocks("Q4_0", 16, 64, seed=1)
    gemm = Gemm8.bind(vnni_kernels, [("Q4_0", blocks)], None)
    assert gemm is not None
    for x in (torch.randn(2, 32), torch.randn(2, 64).double(), torch.randn(64, 2).T):
        with pytest.raises(ValueError, match="cannot multiply"):
            gemm(x)
    with pytest.raises(ValueError, match="widths"):
        Gemm8.bind(
            vnni_kernels, [("Q4_0", blocks), ("Q4_0", random_blocks("Q4_0", 4, 96, 2))], None
        )
    with pytest.raises(ValueError, match="bias"):
        Gemm8.bind(vnni_kernels, [("Q4_0", blocks)], torch.zeros(15))


@pytest.mark.parametrize("kind", ["Q4_1", "Q5_0", "Q4_K", "Q6_K"])
def test_the_fixed_order_g8_product_gives_a_row_bitwise_alone_or_in_any_batch(
    vnni_kernels: Kernels, kind: str
) -> None:
    """``--deterministic``'s products (``fixed`` with ``int8_rows``: the G8 layout through the
    kernels' common entry, as the C layers call it): one row alone equals that row inside
    batches of 2..64 rows, wherever it falls in the 8-row tiles, bitwise; the same numbers as
    the default mode's batched product, and in a stack of a Q6_K part (its own G8H) and
    another each part's columns."""
    blocks = random_blocks(kind, 40, 512, seed=11)
    fixed = vnni_kernels.bind(kind, blocks, torch.randn(40), fixed=True, int8_rows=True)
    assert fixed.g8 and fixed.rows == 40
    gen = torch.Generator().manual_seed(12)
    for rows in (2, 3, 7, 8, 9, 16, 33, 64):
        x = torch.randn(rows, 512, generator=gen)
        batch = fixed(x)
        for r in {0, rows // 2, rows - 1}:
            assert torch.equal(fixed(x[r : r + 1].contiguous()), batch[r : r + 1]), (rows, r)
    gemm = Gemm8.bind(vnni_kernels, [(kind, blocks)], None)
    assert gemm is not None
    x = torch.randn(5, 512, generator=gen)
    unbiased = vnni_kernels.bind(kind, blocks, None, fixed=True, int8_rows=True)
    assert torch.equal(unbiased(x), gemm(x))
    q6 = ("Q6_K", random_blocks("Q6_K", 8, 512, seed=13))
    stack = vnni_kernels.bind_stack([(kind, blocks), q6], None, fixed=True, int8_rows=True)
    assert stack.g8 and all(p.g8 for p in stack.parts)
    assert torch.equal(stack(x), torch.cat([p(x) for p in stack.parts], dim=1))


def test_bfloat16_in_and_out_are_the_float32_product_converted(vnni_kernels: Kernels) -> None:
    """bfloat16 x is read as its exact float32 values, and a bfloat16 y is the float32 product
    rounded as torch rounds (to nearest even): bitwise, with a bias."""
    blocks = random_blocks("Q4_K", 45, 512, seed=6)
    gemm = Gemm8.bind(vnni_kernels, [("Q4_K", blocks)], torch.randn(45))
    assert gemm is not None
    x = torch.randn(19, 512).bfloat16()
    want = gemm(x.float())
    assert torch.equal(gemm(x), want)
    assert torch.equal(gemm(x, torch.bfloat16), want.bfloat16())
    assert torch.equal(gemm(x.float(), torch.bfloat16), want.bfloat16())
    with pytest.raises(ValueError, match="cannot multiply"):
        gemm(x, torch.float16)


@pytest.mark.parametrize("kind", ["Q5_0", "Q4_K", "Q6_K"])
def test_a_residual_is_added_to_the_float32_product_before_any_rounding(
    vnni_kernels: Kernels, kind: str
) -> None:
    """``residual + x @ W.T + bias`` in one call: bitwise the float32 product plus the residual
    as torch adds them, then rounded once to bfloat16 where asked; a residual of another shape,
    dtype or layout is refused before any product."""
    blocks = random_blocks(kind, 40, 512, seed=31)
    gemm = Gemm8.bind(vnni_kernels, [(kind, blocks)], torch.randn(40))
    assert gemm is not None
    x = torch.randn(21, 512).bfloat16()
    residual = torch.randn(21, 40) * 100
    want = residual + gemm(x)
    assert torch.equal(gemm(x, torch.float32, residual), want)
    assert torch.equal(gemm(x, torch.bfloat16, residual), want.bfloat16())
    for bad in (residual[:, :39].contiguous(), residual.double(), torch.randn(40, 21).T):
        with pytest.raises(ValueError, match="residual"):
            gemm(x, torch.float32, bad)


def test_a_layers_residual_is_added_by_the_int8_product_where_the_step_takes_it(
    vnni_kernels: Kernels,
) -> None:
    """``QLinear.add_to``: a step of more rows than the one-row kernels take, over a float32
    residual, gets the kernel's float32 sum (bitwise ``residual + product``); a step the
    one-row kernels run, or a residual in another dtype, gets ``hidden + self(x)`` as before."""
    blocks = random_blocks("Q5_0", 48, 256, seed=51)
    weight = gguf_py("Q5_0", blocks)
    bias = torch.randn(48)
    linear = QLinear(
        weight, bias, QuantizedMatrix("Q5_0", blocks, 256), vnni_kernels, max_rows=8,
        dense_dtype=torch.bfloat16, int8_rows=True,
    )  # fmt: skip
    assert linear.batched_int8
    gen = torch.Generator().manual_seed(52)
    for rows in (20, 2):
        x = torch.randn(1, rows, 256, generator=gen).bfloat16()
        hidden = torch.randn(1, rows, 48, generator=gen)
        got = linear.add_to(hidden, x)
        assert got.dtype == torch.float32 and got.shape == hidden.shape
        if rows > 8:
            gemm = Gemm8.bind(vnni_kernels, [("Q5_0", blocks)], bias.float())
            assert gemm is not None
            assert torch.equal(got, hidden + gemm(x.reshape(rows, 256)).view(1, rows, 48))
        else:
            assert torch.equal(got, hidden + linear(x, native=True))
        low = hidden.bfloat16()
        assert torch.equal(linear.add_to(low, x), low + linear(x, native=True))


def test_a_nan_in_a_row_makes_that_rows_products_nan_only(vnni_kernels: Kernels) -> None:
    """A NaN activation makes its row's outputs NaN, as the float product's, and no other row's."""
    gemm = Gemm8.bind(vnni_kernels, [("Q8_0", random_blocks("Q8_0", 20, 128, seed=5))], None)
    assert gemm is not None
    x = torch.randn(10, 128)
    x[4, 70] = float("nan")
    y = gemm(x)
    assert torch.isnan(y[4]).all()
    assert not torch.isnan(torch.cat([y[:4], y[5:]])).any()


def _prefill_logprobs(runner: ModelRunner, prompt: tuple[int, ...]) -> torch.Tensor:
    """The log-probabilities after ``prompt``, prefilled in one step."""
    cache = PagedKVCache(runner.kv_spec(num_blocks=32, block_size=8))
    cache.zero_blocks(tuple(range(32)))
    head = runner._head
    seen: list[torch.Tensor] = []

    def spy(x: torch.Tensor) -> torch.Tensor:
        out = head(x)
        seen.append(out.float().clone())
        return out

    runner._head = spy  # type: ignore[assignment]
    try:
        params = SamplingParams(max_tokens=1, temperature=0)
        runner.execute(StepBatch((SeqChunk(0, prompt, 0, tuple(range(32)), True, params),)), cache)
    finally:
        runner._head = head  # type: ignore[assignment]
        cache.release()
    return torch.log_softmax(seen[-1][-1], dim=-1)


@pytest.mark.model
def test_the_default_model_prefills_on_int8_close_to_its_float_path(
    vnni_kernels: Kernels,
) -> None:
    """The default model with a bfloat16 dense dtype (``--dtype auto`` on a CPU with fast
    bfloat16) multiplies a prefill of many tokens on int8 activations, every projection, with no
    bfloat16 copy, and says so; ``--dtype float32`` does not. After a 60-token prompt its
    log-probabilities of the float path's 20 likeliest tokens stay within 0.35 nats of the float
    path's. Measured: 0.18 nats at most (the bfloat16 copy's 0.17) with SDPA's bfloat16 prompt
    attention; 0.25 (the copy's 0.09) with the C chunk attention in float32: two equally
    accurate attentions (both within bfloat16 rounding of float64, tests/model/
    test_chunk_attention.py) move this 30-layer bfloat16 model's logprobs by up to 0.9 nats,
    so a bound relative to the copy's gap would test chance."""
    fast = ModelRunner(
        load_model("default", dtype="float32", dense_dtype="bfloat16", device="cpu"),
        quantization="gguf",
    )
    exact = ModelRunner(load_model("default", dtype="float32", device="cpu"), quantization="gguf")
    done, _ = fast._fused.quantized_projections if fast._fused is not None else (0, 0)
    assert done and fast.compute_path.int8_batched_projections == done
    assert exact.compute_path.int8_batched_projections == 0
    layer = fast._fused._layers[0] if fast._fused is not None else None
    assert layer is not None and layer.gate_up.packed is None and layer.gate_up.batched_int8
    text = "Summarise these words: river stone lantern orchard copper violin harbour " * 5
    prompt = tuple(exact.loaded.tokenizer.encode(text))[:60]
    assert len(prompt) == 60 > fast.kernel_rows
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Gemm8, "bind", classmethod(lambda cls, *a: None))
        patch.setattr(_qkernels, "G8_ALONE_TYPES", frozenset())
        bf16 = ModelRunner(
            load_model("default", dtype="float32", dense_dtype="bfloat16", device="cpu"),
            quantization="gguf",
        )
    assert bf16.compute_path.int8_batched_projections == 0
    want = _prefill_logprobs(exact, prompt)
    top = want.topk(20).indices
    gaps = {
        name: (_prefill_logprobs(r, prompt)[top] - want[top]).abs().max().item()
        for name, r in (("int8", fast), ("bfloat16", bf16))
    }
    assert 0 < gaps["int8"] < 0.35, gaps
    assert 0 < gaps["bfloat16"] < 0.35, gaps
