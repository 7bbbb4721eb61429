"""The cache of GGUF models' metadata: content keys, entries, listing and pruning.

Layout under the cache root (``--cache-dir``, else ``$STOIC_CACHE_DIR``, else
``$XDG_CACHE_HOME/stoic`` or ``~/.cache/stoic``)::

    converted/<key>/            one entry: config and tokenizer files (an older stoic's: and
                                float32 safetensors, no longer read)
    converted/<key>/stoic-cache.json   its manifest: source file, name; its mtime is "last used"
    converted/.convert-*/       an entry being written (or one a crash left behind)
    converted/<stem>-<16 hex>/  an entry of an older stoic, keyed by the file's path (legacy)

An entry appears by an atomic rename of a finished directory, and its manifest is written before
that rename: a directory named by a key with a manifest is complete. Legacy entries are never
looked up by name again: the first start that finds the legacy entry of the very file it loads
adopts it (renames it to its content key), and ``stoic cache prune`` removes the others.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ._header import GgufHeader

__all__ = [
    "CacheEntry",
    "commit_entry",
    "default_cache_dir",
    "find_entry",
    "gguf_content_key",
    "list_entries",
    "new_entry_dir",
    "remove_entry",
    "select_for_prune",
]

CONVERTED = "converted"
MANIFEST = "stoic-cache.json"
_KEY = re.compile(r"^[0-9a-f]{32}$")
_EDGE = 1 << 20  # bytes of tensor data hashed at the start, middle and end of the file
_HEADER_CAP = 64 << 20  # metadata beyond this (never seen: vocabularies are a few MiB) is sampled
#: a temporary directory untouched this long is a crashed conversion's leftover, not a live one
STALE_PARTIAL_S = 3600.0

EntryKind = Literal["entry", "legacy", "partial"]


@dataclass(frozen=True)
class CacheEntry:
    """One directory under ``converted/``."""

    #: the content key (a legacy or partial entry: its directory name)
    key: str
    path: Path
    #: ``entry``: usable; ``legacy``: path-keyed by an older stoic; ``partial``: unfinished
    kind: EntryKind
    #: the GGUF file it was converted from (None when unknown: legacy and partial entries)
    source: str | None
    #: bytes on disk
    size: int
    #: when a start last used it (epoch seconds); for other kinds, when it was last written
    last_used: float


def default_cache_dir() -> Path:
    """``$STOIC_CACHE_DIR``, else ``$XDG_CACHE_HOME/stoic``, else ``~/.cache/stoic``."""
    env = os.environ.get("STOIC_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "stoic"


def gguf_content_key(path: Path, header: GgufHeader) -> str:
    """A key equal for byte-identical GGUF files wherever they are, different for different models.

    Why not a hash of the whole file: hashing hundreds of MiB on every start (including every
    worker-process restart) costs seconds on a small CPU, longer than loading the converted
    model. Instead the key hashes what identifies a model: the size, the whole header (every
    metadata value: architecture, hyper-parameters, the vocabulary and merges, the quantisation
    type; and the tensor table: every tensor's name, shape, type and offset), and 1 MiB of tensor
    data at the start, the middle and the end of the file (the weights themselves). Two different
    models, fine-tunes of one base included, differ there; files that agree on all of it and
    differ only elsewhere would have to be hand-edited in place, which a GGUF file (a published,
    immutable artifact) is not. Path and mtime are deliberately left out: that is what lets two
    virtualenvs' copies of one wheel share an entry. Cost: a few MiB read, milliseconds.
    """
    size = path.stat().st_size
    digest = hashlib.blake2b(digest_size=16, person=b"stoic-gguf-v1")
    digest.update(size.to_bytes(8, "little"))
    head = min(max(header.end, _EDGE), _HEADER_CAP, size)
    spans = [(0, head), ((size - _EDGE) // 2, _EDGE), (size - _EDGE, _EDGE)]
    with path.open("rb") as file:
        for start, length in spans:
            file.seek(max(start, 0))
            digest.update(file.read(length))
    return digest.hexdigest()


def _legacy_path(root: Path, gguf: Path) -> Path:
    """Where stoic <= 0.1 cached ``gguf``: keyed by its resolved path, size and mtime."""
    stat = gguf.stat()
    text = f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return root / CONVERTED / f"{gguf.stem}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def find_entry(root: Path, key: str, gguf: Path, header: GgufHeader) -> Path | None:
    """The complete entry for ``key`` (marked used now), or None.

    A legacy entry of this very file (same path, size and mtime) is adopted: renamed to ``key``.
    """
    target = root / CONVERTED / key
    if not (target / MANIFEST).exists():
        legacy = _legacy_path(root, gguf)
        if not (legacy / "config.json").exists():
            return None
        with contextlib.suppress(OSError):  # another process adopted it first: fine
            _write_manifest(legacy, key, gguf, header)
            legacy.rename(target)
        if not (target / MANIFEST).exists():
            return None
    with contextlib.suppress(OSError):  # a read-only cache still works, unaged
        os.utime(target / MANIFEST)
    return target


def new_entry_dir(root: Path) -> Path:
    """A fresh temporary directory under ``converted/`` to convert into."""
    parent = root / CONVERTED
    parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=".convert-", dir=parent))


def commit_entry(tmp: Path, root: Path, key: str, gguf: Path, header: GgufHeader) -> Path:
    """Write the manifest into ``tmp`` and rename it to the entry for ``key``; return the entry.

    If another process committed the same key first, theirs is kept and ``tmp`` is left for the
    caller to remove.
    """
    target = root / CONVERTED / key
    _write_manifest(tmp, key, gguf, header)
    try:
        tmp.rename(target)
    except OSError:  # another process won the race: keep theirs
        if not (target / MANIFEST).exists():
            raise
    return target


def _write_manifest(directory: Path, key: str, gguf: Path, header: GgufHeader) -> None:
    manifest = {
        "format": 1,
        "key": key,
        "source": str(gguf.resolve()),
        "source_size": gguf.stat().st_size,
        "name": header.name,
        "architecture": header.architecture,
        "created": time.time(),
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def list_entries(root: Path) -> list[CacheEntry]:
    """Every directory under ``root/converted``, most recently used first."""
    parent = root / CONVERTED
    if not parent.is_dir():
        return []
    entries = [_entry(path) for path in parent.iterdir() if path.is_dir()]
    return sorted(entries, key=lambda e: e.last_used, reverse=True)


def _entry(path: Path) -> CacheEntry:
    manifest = path / MANIFEST
    size = _disk_size(path)
    if path.name.startswith("."):
        return CacheEntry(path.name, path, "partial", None, size, _newest_mtime(path))
    if _KEY.match(path.name) and manifest.exists():
        source: Any = None
        with contextlib.suppress(OSError, ValueError):
            source = json.loads(manifest.read_text()).get("source")
        source = source if isinstance(source, str) else None
        return CacheEntry(path.name, path, "entry", source, size, manifest.stat().st_mtime)
    return CacheEntry(path.name, path, "legacy", None, size, _newest_mtime(path))


def _disk_size(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def _newest_mtime(path: Path) -> float:
    times = [path.stat().st_mtime]
    for child in path.iterdir():
        with contextlib.suppress(OSError):
            times.append(child.stat().st_mtime)
    return max(times)


def select_for_prune(
    entries: Iterable[CacheEntry],
    *,
    everything: bool = False,
    older_than_days: float | None = None,
    now: float | None = None,
) -> list[CacheEntry]:
    """The entries ``stoic cache prune`` removes.

    Always: partial conversions untouched for :data:`STALE_PARTIAL_S` (a live one is never
    touched). With ``everything``: every other entry. With ``older_than_days``: entries (legacy
    ones included) last used longer ago than that. With neither: legacy entries only, which no
    start looks up any more.
    """
    now = time.time() if now is None else now
    chosen = []
    for entry in entries:
        age = now - entry.last_used
        if entry.kind == "partial":
            remove = age > STALE_PARTIAL_S
        elif everything:
            remove = True
        elif older_than_days is not None:
            remove = age > older_than_days * 86400.0
        else:
            remove = entry.kind == "legacy"
        if remove:
            chosen.append(entry)
    return chosen


def remove_entry(entry: CacheEntry) -> None:
    """Delete ``entry``: first renamed aside (a start then misses it cleanly), then removed."""
    aside = entry.path.with_name(f".prune-{entry.path.name}-{os.getpid()}")
    try:
        entry.path.rename(aside)
    except OSError:
        aside = entry.path
    shutil.rmtree(aside, ignore_errors=True)
