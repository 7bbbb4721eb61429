"""The KV cache is sized where the weights are, after they are loaded: a profiling forward at the
step budget's largest shapes, then what ``gpu_memory_utilization`` of the device's total memory
leaves. The device's figures are injected (:func:`stoic.worker._memory.device_memory`); the
server process never initialises CUDA."""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import mmap
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import structlog
import torch
from support import engine_config, free_port, wait_replaced

import stoic
from stoic.cli import build_parser, config_from_args
from stoic.errors import InsufficientMemory
from stoic.executor import ProcessBackend
from stoic.executor import _backend as backend_module
from stoic.model import KVCacheSpec, load_model
from stoic.worker import CacheBudget, ModelRunner
from stoic.worker import _memory as memory_module
from stoic.worker._memory import HostMemory, plan_cache

GIB = 2**30
MIB = 2**20
PARAMS = stoic.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
STOIC = Path(stoic.__file__).parent


class FakeDevice:
    """A device whose figures the test sets: ``held`` bytes in use by the process (weights and
    the rest), a profiling step peaking ``activations`` above what is in use."""

    def __init__(self, *, total: int, held: int, activations: int, available: int) -> None:
        self._total, self._held = total, held
        self._activations, self._available = activations, available
        self.resets = 0

    def total(self) -> int:
        return self._total

    def available(self) -> int:
        return self._available

    def in_use(self) -> int:
        return self._held

    def reset_peak(self) -> None:
        self.resets += 1

    def peak(self) -> int:
        return self._held + self._activations


def _inject(monkeypatch: pytest.MonkeyPatch, device: FakeDevice) -> None:
    monkeypatch.setattr(memory_module, "device_memory", lambda _device: device)


def _config(model_dir: Path, **overrides: Any) -> stoic.EngineConfig:
    return engine_config(model_dir, **{"num_kv_blocks": None, **overrides})


