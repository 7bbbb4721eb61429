"""The kernels as a C library (:mod:`stoic.kernels._build`, :mod:`stoic.kernels._constants`):
each ``.c`` file its own translation unit on the shared headers, the library exporting its
interface (``stoic_kernels.h``) and nothing else, the constants defined once in C, and a build
keyed on every source and header."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from stoic.kernels import GGML_TYPES, MAX_HEAD_DIM, _build
from stoic.kernels._qkernels import Kernels

KERNELS = Path(_build.__file__).parent


def _interface() -> set[str]:
    """The functions and constants ``stoic_kernels.h`` declares."""
    text = (KERNELS / "stoic_kernels.h").read_text()
    return set(re.findall(r"\b(stoic_\w+)\s*(?:\(|;)", text))


def test_the_sources_are_every_c_file_and_header_of_the_package() -> None:
    """What the build compiles is what the package ships (``*.c``, ``*.h``); no file includes
    another ``.c`` file (each is its own translation unit)."""
    files = _build.sources()
    on_disk = {p.name for p in KERNELS.iterdir() if p.suffix in (".c", ".h")}
    assert set(files) == on_disk and "stoic_kernels.h" in files
    for name, data in files.items():
        assert not re.search(rb'#include\s+"[^"]+\.c"', data), name


def test_the_library_exports_its_interface_and_hides_the_rest(kernels: Kernels) -> None:
    """Every function and constant the interface header declares is in the library; what one
    file calls in another (``_common.h``'s hidden functions) is not exported."""
    lib = ctypes.CDLL(str(kernels.path))
    declared = _interface()
    assert {"stoic_qmm", "stoic_layout_of", "stoic_max_head_dim"} <= declared
    for name in declared:
        assert hasattr(lib, name), name
    for hidden in ("kquants_mm", "int8rows_mm", "gemm8_mm", "bf16fixed_mm", "qkernels_fixed_order"):
        assert not hasattr(lib, hidden), hidden


def test_the_constants_read_from_the_header_are_the_librarys(kernels: Kernels) -> None:
    """``MAX_HEAD_DIM`` and the GGML types, read from the header's text at import, are what the
    library was built with: each type repacks into a layout of its own, of some bytes."""
    assert kernels.max_head_dim == MAX_HEAD_DIM > 0
    layouts = kernels.layouts
    assert set(layouts.of) == set(GGML_TYPES)
    assert len(set(layouts.of.values())) == len(GGML_TYPES)
    flags = {layouts.fixed_order, layouts.int8_rows}
    assert len(flags) == 2 and all(f & (f - 1) == 0 for f in flags)  # one bit each
    special = {layouts.mixed, layouts.bf16fixed, layouts.g8}
    assert len(special) == 3 and not special & set(layouts.of.values())
    for kind, ggml in GGML_TYPES.items():
        assert ggml.weights in (32, 256) and ggml.block_bytes > 0, kind
        assert kernels._packed_bytes(ggml.type_id) > 0, kind


def test_the_build_is_keyed_on_every_file_the_compiler_and_the_flags() -> None:
    """A change to any source or header, the compiler, its version or the flags is another
    build (another directory); the same inputs are the same build."""
    files = _build.sources()
    flags = _build.flags()
    key = _build.cache_key("cc", files, ["cc 1"], flags)
    assert key == _build.cache_key("cc", dict(reversed(files.items())), ["cc 1"], flags)
    for name in ("stoic_kernels.h", "_common.h", "_blocks.h", "_gemm8.c"):
        changed = {**files, name: files[name] + b"\n"}
        assert _build.cache_key("cc", changed, ["cc 1"], flags) != key, name
    assert _build.cache_key("gcc", files, ["cc 1"], flags) != key
    assert _build.cache_key("cc", files, ["cc 2"], flags) != key
    assert _build.cache_key("cc", files, ["cc 1"], (*flags, "-mavx512f")) != key


@pytest.mark.slow
def test_a_file_that_fails_fails_the_build_and_nothing_is_installed(tmp_path: Path) -> None:
    """A translation unit that does not compile (here beside one that does, on the shared
    headers) fails the build, and neither the library nor an object is left behind."""
    cc = _build.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    headers = {n: d for n, d in _build.sources().items() if n.endswith(".h")}
    files = {
        **headers,
        "_fine.c": b'#include "_common.h"\nfloat fine(void) { return hsum(_mm256_setzero_ps()); }\n',
        "_broken.c": b'#include "_common.h"\nint broken(void) { return }\n',
    }
    target = tmp_path / "lib" / _build.LIBRARY
    with pytest.raises(_build.KernelsUnavailable, match="failed to build the kernels: "):
        _build.build(cc, files, target, _build.flags())
    assert not target.exists() and not list(tmp_path.rglob("*.o"))
    del files["_broken.c"]
    _build.build(cc, files, target, _build.flags())
    assert hasattr(ctypes.CDLL(str(target)), "fine")
