"""An unusable ``--model`` is one line saying what is wrong and what to do, and exit status 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import structlog
from gguf_fakes import write_gguf

from stoic.errors import ModelUnavailable
from stoic.model import check_model_source, load_model
from stoic.model._loader import gguf_metadata_dir
from stoic.model._source import one_line

ROOT = Path(__file__).resolve().parents[2]


def _model_dir(path: Path, *, weights: bool = True, tokenizer: str | None = None) -> Path:
    """A model directory: a real Llama config, an (empty) weights file, an optional tokenizer
    file (name)."""
    from transformers import LlamaConfig

    path.mkdir()
    LlamaConfig(
        vocab_size=16,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    ).to_json_file(path / "config.json")
    if weights:
        (path / "model.safetensors").write_bytes(b"")
    if tokenizer:
        (path / tokenizer).write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return path


def _serve(model: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "STOIC_CACHE_DIR": str(tmp_path / "cache")}
    return subprocess.run(
        [sys.executable, "-m", "stoic", "serve", "--model", str(model), "--port", "0"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_serve_with_a_file_that_is_not_gguf_fails_on_one_line(tmp_path: Path) -> None:
    """A text file renamed x.gguf: exit 2, one line on stderr naming the file, the reason and
    what to do; no traceback, nothing on stdout, no cache written."""
    bad = tmp_path / "x.gguf"
    bad.write_text("these are my notes, not a model\n")
    done = _serve(bad, tmp_path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert "stoic.start_failed" in lines[0] and str(bad) in lines[0]
    assert "does not start with the GGUF magic bytes" in lines[0]
    assert "pass another --model" in lines[0]
    assert done.stdout == ""
    assert not (tmp_path / "cache").exists()


def test_serve_with_a_model_dir_without_tokenizer_fails_on_one_line(tmp_path: Path) -> None:
    """A directory with config.json and weights but no tokenizer files: exit 2, one line."""
    model = _model_dir(tmp_path / "no-tokenizer")
    done = _serve(model, tmp_path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert f"{model} has no tokenizer" in lines[0]
    assert "copy the model's tokenizer files into it" in lines[0]


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda p: p / "missing", "not found: no such file or directory"),
        (lambda p: p, "is not a model directory: it has no config.json"),
        (lambda p: _model_dir(p / "m", weights=False), "has no weights"),
        (lambda p: _model_dir(p / "m"), "has no tokenizer"),
        (lambda p: write_gguf(p / "m.gguf", tokens=()), "has no tokenizer"),
        (lambda p: write_gguf(p / "m.gguf", version=1), "GGUF version 1 is not supported"),
        (lambda p: write_gguf(p / "m.bin"), "is a file but not a .gguf file"),
    ],
)
def test_each_unusable_source_says_what_is_wrong(
    tmp_path: Path, make: object, expected: str
) -> None:
    """The cheap pre-flight check names the problem on one line, with what to do after ';'."""
    model = make(tmp_path)  # type: ignore[operator]
    with pytest.raises(ModelUnavailable) as raised:
        check_model_source(str(model))
    message = raised.value.message
    assert expected in message and "\n" not in message
    assert "; " in message  # what to do
    assert raised.value.code == "model_unavailable"


def test_usable_sources_pass_the_check(tmp_path: Path) -> None:
    """A model directory with a tokenizer, a GGUF with a vocabulary, and the default model."""
    check_model_source(str(_model_dir(tmp_path / "m", tokenizer="tokenizer.json")))
    check_model_source(str(write_gguf(tmp_path / "m.gguf")))
    check_model_source("default")
    # the worker process needs no tokenizer
    check_model_source(str(_model_dir(tmp_path / "w")), tokenizer=False)


def test_transformers_failures_are_wrapped_with_their_reason(tmp_path: Path) -> None:
    """What the cheap checks cannot see fails in transformers: a ModelUnavailable with
    transformers' reason on one line (the original exception chained), not a traceback."""
    model = _model_dir(tmp_path / "m", tokenizer="tokenizer_config.json")  # no vocabulary in it
    with pytest.raises(ModelUnavailable) as raised:
        load_model(str(model), weights=False, cache_root=tmp_path / "cache")
    message = raised.value.message
    assert message.startswith(f"cannot load the tokenizer of {model}: ")
    assert "\n" not in message and "check the model directory's files" in message
    assert isinstance(raised.value.__cause__, ValueError)


def test_a_gguf_transformers_cannot_read_fails_before_anything_is_cached(tmp_path: Path) -> None:
    """An architecture transformers does not support: transformers' reason, and no cache entry
    (nor a temporary directory) left behind. The metadata build's start was logged first."""
    gguf = write_gguf(tmp_path / "odd.gguf", architecture="nonsense")
    with structlog.testing.capture_logs() as logs, pytest.raises(ModelUnavailable) as raised:
        gguf_metadata_dir(gguf, tmp_path / "cache")
    assert raised.value.message.startswith(f"cannot read the model in {gguf}: ")
    assert "nonsense" in raised.value.message
    assert list((tmp_path / "cache" / "converted").glob("*")) == []
    start = next(e for e in logs if e["event"] == "model.metadata.building")
    assert start["source"] == str(gguf) and "target" in start


def test_one_line_collapses_whitespace_and_bounds_length() -> None:
    assert one_line(ValueError("a\n  b.\n")) == "a b"
    assert one_line(KeyError("model_type")) == "KeyError: 'model_type'"
    long = one_line(OSError("x" * 1000))
    assert len(long) == 300 and long.endswith("...")
