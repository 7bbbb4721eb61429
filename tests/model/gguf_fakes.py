"""Writing small GGUF files for tests: a valid header, a few bytes of tensor data."""

from __future__ import annotations

import struct
from pathlib import Path

_STRING, _ARRAY, _U32 = 8, 9, 4


def _string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def write_gguf(
    path: Path,
    *,
    architecture: str = "llama",
    name: str = "fake",
    tokens: tuple[str, ...] = ("<unk>", "a", "b"),
    data: bytes = b"\0" * 64,
    version: int = 3,
) -> Path:
    """A GGUF file with ``general.architecture``/``general.name``, a ``tokenizer.ggml.tokens``
    array (left out when ``tokens`` is empty), one F32 tensor ``w`` and ``data`` as its bytes.
    The parent directories are created."""
    kvs = [
        _string("general.architecture") + struct.pack("<I", _STRING) + _string(architecture),
        _string("general.name") + struct.pack("<I", _STRING) + _string(name),
        _string("general.alignment") + struct.pack("<II", _U32, 32),
    ]
    if tokens:
        array = struct.pack("<IQ", _STRING, len(tokens)) + b"".join(_string(t) for t in tokens)
        kvs.append(_string("tokenizer.ggml.tokens") + struct.pack("<I", _ARRAY) + array)
    tensor = _string("w") + struct.pack("<IQIQ", 1, len(data) // 4, 0, 0)
    header = b"GGUF" + struct.pack("<IQQ", version, 1, len(kvs)) + b"".join(kvs) + tensor
    padding = b"\0" * (-len(header) % 32)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(header + padding + data)
    return path
