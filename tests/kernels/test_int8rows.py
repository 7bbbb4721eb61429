"""One-row products on int8 activations (``_int8rows.c``; AVX-512 VNNI): the row of x quantised
per block of 32 (``rint(x * 127 / max|x|)``, scale ``max|x| / 127``) times the de-quantised
weights, within float32 rounding of that product, per layout, and up to eight rows each as
alone; ignored with more rows, in the
fixed order, and where the build has no VNNI (the float path's numbers, bitwise); and the default
model in a fast dtype decodes with log-probabilities close to its float32 path's."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf_blocks import gguf_py, random_blocks

from stoic.gguf import default_cache_dir
from stoic.kernels import (
    G8_ALONE_TYPES,
    G8_TYPES,
    Kernels,
    KernelsUnavailable,
    _build,
    load_kernels,
)
from stoic.model import PagedKVCache, load_model
from stoic.request import SamplingParams, SeqChunk, StepBatch
from stoic.worker import ModelRunner

#: the types whose one-row products take int8 activations
INT8_TYPES = ("Q4_1", "Q4_0", "Q8_0", "Q5_0", "Q4_K", "Q6_K")


@pytest.fixture(scope="module")
def vnni_kernels() -> Kernels:
    """The kernels built for this CPU, which must have the int8 products."""
    try:
        kernels = load_kernels(default_cache_dir())
    except KernelsUnavailable as e:
        pytest.skip(f"quantised kernels unavailable here: {e}")
    if not kernels.int8_rows:
        pytest.skip("this CPU has no AVX-512 VNNI")
    return kernels


def quantized_x(x: torch.Tensor) -> torch.Tensor:
    """The row ``x`` as the int8 path sees it (float64): per block of 32, ``xq * dx`` with
    ``xq = rint(x * (127 / amax))`` and ``dx = amax / 127`` in float32, as ``_int8rows.c``."""
    blocks = x.numpy().astype(np.float32).reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    xq = np.rint(blocks * inv).astype(np.float64)
    dx = (amax / np.float32(127)).astype(np.float32).astype(np.float64)
    return torch.from_numpy((xq * dx).reshape(x.shape))


def assert_int8_product(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """``got`` is the quantised ``x`` times ``weight.T``, up to float32 rounding of its sums
    (K ulps of the sum of |terms|, against float64)."""
    xq = quantized_x(x)
    want = xq @ weight.double().T
    bound = x.shape[1] * torch.finfo(torch.float32).eps * (xq.abs() @ weight.double().abs().T)
    excess = (got.double() - want).abs() - bound
    assert excess.max().item() <= 0, f"off by {excess.max().item()} beyond rounding"


@pytest.mark.parametrize("kind", INT8_TYPES)
@pytest.mark.parametrize("shape", [(37, 512), (130, 768)])
def test_one_row_products_multiply_the_int8_row(
    vnni_kernels: Kernels, kind: str, shape: tuple[int, int]
) -> None:
    """Through the public product (N not a multiple of any tile, K of several blocks): the
    int8 row's product, not the float row's (the float product is off beyond rounding)."""
    n, k = shape
    blocks = random_blocks(kind, n, k, seed=3)
    weight = gguf_py(kind, blocks)
    bias = torch.randn(n)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(5))
    x[0, :32] = 0.0  # a block of zeros: scale 0
    product = vnni_kernels.bind(kind, blocks, bias, int8_rows=True)
    assert product.int8_rows
    got = product(x) - bias
    assert_int8_product(got, x, weight)
    exact = x.double() @ weight.double().T
    assert (got.double() - exact).abs().max() > 1e-4 * exact.abs().max()


@pytest.mark.parametrize("kind", INT8_TYPES)
def test_without_the_flag_or_with_more_rows_the_float_path_runs_bitwise(
    vnni_kernels: Kernels, kind: str
) -> None:
    """A product bound without ``int8_rows`` gives the float path's numbers bitwise; with it,
    a type of :data:`G8_ALONE_TYPES` multiplies every row count on its G8 layout (G4 for the
    4-bit types: at most 1.2x its blocks' bytes), the fixed order's very bytes and numbers, and
    another type (Q5_0) multiplies on int8 activations over its blocks, nine rows too (each row
    bitwise its one-row product); in the fixed order the flag means the G8 layout's int8
    products (``test_gemm8.py``: every type here has one); a stack of int8 parts equals its
    parts."""
    blocks = random_blocks(kind, 48, 256, seed=4)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(6))
    plain = vnni_kernels.bind(kind, blocks, None)
    int8 = vnni_kernels.bind(kind, blocks, None, int8_rows=True)
    fixed = vnni_kernels.bind(kind, blocks, None, fixed=True, int8_rows=True)
    assert fixed.fixed and fixed.g8 == (kind in G8_TYPES) and fixed.int8_rows == fixed.g8
    assert int8.g8 == (kind in G8_ALONE_TYPES)
    if int8.g8:
        assert torch.equal(int8.packed, fixed.packed) and torch.equal(int8(x), fixed(x))
        assert int8.nbytes <= 1.2 * plain.nbytes  # Q4_0: 0.75 bytes a weight, Z4 0.625
    else:
        nine = int8(x)
        assert all(torch.equal(nine[r : r + 1], int8(x[r : r + 1])) for r in range(9))
    assert not torch.equal(int8(x[:1]), plain(x[:1]))
    assert not torch.equal(int8(x), plain(x))
    other = random_blocks("Q6_K", 8, 256, seed=7)
    stack = vnni_kernels.bind_stack(
        [(kind, random_blocks(kind, 8, 256, seed=8)), ("Q6_K", other)], None, int8_rows=True
    )
    row = torch.randn(1, 256)
    parts = [p(row) for p in stack.parts]
    assert torch.equal(stack(row), torch.cat(parts, dim=1))


def test_a_build_without_vnni_has_no_int8_rows_and_ignores_the_flag(
    vnni_kernels: Kernels,
) -> None:
    """With AVX512_VNNI hidden from the build the kernels report none, and a product bound with
    the flag computes the float path's numbers bitwise."""
    flags = _build.cpu_flags()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_build, "cpu_flags", lambda: flags - {"avx512_vnni"})
        assert "-mavx512vnni" not in _build.flags()
        plain = load_kernels(default_cache_dir())
    assert not plain.int8_rows
    blocks = random_blocks("Q4_1", 24, 96, seed=2)
    x = torch.randn(1, 96)
    product = plain.bind("Q4_1", blocks, None, int8_rows=True)
    assert not product.int8_rows
    assert torch.equal(product(x), plain.bind("Q4_1", blocks, None)(x))
    assert torch.equal(product(x), vnni_kernels.bind("Q4_1", blocks, None)(x))


