"""``stoic cache list`` and ``stoic cache prune`` on a temporary cache with fake entries."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from stoic.cli import build_parser, config_from_args, main

KEY_NEW = "0123456789abcdef0123456789abcdef"
KEY_OLD = "fedcba9876543210fedcba9876543210"
LEGACY = "SmolLM2-135M-Instruct.Q4_1-0123456789abcdef"


def _entry(root: Path, key: str, *, source: str, size: int, days_ago: float = 0) -> Path:
    path = root / "converted" / key
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"\0" * size)
    manifest = path / "stoic-cache.json"
    manifest.write_text(json.dumps({"format": 1, "key": key, "source": source}))
    used = time.time() - days_ago * 86400
    os.utime(manifest, (used, used))
    return path


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    """A cache root with a recent entry, one unused for 40 days, and an older stoic's entry."""
    root = tmp_path / "cache"
    _entry(root, KEY_NEW, source="/venv1/m.gguf", size=3 << 20)
    _entry(root, KEY_OLD, source="/venv2/old.gguf", size=1 << 20, days_ago=40)
    legacy = root / "converted" / LEGACY
    legacy.mkdir()
    (legacy / "config.json").write_text("{}")
    (legacy / "model.safetensors").write_bytes(b"\0" * (2 << 20))
    return root


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


def test_list_shows_key_source_size_and_last_used(
    cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _run(["cache", "list", "--cache-dir", str(cache)], capsys)
    lines = out.splitlines()
    assert lines[0].split() == ["KEY", "SIZE", "LAST", "USED", "SOURCE"]
    new = next(line for line in lines if line.startswith(KEY_NEW))
    assert "3.0 MiB" in new and "/venv1/m.gguf" in new
    assert time.strftime("%Y-%m-%d") in new
    old = next(line for line in lines if line.startswith(KEY_OLD))
    assert "/venv2/old.gguf" in old
    legacy = next(line for line in lines if line.startswith(LEGACY))
    assert "older stoic" in legacy
    assert lines[-1].startswith("3 entries, 6.0 MiB in ") and str(cache) in lines[-1]
    # most recently used first
    assert lines.index(new) < lines.index(old)


def test_list_of_an_empty_cache(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(["cache", "list", "--cache-dir", str(tmp_path)], capsys)
    assert out.strip() == f"no converted models in {tmp_path / 'converted'}"


def test_the_cache_dir_comes_from_the_environment_like_serve(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``$STOIC_CACHE_DIR`` without ``--cache-dir``; ``--cache-dir`` (before or after the action)
    wins over it. ``serve --cache-dir`` reaches the engine's configuration."""
    monkeypatch.setenv("STOIC_CACHE_DIR", str(cache))
    assert KEY_NEW in _run(["cache", "list"], capsys)
    empty = tmp_path / "empty"
    assert "no converted models" in _run(["cache", "list", "--cache-dir", str(empty)], capsys)
    assert "no converted models" in _run(["cache", "--cache-dir", str(empty), "list"], capsys)
    args = build_parser().parse_args(["serve", "--cache-dir", str(cache)])
    assert config_from_args(args).cache_dir == cache
    assert config_from_args(build_parser().parse_args(["serve"])).cache_dir is None


def test_prune_without_options_removes_only_older_stoic_entries(
    cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _run(["cache", "prune", "--cache-dir", str(cache)], capsys)
    assert f"removed {LEGACY} (2.0 MiB" in out
    assert out.splitlines()[-1].startswith("freed 2.0 MiB (1 entry) in ")
    assert sorted(p.name for p in (cache / "converted").iterdir()) == sorted([KEY_NEW, KEY_OLD])


def test_prune_older_than_removes_entries_unused_that_long(
    cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _run(["cache", "prune", "--older-than", "30", "--cache-dir", str(cache)], capsys)
    assert f"removed {KEY_OLD} (1.0 MiB, /venv2/old.gguf)" in out
    assert "freed 1.0 MiB (1 entry)" in out
    assert sorted(p.name for p in (cache / "converted").iterdir()) == sorted([KEY_NEW, LEGACY])


def test_prune_all_removes_every_entry(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(["cache", "prune", "--all", "--cache-dir", str(cache)], capsys)
    assert "freed 6.0 MiB (3 entries)" in out
    assert list((cache / "converted").iterdir()) == []
    out = _run(["cache", "prune", "--all", "--cache-dir", str(cache)], capsys)
    assert out.startswith("freed 0 B (0 entries)")


def test_prune_keeps_a_conversion_in_progress(
    cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A fresh temporary directory is a live conversion: kept even by --all; a stale one goes."""
    live = cache / "converted" / ".convert-live"
    live.mkdir()
    stale = cache / "converted" / ".convert-crashed"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"\0" * 10)
    old = time.time() - 2 * 3600
    os.utime(stale / "model.safetensors", (old, old))
    os.utime(stale, (old, old))
    _run(["cache", "prune", "--all", "--cache-dir", str(cache)], capsys)
    assert [p.name for p in (cache / "converted").iterdir()] == [live.name]


@pytest.mark.parametrize(
    "argv",
    [
        ["cache"],
        ["cache", "drop"],
        ["cache", "prune", "--all", "--older-than", "3"],
        ["cache", "prune", "--older-than", "-1"],
        ["cache", "prune", "--older-than", "soon"],
    ],
)
def test_bad_cache_arguments_are_usage_errors(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert "error" in capsys.readouterr().err
