"""The Python bindings of stoic's C kernels: :func:`load_kernels` (build once, load with
:mod:`ctypes`), :class:`Kernels` (the loaded library's functions, typed) and :class:`Product` (a
matrix repacked for the products). Re-exports the constants (:mod:`._constants`: the GGML
types and :data:`MAX_HEAD_DIM` from ``stoic_kernels.h``, the layouts from the library).

The build (compiler, flags, cache, compile and link) is :mod:`._build`'s. Why our own kernel at
all: torch's weight-only int8/int4 CPU kernels were measured 8x *slower* than the float32
product on an AVX2 CPU (docs/benchmarks.md, "Single-stream speed"); a ctypes call releases the
GIL.

Types: Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 (32-weight blocks) and the K-quants Q4_K, Q5_K and Q6_K
(256-weight super-blocks; these and the 5-bit types in ``_kquants.c``); a matrix stacked from
parts of different types (a fused projection of a mixed file such as Q4_K_M: Q4_K q and k over a
Q6_K v) is one product over its parts (:meth:`Kernels.bind_stack`).

On a CPU with AVX-512F the build adds ``-mavx512f``: products of up to 16 rows then use 16-lane
registers (35% less time at one row on a Xeon; the same arithmetic, the sums in another order).
With AVX512_BF16 too it adds ``-mavx512bf16``: ``--deterministic``'s fixed-order products are
then bfloat16 dot products (``_bf16fixed.c``; :meth:`Kernels.bind` with ``fixed``), 0.3-0.5x the
float32 fixed order's time at 16-64 rows.

With AVX512_VNNI (and BW, VL) it adds ``-mavx512bw -mavx512vl -mavx512vnni``: a product bound
with ``int8_rows`` (a model in a fast dtype: :class:`Product`) then multiplies up to eight rows
of activations quantised to int8 per block of 32 by integer dot products (``_int8rows.c``:
0.40-0.76x the float32 rows' time per matrix; not the float32 product).

Where the kernels cannot run (not x86-64, no AVX2/FMA/F16C, no C compiler, a failed build)
:func:`load_kernels` says why and the model runs on its de-quantised float weights, as before.
"""

from __future__ import annotations

import ctypes
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ._arena import Alloc, current_layouts, empty_bytes
from ._build import KernelsUnavailable, build_library
from ._constants import (
    C_POOL_DTYPES,
    G4_TYPES,
    G8_ALONE_TYPES,
    G8_TYPES,
    GGML_TYPES,
    MAX_HEAD_DIM,
    GgmlType,
    Layouts,
    const,
)

__all__ = [
    "C_POOL_DTYPES",
    "G4_TYPES",
    "G8_ALONE_TYPES",
    "G8_TYPES",
    "GGML_TYPES",
    "MAX_HEAD_DIM",
    "G8Layout",
    "GgmlType",
    "Kernels",
    "KernelsUnavailable",
    "Layouts",
    "Product",
    "load_kernels",
]


class G8Layout(NamedTuple):
    """A matrix laid out for the int8 products (:meth:`Kernels.g8_layout`)."""

    packed: torch.Tensor
    #: ``G8`` or a variant of it (``_gemm8.c``: +1 a scale and offset per 16 weights, +2 no
    #: offsets), as the kernels name it (:attr:`Layouts.g8`)
    layout: int


#: the threads a product runs on (a seam: tests pin it)
get_threads = torch.get_num_threads


