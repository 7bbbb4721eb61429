"""The attention backend seam: chosen once by device, dtype and kernels; a step's inputs built on
the host and moved in one copy; one read from the device a step (the sampled ids)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from stoic.kernels import Kernels
from stoic.model import PagedKVCache, load_model
from stoic.model._attention import (
    CPagedAttention,
    TorchPagedAttention,
    choose_attention,
    interface_attention,
    to_device,
)
from stoic.request import SamplingParams, SeqChunk, StepBatch
from stoic.worker import ModelRunner
from stoic.worker._inputs import build_inputs

GREEDY = SamplingParams(max_tokens=8, temperature=0)
LOGPROBS = SamplingParams(max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
SAMPLED = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=7)

#: every way Python code reads a tensor's values back to the host (not ``numpy``: it takes CPU
#: tensors only and raises for a device's, which must pass through one of these first; the
#: sampler's argmax reads CPU logits through NumPy, on the host already)
_READS = ("item", "tolist", "cpu", "__int__", "__float__", "__bool__", "__index__")


@contextmanager
def _device_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The names of the host reads of tensors made while inside (torch's, transformers' and
    stoic's Python code alike)."""
    seen: list[str] = []
    with monkeypatch.context() as patch:
        for name in _READS:
            original = getattr(torch.Tensor, name)

            def counted(self: torch.Tensor, *args: Any, _o: Any = original, _n: str = name) -> Any:
                seen.append(_n)
                return _o(self, *args)

            patch.setattr(torch.Tensor, name, counted)
        yield seen


def _steps() -> list[StepBatch]:
    """A prefill of three sequences (greedy, with logprobs, sampled), a decode step of all
    three, and a mixed step (two decodes, a new prompt chunk, a continued chunk)."""
    tables = [tuple(range(8 * i, 8 * i + 8)) for i in range(4)]
    params = (GREEDY, LOGPROBS, SAMPLED)
    prompts = [tuple(range(100, 105)), tuple(range(300, 323)), tuple(range(700, 709))]
    prefill = StepBatch(
        tuple(SeqChunk(i, p, 0, tables[i], True, params[i]) for i, p in enumerate(prompts)),
        tuple(range(32)),
    )
    decode = StepBatch(
        tuple(
            SeqChunk(i, (50 + i,), len(p), tables[i], True, params[i], num_generated=1)
            for i, p in enumerate(prompts)
        )
    )
    new = tuple(range(900, 914))
    mixed = StepBatch(
        (
            SeqChunk(0, (60,), len(prompts[0]) + 1, tables[0], True, GREEDY, num_generated=2),
            SeqChunk(3, new[:6], 0, tables[3], False, GREEDY),
            SeqChunk(2, (62,), len(prompts[2]) + 1, tables[2], True, SAMPLED, num_generated=2),
        )
    )
    rest = StepBatch((SeqChunk(3, new[6:], 6, tables[3], True, LOGPROBS),))
    return [prefill, decode, mixed, rest]


