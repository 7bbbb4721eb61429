"""``--dtype`` and ``--kv-cache-dtype`` resolved to the model's dtype, the dense products' dtype
and the KV cache's (:mod:`stoic.model._precision`): a GGUF Llama model decoding on its blocks
keeps float32 activations, takes bfloat16 only for products over many rows where bfloat16 is
faster, and a bfloat16 KV cache under ``auto``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import structlog
import torch
import torch.nn.functional as F
from gguf_fakes import write_gguf

from stoic.gguf import (
    DENSE_KERNEL_ROWS,
    MAX_KERNEL_ROWS,
    PackedLinear,
    QLinear,
    QuantizedMatrix,
    default_cache_dir,
)
from stoic.kernels import Kernels
from stoic.model import _precision, default_gguf_path, load_model
from stoic.model._precision import Precision, resolve_precision
from stoic.request import SamplingParams, SeqChunk, StepBatch
from stoic.worker import ModelRunner
from stoic.worker.testing import final_hidden_states

GREEDY = SamplingParams(max_tokens=64, temperature=0)
CPU = torch.device("cpu")
#: decode steps of these many sequences: the C layers' limit, one more, and few
WIDTHS = (DENSE_KERNEL_ROWS, DENSE_KERNEL_ROWS + 2, 3)


@pytest.fixture
def probe_says(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Make the CPU probe answer ``dtype`` (what an AMX CPU, or an AVX2 one, measures)."""

    def set_answer(dtype: torch.dtype) -> None:
        monkeypatch.setattr(_precision, "probe_cpu_dtype", lambda root=None: dtype)

    return set_answer


def test_auto_keeps_float32_activations_for_a_gguf_llama_decoding_on_blocks(
    kernels: Kernels, probe_says: Any, tmp_path: Path
) -> None:
    """Where bfloat16 measures faster, a GGUF Llama (or Qwen2) file whose decode runs on its
    blocks in the C layers gets float32 activations and bfloat16 dense products; with ``--quantization none``, a model
    directory or another architecture (Qwen3), ``auto`` is the probe's choice; an explicit dtype is
    taken as given; where float32 is faster only the KV cache is bfloat16."""
    root = default_cache_dir()
    gguf = default_gguf_path()
    probe_says(torch.bfloat16)
    fast = Precision(torch.float32, torch.bfloat16, torch.bfloat16)
    assert resolve_precision("auto", CPU, root, gguf=gguf) == fast
    assert resolve_precision(None, CPU, root, gguf=gguf, quantization="gguf") == fast
    assert resolve_precision("auto", CPU, root, gguf=gguf, quantization="none") == Precision(
        torch.bfloat16
    )
    assert resolve_precision("auto", CPU, root, gguf=None) == Precision(torch.bfloat16)
    qwen2 = write_gguf(tmp_path / "qwen2.gguf", architecture="qwen2")  # C layers too
    assert resolve_precision("auto", CPU, root, gguf=qwen2) == fast
    other = write_gguf(tmp_path / "qwen3.gguf", architecture="qwen3")
    assert resolve_precision("auto", CPU, root, gguf=other) == Precision(torch.bfloat16)
    assert resolve_precision("float32", CPU, root, gguf=gguf) == Precision(torch.float32)
    assert resolve_precision("bf16", CPU, root, gguf=gguf) == Precision(torch.bfloat16)
    probe_says(torch.float32)
    assert resolve_precision("auto", CPU, root, gguf=gguf) == Precision(
        torch.float32, kv_dtype=torch.bfloat16
    )
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_precision("float8", CPU, root, gguf=gguf)


def test_the_kv_cache_is_bfloat16_only_where_auto_puts_the_model_on_its_blocks(
    kernels: Kernels, probe_says: Any
) -> None:
    """``--kv-cache-dtype auto`` gives bfloat16 for a GGUF model decoding on its blocks with
    ``--dtype auto`` (not with ``--deterministic``, whose rows kernel reads float32 pools), the
    dtype's type everywhere else; an explicit choice is taken as given (None when it is the
    dtype's own); an unknown name is refused."""
    root, gguf = default_cache_dir(), default_gguf_path()
    probe_says(torch.bfloat16)
    assert resolve_precision("auto", CPU, root, gguf=gguf, deterministic=True) == Precision(
        torch.float32, torch.bfloat16
    )
    assert resolve_precision("float32", CPU, root, gguf=gguf).kv_dtype is None
    assert resolve_precision("auto", CPU, root, gguf=None).kv_dtype is None  # a directory
    explicit = resolve_precision("auto", CPU, root, gguf=gguf, kv_cache_dtype="float32")
    assert explicit == Precision(torch.float32, torch.bfloat16)
    assert resolve_precision(
        "float32", CPU, root, gguf=gguf, kv_cache_dtype="bfloat16"
    ) == Precision(torch.float32, kv_dtype=torch.bfloat16)
    assert resolve_precision(
        "bfloat16", CPU, root, gguf=None, kv_cache_dtype="bfloat16"
    ) == Precision(torch.bfloat16)
    with pytest.raises(ValueError, match="unknown KV cache dtype 'int8'"):
        resolve_precision("auto", CPU, root, gguf=gguf, kv_cache_dtype="int8")