class Product:
    """``x @ W.T (+ bias)`` by a matrix repacked for the kernels (:meth:`Kernels.bind`): a call
    costs a ctypes call and an output allocation (``layouts``: the library's layout ids).
    ``kind`` is the GGML type, or the parts' types joined by ``+`` for a stacked matrix (layout
    ``MIXED``: ``packed`` is its descriptor, ``parts`` the products whose repacked rows it
    points to). With ``fixed`` each row of the
    result is computed in one order whatever the number of rows: bitwise the same alone or in
    any batch (``--deterministic``; the layer kernels take the flag with the layout).

    ``bf16``: a fixed-order product in bfloat16 (``_bf16fixed.c``): ``(descriptor, copy)``, the
    int64 descriptor the kernels read (layout ``BF16FIXED``) and the bfloat16 copy of the
    weights (None: every step de-quantises in registers); ``packed`` the repacked blocks.

    ``int8_rows``: a product of up to eight rows quantises them to int8 per block of 32 (a scale
    each) and multiplies by integer dot products where the kernels have them
    (:attr:`Kernels.int8_rows`; ``_int8rows.c`` states the numerics): not the float32 product,
    so only for a model in a fast dtype; ignored by layouts without an int8 product (Q5_1, Q5_K;
    ``_int8rows.c`` lists them).

    ``g8``: a fixed-order product on int8 activations over the G8 layout (``_gemm8.c``; what
    :meth:`Kernels.bind` makes of ``fixed`` with ``int8_rows``): every row, whatever their
    number, quantised and summed in one order; ``rows`` then gives the matrix's rows (the
    layout is padded)."""

    __slots__ = (
        "_bf16",
        "_bias",
        "_packed",
        "_qmm",
        "cols",
        "fixed",
        "g8",
        "int8_rows",
        "kind",
        "layout",
        "parts",
        "rows",
    )  # fmt: skip

    def __init__(
        self,
        qmm: Callable[..., int],
        layouts: Layouts,
        kind: str,
        packed: torch.Tensor,
        cols: int,
        bias: torch.Tensor | None,
        parts: tuple[Product, ...] = (),
        *,
        fixed: bool = False,
        bf16: tuple[torch.Tensor, torch.Tensor | None] | None = None,
        int8_rows: bool = False,
        g8: int = 0,
        rows: int | None = None,
    ) -> None:
        self._qmm, self.kind, self._packed, self._bias = qmm, kind, packed, bias
        self.parts = parts
        self.fixed = fixed or bf16 is not None or bool(g8)
        self.g8: bool = bool(g8) or (bool(parts) and all(p.g8 for p in parts))
        self.int8_rows = (int8_rows and not self.fixed) or self.g8
        self._bf16 = bf16
        fixed_order = layouts.fixed_order
        self.layout = (layouts.mixed if parts else layouts.of[kind]) | (
            fixed_order if self.fixed else 0
        )
        self.layout |= layouts.int8_rows if int8_rows and not self.fixed else 0
        if bf16 is not None:
            self.layout = layouts.bf16fixed | fixed_order
        if g8:
            self.layout = g8 | fixed_order
        self.rows: int = (
            rows
            if rows is not None
            else sum(p.rows for p in parts)
            if parts
            else int(packed.shape[0])
        )
        self.cols = cols

    @property
    def nbytes(self) -> int:
        """Bytes held: the repacked blocks (a stack: its parts'), and a bfloat16 copy."""
        own = 0 if self.parts else self._packed.numel() * self._packed.element_size()
        copy = self._bf16[1] if self._bf16 is not None else None
        own += 0 if copy is None else copy.numel() * copy.element_size()
        return own + sum(p.nbytes for p in self.parts)

    @property
    def packed(self) -> torch.Tensor:
        """The repacked blocks (a G8 layout's bytes where :attr:`g8`), or a stack's descriptor."""
        return self._packed

    @property
    def pointer(self) -> int:
        """Where the repacked blocks are, or their descriptor (for the layer kernels); valid
        while this lives."""
        if self._bf16 is not None:
            return int(self._bf16[0].data_ptr())
        return int(self._packed.data_ptr())

    @property
    def bfloat16(self) -> bool:
        """Whether this computes in bfloat16 (the fixed order of ``_bf16fixed.c``; a stack:
        its parts do)."""
        return self._bf16 is not None or (bool(self.parts) and self.parts[0].bfloat16)

    @property
    def bf16_copy(self) -> torch.Tensor | None:
        """The bfloat16 copy of the weights steps of several rows read (None: none), each
        chunk of 32 in the product's element order (4-bit Q4_0/Q4_1: 0-7, 16-23, 8-15, 24-31)."""
        return None if self._bf16 is None else self._bf16[1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """:raises ValueError: if ``x`` is not float32 ``[M, cols]`` contiguous;
        ``torch.OutOfMemoryError`` if the kernel could not allocate its scratch copy of ``x``."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.cols:
            raise ValueError(
                f"cannot multiply x {tuple(x.shape)} by {self.kind} {(self.rows, self.cols)}"
            )
        if not x.is_contiguous():
            raise ValueError(f"cannot multiply a strided x {tuple(x.shape)}")
        m = x.shape[0]
        y = torch.empty(m, self.rows, dtype=torch.float32)
        bias = None if self._bias is None else self._bias.data_ptr()
        rc = self._qmm(
            self.layout, x.data_ptr(), m, self.cols, self.pointer, self.rows, bias,
            y.data_ptr(), get_threads(),
        )  # fmt: skip
        if rc != 0:  # the shapes were checked: only an allocation can fail
            raise torch.OutOfMemoryError(f"quantised {self.kind} product failed ({rc})")
        return y


class Kernels:
    """The loaded library. Thread-safe: calls share nothing but their arguments.

    :raises AttributeError: (construction) if ``lib`` lacks a function; ``ValueError`` if it
        lacks a constant (:meth:`Layouts.read`): a library built from other sources.
    """

    def __init__(self, path: Path, lib: ctypes.CDLL) -> None:
        self.path = path
        #: the layouts and flags the products take, as this library defines them
        self.layouts = Layouts.read(lib)
        #: the largest head dimension the attention kernels take (:data:`MAX_HEAD_DIM`, from
        #: the same header)
        self.max_head_dim = const(lib, "stoic_max_head_dim")
        i64, ptr, i32, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
        signatures: dict[str, list[Any]] = {
            "stoic_qmm": [i32, ptr, i64, i64, ptr, i64, ptr, ptr, i32],
            "stoic_dequantize": [i32, ptr, i64, i64, ptr],
            "stoic_repack": [i32, ptr, i64, i64, ptr],
            "stoic_repacked_bytes": [i32],
            # layout blocks N K out threads
            "stoic_bf16_pack": [i32, ptr, i64, i64, ptr, i32],
            "stoic_bf16_fixed": [],
            # hidden M D norm eps layout qkv bias heads kv_heads dh cos sin q k v threads
            "stoic_layer_pre": [ptr, i64, i64, ptr, f32, i32, ptr, ptr, i64, i64, i64, ptr,
                                ptr, ptr, ptr, ptr, i32],
            # q k v k_pool v_pool write tables lens M heads kv_heads dh block max_blocks scale
            # out threads kv_bf16 (the pools' type: 0 float32, 1 bfloat16)
            "stoic_decode_attention": [ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64,
                                       i64, i64, i64, f32, ptr, i32, i32],
            # q k v k_pool v_pool write tables lens runs n_runs M heads kv_heads dh block
            # max_blocks scale out threads kv_bf16 (0 only: float32 pools)
            "stoic_prefill_attention": [ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64,
                                        i64, i64, i64, i64, i64, f32, ptr, i32, i32],
            # hidden attn M D A layout_o o norm eps layout_gu gate_up F layout_down down threads
            "stoic_layer_post": [ptr, ptr, i64, i64, i64, i32, ptr, ptr, f32, i32, ptr, i64,
                                 i32, ptr, i32],
            # x M D w eps out threads
            "stoic_rms_norm_bf16": [ptr, i64, i64, ptr, f32, ptr, i32],
            # y N stride heads dh cos sin threads
            "stoic_rope_bf16": [ptr, i64, i64, i64, i64, ptr, ptr, i32],
            # gate gate_stride up up_stride M F out threads
            "stoic_silu_mul_bf16": [ptr, i64, ptr, i64, i64, i64, ptr, i32],
            # type blocks N K q d m  /  d m N K  /  q d m N K layout out  /  N K layout
            "stoic_g8_decode": [i32, ptr, i64, i64, ptr, ptr, ptr],
            "stoic_g8_layout": [ptr, ptr, i64, i64],
            "stoic_g8_pack": [ptr, ptr, ptr, i64, i64, i32, ptr],
            "stoic_g8_bytes": [i64, i64, i32],
            # x x_bf16 M K w N layout bias residual y y_bf16 threads
            "stoic_g8_mm": [ptr, i32, i64, i64, ptr, i64, i32, ptr, ptr, ptr, i32, i32],
            # Q4_K blocks N K out
            "stoic_g4k_pack": [ptr, i64, i64, ptr],
            # Q6_K blocks N K out
            "stoic_q6k_pack": [ptr, i64, i64, ptr],
            # q k_pool v_pool table nblocks start_pos n heads kv_heads dh block scale out threads
            # kv_bf16
            "stoic_chunk_attention": [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, f32,
                                      ptr, i32, i32],
            "stoic_chunk_attention_available": [],
        }  # fmt: skip
        for name, argtypes in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = i64 if name in ("stoic_repacked_bytes", "stoic_g8_bytes") else i32
        self._qmm: Callable[..., int] = lib.stoic_qmm
        self._dequantize: Callable[..., int] = lib.stoic_dequantize
        self._repack: Callable[..., int] = lib.stoic_repack
        self._packed_bytes: Callable[[int], int] = lib.stoic_repacked_bytes
        self._bf16_pack: Callable[..., int] = lib.stoic_bf16_pack
        #: whether fixed-order products compute in bfloat16 here (``_bf16fixed.c``: a CPU with
        #: AVX512_BF16); else in float32 on the blocks (FIXED_ORDER's tiles)
        self.bf16 = bool(lib.stoic_bf16_fixed())
        #: whether products of up to eight rows can take int8 activations here (``_int8rows.c``:
        #: a CPU with AVX-512 VNNI; False for a library built before them)
        probe = getattr(lib, "stoic_int8_rows", None)
        if probe is not None:
            probe.argtypes, probe.restype = [], i32
        self.int8_rows = bool(probe()) if probe is not None else False
        #: the batched int8 products' layout and product (:mod:`._gemm8` calls them)
        self.g8_decode: Callable[..., int] = lib.stoic_g8_decode
        self.g8_fit: Callable[..., int] = lib.stoic_g8_layout
        self.g8_pack: Callable[..., int] = lib.stoic_g8_pack
        self.g8_bytes: Callable[[int, int, int], int] = lib.stoic_g8_bytes
        self.g8_mm: Callable[..., int] = lib.stoic_g8_mm
        self.g4k_pack: Callable[..., int] = lib.stoic_g4k_pack
        self.q6k_pack: Callable[..., int] = lib.stoic_q6k_pack
        #: the layer kernels (:mod:`stoic.model._cdecode` calls them)
        self.layer_pre: Callable[..., int] = lib.stoic_layer_pre
        self.attention: Callable[..., int] = lib.stoic_decode_attention
        self.layer_post: Callable[..., int] = lib.stoic_layer_post
        #: the attention of runs of rows that share a sequence's keys (prefill chunks in
        #: deterministic mode), each row bitwise as :attr:`attention` computes it
        self.prefill_attention: Callable[..., int] = lib.stoic_prefill_attention
        #: a prompt chunk's causal attention over the pools in place (the default mode's prefill
        #: chunks, :mod:`stoic.model._cattention`), where :attr:`chunk_attention_available` (AVX-512)
        self.chunk_attention: Callable[..., int] = lib.stoic_chunk_attention
        self.chunk_attention_available = bool(lib.stoic_chunk_attention_available())
        #: the bfloat16 prefill's elementwise operators (:mod:`._cops` calls them)
        self.rms_norm_bf16: Callable[..., int] = lib.stoic_rms_norm_bf16
        self.rope_bf16: Callable[..., int] = lib.stoic_rope_bf16
        self.silu_mul_bf16: Callable[..., int] = lib.stoic_silu_mul_bf16

    def mm(
        self, kind: str, x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x @ W.T (+ bias)`` for ``x`` ``[M, K]`` float32 contiguous and ``W`` held as
        ``blocks`` (uint8 ``[N, K / 32 * block_bytes]`` of GGML type ``kind``); float32
        ``[M, N]``. Repacks the blocks on every call: a step uses :meth:`bind`.

        :raises ValueError: if the shapes or dtypes do not fit (nothing is computed).
        """
        return self.bind(kind, blocks, bias)(x)

    def bind(
        self,
        kind: str,
        blocks: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        fixed: bool = False,
        bf16_copy: bool = True,
        int8_rows: bool = False,
    ) -> Product:
        """:meth:`mm` by these blocks and bias: the blocks are checked and repacked into the
        products' layout once (float32 scales; Q4_0/Q4_1 nibbles reordered: 0.625-1.125 bytes a
        weight; the K-quants: 1.05-1.52x the file's bytes, ``_kquants.c`` says why). ``fixed``:
        in the fixed order (:class:`Product`): in bfloat16 where :attr:`bf16`, with
        (``bf16_copy``) a bfloat16 copy of the weights (2 bytes a weight) that steps of several
        rows read; without it they de-quantise in registers, bitwise the same results, slower.
        ``int8_rows``: products of up to eight rows with int8 activations where :attr:`int8_rows`
        (:class:`Product`); every product on int8 activations over the G8 layout where
        :attr:`int8_rows` and ``kind`` is one of :data:`G8_ALONE_TYPES` (its bytes are no more
        than the repacked blocks'; :attr:`Product.g8`), or with ``fixed`` one of
        :data:`G8_TYPES` (batch-invariant, 0.75-1.5 bytes a weight, no bfloat16 copy); with
        ``fixed`` otherwise the bfloat16 or float32 fixed order.

        :raises ValueError: if the blocks or the bias do not fit.
        """
        ggml = GGML_TYPES[kind]
        n, row_bytes = blocks.shape
        cols = row_bytes // ggml.block_bytes * ggml.weights
        if (
            blocks.dtype != torch.uint8
            or not blocks.is_contiguous()
            or row_bytes % ggml.block_bytes
        ):
            raise ValueError(f"not {kind} blocks: {blocks.dtype} {tuple(blocks.shape)}")
        _check_bias(bias, n)
        if int8_rows and self.int8_rows and kind in (G8_TYPES if fixed else G8_ALONE_TYPES):
            g8 = self.g8_layout([(kind, blocks)])
            return Product(
                self._qmm, self.layouts, kind, g8.packed, cols,
                None if bias is None else bias.contiguous(), g8=g8.layout, rows=n,
            )  # fmt: skip
        packed = torch.empty(
            n, cols // ggml.weights * self._packed_bytes(ggml.type_id), dtype=torch.uint8
        )
        if self._repack(ggml.type_id, blocks.data_ptr(), n, cols, packed.data_ptr()) != 0:
            raise ValueError(f"cannot repack {kind} blocks {tuple(blocks.shape)}")
        bf16 = self._bf16_of(kind, packed, n, cols, bf16_copy) if fixed and self.bf16 else None
        return Product(
            self._qmm, self.layouts, kind, packed, cols,
            None if bias is None else bias.contiguous(),
            fixed=fixed, bf16=bf16, int8_rows=int8_rows and self.int8_rows,
        )  # fmt: skip

    def _bf16_of(
        self, kind: str, packed: torch.Tensor, n: int, cols: int, copy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The descriptor of a bfloat16 fixed-order product over ``packed`` (and the copy)."""
        layout = self.layouts.of[kind]
        dense = torch.empty(n, cols, dtype=torch.bfloat16) if copy else None
        if dense is not None:
            rc = self._bf16_pack(
                layout, packed.data_ptr(), n, cols, dense.data_ptr(), get_threads()
            )
            if rc != 0:
                raise ValueError(f"cannot make a bfloat16 copy of {kind} {(n, cols)}")
        entries = [layout, packed.data_ptr(), 0 if dense is None else dense.data_ptr()]
        return torch.tensor(entries, dtype=torch.int64), dense

    def bind_stack(
        self,
        parts: list[tuple[str, torch.Tensor]],
        bias: torch.Tensor | None,
        *,
        fixed: bool = False,
        bf16_copy: bool = True,
        int8_rows: bool = False,
    ) -> Product:
        """:meth:`bind` for the matrix made of ``parts`` (``(kind, blocks)``, one below the
        other, of one width) whose types differ: one product, each part multiplied by its own
        kernel into its columns of the result.

        :raises ValueError: if a part does not fit, or the parts differ in width.
        """
        products = tuple(
            self.bind(kind, blocks, None, fixed=fixed, bf16_copy=bf16_copy, int8_rows=int8_rows)
            for kind, blocks in parts
        )
        if not products or len({p.cols for p in products}) != 1:
            raise ValueError(f"cannot stack matrices of widths {[p.cols for p in products]}")
        rows = sum(p.rows for p in products)
        _check_bias(bias, rows)
        entries = [len(products)]
        for p in products:
            entries += [p.layout, p.rows, p.pointer]
        descriptor = torch.tensor(entries, dtype=torch.int64)
        kind = "+".join(dict.fromkeys(p.kind for p in products))
        return Product(
            self._qmm,
            self.layouts,
            kind,
            descriptor,
            products[0].cols,
            None if bias is None else bias.contiguous(),
            products,
            fixed=fixed,
            int8_rows=int8_rows and self.int8_rows,
        )

    def g8_layout(
        self, parts: list[tuple[str, torch.Tensor]], layout: int | None = None
    ) -> G8Layout:
        """The matrix stacked from ``parts`` (``(kind, blocks)``, one below the other, each of
        :data:`G8_TYPES`) in the G8 layout (``_gemm8.c``), or the variant its blocks fit: G4,
        0.75 bytes a weight, where every part is of :data:`G4_TYPES` (G4K, 0.59, for Q4_K); G6,
        0.83, where every part is Q6_K; else 1.125 where every part is symmetric (Q4_0, Q5_0,
        Q8_0, Q6_K), 1.25 otherwise (1.25 and 1.5 with a Q6_K part: a scale per 16 weights).
        ``layout``: that variant instead (comparisons of the variants on the same blocks).

        Its bytes are private memory, or the shared memory of the arena in use
        (:func:`~stoic.kernels.use_layouts`: a worker process's load), where a later worker maps
        what the first packed.

        :raises ValueError: if a part is of another type, its blocks do not fit it or the
            ``layout`` asked for, or the parts differ in width.
        """
        arena = current_layouts()
        if arena is None:
            return self._g8_layout(parts, layout, empty_bytes)
        key = f"{layout}|" + ";".join(_fingerprint(kind, blocks) for kind, blocks in parts)

        def build(alloc: Alloc) -> tuple[torch.Tensor, int]:
            made = self._g8_layout(parts, layout, alloc)
            return made.packed, made.layout

        return G8Layout(*arena.take(key, build))

    def _g8_layout(
        self,
        parts: list[tuple[str, torch.Tensor]],
        layout: int | None,
        alloc: Alloc,
    ) -> G8Layout:
        """:meth:`g8_layout`, its bytes from ``alloc``."""
        # packed straight from the blocks: Q4_K into G4K (the file's super-block scales), Q6_K
        # into G6 (its products bitwise G8-with-halves-and-symmetric's over the decoded blocks)
        for kind, direct, pack in (
            ("Q4_K", self.layouts.g4k, self.g4k_pack),
            ("Q6_K", self.layouts.g6, self.q6k_pack),
        ):
            if layout in (None, direct) and parts and all(k == kind for k, _ in parts):
                return self._packed_from_blocks(kind, [b for _, b in parts], direct, pack, alloc)
        decoded = [self._g8_decode(kind, blocks) for kind, blocks in parts]
        widths = [q.shape[1] for q, _, _ in decoded]
        if not decoded or len(set(widths)) != 1:
            raise ValueError(f"cannot stack matrices of widths {[int(w) for w in widths]}")
        q, d, m = (torch.cat(t) if len(decoded) > 1 else t[0] for t in zip(*decoded, strict=True))
        rows, cols = q.shape
        if layout is None and all(kind in G4_TYPES for kind, _ in parts):
            layout = self.layouts.g4
        if layout is None:
            layout = self.g8_fit(d.data_ptr(), m.data_ptr(), rows, cols)
        packed = alloc(self.g8_bytes(rows, cols, layout))
        rc = self.g8_pack(
            q.data_ptr(), d.data_ptr(), m.data_ptr(), rows, cols, layout, packed.data_ptr()
        )
        if rc != 0:
            raise ValueError(
                f"cannot lay out a {rows} x {cols} matrix for int8 products (layout {layout})"
            )
        return G8Layout(packed, layout)

    def _packed_from_blocks(
        self,
        kind: str,
        parts: list[torch.Tensor],
        layout: int,
        pack: Callable[..., int],
        alloc: Alloc,
    ) -> G8Layout:
        """``parts`` of ``kind`` stacked, then ``pack(blocks, N, K, out)`` into ``layout``.

        :raises ValueError: the parts are not ``kind``'s blocks of one width, or ``pack``
            refused them."""
        ggml = GGML_TYPES[kind]
        if len({int(b.shape[1]) for b in parts}) != 1 or any(
            b.dtype != torch.uint8 or b.shape[1] % ggml.block_bytes for b in parts
        ):
            raise ValueError(f"not {kind} blocks of one width: {[tuple(b.shape) for b in parts]}")
        blocks = (torch.cat(parts) if len(parts) > 1 else parts[0]).contiguous()
        rows, cols = int(blocks.shape[0]), int(blocks.shape[1]) // ggml.block_bytes * ggml.weights
        packed = alloc(self.g8_bytes(rows, cols, layout))
        if pack(blocks.data_ptr(), rows, cols, packed.data_ptr()) != 0:
            raise ValueError(f"cannot lay out a {rows} x {cols} {kind} matrix (layout {layout})")
        return G8Layout(packed, layout)

    def _g8_decode(
        self, kind: str, blocks: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The unsigned integers (uint8 ``[N, K]``), scales and offsets (float32 ``[N, K / 16]``,
        per 16 weights) of ``blocks`` of ``kind``: w = q d + m."""
        ggml = GGML_TYPES[kind]
        n, row_bytes = blocks.shape
        if (
            kind not in G8_TYPES
            or blocks.dtype != torch.uint8
            or not blocks.is_contiguous()
            or row_bytes % ggml.block_bytes
        ):
            raise ValueError(f"not {kind} blocks for int8 products: {tuple(blocks.shape)}")
        cols = row_bytes // ggml.block_bytes * ggml.weights
        q = torch.empty(n, cols, dtype=torch.uint8)
        d = torch.empty(n, cols // 16, dtype=torch.float32)
        m = torch.empty(n, cols // 16, dtype=torch.float32)
        rc = self.g8_decode(
            ggml.type_id, blocks.data_ptr(), n, cols, q.data_ptr(), d.data_ptr(), m.data_ptr()
        )
        if rc != 0:
            raise ValueError(f"cannot decode {kind} blocks {tuple(blocks.shape)}")
        return q, d, m

    def dequantize(self, kind: str, blocks: torch.Tensor, cols: int) -> torch.Tensor:
        """The float32 ``[N, cols]`` matrix ``blocks`` holds, as :meth:`mm` sees it."""
        ggml = GGML_TYPES[kind]
        if (
            cols % ggml.weights
            or blocks.shape[1] != cols // ggml.weights * ggml.block_bytes
            or not blocks.is_contiguous()
        ):
            raise ValueError(f"{kind} blocks {tuple(blocks.shape)} do not hold {cols} columns")
        out = torch.empty(blocks.shape[0], cols, dtype=torch.float32)
        self._dequantize(ggml.type_id, blocks.data_ptr(), blocks.shape[0], cols, out.data_ptr())
        return out


def _fingerprint(kind: str, blocks: torch.Tensor) -> str:
    """``kind``, the shape and a checksum of the first and last 4 KiB of ``blocks``: what names
    a part of a layout in shared memory (:class:`~stoic.kernels.SharedLayouts`), telling apart
    the many matrices of one shape."""
    flat = blocks.reshape(-1)
    ends = torch.cat([flat[:4096], flat[-4096:]]).numpy().tobytes()
    return f"{kind}:{tuple(blocks.shape)}:{zlib.crc32(ends):08x}"


def _check_bias(bias: torch.Tensor | None, rows: int) -> None:
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (rows,)):
        raise ValueError(f"a bias of {tuple(bias.shape)} for {rows} outputs")


def load_kernels(cache_root: Path) -> Kernels:
    """Build (once: :func:`._build.build_library`) and load the kernels, under
    ``cache_root / "kernels"``.

    :raises KernelsUnavailable: if this machine cannot run them (one line: why).
    """
    target = build_library(cache_root)
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as e:
        raise KernelsUnavailable(f"cannot load {target}: {e}") from e
    try:
        return Kernels(target, lib)
    except (AttributeError, ValueError) as e:  # a library built from other sources
        raise KernelsUnavailable(f"{target} lacks a kernel: {e}") from e
