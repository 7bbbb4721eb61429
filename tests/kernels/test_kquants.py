"""K-quant products (:mod:`stoic.kernels._qkernels`, ``_kquants.c``): Q4_K, Q5_K and Q6_K blocks
(and Q5_0 and Q5_1, which Q4_K_M files hold where a width is not a multiple of 256) de-quantise
bit for bit to gguf-py's numbers and multiply to the float product within float32
rounding, on the AVX2 and the AVX-512 build; a file that mixes types runs each matrix on its
own type and decodes the same greedy tokens as its de-quantised float32 model."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_blocks import gguf_py, quantize, random_blocks, write_llama_gguf

import stoic
from stoic.gguf import MixedMatrix, QuantizedMatrix, default_cache_dir
from stoic.kernels import Kernels, KernelsUnavailable, _build, load_kernels
from stoic.model import load_model
from stoic.worker import ModelRunner

KQUANTS = ("Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1")
ISAS = ("avx2", "avx512")


@pytest.fixture(scope="module", params=ISAS)
def isa_kernels(request: pytest.FixtureRequest) -> Kernels:
    """The kernels built for AVX2 only (the CPU's AVX-512 hidden from the build), and with
    AVX-512 where the CPU has it: each build is its own library (the flags are in its key)."""
    flags = _build.cpu_flags()
    if request.param == "avx512" and "avx512f" not in flags:
        pytest.skip("this CPU has no AVX-512F")
    with pytest.MonkeyPatch.context() as patch:
        if request.param == "avx2":
            patch.setattr(_build, "cpu_flags", lambda: flags - {"avx512f"})
        try:
            kernels = load_kernels(default_cache_dir())
        except KernelsUnavailable as e:
            pytest.skip(f"quantised kernels unavailable here: {e}")
        assert ("-mavx512f" in _build.flags()) == (request.param == "avx512")
    return kernels


def assert_within_rounding(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """``got`` is ``x @ weight.T`` up to float32 rounding of its sums: within K ulps of the
    sum of |terms| (the bound of any order of summation), against the float64 product."""
    want = x.double() @ weight.double().T
    bound = (
        x.shape[1] * torch.finfo(torch.float32).eps * (x.double().abs() @ weight.double().abs().T)
    )
    assert got.shape == want.shape
    excess = (got.double() - want).abs() - bound
    assert excess.max().item() <= 0, f"off by {excess.max().item()} beyond rounding"


@pytest.mark.parametrize("kind", KQUANTS)
def test_k_quants_dequantise_to_exactly_gguf_py_numbers(isa_kernels: Kernels, kind: str) -> None:
    """Random super-blocks and blocks of quantised weights: every weight the kernels multiply
    by is bitwise gguf-py's float32 value (what transformers' de-quantised copy holds)."""
    blocks = random_blocks(kind, 9, 512, seed=1)
    assert torch.equal(isa_kernels.dequantize(kind, blocks, 512), gguf_py(kind, blocks))
    weights = np.random.default_rng(2).normal(size=(5, 768)).astype(np.float32)
    real = torch.from_numpy(quantize(kind, weights))
    assert torch.equal(isa_kernels.dequantize(kind, real, 768), gguf_py(kind, real))


@pytest.mark.parametrize("kind", KQUANTS)
@pytest.mark.parametrize("shape", [(37, 256), (19, 1024)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 16, 17, 33])
def test_k_quant_products_equal_the_dequantised_product(
    isa_kernels: Kernels, kind: str, shape: tuple[int, int], rows: int
) -> None:
    """``x @ W.T + b`` over the blocks equals the float64 product with gguf-py's de-quantised
    matrix within float32 rounding: one row (the factored path), the 4- and 8-row tiles and
    what is left over, the 16-lane and the 8-lane range of the AVX-512 build."""
    n, k = shape
    blocks = random_blocks(kind, n, k, seed=rows)
    weight = gguf_py(kind, blocks)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(n)
    got = isa_kernels.mm(kind, x, blocks, bias)
    assert_within_rounding(got - bias, x, weight)
    assert_within_rounding(isa_kernels.mm(kind, x, blocks, None), x, weight)


@pytest.mark.parametrize("rows", [1, 4, 20])
def test_a_stack_of_types_multiplies_each_part_on_its_own(isa_kernels: Kernels, rows: int) -> None:
    """A fused projection of a mixed file (Q4_K and Q5_K over Q6_K, Q8_0, Q4_1 and Q5_0 parts) is
    one product: each part's rows on its own type, the bias added, results in the parts'
    order."""
    parts = [
        ("Q4_K", random_blocks("Q4_K", 6, 512, seed=3)),
        ("Q6_K", random_blocks("Q6_K", 5, 512, seed=4)),
        ("Q5_K", random_blocks("Q5_K", 3, 512, seed=5)),
    ]
    for kind in ("Q8_0", "Q4_1", "Q5_0"):
        weights = np.random.default_rng(6).normal(size=(4, 512)).astype(np.float32)
        parts.append((kind, torch.from_numpy(quantize(kind, weights))))
    weight = torch.cat([gguf_py(kind, blocks) for kind, blocks in parts])
    bias = torch.randn(weight.shape[0])
    product = isa_kernels.bind_stack(parts, bias)
    assert product.kind == "Q4_K+Q6_K+Q5_K+Q8_0+Q4_1+Q5_0" and product.rows == weight.shape[0]
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    assert_within_rounding(product(x) - bias, x, weight)


def test_mismatched_k_quant_blocks_are_refused(kernels: Kernels) -> None:
    """Blocks that are not whole super-blocks, a stack of different widths, a bias of the
    wrong length: ValueError before anything is computed."""
    blocks = random_blocks("Q4_K", 4, 512, seed=0)
    with pytest.raises(ValueError, match="not Q4_K blocks"):
        kernels.mm("Q4_K", torch.randn(1, 512), blocks[:, :-1].contiguous(), None)
    with pytest.raises(ValueError, match="cannot multiply"):
        kernels.mm("Q4_K", torch.randn(1, 256), blocks, None)
    with pytest.raises(ValueError, match="cannot stack"):
        kernels.bind_stack([("Q4_K", blocks), ("Q6_K", random_blocks("Q6_K", 2, 256, 1))], None)
    with pytest.raises(ValueError, match="a bias of"):
        kernels.bind_stack(
            [("Q4_K", blocks), ("Q6_K", random_blocks("Q6_K", 2, 512, 1))], torch.randn(5)
        )


def test_stacking_matrices_of_different_types_keeps_each_type(kernels: Kernels) -> None:
    """:meth:`QuantizedMatrix.stack` of a Q4_K and a Q6_K matrix is a :class:`MixedMatrix`;
    its sampled-row check holds for its de-quantised weights and fails for rows out of order."""
    q = QuantizedMatrix("Q4_K", random_blocks("Q4_K", 8, 256, seed=1), 256)
    v = QuantizedMatrix("Q6_K", random_blocks("Q6_K", 4, 256, seed=2), 256)
    stacked = QuantizedMatrix.stack([q, q, v])
    assert isinstance(stacked, MixedMatrix) and stacked.kind == "Q4_K+Q6_K"
    weight = torch.cat([gguf_py("Q4_K", q.blocks)] * 2 + [gguf_py("Q6_K", v.blocks)])
    assert stacked.matches(kernels, weight)
    assert not stacked.matches(kernels, weight.roll(1, 0))
    assert QuantizedMatrix.stack([q, None]) is None
    same = QuantizedMatrix.stack([q, q])
    # parts of one type stay apart too (no copy: the blocks may be a file's mapped pages), and
    # bind as one product over their rows stacked
    assert isinstance(same, MixedMatrix) and same.rows == 16 and same.kind == "Q4_K"
    assert same.parts[0].blocks.data_ptr() == q.blocks.data_ptr()
    assert QuantizedMatrix.stack([q]) is q
    product = same.bind(kernels, None)
    x = torch.randn(3, 256)
    assert product.kind == "Q4_K" and not product.parts
    assert torch.equal(product(x), kernels.bind("Q4_K", torch.cat([q.blocks, q.blocks]), None)(x))


#: per-matrix types: llama.cpp's Q4_K_M pattern (Q6_K for some V and down projections and
#: the output) and a file with every type the kernels take plus a float32 matrix
FILES = {
    "q4_k_m": {
        "default": "Q4_K", "0.attn_v": "Q6_K", "0.ffn_down": "Q6_K", "1.ffn_down": "Q5_K",
        "1.attn_q": "Q5_0", "1.attn_k": "Q5_0", "output": "Q6_K",
    },
    "every_type": {
        "default": "Q5_K", "0.attn_q": "Q4_K", "0.attn_k": "Q8_0", "0.attn_v": "Q6_K",
        "0.ffn_gate": "Q4_0", "0.ffn_up": "Q4_1", "0.ffn_down": "Q5_1", "1.attn_output": "F32",
        "output": "Q8_0",
    },
}  # fmt: skip
PROMPTS = ["the cat sat on the mat", "0123456789", "hello world, hello", "zzz"]


@pytest.mark.model
@pytest.mark.parametrize("layouts", ["fast", "compact"])
@pytest.mark.parametrize("name", sorted(FILES))
async def test_a_mixed_k_quant_file_decodes_like_its_dequantised_model(
    kernels: Kernels, tmp_path: Path, name: str, layouts: str
) -> None:
    """A tiny Llama GGUF file whose matrices are of different types: every quantised matrix
    runs on its own blocks (the float32 one on the float path), and greedy tokens, decoded
    alone and four at once, equal transformers' ``generate`` on the de-quantised float32
    model; with ``--weight-layouts compact`` too, where a prompt of more than 32 tokens is
    multiplied by the blocks as well (no dense copy made from them)."""
    gguf = write_llama_gguf(tmp_path / f"{name}.gguf", FILES[name])
    cache = tmp_path / "cache"
    loaded = load_model(str(gguf), dtype="float32", device="cpu", cache_root=cache)
    # the reference: every tensor de-quantised (gguf-py) into transformers' model
    dense = load_model(
        str(gguf), dtype="float32", device="cpu", cache_root=cache, quantization="none"
    )
    tokenizer = loaded.tokenizer
    prompts = [tokenizer.encode(p) for p in [*PROMPTS, " ".join(PROMPTS) * 2]]
    assert len(prompts[-1]) > 32  # a step of more rows than the kernels' default
    want = []
    with torch.inference_mode():
        for ids in prompts:
            out = dense.model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=12,
                min_new_tokens=12,
                do_sample=False,
            )
            want.append(out[0, len(ids) :].tolist())
    assert len({tuple(w) for w in want}) > 1  # outputs depend on the prompt
    runner = ModelRunner(loaded, quantization="gguf", weight_layouts=layouts)  # type: ignore[arg-type]
    summary = runner.quantized  # (the model is now stoic's)
    floats = sum(kind == "F32" for key, kind in FILES[name].items() if key != "output")
    assert summary["of"] == 8 and summary["projections"] == 8 - floats
    assert summary["head"] == FILES[name]["output"]
    assert summary["c_layers"] == (floats == 0)
    assert summary["weight_layouts"] == layouts
    assert (summary["kernel_rows"] == 2**31 - 1) == (layouts == "compact")
    config = stoic.EngineConfig(
        model=str(gguf),
        cache_dir=cache,
        quantization="gguf",
        weight_layouts=layouts,  # type: ignore[arg-type]
        executor="thread",
        dtype="float32",
        num_kv_blocks=64,
    )
    params = stoic.SamplingParams(max_tokens=12, min_tokens=12, temperature=0)
    async with stoic.Engine.start(config) as engine:
        alone = [(await engine.complete(ids, params)).token_ids for ids in prompts]
        together = await asyncio.gather(*(engine.complete(ids, params) for ids in prompts))
    assert [list(t) for t in alone] == want
    assert [list(r.token_ids) for r in together] == want
