"""Quantised-weight products (:mod:`stoic.kernels._qkernels`, :mod:`stoic.gguf._quant`): the
GGUF file's own blocks hold exactly the numbers of the de-quantised model, and multiplying by
them gives the float32 product up to the order of the sums."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import structlog
import torch
from gguf_blocks import gguf_py, random_blocks

from stoic.errors import ModelUnavailable
from stoic.gguf._quant import (
    MAX_KERNEL_ROWS,
    QLinear,
    QuantizedMatrix,
    choose_layouts,
    prepare_quantized,
    read_llama_blocks,
)
from stoic.kernels import GGML_TYPES, Kernels, KernelsUnavailable, load_kernels
from stoic.model import ComputePath, LoadedModel, default_gguf_path, load_model
from stoic.worker import ModelRunner

#: the types of 32-weight blocks (the K-quants' tests: test_kquants.py)
BLOCK32 = sorted(kind for kind, ggml in GGML_TYPES.items() if ggml.weights == 32)


@pytest.mark.parametrize("kind", BLOCK32)
def test_kernels_dequantise_to_the_numbers_gguf_py_gives(kernels: Kernels, kind: str) -> None:
    """Every weight the kernels compute with is bit for bit the float32 value of transformers'
    de-quantised copy (so quantised and float paths multiply the same matrix)."""
    blocks = random_blocks(kind, 7, 96, seed=1)
    assert torch.equal(kernels.dequantize(kind, blocks, 96), gguf_py(kind, blocks))


@pytest.mark.parametrize("kind", BLOCK32)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 33])
def test_product_equals_the_float_product_up_to_rounding(
    kernels: Kernels, kind: str, rows: int
) -> None:
    """``x @ W.T + b`` over the blocks equals the float64 product with the de-quantised matrix
    within float32 rounding, for row counts on and off the kernel's 4-row tiles."""
    blocks = random_blocks(kind, 37, 160, seed=rows)
    weight = gguf_py(kind, blocks)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(37)
    want = (x.double() @ weight.double().T + bias.double()).float()
    got = kernels.mm(kind, x, blocks, bias)
    assert got.shape == (rows, 37)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kernels.mm(kind, x, blocks, None), want - bias, rtol=1e-5, atol=1e-5)


def test_mismatched_shapes_are_refused_before_computing(kernels: Kernels) -> None:
    """A width that is not the blocks', not a multiple of 32, a non-float32 or strided input:
    ValueError, nothing read past the tensors."""
    blocks = random_blocks("Q8_0", 4, 64, seed=0)
    for x in (
        torch.randn(2, 96),
        torch.randn(2, 48),
        torch.randn(2, 64, dtype=torch.float64),
        torch.randn(64, 2).T,
    ):
        with pytest.raises(ValueError, match="cannot multiply"):
            kernels.mm("Q8_0", x, blocks, None)
    with pytest.raises(ValueError, match="a bias of"):
        kernels.mm("Q8_0", torch.randn(1, 64), blocks, torch.randn(5))
    with pytest.raises(ValueError, match="not Q8_0 blocks"):
        kernels.mm("Q8_0", torch.randn(1, 64), blocks[:, :-1].contiguous(), None)