def _greedy_logprobs(
    runners: tuple[ModelRunner, ModelRunner], prompt: tuple[int, ...], steps: int
) -> tuple[list[float], list[float], int]:
    """Decode ``steps`` one-token steps on both runners, feeding both the first one's greedy
    token; per step each runner's log-probability of that token, and how many steps the second
    runner's own greedy choice agreed."""
    caches = []
    for r in runners:
        cache = PagedKVCache(r.kv_spec(num_blocks=16, block_size=4))
        cache.zero_blocks(tuple(range(16)))
        caches.append(cache)
    table = tuple(range(16))
    logits: list[list[torch.Tensor]] = [[], []]
    heads = [r._head for r in runners]

    def spy(i: int) -> Any:
        def call(x: torch.Tensor) -> torch.Tensor:
            out = heads[i](x)
            logits[i].append(out.float().clone())
            return out

        return call

    greedy = SamplingParams(max_tokens=steps + 1, temperature=0)
    first, second, agreed = [], [], 0
    try:
        for i, r in enumerate(runners):
            r._head = spy(i)  # type: ignore[assignment]
        chunk = SeqChunk(0, prompt, 0, table, True, greedy)
        for n in range(steps + 1):
            for r, cache in zip(runners, caches, strict=True):
                r.execute(StepBatch((chunk,)), cache)
            a, b = (torch.log_softmax(lg[-1][-1], dim=-1) for lg in logits)
            token = int(a.argmax())
            if n:  # the prompt's step samples too: compare from the first decode step on
                first.append(float(a[token]))
                second.append(float(b[token]))
                agreed += int(b.argmax()) == token
            chunk = SeqChunk(0, (token,), len(prompt) + n, table, True, greedy)
    finally:
        for r, h in zip(runners, heads, strict=True):
            r._head = h  # type: ignore[assignment]
    return first, second, agreed