def test_a_mid_size_model_on_an_80_gb_card_leaves_the_cache_the_remainder() -> None:
    """An 8B model in bfloat16 (16 GB of weights) on an 80 GiB card, a 2048-token step peaking
    at 2.5 GiB: the cache gets 0.9 of the card less weights, activations and the most a decode
    step's copy of one layer's blocks can take, so everything fits (no OOM), to within one block. Sizing from free memory before the weights loaded (the old
    rule, 0.8 of 80 GiB, with nothing kept for the activations) would have asked for more than
    the card has."""
    llama_8b = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8}
    config = type("Config", (), {**llama_8b, "hidden_size": 4096, "head_dim": 128})()
    spec = KVCacheSpec.for_model(
        config, num_blocks=1, block_size=16, dtype=torch.bfloat16, device=torch.device("cpu")
    )
    assert spec.bytes_per_block == 2 * MIB
    total, weights, activations = 80 * GIB, 16_060_000_000, int(2.5 * GIB)
    budget = CacheBudget(block_size=16, step_tokens=2048, max_seqs=256, utilization=0.9)
    sizing = plan_cache(
        budget,
        bytes_per_block=spec.bytes_per_block,
        total=total,
        available=total - weights - GIB,  # the CUDA context and the allocator's slack
        weights=weights,
        activations=activations,
        # a decode step's copy of one layer, groups padded: twice the layer's cache at most,
        # and 1,500 keys per length class (128K tokens of context: 14 classes)
        gather_per_block=2 * spec.bytes_per_block // 32,
        gather_fixed=1500 * 14 * (spec.bytes_per_block // 32 // 16),
    )
    gather = 2 * sizing.cache_bytes / 32 + 1500 * 14 * 4096
    used = weights + activations + sizing.cache_bytes + gather
    assert used <= 0.9 * total < total
    assert 0.9 * total - used < spec.bytes_per_block * (1 + 2 / 32)
    assert sizing.num_blocks > 20_000  # ~52 GiB of cache
    # the old sizing, 0.8 of the free memory before the weights, with no room for activations
    assert weights + 0.8 * total + activations > total


def test_too_little_memory_names_the_figures() -> None:
    budget = CacheBudget(block_size=16, step_tokens=2048, max_seqs=64, utilization=0.9)
    with pytest.raises(InsufficientMemory) as caught:
        plan_cache(
            budget,
            bytes_per_block=2 * MIB,
            total=24 * GIB,
            available=8 * GIB,
            weights=int(20.5 * GIB),
            activations=GIB,
            device="cuda:0",
        )
    message = caught.value.message
    for figure in (
        "24.00 GiB",
        "21.60 GiB",
        "20.50 GiB",
        "0.10 GiB",
        "1.00 GiB",
        "2048 tokens",
        "128 blocks",
    ):
        assert figure in message
    assert "--gpu-memory-utilization 0.9" in message


def test_the_cache_never_takes_more_than_is_free_or_the_cap() -> None:
    budget = CacheBudget(block_size=16, step_tokens=256, max_seqs=64, utilization=0.9)
    figures = {"bytes_per_block": MIB, "total": 64 * GIB, "weights": GIB, "activations": GIB}
    tight = plan_cache(budget, available=5 * GIB, **figures)
    assert tight.cache_bytes == 4 * GIB  # free now, less a step's activations
    capped = plan_cache(
        dataclasses.replace(budget, cap_bytes=GIB // 2), available=60 * GIB, **figures
    )
    assert capped.cache_bytes == GIB // 2


@pytest.mark.asyncio
async def test_the_worker_profiles_the_largest_step_and_the_scheduler_gets_its_blocks(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Thread executor, injected figures: the profiling forwards run at the step budget's
    largest shapes (all its tokens in one sequence, and spread over max_num_seqs), the
    scheduler's allocator gets the blocks the remainder holds, one ``engine.kv_sizing`` event
    says so, and requests are served."""
    device = FakeDevice(total=400 * MIB, held=150 * MIB, activations=30 * MIB, available=GIB)
    _inject(monkeypatch, device)
    shapes: list[tuple[int, int]] = []
    execute = ModelRunner.execute

    def spy(self: ModelRunner, batch: Any, cache: Any) -> Any:
        shapes.append((batch.num_tokens, len(batch.chunks)))
        return execute(self, batch, cache)

    monkeypatch.setattr(ModelRunner, "execute", spy)
    config = _config(
        tiny_model_dir, gpu_memory_utilization=0.5, max_num_seqs=8, max_num_batched_tokens=64
    )
    with structlog.testing.capture_logs() as logs:
        async with stoic.Engine.start(config) as engine:
            per_block = engine._parts.kv_spec.bytes_per_block
            assert shapes[:2] == [(64, 1), (64, 8)]
            assert device.resets == 2
            spec = engine._parts.kv_spec
            layer_key = per_block // spec.num_layers // spec.block_size
            longest = -(-engine.max_model_len // spec.block_size)
            fixed = 1500 * longest.bit_length() * layer_key  # per length class of decodes
            blocks = ((200 - 150 - 30) * MIB - fixed) // (per_block + 2 * layer_key * 16)
            assert engine.stats().kv_blocks_total == blocks
            assert engine.kv_sizing.num_blocks == blocks
            assert (await engine.complete("Hello", PARAMS)).text
    [event] = [e for e in logs if e["event"] == "engine.kv_sizing"]
    assert event["kv_blocks"] == blocks
    assert event["weights_mib"] == 150.0 and event["activations_peak_mib"] == 30.0
    assert event["kv_cache_mib"] == round(blocks * per_block / MIB, 1)


@pytest.mark.asyncio
async def test_a_cpu_cache_capped_within_plenty_of_ram_is_sized_without_a_profile(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CPU with RAM to spare: even the shapes' upper bound of a step's activations leaves the
    cap binding, so no profiling step runs (it could not change the blocks); the cache is the
    cap, and the figures say the activations are the bound."""
    device = FakeDevice(total=64 * GIB, held=150 * MIB, activations=30 * MIB, available=32 * GIB)
    _inject(monkeypatch, device)
    profiled: list[int] = []
    execute = ModelRunner.execute

    def spy(self: ModelRunner, batch: Any, cache: Any) -> Any:
        profiled.append(batch.num_tokens)
        return execute(self, batch, cache)

    monkeypatch.setattr(ModelRunner, "execute", spy)
    config = _config(tiny_model_dir, kv_cache_memory_gib=0.25, max_num_batched_tokens=64)
    with structlog.testing.capture_logs() as logs:
        async with stoic.Engine.start(config) as engine:
            assert profiled == [] and device.resets == 0
            sizing = engine.kv_sizing
            assert sizing.num_blocks == GIB // 4 // sizing.bytes_per_block
            assert sizing.activations_bound and sizing.profiled
            bound = memory_module.activation_bound(
                engine.loaded.config, CacheBudget.of(config, "cpu")
            )
            assert bound is not None and sizing.activations == bound > 64 * MIB
            assert (await engine.complete("Hello", PARAMS)).text
    [event] = [e for e in logs if e["event"] == "engine.kv_sizing"]
    assert event["activations_bound"] is True


def test_the_activation_bound_grows_with_the_step_and_needs_every_dimension() -> None:
    """The bound is linear in a step's tokens but for a chunk's scores, grows with the sampled
    sequences, and is None (profile instead) where the configuration lacks a dimension."""
    config = SimpleNamespace(
        hidden_size=1536, intermediate_size=8960, vocab_size=151936, num_attention_heads=12
    )

    def bound(tokens: int, seqs: int, cfg: Any = config) -> int | None:
        budget = CacheBudget(block_size=16, step_tokens=tokens, max_seqs=seqs, utilization=0.9)
        return memory_module.activation_bound(cfg, budget)

    small, large, many = bound(256, 1), bound(512, 1), bound(256, 64)
    assert small is not None and large is not None and many is not None
    assert large > 2 * small - 64 * MIB  # the scores grow as the square of the chunk
    assert many - small == 2 * 4 * 3 * 63 * 151936
    assert bound(256, 1, SimpleNamespace(hidden_size=1536)) is None


@pytest.mark.asyncio
async def test_too_little_memory_fails_the_start_with_the_figures(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _inject(monkeypatch, FakeDevice(total=GIB, held=900 * MIB, activations=50 * MIB, available=GIB))
    with pytest.raises(InsufficientMemory, match=r"the weights take 0\.88 GiB"):
        async with stoic.Engine.start(_config(tiny_model_dir)):
            pass


@pytest.mark.asyncio
async def test_a_worker_process_that_cannot_fit_a_cache_fails_the_start_once(
    tiny_model_dir: Path,
) -> None:
    """Process executor, real RAM: 0.1% of it cannot hold the worker's own resident memory, so
    the worker reports the figures instead of ready, and the start fails with them at once (no
    replacement worker tries again)."""
    started = time.monotonic()
    config = _config(tiny_model_dir, executor="process", gpu_memory_utilization=0.001)
    with pytest.raises(InsufficientMemory, match="no room for the KV cache on cpu"):
        async with stoic.Engine.start(config):
            pass
    assert time.monotonic() - started < 120


def test_stoic_serve_with_too_little_memory_exits_2_with_one_line(tiny_model_dir: Path) -> None:
    """The command line: one ``stoic.start_failed`` line naming the figures, status 2 (a
    configuration error), no traceback, no second worker."""
    argv = ["serve", "--model", str(tiny_model_dir), "--host", "127.0.0.1", "--port"]
    argv += [str(free_port()), "--gpu-memory-utilization", "0.001", "--log-format", "json"]
    done = subprocess.run(
        [sys.executable, "-m", "stoic", *argv], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    [failed] = [line for line in done.stderr.splitlines() if "stoic.start_failed" in line]
    event = json.loads(failed)
    assert event["error"] == "InsufficientMemory"
    assert "no room for the KV cache on cpu" in event["message"]
    assert done.stderr.count("executor.worker_starting") == 1


@pytest.mark.asyncio
async def test_the_worker_process_sizes_from_ram_and_reports_its_blocks(
    tiny_model_dir: Path,
) -> None:
    """Process executor on a CPU: the worker sizes within the RAM (here the explicit cap binds)
    and its figure reaches the scheduler over the worker's reply channel."""
    config = _config(tiny_model_dir, executor="process", kv_cache_memory_gib=0.01)
    async with stoic.Engine.start(config) as engine:
        sizing = engine.kv_sizing
        assert sizing.profiled and sizing.weights > 0 and sizing.total > sizing.weights
        assert sizing.num_blocks == int(0.01 * GIB) // sizing.bytes_per_block
        assert engine.stats().kv_blocks_total == sizing.num_blocks
        assert (await engine.complete("Hello", PARAMS)).text


@pytest.mark.asyncio
async def test_a_replacement_worker_gets_the_first_workers_blocks_unprofiled(
    tiny_model_dir: Path,
) -> None:
    """kill -9 of the sized worker: its replacement is not profiled again and gets the same
    blocks (the allocator's ids stay valid; a restart after an OOM must not grow the cache)."""
    config = _config(tiny_model_dir, executor="process", kv_cache_memory_gib=0.01)
    with structlog.testing.capture_logs() as logs:
        async with stoic.Engine.start(config) as engine:
            pid = engine.stats().executor_pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            await wait_replaced(engine, pid, restarts=1)
            assert engine.stats().kv_blocks_total == engine.kv_sizing.num_blocks
            assert (await engine.complete("Hello", PARAMS)).text
    ready = [(e["kv_blocks"], e["profiled"]) for e in logs if e["event"] == "executor.worker_ready"]
    blocks = engine.kv_sizing.num_blocks
    assert ready == [(blocks, True), (blocks, False)]


def test_ram_is_bounded_by_the_cgroups_memory_limit(tmp_path: Path) -> None:
    """The CPU path: RAM from /proc/meminfo, bounded by the cgroup v2 limit and its headroom."""
    proc, root = tmp_path / "proc", tmp_path / "root"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(
        f"MemTotal: {16 * GIB // 1024} kB\nMemAvailable: {12 * GIB // 1024} kB\n"
    )
    (proc / "self" / "cgroup").write_text("0::/pod\n")
    (proc / "self" / "mountinfo").write_text("30 1 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n")
    pod = root / "sys" / "fs" / "cgroup" / "pod"
    pod.mkdir(parents=True)
    (pod / "memory.max").write_text(str(4 * GIB))
    (pod / "memory.current").write_text(str(GIB))
    memory = HostMemory(proc=proc, root=root)
    assert memory.total() == 4 * GIB
    assert memory.available() == 3 * GIB
    (pod / "memory.max").write_text("max")
    assert (memory.total(), memory.available()) == (16 * GIB, 12 * GIB)


def test_ram_peak_sees_a_steps_allocation_after_a_reset() -> None:
    """The CPU path's activations: the resident high-water mark, reset before the step."""
    memory = HostMemory()
    before = memory.in_use()
    memory.reset_peak()
    # 200 MB of fresh anonymous pages, touched (a torch tensor could reuse heap pages earlier
    # tests freed but the process still holds: no new resident memory to see)
    held = mmap.mmap(-1, 200 * MIB)
    for offset in range(0, 200 * MIB, mmap.PAGESIZE):
        held[offset] = 1
    peak = memory.peak()
    held.close()
    assert peak - before >= 150 * MIB
    assert before <= memory.total() and memory.available() <= memory.total()


def test_spares_on_a_gpu_need_memory_given_for_them() -> None:
    base = {"executor": "process", "executor_spares": 1}
    with pytest.raises(
        InsufficientMemory, match=r"2 x 0\.9 > 1.*at most --gpu-memory-utilization 0\.5"
    ):
        stoic.EngineConfig(**base).check_spares("cuda:0")
    stoic.EngineConfig(**base, gpu_memory_utilization=0.45).check_spares("cuda:0")
    stoic.EngineConfig(**base, num_kv_blocks=1000).check_spares("cuda:0")
    stoic.EngineConfig(**base).check_spares("cpu")  # the cache is capped on a CPU


@pytest.mark.asyncio
async def test_spares_are_refused_before_any_worker_starts(tiny_model_dir: Path) -> None:
    config = stoic.EngineConfig(
        model=str(tiny_model_dir), dtype="float32", executor="process", executor_spares=1
    )
    loaded = load_model(config.model, dtype="float32", weights=False)
    on_gpu = dataclasses.replace(loaded, device=torch.device("cuda:0"))
    backend = ProcessBackend(spares=1)
    with pytest.raises(InsufficientMemory, match="--executor-spares 1"):
        await backend.prepare(config, on_gpu, threads=1, vocab=None, grammar=None)
    assert backend._pool is None


def _cuda_entry_points() -> list[Any]:
    """Every torch.cuda module whose functions initialise CUDA through ``_lazy_init``."""
    return [
        m
        for name, m in sys.modules.items()
        if name.startswith("torch.cuda") and hasattr(m, "_lazy_init")
    ]


@pytest.mark.asyncio
async def test_the_server_process_never_initialises_cuda(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that believes its device is CUDA (an injected fake device: torch.cuda answers
    "available", and the worker, which cannot have one here, is handed the CPU) starts, sizes
    and serves without any call in this process reaching CUDA's initialisation."""
    reached: list[str] = []

    def refuse() -> None:
        reached.append("torch.cuda._lazy_init")
        raise AssertionError("the server process initialised CUDA")

    for module in _cuda_entry_points():
        monkeypatch.setattr(module, "_lazy_init", refuse)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    real_spec = backend_module.WorkerSpec
    monkeypatch.setattr(backend_module, "WorkerSpec", functools.partial(_on_cpu, real_spec))
    config = _config(
        tiny_model_dir, executor="process", device="cuda", dtype="auto", kv_cache_memory_gib=0.01
    )
    async with stoic.Engine.start(config) as engine:
        assert engine.loaded.device.type == "cuda"
        assert engine.kv_sizing.profiled
        assert (await engine.complete("Hello", PARAMS)).text
    assert reached == []
    assert not torch.cuda.is_initialized()


def _on_cpu(spec_type: Any, **fields: Any) -> Any:
    return spec_type(**{**fields, "device": "cpu"})


#: where the server process runs code (the model's modules run in the worker, or on the
#: thread executor's step thread, where the device is the engine's own)
_SERVER_SIDE = (
    "engine",
    "http",
    "scheduler",
    "runtime",
    "executor/_backend.py",
    "executor/_process.py",
)


def test_no_server_side_module_uses_torch_cuda() -> None:
    for part in _SERVER_SIDE:
        path = STOIC / part
        for file in [path] if path.is_file() else sorted(path.rglob("*.py")):
            tree = ast.parse(file.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and node.attr == "cuda":
                    pytest.fail(f"{file.relative_to(STOIC)}:{node.lineno} uses torch.cuda")


def test_the_memory_flags_reach_the_config() -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "--gpu-memory-utilization",
            "0.45",
            "--kv-cache-memory",
            "2",
            "--executor-spares",
            "1",
        ]
    )
    config = config_from_args(args)
    assert (config.gpu_memory_utilization, config.kv_cache_memory_gib) == (0.45, 2.0)
    defaults = config_from_args(build_parser().parse_args(["serve"]))
    assert (defaults.gpu_memory_utilization, defaults.kv_cache_memory_gib) == (0.9, None)
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        config_from_args(build_parser().parse_args(["serve", "--gpu-memory-utilization", "1.5"]))


@pytest.mark.parametrize("continued", [False, True])
def test_the_profile_reaches_the_longest_context_a_chunk_attends_over(continued: bool) -> None:
    """The sizing's profiling steps: the step budget's tokens from position 0 (one sequence,
    and spread over the most), and on a GPU one chunk of the budget's tokens that ends a
    sequence of the longest context (its attention's scores are the largest activation a step
    can have); each step's blocks cover its positions."""
    budget = CacheBudget(
        block_size=16, step_tokens=2048, max_seqs=64, utilization=0.9, max_model_len=8192
    )
    batches = memory_module.profile_batches(budget, 8192, continued=continued)
    assert [len(b.chunks) for b, _ in batches] == [1, 64] + ([1] if continued else [])
    for batch, blocks in batches:
        assert sum(len(c.token_ids) for c in batch.chunks) == 2048
        for chunk in batch.chunks:
            assert len(chunk.block_table) * 16 >= chunk.start_pos + len(chunk.token_ids)
            assert max(chunk.block_table) < blocks
    if continued:
        (last,) = batches[-1][0].chunks
        assert last.start_pos + len(last.token_ids) == 8192 and last.start_pos == 8192 - 2048
    # a context shorter than the step: the chunk is all of it but its first token
    (short,) = memory_module.profile_batches(budget, 100, continued=True)[-1][0].chunks
    assert (short.start_pos, len(short.token_ids)) == (1, 99)


def test_the_budget_carries_max_model_len() -> None:
    assert CacheBudget.of(stoic.EngineConfig(max_model_len=4096), "cuda").max_model_len == 4096
    assert CacheBudget.of(stoic.EngineConfig(), "cuda").max_model_len is None