def test_qlinear_uses_the_blocks_for_small_steps_only(kernels: Kernels) -> None:
    """At most ``max_rows`` rows go through the kernel, more through ``F.linear`` on the float
    weight (told apart here by giving the two different matrices); other dtypes come back in
    their own dtype."""
    blocks = random_blocks("Q4_1", 16, 64, seed=3)
    weight = gguf_py("Q4_1", blocks)
    linear = QLinear(
        torch.zeros_like(weight), None, QuantizedMatrix("Q4_1", blocks, 64), kernels, 4
    )
    small = torch.randn(1, 4, 64)
    torch.testing.assert_close(linear(small), small @ weight.T, rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(linear(torch.randn(1, 5, 64))) == 0
    half = linear(small.bfloat16())
    assert half.dtype == torch.bfloat16 and half.shape == (1, 4, 16)
    assert not QLinear(weight, None, None, kernels).uses_kernel(1)


@pytest.fixture(scope="module")
def default_fp32() -> LoadedModel:
    return load_model("default", dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def reference_fp32(default_model_dir: Path) -> LoadedModel:
    """The default model's weights as transformers de-quantises them (a model directory)."""
    return load_model(str(default_model_dir), dtype="float32", device="cpu")


@pytest.mark.model
def test_default_gguf_blocks_hold_the_converted_weights(
    kernels: Kernels, reference_fp32: LoadedModel
) -> None:
    """Every projection and the LM head of the default model, read from the GGUF file (Q/K rows
    un-permuted as transformers does), de-quantises to exactly transformers' float32 weights."""
    loaded = reference_fp32
    blocks = read_llama_blocks(default_gguf_path(), loaded.config)
    base = loaded.model.base_model
    assert len(blocks) == 7 * len(base.layers) + 1
    assert blocks["head"].kind == "Q8_0" and blocks["0.q"].kind == "Q4_1"
    for i, layer in enumerate(base.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for key, module in {
            "q": attn.q_proj, "k": attn.k_proj, "v": attn.v_proj, "o": attn.o_proj,
            "gate": mlp.gate_proj, "up": mlp.up_proj, "down": mlp.down_proj,
        }.items():  # fmt: skip
            m = blocks[f"{i}.{key}"]
            assert torch.equal(kernels.dequantize(m.kind, m.blocks, m.cols), module.weight), key
    head = loaded.model.get_output_embeddings().weight
    m = blocks["head"]
    assert torch.equal(kernels.dequantize(m.kind, m.blocks, m.cols), head)


@pytest.mark.model
def test_blocks_in_the_wrong_row_order_are_not_used(
    kernels: Kernels, reference_fp32: LoadedModel
) -> None:
    """A matrix whose rows do not match the model's (a mapping mistake, or Q rows left in
    llama.cpp's order) is detected at load by the sampled-row check and stays on the float path."""
    loaded = reference_fp32
    blocks = read_llama_blocks(default_gguf_path(), loaded.config)
    q = blocks["0.q"]
    weight = loaded.model.base_model.layers[0].self_attn.q_proj.weight
    assert q.matches(kernels, weight)
    swapped = QuantizedMatrix(q.kind, q.blocks.roll(1, 0), q.cols)
    assert not swapped.matches(kernels, weight)
    assert not q.matches(kernels, weight[:-1])


@pytest.mark.model
def test_runner_uses_the_blocks_for_every_projection(
    default_fp32: LoadedModel, kernels: Kernels
) -> None:
    """With the GGUF file at hand, every fused projection and the LM head run on blocks; the
    summary says so, with the architecture, the decoder path and the file's matrix types."""
    runner = ModelRunner(default_fp32, quantization="gguf")
    layers = default_fp32.config.num_hidden_layers
    # the repacked blocks' bytes, and (float32: no int8 layout) the dense copies prefill
    # multiplies by, made from them: each 4 bytes a weight
    layouts_mib = runner.quantized.pop("layouts_mib")
    assert 4 * 134e6 / 2**20 < layouts_mib < 6 * 134e6 / 2**20
    q4 = {r: "Q4_1" for r in ("attn_k", "attn_output", "attn_q", "attn_v")}
    ffn = {r: "Q4_1" for r in ("ffn_down", "ffn_gate", "ffn_up")}
    assert runner.quantized == {
        "architecture": "LlamaForCausalLM",
        "decoder": "fused",
        "logits": "output-layer",
        "whole_forward_reason": None,
        # the file's token embedding is the tied head: Q8_0
        "matrix_types": {**q4, **ffn, "token_embd": "Q8_0"},
        "kernel_types": ["Q4_1", "Q8_0"],
        "projections": 4 * layers,
        "of": 4 * layers,
        "head": "Q8_0",
        "c_layers": True,
        "kernel_rows": MAX_KERNEL_ROWS,
        "attention": "c-paged",
        "deterministic": False,
        "dtype": "float32",
        "dense_dtype": "float32",
        "kv_cache_dtype": "float32",
        "row_activations": "float32",
        "int8_batched_projections": 0,
        "weight_layouts": "fast",
    }
    runner.quantized["layouts_mib"] = layouts_mib
    assert runner.compute_path == ComputePath.from_summary(runner.quantized)
    assert runner.compute_path.layouts_mib == layouts_mib
    assert runner.compute_path.kernel_types == ("Q4_1", "Q8_0")


@pytest.mark.model
def test_model_directories_run_dequantised_and_gguf_mode_refuses_them(tiny_model_dir: Path) -> None:
    """A model directory has no blocks: ``auto`` runs as before, ``gguf`` fails with why."""
    loaded = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    with structlog.testing.capture_logs() as logs:
        assert ModelRunner(loaded).quantized["projections"] == 0
    off = [e for e in logs if e["event"] == "model.quantization.off"]
    assert [e["log_level"] for e in off] == ["info"]  # expected for a directory: no warning
    with pytest.raises(ModelUnavailable, match="not loaded from a GGUF file"):
        ModelRunner(loaded, quantization="gguf")


def test_without_a_compiler_auto_falls_back_and_gguf_refuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No C compiler: :func:`load_kernels` says so, ``auto`` uses no blocks and warns with the
    reason (a GGUF model on a CPU expected them), ``none`` says nothing, ``gguf`` refuses."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(KernelsUnavailable, match="no C compiler"):
        load_kernels(tmp_path)
    config = object()
    cpu = torch.device("cpu")
    with structlog.testing.capture_logs() as logs:
        assert prepare_quantized(default_gguf_path(), config, cpu, "auto", tmp_path) == ({}, None)
        assert prepare_quantized(default_gguf_path(), config, cpu, "none", tmp_path) == ({}, None)
    off = [e for e in logs if e["event"] == "model.quantization.off"]
    assert len(off) == 1 and off[0]["log_level"] == "warning"
    assert "no C compiler" in off[0]["reason"]
    with pytest.raises(ModelUnavailable, match="no C compiler"):
        prepare_quantized(default_gguf_path(), config, cpu, "gguf", tmp_path)


def test_a_failing_compiler_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiler that fails: KernelsUnavailable naming it, nothing left in the cache."""
    fake = tmp_path / "fakecc"
    fake.write_text("#!/bin/sh\necho 'fakecc: error: nope' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    with pytest.raises(KernelsUnavailable, match="failed to build the kernels: fakecc: error"):
        load_kernels(tmp_path / "cache")
    assert not list((tmp_path / "cache").rglob("*.so"))


@pytest.mark.model
async def test_gguf_mode_is_refused_before_any_worker_starts(tiny_model_dir: Path) -> None:
    """``quantization="gguf"`` with a model directory: the engine start fails with the reason in
    the server process (a configuration error), not in a worker process starting."""
    import stoic

    config = stoic.EngineConfig(model=str(tiny_model_dir), quantization="gguf", executor="process")
    with pytest.raises(ModelUnavailable, match="not loaded from a GGUF file"):
        async with stoic.Engine.start(config):
            pytest.fail("the engine started")


@pytest.mark.slow
def test_kernels_build_wherever_the_machine_allows(tmp_path: Path) -> None:
    """On an x86-64 CPU with AVX2, FMA and F16C and a C compiler, the kernels build (from
    nothing) and load: a broken build fails here instead of skipping every test above."""
    from stoic.kernels import _build

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("not an x86-64 machine")
    missing = {"avx2", "fma", "f16c"} - _build.cpu_flags()
    if missing or _build.compiler() is None:
        pytest.skip(f"no compiler, or the CPU lacks {missing}")
    kernels = load_kernels(tmp_path)
    assert kernels.path.is_relative_to(tmp_path) and kernels.path.exists()
    blocks = random_blocks("Q4_0", 3, 32, seed=5)
    x = torch.randn(2, 32)
    want = x @ gguf_py("Q4_0", blocks).T
    torch.testing.assert_close(kernels.mm("Q4_0", x, blocks, None), want, rtol=1e-5, atol=1e-5)


def test_the_build_uses_avx512_exactly_where_the_cpu_has_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``-mavx512f`` is passed only for a CPU that lists ``avx512f`` (a 16-lane build would die
    of SIGILL elsewhere); the flags are part of the build's key, so each CPU kind gets its own."""
    from stoic.kernels import _build

    monkeypatch.setattr(_build, "cpu_flags", lambda: {"avx2", "fma", "f16c"})
    assert "-mavx512f" not in _build.flags()
    monkeypatch.setattr(_build, "cpu_flags", lambda: {"avx2", "fma", "f16c", "avx512f"})
    assert "-mavx512f" in _build.flags()
    assert "-mavx512bf16" not in _build.flags()
    # the bfloat16 fixed-order products (_bf16fixed.c) only with AVX512_BF16 and AVX-512F
    monkeypatch.setattr(_build, "cpu_flags", lambda: {"avx2", "fma", "f16c", "avx512_bf16"})
    assert "-mavx512bf16" not in _build.flags()
    bf16 = {"avx2", "fma", "f16c", "avx512f", "avx512_bf16"}
    monkeypatch.setattr(_build, "cpu_flags", lambda: bf16)
    assert {"-mavx512f", "-mavx512bf16"} <= set(_build.flags())


@pytest.mark.slow
def test_a_compiler_without_avx512_bf16_builds_the_float32_fixed_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compiler that rejects ``-mavx512bf16`` (GCC < 10) does not cost the kernels: the build
    is retried without it, and the fixed-order products are float32 and batch-invariant."""
    from gguf_blocks import random_blocks
    from support import compiler_rejecting

    from stoic.kernels import _build, _qkernels

    if "avx512f" not in _build.cpu_flags():
        pytest.skip("needs AVX-512F")
    monkeypatch.setenv("CC", str(compiler_rejecting("-mavx512bf16", tmp_path)))
    flags = _build.cpu_flags() | {"avx512_bf16"}
    monkeypatch.setattr(_build, "cpu_flags", lambda: flags)
    kernels = _qkernels.load_kernels(tmp_path / "cache")
    assert not kernels.bf16
    product = kernels.bind("Q8_0", random_blocks("Q8_0", 8, 64, 1), None, fixed=True)
    x = torch.randn(9, 64)
    assert not product.bfloat16 and torch.equal(product(x)[:1], product(x[:1].contiguous()))


@pytest.mark.model
async def test_a_worker_process_reports_what_runs_on_blocks(kernels: Kernels) -> None:
    """With the process executor the worker's ``model.quantized`` line is not relayed, so the
    server's ``executor.worker_ready`` event carries the summary: every projection and the head
    on blocks, the C layers on."""
    import stoic

    config = stoic.EngineConfig(executor="process", quantization="gguf", dtype="float32")
    with structlog.testing.capture_logs() as logs:
        async with stoic.Engine.start(config) as engine:
            done = await engine.complete([1, 2, 3], stoic.SamplingParams(max_tokens=2))
            assert len(done.token_ids) >= 1
            compute = engine.stats().compute  # what /metrics shows as stoic_model_info
    ready = [e for e in logs if e["event"] == "executor.worker_ready"]
    assert ready and ready[0]["quantized"]["projections"] == ready[0]["quantized"]["of"] > 0
    assert ready[0]["quantized"]["head"] == "Q8_0" and ready[0]["quantized"]["c_layers"]
    assert compute is not None and compute.kernels and compute.c_layers
    assert compute.quantized_projections == compute.projections == ready[0]["quantized"]["of"]
    assert (compute.dtype, compute.dense_dtype, compute.head) == ("float32", "float32", "Q8_0")


def _matrices(weights: int, count: int = 1) -> dict[str, QuantizedMatrix]:
    """``count`` Q8_0 matrices of ``weights`` weights each (blocks of no consequence)."""
    rows = weights // 256
    blocks = torch.zeros(rows, 256 // 32 * 34, dtype=torch.uint8)
    return {f"{i}.q": QuantizedMatrix("Q8_0", blocks, 256) for i in range(count)}


def test_auto_weight_layouts_hold_the_batched_layout_while_it_fits_half_the_memory() -> None:
    """``auto``: the blocks and the int8 layout (1.5 bytes a weight at most) where they take
    at most half the memory free at load, else the blocks alone; the explicit choices are
    kept; a model that is not on blocks alone (dense weights of its own) is ``fast`` whatever
    the memory."""
    gib = 2**30
    # 2^31 weights in Q8_0 blocks (2.125 GiB) and 3 GiB of int8 layout
    two_b = _matrices(2**21, count=1024)
    assert choose_layouts("auto", two_b, batched_bytes=1.5, available=11 * gib) == "fast"
    assert choose_layouts("auto", two_b, batched_bytes=1.5, available=10 * gib) == "compact"
    # a dense bfloat16 copy (no int8 products here) takes 2 bytes a weight
    assert choose_layouts("auto", two_b, batched_bytes=2, available=13 * gib) == "fast"
    assert choose_layouts("auto", two_b, batched_bytes=2, available=12 * gib) == "compact"
    assert choose_layouts("compact", two_b, batched_bytes=1.5, available=64 * gib) == "compact"
    assert choose_layouts("fast", two_b, batched_bytes=1.5, available=1 * gib) == "fast"
    assert choose_layouts("auto", {}, batched_bytes=4, available=0) == "fast"
    # a type whose one layout serves every step (int8 products: G8_ALONE_TYPES) holds no more
    alone = frozenset({"Q8_0"})
    assert (
        choose_layouts("auto", two_b, batched_bytes=1.5, available=5 * gib, alone=alone) == "fast"
    )
    assert (
        choose_layouts("auto", two_b, batched_bytes=1.5, available=4 * gib, alone=alone)
        == "compact"
    )
    assert choose_layouts("compact", {}, batched_bytes=4, available=0) == "compact"