def test_without_kernels_auto_is_the_probes_choice(
    probe_says: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No C compiler: the model cannot decode on blocks, so ``auto`` is plain bfloat16 (the
    C layers' float32 would buy nothing)."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    probe_says(torch.bfloat16)
    got = resolve_precision("auto", CPU, tmp_path, gguf=default_gguf_path())
    assert got == Precision(torch.bfloat16)


def test_qlinear_multiplies_many_rows_by_the_dense_copy(kernels: Kernels) -> None:
    """With a bfloat16 dense dtype, up to ``max_rows`` rows are multiplied by the blocks in
    float32 and more rows by a bfloat16 copy of the weights (inputs rounded to bfloat16, the
    result float32, or bfloat16 with ``native``, as the next product takes it); the split product
    equals the whole one's halves."""
    gen = torch.Generator().manual_seed(5)
    blocks = torch.randint(0, 256, (16, 2 * 20), dtype=torch.uint8, generator=gen)
    blocks.view(16, 2, 20)[:, :, :4] = torch.tensor([0, 0x2C, 0, 0xA8], dtype=torch.uint8)
    matrix = QuantizedMatrix("Q4_1", blocks, 64)
    weight = kernels.dequantize("Q4_1", blocks, 64)
    bias = torch.randn(16, generator=gen)
    linear = QLinear(weight, bias, matrix, kernels, max_rows=4, dense_dtype=torch.bfloat16)
    assert linear.dense_dtype == torch.bfloat16 and linear.weight.dtype == torch.float32
    # the copy is held packed for oneDNN when this CPU lets it pack (not twice), else plain
    assert (linear.packed is None) != (linear.dense_weight is None)
    if PackedLinear.build(weight.bfloat16(), None) is not None:
        assert linear.packed is not None
    few, many = torch.randn(1, 4, 64, generator=gen), torch.randn(1, 9, 64, generator=gen)
    torch.testing.assert_close(linear(few), F.linear(few, weight, bias), rtol=1e-5, atol=1e-5)
    got = linear(many)
    assert got.dtype == torch.float32
    want = F.linear(many.bfloat16(), weight.bfloat16(), bias.bfloat16()).float()
    assert torch.equal(got, want)
    assert not torch.equal(got, F.linear(many, weight, bias))  # it really is bfloat16
    native = linear(many, native=True)  # left bfloat16 for the next product
    assert native.dtype == torch.bfloat16 == linear.out_dtype(many, native=True)
    assert torch.equal(native.float(), got)
    assert linear(few, native=True).dtype == torch.float32 == linear.out_dtype(few, native=True)
    lo, hi = linear.dense(many, 2)
    torch.testing.assert_close(torch.cat([lo, hi], -1), got, rtol=0, atol=0)
    halves = QLinear(weight, bias, matrix, kernels, 4, torch.bfloat16, pack_parts=2)
    assert [torch.equal(a, b) for a, b in zip(halves.dense(many, 2), (lo, hi), strict=True)] == [
        True,
        True,
    ]
    assert torch.equal(halves(many), got)  # the halves joined when the whole is asked for
    plain = QLinear(weight, bias, matrix, kernels, max_rows=4)
    assert plain.dense_weight is weight and torch.equal(plain(many), F.linear(many, weight, bias))


@pytest.fixture(scope="module")
def runners(kernels: Kernels) -> tuple[ModelRunner, ModelRunner]:
    """The default model decoding on its blocks: float32 throughout, and float32 with bfloat16
    dense products (what ``auto`` gives on a CPU with AMX)."""
    exact = ModelRunner(load_model("default", dtype="float32", device="cpu"), quantization="gguf")
    mixed = load_model("default", dtype="float32", device="cpu", dense_dtype="bfloat16")
    assert mixed.dtype == torch.float32 and mixed.dense_dtype == torch.bfloat16
    return exact, ModelRunner(mixed, quantization="gguf")


@pytest.mark.model
def test_mixed_runner_decodes_few_rows_on_the_c_layers_and_prefills_in_bfloat16(
    runners: tuple[ModelRunner, ModelRunner],
) -> None:
    """The mixed runner reports its split (blocks up to DENSE_KERNEL_ROWS rows, bfloat16
    beyond), keeps a float32 KV cache, runs decode steps of up to that many sequences on the C
    layers and bigger ones on the torch path; its prefill's hidden states stay close to
    float32's (bfloat16 rounding, not equality).
    """
    exact, mixed = runners
    assert exact.kernel_rows == MAX_KERNEL_ROWS and mixed.kernel_rows == DENSE_KERNEL_ROWS
    assert mixed.quantized["dense_dtype"] == "bfloat16" and mixed.quantized["c_layers"]
    assert exact.quantized["dense_dtype"] == "float32"
    assert mixed.kv_spec(4, 4).dtype == torch.float32
    fused = mixed._fused
    assert fused is not None and fused.c_decoder is not None
    calls: list[int] = []
    original = fused.c_decoder.forward

    def counting(*args: Any) -> torch.Tensor:
        calls.append(args[0].shape[1])
        return original(*args)

    tables = [tuple(range(8 * i, 8 * i + 8)) for i in range(18)]
    prompts = [tuple(range(100 + 37 * i, 100 + 37 * i + 20)) for i in range(18)]
    steps = [
        StepBatch(tuple(SeqChunk(i, p, 0, tables[i], True, GREEDY) for i, p in enumerate(prompts)))
    ]
    for width in WIDTHS:
        steps.append(
            StepBatch(
                tuple(SeqChunk(i, (60 + i,), 20, tables[i], True, GREEDY) for i in range(width))
            )
        )
    fused.c_decoder.forward = counting  # type: ignore[method-assign]
    try:
        got, _ = final_hidden_states(mixed, steps[:1], num_blocks=144, block_size=4)
        for n, width in enumerate(WIDTHS):
            calls.clear()
            final_hidden_states(mixed, [steps[0], steps[n + 1]], 144, 4)
            assert calls == ([width] if width <= DENSE_KERNEL_ROWS else [])
    finally:
        fused.c_decoder.forward = original  # type: ignore[method-assign]
    want, _ = final_hidden_states(exact, steps[:1], num_blocks=144, block_size=4)
    cos = F.cosine_similarity(got[0], want[0], dim=-1)
    assert cos.min() > 0.99, cos
    assert not torch.equal(got[0], want[0])


@pytest.mark.model
def test_mixed_runner_attends_a_continued_prompt_chunk_like_the_whole_prompt(
    runners: tuple[ModelRunner, ModelRunner],
) -> None:
    """A prompt prefilled in two chunks (the second, 30 tokens after 34 cached, attends the
    float32 cache through a mask, converted to the queries' bfloat16) ends in the hidden state
    of the same prompt in one chunk and of float32's, within bfloat16 rounding; the cached keys
    and values of both runs agree as closely."""
    exact, mixed = runners
    prompt = tuple(range(300, 364))
    table = tuple(range(16))
    whole = [StepBatch((SeqChunk(0, prompt, 0, table, True, GREEDY),))]
    split = [
        StepBatch((SeqChunk(0, prompt[:34], 0, table, False, GREEDY),)),
        StepBatch((SeqChunk(0, prompt[34:], 34, table, True, GREEDY),)),
    ]
    (one,), one_cache = final_hidden_states(mixed, whole, num_blocks=16, block_size=4)
    (two,), two_cache = final_hidden_states(mixed, split, num_blocks=16, block_size=4)
    (ref,), _ = final_hidden_states(exact, whole, num_blocks=16, block_size=4)
    for got in (two, one):
        assert F.cosine_similarity(got, ref, dim=-1).min() > 0.99
    assert F.cosine_similarity(two, one, dim=-1).min() > 0.99
    for a, b in zip(
        one_cache.keys + one_cache.values, two_cache.keys + two_cache.values, strict=True
    ):
        assert F.cosine_similarity(a.flatten(1), b.flatten(1), dim=-1).min() > 0.99


@pytest.mark.model
async def test_a_worker_process_is_given_the_dense_dtype_its_server_resolved(
    kernels: Kernels, probe_says: Any
) -> None:
    """``--dtype auto`` resolves once, in the server: where bfloat16 measures faster the
    worker process loads float32 activations with bfloat16 dense products and says so in
    ``executor.worker_ready``; the engine's own record agrees."""
    import stoic

    probe_says(torch.bfloat16)
    config = stoic.EngineConfig(executor="process", dtype="auto")
    with structlog.testing.capture_logs() as logs:
        async with stoic.Engine.start(config) as engine:
            assert engine.loaded.dtype == torch.float32
            assert engine.loaded.dense_dtype == torch.bfloat16
            done = await engine.complete(list(range(100, 140)), SamplingParams(max_tokens=3))
            assert len(done.token_ids) >= 1
    ready = [e for e in logs if e["event"] == "executor.worker_ready"]
    assert ready and ready[0]["quantized"]["dense_dtype"] == "bfloat16"
    assert ready[0]["quantized"]["kernel_rows"] == DENSE_KERNEL_ROWS
    started = [e for e in logs if e["event"] == "engine.started"]
    assert started[0]["dtype"] == "float32" and started[0]["dense_dtype"] == "bfloat16"


def test_parse_dtype_names() -> None:
    """The names ``--dtype`` and ``WorkerSpec.dense_dtype`` use map to torch dtypes."""
    assert _precision.parse_dtype("bfloat16") is torch.bfloat16
    assert _precision.parse_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        _precision.parse_dtype("int4")
