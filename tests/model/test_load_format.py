"""``--load-format dummy``: a model's shape with random weights made on the device, from a
directory with no weight files (the shipped ``shapes/``), through both executors; the shapes'
published sizes; and what the flag changes nothing of without it."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import stoic
from stoic.errors import ModelUnavailable
from stoic.model import check_model_source, load_model

ROOT = Path(__file__).resolve().parents[2]
SHAPES = ROOT / "shapes"
#: parameters of each shipped shape, as the models' publishers count them (rounded)
PUBLISHED = {"smollm2-135m": 0.135e9, "qwen2.5-1.5b": 1.544e9, "llama3.1-8b": 8.03e9}


@pytest.mark.parametrize("shape", sorted(PUBLISHED))
def test_each_shipped_shape_is_its_published_size_and_has_no_weights(shape: str) -> None:
    """Every shape builds (on the meta device: no memory) to its published parameter count,
    holds no weight file, and its tokenizer loads."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = SHAPES / shape
    assert not [p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf")]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    params = sum(p.numel() for p in model.parameters())
    assert abs(params - PUBLISHED[shape]) / PUBLISHED[shape] < 0.005
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert max(tokenizer.encode("Name three colours.")) < model.config.vocab_size


def test_a_directory_without_weights_is_refused_unless_dummy() -> None:
    """The cheap start check refuses a directory with no weights, in one line naming what is
    missing and the flag that runs it anyway, and accepts it when the weights are to be made
    (``weights=False``)."""
    path = str(SHAPES / "smollm2-135m")
    with pytest.raises(ModelUnavailable, match=r"has no weights .*--load-format dummy"):
        check_model_source(path)
    check_model_source(path, weights=False)


def test_serve_checks_a_weightless_directory_by_the_load_format(tmp_path: Path) -> None:
    """``stoic serve --model shapes/...``: exit 2 with the one line; with ``--load-format dummy``
    the check passes, and the start goes on to the next check (a taken port: exit 1, the one
    line naming the address, not the model)."""
    env = {**os.environ, "STOIC_CACHE_DIR": str(tmp_path / "cache")}
    with contextlib.closing(socket.socket()) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        cmd = [sys.executable, "-m", "stoic", "serve", "--model", str(SHAPES / "smollm2-135m")]
        cmd += ["--port", port]
        runs = [
            subprocess.run([*c], capture_output=True, text=True, env=env, timeout=120, check=False)
            for c in (cmd, [*cmd, "--load-format", "dummy"])
        ]
    refused, accepted = runs
    assert refused.returncode == 2
    (line,) = refused.stderr.splitlines()
    assert "stoic.start_failed" in line and "--load-format dummy" in line
    assert accepted.returncode == 1
    (line,) = [x for x in accepted.stderr.splitlines() if "stoic.start_failed" in x]
    assert port in line and "weights" not in line


@pytest.mark.model
def test_a_gguf_file_loaded_dummy_reads_none_of_its_tensors() -> None:
    """The default model's file with ``load_format="dummy"``: its configuration and tokenizer,
    random weights in the compute dtype, and no file to run on (``gguf`` None): the weights
    differ from the file's."""
    real = load_model("default", dtype="float32", quantization="none")
    dummy = load_model("default", dtype="float32", load_format="dummy")
    assert dummy.gguf is None and real.gguf is not None
    assert dummy.model.config.hidden_size == real.model.config.hidden_size
    mine = dummy.model.get_input_embeddings().weight
    theirs = real.model.get_input_embeddings().weight
    assert mine.shape == theirs.shape and mine.dtype == torch.float32
    assert not torch.equal(mine, theirs)
    # the same random weights at every load (a replacement worker continues on them), and the
    # caller's random state untouched
    state = torch.random.get_rng_state()
    again = load_model("default", dtype="float32", load_format="dummy")
    assert torch.equal(torch.random.get_rng_state(), state)
    for a, b in zip(dummy.model.parameters(), again.model.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.model
@pytest.mark.parametrize("executor", ["thread", "process"])
async def test_a_shape_serves_with_dummy_weights(executor: str) -> None:
    """An engine on ``shapes/smollm2-135m`` (no weight file) with ``load_format="dummy"``
    starts under either executor (the worker process makes its own random weights) and
    completes requests, batched."""
    config = stoic.EngineConfig(
        model=str(SHAPES / "smollm2-135m"),
        load_format="dummy",
        dtype="float32",
        executor=executor,
        num_kv_blocks=64,
    )
    async with stoic.Engine.start(config) as engine:
        params = stoic.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        results = [await engine.complete(p, params) for p in ("Hello", "Name three colours.")]
    assert [len(r.token_ids) for r in results] == [6, 6]


def test_an_unknown_load_format_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="load_format must be one of auto, dummy"):
        stoic.EngineConfig(load_format="pt")  # type: ignore[arg-type]
