"""Reading a GGUF file's header without torch or transformers: fast, and strict about bad files.

The header is the magic bytes, the version, the metadata key/value pairs and the tensor table
(names, shapes, types, offsets); the tensor data follows it. Reading it costs tens of
milliseconds even for a large vocabulary (string arrays are skipped, not decoded), which is what
lets stoic check a file and compute its cache key (:mod:`._cache`) on every start.

Only GGUF versions 2 and 3 are read: version 1 (32-bit counts) is what transformers refuses too.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["GgufError", "GgufHeader", "GgufTensor", "read_gguf_header"]

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_STRING, _ARRAY = 8, 9
#: fixed-size value types: struct format by GGUF type id
_SCALAR = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}  # fmt: skip

Scalar = str | int | float | bool
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


class GgufError(ValueError):
    """The file is not a GGUF file stoic can read; the message says why (one line)."""


@dataclass(frozen=True)
class GgufTensor:
    """One entry of the tensor table."""

    name: str
    #: dimensions, innermost first (a ``[rows, cols]`` matrix is ``(cols, rows)``)
    dims: tuple[int, ...]
    #: the GGML type id (0 F32, 1 F16, 2 Q4_0, 3 Q4_1, 8 Q8_0, ...)
    ggml_type: int
    #: from the start of the tensor data (:attr:`GgufHeader.data_start`)
    offset: int


@dataclass(frozen=True)
class GgufHeader:
    """What a GGUF file's header says. Array values are not kept, only their lengths."""

    version: int
    tensor_count: int
    #: the scalar and string metadata values, by key
    metadata: dict[str, Scalar] = field(repr=False)
    #: the number of elements of every array-valued key (``tokenizer.ggml.tokens``: vocabulary)
    array_lengths: dict[str, int] = field(repr=False)
    #: offset just past the tensor table: everything before it is metadata
    end: int
    #: the tensor table, by name
    tensors: dict[str, GgufTensor] = field(default_factory=dict, repr=False)

    @property
    def data_start(self) -> int:
        """Where the tensor data begins: :attr:`end` rounded up to ``general.alignment``."""
        align = self.metadata.get("general.alignment", 32)
        align = align if isinstance(align, int) and align > 0 else 32
        return -(-self.end // align) * align

    @property
    def architecture(self) -> str | None:
        value = self.metadata.get("general.architecture")
        return value if isinstance(value, str) else None

    @property
    def name(self) -> str | None:
        value = self.metadata.get("general.name")
        return value if isinstance(value, str) else None

    @property
    def has_tokenizer(self) -> bool:
        """Whether the file embeds a vocabulary (transformers builds the tokenizer from it)."""
        return self.array_lengths.get("tokenizer.ggml.tokens", 0) > 0


class _Reader:
    def __init__(self, buf: mmap.mmap | bytes) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> tuple[object, ...]:
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def u32(self) -> int:
        value: int = _U32.unpack_from(self.buf, self.pos)[0]
        self.pos += 4
        return value

    def u64(self) -> int:
        value: int = _U64.unpack_from(self.buf, self.pos)[0]
        self.pos += 8
        return value

    def skip(self, n: int) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise struct.error("past the end of the file")
        self.pos += n

    def string(self) -> str:
        n = self.u64()
        start = self.pos
        self.skip(n)
        return bytes(self.buf[start : self.pos]).decode("utf-8", errors="replace")

    def scalar(self, kind: int) -> Scalar:
        if kind == _STRING:
            return self.string()
        if kind not in _SCALAR:
            raise GgufError(f"unknown metadata value type {kind}")
        value = self.unpack(_SCALAR[kind])[0]
        assert isinstance(value, str | int | float | bool)
        return value

    def skip_array(self) -> int:
        kind, count = self.u32(), self.u64()
        if kind == _STRING:  # the hot loop (a vocabulary, its merges): locals only
            buf, pos, length = self.buf, self.pos, _U64.unpack_from
            for _ in range(count):  # each string is >= 8 bytes: a bad count fails fast
                pos += 8 + length(buf, pos)[0]
            self.pos = pos
            self.skip(0)  # raises if the last string ran past the end
        elif kind in _SCALAR:
            self.skip(struct.calcsize(_SCALAR[kind]) * count)
        else:
            raise GgufError(f"unsupported metadata array of type {kind}")
        return count


def read_gguf_header(path: Path) -> GgufHeader:
    """Parse ``path``'s GGUF header (metadata and tensor table), not its tensor data.

    :raises GgufError: the file is not GGUF (wrong magic bytes), an unsupported version, or its
        header is truncated or malformed.
    :raises OSError: the file cannot be read.
    """
    with path.open("rb") as file:
        if file.read(4) != _MAGIC:
            raise GgufError("it does not start with the GGUF magic bytes")
        if path.stat().st_size < 24:
            raise GgufError("its header is truncated or corrupt")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(_Reader(buf))


def _parse(r: _Reader) -> GgufHeader:
    r.pos = 4  # past the magic bytes, checked by the caller
    version = r.u32()
    if version not in _VERSIONS:
        raise GgufError(f"GGUF version {version} is not supported (only 2 and 3)")
    try:
        tensor_count, kv_count = r.u64(), r.u64()
        metadata: dict[str, Scalar] = {}
        arrays: dict[str, int] = {}
        for _ in range(kv_count):
            key, kind = r.string(), r.u32()
            if kind == _ARRAY:
                arrays[key] = r.skip_array()
            else:
                metadata[key] = r.scalar(kind)
        tensors: dict[str, GgufTensor] = {}
        for _ in range(tensor_count):
            name, ndims = r.string(), r.u32()
            if ndims > 8:
                raise GgufError(f"tensor {name!r} has {ndims} dimensions")
            dims = tuple(r.u64() for _ in range(ndims))
            ggml_type, offset = r.u32(), r.u64()
            tensors[name] = GgufTensor(name, dims, ggml_type, offset)
    except struct.error:
        raise GgufError("its header is truncated or corrupt") from None
    if "general.architecture" not in metadata:
        raise GgufError("its metadata has no general.architecture")
    return GgufHeader(version, tensor_count, metadata, arrays, r.pos, tensors)