@pytest.mark.model
def test_the_default_model_in_a_fast_dtype_decodes_close_to_its_float_path(
    vnni_kernels: Kernels,
) -> None:
    """The default model with a bfloat16 dense dtype (what ``--dtype auto`` picks on a CPU whose
    bfloat16 products are fast) takes int8 one-row products and says so; with ``--dtype
    float32`` it does not. Fed the float path's greedy tokens, its log-probabilities of them stay
    close to the float path's (measured: 0.030 nats apart on average, 0.177 at most over these
    24 steps, 23 of 24 choices the same: the activations' 8 bits, as ggml's Q8_0 ones; a prompt
    of at most 8 tokens, whose prefill takes the int8 tiles too and whose first tokens' rows hold
    the model's largest activations, measured 0.055 and 0.46), and its own greedy choice mostly
    agrees."""
    fast = ModelRunner(
        load_model("default", dtype="float32", dense_dtype="bfloat16", device="cpu"),
        quantization="gguf",
    )
    exact = ModelRunner(load_model("default", dtype="float32", device="cpu"), quantization="gguf")
    assert fast.int8_rows and fast.compute_path.row_activations == "int8"
    assert not exact.int8_rows and exact.compute_path.row_activations == "float32"
    assert exact.compute_path.labels()["row_activations"] == "float32"
    text = "Write a short story about a lighthouse keeper who finds a message in a bottle"
    prompt = tuple(exact.loaded.tokenizer.encode(text))
    assert len(prompt) > 8  # prefill on the products of many rows (bfloat16 / batched int8)
    want, got, agreed = _greedy_logprobs((exact, fast), prompt, 24)
    gaps = [abs(w - g) for w, g in zip(want, got, strict=True)]
    assert sum(gaps) / len(gaps) < 0.05 and max(gaps) < 0.25, gaps
    assert any(gap > 0 for gap in gaps)  # the int8 path ran
    assert agreed >= 22


@pytest.mark.slow
def test_a_compiler_without_avx512_vnni_builds_the_float_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compiler that rejects ``-mavx512bf16`` and ``-mavx512vnni`` (GCC < 8) does not cost the
    kernels: the build is retried without each, and one-row products stay float32."""
    real = shutil.which("cc") or shutil.which("gcc")
    if real is None or "avx512f" not in _build.cpu_flags():
        pytest.skip("needs a C compiler and AVX-512F")
    old_cc = tmp_path / "old-cc"
    old_cc.write_text(
        '#!/bin/sh\ncase "$*" in *-mavx512bf16*|*-mavx512vnni*) echo "unrecognized option" >&2; '
        f'exit 1;; esac\nexec {real} "$@"\n'
    )
    old_cc.chmod(0o755)
    monkeypatch.setenv("CC", str(old_cc))
    flags = _build.cpu_flags() | {"avx512_bf16", "avx512_vnni", "avx512bw", "avx512vl"}
    monkeypatch.setattr(_build, "cpu_flags", lambda: flags)
    kernels = load_kernels(tmp_path / "cache")
    assert not kernels.int8_rows and not kernels.bf16
    blocks = random_blocks("Q4_1", 8, 64, seed=1)
    x = torch.randn(1, 64)
    product = kernels.bind("Q4_1", blocks, None, int8_rows=True)
    assert not product.int8_rows
    assert_float_row(product(x), x, gguf_py("Q4_1", blocks))


def assert_float_row(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """``got`` is ``x @ weight.T`` within float32 rounding (K ulps of the sum of |terms|)."""
    want = x.double() @ weight.double().T
    bound = (
        x.shape[1] * torch.finfo(torch.float32).eps * (x.double().abs() @ weight.double().abs().T)
    )
    assert ((got.double() - want).abs() - bound).max().item() <= 0


def test_a_nan_in_the_row_makes_the_int8_products_nan(vnni_kernels: Kernels) -> None:
    """A NaN activation spreads to every output, as in the float product (its block's scale is
    NaN), whichever layout."""
    for kind in INT8_TYPES:
        blocks = random_blocks(kind, 16, 256, seed=9)
        x = torch.randn(1, 256)
        x[0, 70] = float("nan")
        assert torch.isnan(vnni_kernels.bind(kind, blocks, None, int8_rows=True)(x)).all(), kind


@pytest.mark.parametrize("rows", [2, 3, 5, 7, 8])
@pytest.mark.parametrize("kind", INT8_TYPES)
def test_up_to_eight_rows_take_int8_tiles_each_row_bitwise_its_one_row_result(
    vnni_kernels: Kernels, kind: str, rows: int
) -> None:
    """Two to eight rows (a few sequences decoding, a sequence's draft tokens to verify) take
    the int8 path too, every type here: each row of the result bitwise what the row alone
    gives, the bias added, so a token computes the same whatever it is multiplied with."""
    blocks = random_blocks(kind, 45, 512, seed=10)
    bias = torch.randn(45)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(11 + rows))
    x[rows - 1, 64:96] = 0.0  # a block of zeros in one row: its scale 0
    int8 = vnni_kernels.bind(kind, blocks, bias, int8_rows=True)
    together = int8(x)
    alone = torch.cat([int8(x[i : i + 1]) for i in range(rows)])
    assert torch.equal(together, alone)
    assert_int8_product(together - bias, x, gguf_py(kind, blocks))