def _reads_per_step(runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    cache = PagedKVCache(runner.kv_spec(num_blocks=32, block_size=4))
    out = []
    for step in _steps():
        with _device_reads(monkeypatch) as seen:
            runner.execute(step, cache)
        out.append(seen)
    return out


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> ModelRunner:
    return ModelRunner(load_model(str(tiny_model_dir), dtype="float32", device="cpu"))


@pytest.mark.parametrize("fused", [True, False])
def test_a_step_reads_the_device_once_the_sampled_ids(
    tiny_model_dir: Path, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill, decode, mixed and continued-prefill steps (greedy, seeded and logprob rows) read
    one tensor back each: the sampled ids (with their logprobs, in the same table), on the
    fused decoder and on transformers' own layers."""
    loaded = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    runner = ModelRunner(loaded, fused=fused)
    assert (runner._fused is not None) == fused and runner.attention.name == "torch-paged"
    assert _reads_per_step(runner, monkeypatch) == [["tolist"]] * 4


@pytest.mark.model
def test_the_c_paths_read_the_device_once_a_step(
    kernels: Kernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default model on its quantised blocks: the C decode layers (decode step), the C decode
    attention next to torch's prefill (mixed step) and the torch path (prefills) read one tensor
    back a step."""
    runner = ModelRunner(load_model("default", dtype="float32", device="cpu"), quantization="gguf")
    assert runner.attention.name == "c-paged" and runner.compute_path.attention == "c-paged"
    assert runner.compute_path.card()["attention"] == "c-paged"
    assert _reads_per_step(runner, monkeypatch) == [["tolist"]] * 4


def test_a_steps_inputs_are_views_of_one_buffer(tiny: ModelRunner) -> None:
    """Ids, positions, sampled rows and every index the attention reads are built on the host
    and share one buffer (one copy to the device); the step's highest position is a number."""
    cache = PagedKVCache(tiny.kv_spec(num_blocks=32, block_size=4))
    step = build_inputs(_steps()[2], cache, torch.device("cpu"))
    meta = step.meta
    tensors = [step.input_ids, step.positions, step.rows, meta.write_index]
    for group in meta.decodes:
        tensors += [group.q_index, group.gather_index, group.context_lens, group.positions]
    tensors += [chunk.gather_index for chunk in meta.prefills]
    assert len(meta.decodes) >= 1 and len(meta.prefills) == 1
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    assert len(storages) == 1
    assert all(t.dtype == torch.int64 for t in tensors)
    assert meta.max_position == 10 and isinstance(meta.max_position, int)
    assert step.positions.tolist() == [[6, 0, 1, 2, 3, 4, 5, 10]]
    assert step.rows.tolist() == [0, 7]
    assert step.zero_rows is None
    # a step that hands out fresh blocks: their pool rows, every head, in the same buffer
    prefill = build_inputs(_steps()[0], cache, torch.device("cpu"))
    assert prefill.zero_rows is not None
    assert prefill.zero_rows.untyped_storage().data_ptr() == (
        prefill.input_ids.untyped_storage().data_ptr()
    )
    heads, blocks = cache.spec.num_kv_heads, cache.spec.num_blocks
    assert sorted(prefill.zero_rows.tolist()) == sorted(
        h * blocks + b for h in range(heads) for b in range(32)
    )


def test_to_device_pins_and_copies_without_blocking_on_cuda_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the CPU the host tensor itself (no pinning, no copy); on CUDA pinned, then copied
    non-blocking; elsewhere a plain copy."""
    host = torch.arange(6)
    assert to_device(host, torch.device("cpu")) is host
    calls: list[tuple[str, Any]] = []

    def pin(self: torch.Tensor) -> torch.Tensor:
        calls.append(("pin", None))
        return self

    def to(self: torch.Tensor, device: Any, non_blocking: bool = False) -> torch.Tensor:
        calls.append((str(device), non_blocking))
        return self

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    monkeypatch.setattr(torch.Tensor, "to", to)
    to_device(host, torch.device("cuda", 0))
    assert calls == [("pin", None), ("cuda:0", True)]
    calls.clear()
    to_device(host, torch.device("meta"))
    assert calls == [("meta", False)]


def test_the_backend_is_chosen_by_device_dtype_and_kernels(kernels: Kernels) -> None:
    """The C decode attention where the kernels run on a float32 cache on the CPU; torch's
    paged attention elsewhere (no kernels, another dtype or device, shapes the kernel lacks)."""
    shapes = {"heads": 9, "kv_heads": 3, "head_dim": 64}
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert isinstance(
        choose_attention(kernels, device=cpu, dtype=torch.float32, **shapes), CPagedAttention
    )
    for chosen in (
        choose_attention(None, device=cpu, dtype=torch.float32, **shapes),
        choose_attention(kernels, device=cpu, dtype=torch.bfloat16, **shapes),
        choose_attention(kernels, device=cuda, dtype=torch.float32, **shapes),
        choose_attention(kernels, device=cpu, dtype=torch.float32, heads=9, kv_heads=3, head_dim=6),
    ):
        assert isinstance(chosen, TorchPagedAttention) and chosen.name == "torch-paged"


def test_transformers_layers_need_a_planned_step() -> None:
    """transformers' attention interface without stoic's planned step fails with why."""
    q = torch.zeros(1, 2, 1, 4)
    with pytest.raises(RuntimeError, match="without a planned step"):
        interface_attention(torch.nn.Module(), q, q, q, None)
