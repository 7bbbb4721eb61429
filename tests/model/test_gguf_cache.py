"""The GGUF header reader, the content-keyed conversion cache, and the conversion heartbeat."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from gguf_fakes import write_gguf

from stoic.gguf import GgufError, default_cache_dir, read_gguf_header
from stoic.gguf._cache import (
    MANIFEST,
    STALE_PARTIAL_S,
    CacheEntry,
    commit_entry,
    find_entry,
    gguf_content_key,
    list_entries,
    new_entry_dir,
    remove_entry,
    select_for_prune,
)
from stoic.gguf._cache import _legacy_path as legacy_path
from stoic.model._progress import heartbeat


def _key(path: Path) -> str:
    return gguf_content_key(path, read_gguf_header(path))


# -- the header -----------------------------------------------------------------------------------
def test_header_reads_metadata_and_array_lengths(tmp_path: Path) -> None:
    gguf = write_gguf(tmp_path / "m.gguf", name="tiny", tokens=("<unk>", "a", "b", "c"))
    header = read_gguf_header(gguf)
    assert (header.version, header.tensor_count) == (3, 1)
    assert (header.architecture, header.name, header.has_tokenizer) == ("llama", "tiny", True)
    assert header.array_lengths == {"tokenizer.ggml.tokens": 4}
    assert 0 < header.end < gguf.stat().st_size


def test_header_of_the_default_model() -> None:
    from stoic.model import default_gguf_path

    header = read_gguf_header(default_gguf_path())
    assert header.architecture == "llama" and header.array_lengths["tokenizer.ggml.tokens"] > 0
    assert header.tensor_count > 0


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"hello, world\n", "magic bytes"),
        (b"", "magic bytes"),
        (b"GGUF\x03\x00", "truncated"),
        (b"GGUF\x01\x00\x00\x00" + b"\0" * 40, "version 1"),
    ],
)
def test_header_refuses_what_is_not_gguf(tmp_path: Path, content: bytes, reason: str) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(content)
    with pytest.raises(GgufError, match=reason):
        read_gguf_header(path)


def test_header_refuses_a_truncated_file(tmp_path: Path) -> None:
    """A download cut short inside the metadata (the vocabulary) is reported, not mis-read."""
    gguf = write_gguf(tmp_path / "m.gguf", tokens=tuple(f"t{i}" for i in range(1000)))
    gguf.write_bytes(gguf.read_bytes()[:2000])
    with pytest.raises(GgufError, match="truncated or corrupt"):
        read_gguf_header(gguf)


# -- the content key ------------------------------------------------------------------------------
def test_key_is_equal_for_copies_at_different_paths(tmp_path: Path) -> None:
    """Two copies of one file (two virtualenvs, say), mtimes different: one key."""
    original = write_gguf(tmp_path / "a" / "m.gguf", data=os.urandom(3 << 20))
    copy = tmp_path / "b" / "other-name.gguf"
    copy.parent.mkdir()
    shutil.copyfile(original, copy)
    os.utime(copy, (1, 1))
    assert _key(original) == _key(copy)
    assert len(_key(original)) == 32


@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_key_differs_for_different_weights(tmp_path: Path, where: str) -> None:
    """A byte changed in the sampled tensor data (start, middle or end) changes the key."""
    data = bytearray(os.urandom(3 << 20))
    a = write_gguf(tmp_path / "a.gguf", data=bytes(data))
    index = {"start": 10, "middle": len(data) // 2, "end": len(data) - 10}[where]
    data[index] ^= 0xFF
    b = write_gguf(tmp_path / "b.gguf", data=bytes(data))
    assert _key(a) != _key(b)


def test_key_differs_for_different_metadata_or_size(tmp_path: Path) -> None:
    base = _key(write_gguf(tmp_path / "a.gguf"))
    assert _key(write_gguf(tmp_path / "b.gguf", name="another")) != base
    assert _key(write_gguf(tmp_path / "c.gguf", tokens=("<unk>", "a", "c"))) != base
    assert _key(write_gguf(tmp_path / "d.gguf", data=b"\0" * 128)) != base


def test_the_cache_root_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STOIC_CACHE_DIR", "/srv/cache")
    assert default_cache_dir() == Path("/srv/cache")
    monkeypatch.delenv("STOIC_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert default_cache_dir() == Path("/xdg/stoic")


# -- entries --------------------------------------------------------------------------------------
def _convert(root: Path, gguf: Path) -> Path:
    """What gguf_metadata_dir does, with a fake build (one file) instead of transformers."""
    header = read_gguf_header(gguf)
    tmp = new_entry_dir(root)
    (tmp / "config.json").write_text("{}")
    return commit_entry(tmp, root, gguf_content_key(gguf, header), gguf, header)


def _find(root: Path, gguf: Path) -> Path | None:
    header = read_gguf_header(gguf)
    return find_entry(root, gguf_content_key(gguf, header), gguf, header)


def test_a_copy_of_a_converted_file_finds_its_entry(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    first = write_gguf(tmp_path / "venv1" / "m.gguf")
    assert _find(root, first) is None
    entry = _convert(root, first)
    (tmp_path / "venv2").mkdir()
    second = tmp_path / "venv2" / "m.gguf"
    shutil.copyfile(first, second)
    assert _find(root, second) == entry
    manifest = json.loads((entry / MANIFEST).read_text())
    assert manifest["source"] == str(first.resolve()) and manifest["name"] == "fake"
    assert [p.name for p in (root / "converted").iterdir()] == [entry.name]  # no temp left


def test_a_hit_marks_the_entry_used(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    gguf = write_gguf(tmp_path / "m.gguf")
    entry = _convert(root, gguf)
    os.utime(entry / MANIFEST, (1000, 1000))
    before = time.time() - 1
    assert _find(root, gguf) == entry
    assert (entry / MANIFEST).stat().st_mtime >= before


def test_a_legacy_entry_of_the_same_file_is_adopted(tmp_path: Path) -> None:
    """An older stoic's path-keyed entry for this very file is renamed to the content key (no
    second conversion); one for another file stays where it is, ignored."""
    root = tmp_path / "cache"
    gguf = write_gguf(tmp_path / "m.gguf")
    legacy = legacy_path(root, gguf)
    legacy.mkdir(parents=True)
    (legacy / "config.json").write_text("{}")
    other = root / "converted" / "other-0123456789abcdef"
    other.mkdir()
    (other / "config.json").write_text("{}")
    found = _find(root, gguf)
    assert found is not None and found.name == _key(gguf)
    assert (found / "config.json").exists() and not legacy.exists()
    kinds = {e.key: e.kind for e in list_entries(root)}
    assert kinds == {found.name: "entry", other.name: "legacy"}


def test_list_entries_reports_key_source_size_and_last_used(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    assert list_entries(root) == []
    entry = _convert(root, write_gguf(tmp_path / "m.gguf"))
    (entry / "model.safetensors").write_bytes(b"x" * 1000)
    partial = new_entry_dir(root)
    [listed, unfinished] = sorted(list_entries(root), key=lambda e: e.kind)
    assert listed.kind == "entry" and listed.key == entry.name
    assert listed.source == str((tmp_path / "m.gguf").resolve())
    assert listed.size >= 1000 + 2
    assert abs(listed.last_used - time.time()) < 60
    assert unfinished.kind == "partial" and unfinished.path == partial


def _fake(kind: str, age_days: float, now: float) -> CacheEntry:
    key = f"{kind}-{age_days}"
    return CacheEntry(key, Path(key), kind, None, 1, now - age_days * 86400)  # type: ignore[arg-type]


def test_prune_selection() -> None:
    """No option: legacy entries only; --older-than: by last use; --all: everything. Partial
    conversions only once stale (a live one is never removed)."""
    now = 1_000_000_000.0
    entries = [
        _fake("entry", 1, now),
        _fake("entry", 40, now),
        _fake("legacy", 1, now),
        _fake("partial", 0, now),
        _fake("partial", STALE_PARTIAL_S / 86400 * 2, now),
    ]

    def keys(**kwargs: Any) -> set[str]:
        return {e.key for e in select_for_prune(entries, now=now, **kwargs)}

    stale = f"partial-{STALE_PARTIAL_S / 86400 * 2}"
    assert keys() == {"legacy-1", stale}
    assert keys(older_than_days=30) == {"entry-40", stale}
    assert keys(older_than_days=0.5) == {"entry-1", "entry-40", "legacy-1", stale}
    assert keys(everything=True) == {"entry-1", "entry-40", "legacy-1", stale}


def test_remove_entry_makes_a_start_miss_it(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    gguf = write_gguf(tmp_path / "m.gguf")
    _convert(root, gguf)
    [entry] = list_entries(root)
    remove_entry(entry)
    assert list_entries(root) == [] and _find(root, gguf) is None


# -- the heartbeat --------------------------------------------------------------------------------
class _Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.lock = threading.Lock()

    def info(self, event: str, **fields: Any) -> None:
        with self.lock:
            self.events.append((event, fields))


def test_heartbeat_logs_while_the_block_runs_and_never_after() -> None:
    log = _Log()
    with heartbeat(log, "model.converting", interval=0.05, source="x"):
        time.sleep(0.4)
    count = len(log.events)
    assert count >= 2
    assert all(event == "model.converting" and f["source"] == "x" for event, f in log.events)
    elapsed = [f["elapsed"] for _, f in log.events]
    assert elapsed == sorted(elapsed) and elapsed[0] > 0
    time.sleep(0.15)
    assert len(log.events) == count


def test_heartbeat_stops_when_the_block_raises() -> None:
    log = _Log()
    with pytest.raises(RuntimeError), heartbeat(log, "e", interval=0.01):
        raise RuntimeError("conversion failed")
    assert not any(t.name == "stoic-heartbeat" for t in threading.enumerate())
