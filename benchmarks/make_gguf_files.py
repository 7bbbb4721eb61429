"""Make random-weight GGUF files in the shapes of real models, quantised with llama-quantize.

For each ``--shape`` (``smollm2-135m``, ``qwen2.5-0.5b``, ``qwen2.5-1.5b``, ``llama3.2-3b``,
``llama3.1-8b``; ``all`` for every one), into ``--out`` (/tmp/gguf):

1. an F16 GGUF file of that model's architecture (``llama`` or ``qwen2``) and shape (hidden size,
   layers, attention and KV heads, feed-forward size, vocabulary, tied embeddings, Qwen2's q/k/v
   biases, RoPE base, norm epsilon, context length) with random weights: matrices normal with
   std 0.02 in float16, norms 1 and biases 0 in float32 (as llama.cpp's converter keeps them).
   It is written tensor by tensor with gguf-py (header, metadata and tensor infos first, then
   each tensor's data in turn), so one tensor at a time is in memory, never the model;
2. ``llama-quantize <f16> <out> --type`` (Q4_K_M by default), then the F16 file is deleted
   (``--keep-float`` keeps it, and a kept one is reused the next time).

``--random-blocks`` skips both: the Q4_K_M file is written directly, each matrix as random
blocks of the type llama-quantize's Q4_K_M gives it (Q6_K for the head and some ``attn_v`` /
``ffn_down``, Q4_K elsewhere), scaled like the float files' weights; no llama.cpp build (which
takes over 15 minutes on 2 cores), seconds to write, ``<shape>-random-blocks.Q4_K_M.gguf``.

The files are ``<shape>-random.<type>.gguf``, e.g. ``qwen2.5-1.5b-random.Q4_K_M.gguf``::

    python benchmarks/make_gguf_files.py --shape qwen2.5-1.5b --shape llama3.1-8b \\
        --llama-quantize "$(dirname "$(benchmarks/build_llama_server.sh)")/llama-quantize"

Prints the files' paths, one a line (for ``single_stream_bench.py --model``), and the progress
and each file's tensor types on stderr. A file already there is kept (``--force`` makes it again).

The tokenizer (and chat template) is the default model's, SmolLM2-135M's byte-level BPE of 49152
tokens, whatever the shape. To keep each shape's own vocabulary (151936 for Qwen2.5, 128256 for
Llama 3) the tokenizer is padded to it with ``[PAD<id>]`` tokens of type UNUSED, as llama.cpp's
converter pads Qwen's vocabulary to its embedding's rows: the embedding and the head have their
real size, which is where the vocabulary costs time (the head's product and the sampling over
its logits); text is tokenised as SmolLM2's, and generation may emit the padding tokens, which
print as nothing. ``--tokenizer-vocab`` gives every shape the tokenizer's 49152 rows instead
(files ``<shape>-random-vocab49152.<type>.gguf``): a smaller head, and a different speed.

Left out of the real models: Llama 3's RoPE scaling (its ``rope_freqs`` tensor; it changes
positions past 8192, not the speed), the real tokenizers, and training: speed does not depend on
the weights' values, so random weights measure the architecture's fast path at its real size.
Shapes whose rows are not multiples of 256 (SmolLM2's 576, Qwen2.5-0.5B's 896) cannot take
K-quants for every matrix; llama-quantize falls back to other types for those.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gguf
import harness  # noqa: F401  (offline before anything imports transformers)
import numpy as np
from make_kquant_files import quantize, tensor_types

#: the float type of the matrices (norms and biases stay float32)
FLOAT = np.float16
#: elements per chunk of random numbers (a matrix is generated in row blocks this big)
CHUNK = 1 << 24


@dataclasses.dataclass(frozen=True)
class Shape:
    """A model's architecture and shape, as its Hugging Face ``config.json`` gives them."""

    name: str
    model: str  #: the model whose shape it is
    arch: str  #: GGUF architecture: ``llama`` or ``qwen2``
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool  #: the head is the embedding (no ``output.weight``)
    qkv_bias: bool
    rope_theta: float
    rms_eps: float
    context: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES = {
    s.name: s
    for s in (
        Shape("smollm2-135m", "HuggingFaceTB/SmolLM2-135M", "llama", hidden=576, layers=30,
              heads=9, kv_heads=3, ffn=1536, vocab=49152, tied=True, qkv_bias=False,
              rope_theta=100000.0, rms_eps=1e-5, context=8192),
        Shape("qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B-Instruct", "qwen2", hidden=896, layers=24,
              heads=14, kv_heads=2, ffn=4864, vocab=151936, tied=True, qkv_bias=True,
              rope_theta=1000000.0, rms_eps=1e-6, context=32768),
        Shape("qwen2.5-1.5b", "Qwen/Qwen2.5-1.5B-Instruct", "qwen2", hidden=1536, layers=28,
              heads=12, kv_heads=2, ffn=8960, vocab=151936, tied=True, qkv_bias=True,
              rope_theta=1000000.0, rms_eps=1e-6, context=32768),
        Shape("llama3.2-3b", "meta-llama/Llama-3.2-3B-Instruct", "llama", hidden=3072, layers=28,
              heads=24, kv_heads=8, ffn=8192, vocab=128256, tied=True, qkv_bias=False,
              rope_theta=500000.0, rms_eps=1e-5, context=131072),
        Shape("llama3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", "llama", hidden=4096, layers=32,
              heads=32, kv_heads=8, ffn=14336, vocab=128256, tied=False, qkv_bias=False,
              rope_theta=500000.0, rms_eps=1e-5, context=131072),
    )
}  # fmt: skip


def shape_name(text: str) -> str:
    """``"Qwen2.5-1.5B"`` -> ``"qwen2.5-1.5b"``, ``"Llama-3.1-8B"`` -> ``"llama3.1-8b"``."""
    name = text.strip().lower().replace("llama-3", "llama3")
    if name != "all" and name not in SHAPES:
        raise argparse.ArgumentTypeError(f"{text!r}: one of {', '.join(SHAPES)} or all")
    return name


def tensors(shape: Shape, vocab: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    """``(GGUF name, numpy shape)`` of each tensor, in llama.cpp's converter's order; 1-D ones
    are norms (``*norm.weight``) or biases (``*.bias``)."""
    names = gguf.TENSOR_NAMES
    t = gguf.MODEL_TENSOR
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    h, ffn = shape.hidden, shape.ffn
    yield names[t.TOKEN_EMBD] + ".weight", (vocab, h)
    for i in range(shape.layers):
        yield names[t.ATTN_NORM].format(bid=i) + ".weight", (h,)
        for kind, rows in ((t.ATTN_Q, q), (t.ATTN_K, kv), (t.ATTN_V, kv)):
            yield names[kind].format(bid=i) + ".weight", (rows, h)
            if shape.qkv_bias:
                yield names[kind].format(bid=i) + ".bias", (rows,)
        yield names[t.ATTN_OUT].format(bid=i) + ".weight", (h, q)
        yield names[t.FFN_NORM].format(bid=i) + ".weight", (h,)
        yield names[t.FFN_GATE].format(bid=i) + ".weight", (ffn, h)
        yield names[t.FFN_UP].format(bid=i) + ".weight", (ffn, h)
        yield names[t.FFN_DOWN].format(bid=i) + ".weight", (h, ffn)
    yield names[t.OUTPUT_NORM] + ".weight", (h,)
    if not shape.tied:
        yield names[t.OUTPUT] + ".weight", (vocab, h)


def _dtype(dims: tuple[int, ...]) -> type[np.floating[Any]]:
    return FLOAT if len(dims) > 1 else np.float32


def float_bytes(shape: Shape, vocab: int) -> int:
    """The size of the tensors of ``shape``'s float file."""
    return sum(
        int(np.prod(dims)) * np.dtype(_dtype(dims)).itemsize for _, dims in tensors(shape, vocab)
    )


def _random_matrix(gen: np.random.Generator, dims: tuple[int, ...], std: float) -> np.ndarray:
    """A float16 matrix of normal values with std ``std``, made in row blocks of float32."""
    out = np.empty(dims, dtype=FLOAT)
    step = max(1, CHUNK // dims[1])
    for start in range(0, dims[0], step):
        block = gen.standard_normal((min(step, dims[0] - start), dims[1]), dtype=np.float32)
        block *= std
        out[start : start + len(block)] = block
    return out


def _tokenizer(writer: gguf.GGUFWriter, src: gguf.GGUFReader, vocab: int) -> None:
    """``src``'s ``tokenizer.*`` fields into ``writer``, the token list padded to ``vocab``
    with ``[PAD<id>]`` tokens of type UNUSED (llama.cpp's converter's padding)."""
    tokens = list(src.fields["tokenizer.ggml.tokens"].contents())
    if vocab < len(tokens):
        raise SystemExit(f"a vocabulary of {vocab} is smaller than the tokenizer's {len(tokens)}")
    pad = vocab - len(tokens)
    padding = [f"[PAD{i}]" for i in range(len(tokens), vocab)]
    if set(padding) & set(tokens):
        raise SystemExit("the tokenizer already has [PAD<id>] tokens")
    extra: dict[str, list[Any]] = {
        "tokenizer.ggml.tokens": padding,
        "tokenizer.ggml.token_type": [int(gguf.TokenType.UNUSED)] * pad,
        "tokenizer.ggml.scores": [-1000.0] * pad,
    }
    for key, field in src.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        value = field.contents()
        sub = None
        if vtype == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            if key in extra:
                value = list(value) + extra[key]
            elif len(value) == len(tokens):
                raise SystemExit(f"cannot pad {key} to {vocab} entries")
        writer.add_key_value(key, value, vtype, sub_type=sub)


def _writer(
    path: Path,
    shape: Shape,
    tokenizer_from: Path,
    *,
    vocab: int,
    weights: str,
    file_type: gguf.LlamaFileType,
) -> gguf.GGUFWriter:
    """A writer of ``shape``'s file with its metadata and the tokenizer of the GGUF file
    ``tokenizer_from`` (padded to ``vocab``) added; ``weights`` says what they are."""
    src = gguf.GGUFReader(str(tokenizer_from))
    writer = gguf.GGUFWriter(str(path), shape.arch)
    writer.add_name(f"{shape.name}-random")
    padded = vocab > len(src.fields["tokenizer.ggml.tokens"].data)
    writer.add_description(
        f"{weights} in the shape of {shape.model}; the tokenizer of {tokenizer_from.name}"
        + (f", padded to {vocab} tokens" if padded else "")
    )
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_vocab_size(vocab)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    _tokenizer(writer, src, vocab)
    return writer


def write_float_file(
    path: Path, shape: Shape, tokenizer_from: Path, *, vocab: int, seed: int, std: float = 0.02
) -> Path:
    """The F16 GGUF file of ``shape`` with random weights and the tokenizer of the GGUF file
    ``tokenizer_from`` (padded to ``vocab``), written one tensor at a time."""
    writer = _writer(
        path, shape, tokenizer_from, vocab=vocab,
        weights=f"random weights (normal, std {std}, seed {seed})",
        file_type=gguf.LlamaFileType.MOSTLY_F16,
    )  # fmt: skip
    plan = list(tensors(shape, vocab))
    for name, dims in plan:
        dtype = np.dtype(_dtype(dims))
        writer.add_tensor_info(name, dims, dtype, int(np.prod(dims)) * dtype.itemsize)
    gen = np.random.default_rng(seed)
    return _write_tensors(
        writer, path, plan, vocab, float_bytes(shape, vocab),
        lambda name, dims: _random_matrix(gen, dims, std),
    )  # fmt: skip


def _write_tensors(
    writer: gguf.GGUFWriter,
    path: Path,
    plan: list[tuple[str, tuple[int, ...]]],
    vocab: int,
    total: int,
    matrix: Callable[[str, tuple[int, ...]], np.ndarray],
) -> Path:
    """Write the header and then each tensor of ``plan`` (its infos added already) one at a
    time: a matrix from ``matrix(name, dims)``, norms ones, other vectors zeros; a progress line on
    stderr after each ``ffn_down`` and vocabulary-sized matrix (``total`` bytes in all)."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    done, start = 0, time.monotonic()
    for name, dims in plan:
        if len(dims) > 1:
            tensor = matrix(name, dims)
        elif name.endswith("norm.weight"):
            tensor = np.ones(dims, dtype=np.float32)
        else:
            tensor = np.zeros(dims, dtype=np.float32)
        writer.write_tensor_data(tensor)
        done += tensor.nbytes
        if name.endswith("ffn_down.weight") or (len(dims) > 1 and dims[0] == vocab):
            print(
                f"  {path.name}: {name} {done / 1e9:.2f}/{total / 1e9:.2f} GB, "
                f"{time.monotonic() - start:.0f} s",
                file=sys.stderr,
                flush=True,
            )
        del tensor
    writer.close()
    return path


#: ``--random-blocks``: each block's scale(s), so that the weights' root mean square is about
#: 0.02 (the float files' std): Q4_K's ``d * sc * q`` (sc 0..63, q 0..15: rms 321 d), its
#: ``dmin`` the same; Q6_K's ``d * s * (q - 32)`` (s int8, q 0..63: rms 1,369 d)
_BLOCK_SCALE = {"Q4_K": 0.02 / 321, "Q6_K": 0.02 / 1369}


def q4_k_m_type(name: str, layers: int) -> str:
    """The block type llama-quantize's Q4_K_M gives tensor ``name`` of a model of ``layers``
    layers: Q6_K for the head (the tied embedding when there is no ``output``) and for
    ``attn_v`` and ``ffn_down`` in the first and last eighth of the layers and every third one
    between (llama.cpp's ``use_more_bits``), Q4_K for every other matrix."""
    if name.startswith("output.") or name.startswith("token_embd."):
        return "Q6_K"
    if ".attn_v." in name or ".ffn_down." in name:
        i = int(name.split(".")[1])
        more = i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2
        return "Q6_K" if more else "Q4_K"
    return "Q4_K"


def _random_block_rows(gen: np.random.Generator, kind: str, rows: int, cols: int) -> np.ndarray:
    """``rows`` rows of ``cols`` weights as random ``kind`` blocks (bytes ``[rows, row bytes]``):
    every bit of the values and sub-block scales random, the float16 block scales
    :data:`_BLOCK_SCALE` (positive)."""
    weights, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    blocks = cols // weights
    raw = gen.integers(0, 256, size=(rows, blocks, size), dtype=np.uint8)
    halves = 2 if kind == "Q4_K" else 1  # Q4_K: d, dmin first; Q6_K: d last
    scale = np.full((rows, blocks, halves), _BLOCK_SCALE[kind], dtype=np.float16)
    at = slice(size - 2, None) if kind == "Q6_K" else slice(0, 4)
    raw[:, :, at] = scale.view(np.uint8).reshape(rows, blocks, 2 * halves)
    return raw.reshape(rows, blocks * size)


def write_random_blocks_file(
    path: Path, shape: Shape, tokenizer_from: Path, *, vocab: int, seed: int
) -> Path:
    """The Q4_K_M GGUF file of ``shape`` written directly as random blocks of the types
    llama-quantize would give each matrix (:func:`q4_k_m_type`): no float file, no llama.cpp.
    The weights are not a quantised normal matrix but have its scale; speed and memory, which
    do not depend on the values, are a real Q4_K_M file's. One matrix in memory at a time."""
    writer = _writer(
        path, shape, tokenizer_from, vocab=vocab,
        weights=f"random Q4_K_M blocks (seed {seed})",
        file_type=gguf.LlamaFileType.MOSTLY_Q4_K_M,
    )  # fmt: skip
    plan = list(tensors(shape, vocab))
    sizes = []
    for name, dims in plan:
        if len(dims) == 1:
            writer.add_tensor_info(name, dims, np.dtype(np.float32), dims[0] * 4)
            sizes.append(dims[0] * 4)
            continue
        kind = q4_k_m_type(name, shape.layers)
        weights, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
        nbytes = dims[0] * dims[1] // weights * size
        writer.add_tensor_info(
            name, (dims[0], dims[1] // weights * size), np.dtype(np.uint8), nbytes,
            raw_dtype=gguf.GGMLQuantizationType[kind],
        )  # fmt: skip
        sizes.append(nbytes)
    gen = np.random.default_rng(seed)
    return _write_tensors(
        writer, path, plan, vocab, sum(sizes),
        lambda name, dims: _random_block_rows(
            gen, q4_k_m_type(name, shape.layers), dims[0], dims[1]
        ),
    )  # fmt: skip


def find_llama_quantize(given: str | None) -> str:
    """``given``, else ``llama-quantize`` on PATH, else benchmarks/build_llama_server.sh's
    build in its default place."""
    if given:
        if shutil.which(given) is None:
            raise SystemExit(f"{given} is not an executable")
        return given
    build = Path(os.environ.get("TMPDIR", "/tmp"), "stoic-llama-cpp")
    built = sorted(build.glob("llama_cpp_python-*/vendor/llama.cpp/build/bin/llama-quantize"))
    found = shutil.which("llama-quantize") or (str(built[-1]) if built else None)
    if found is None:
        raise SystemExit(
            "no llama-quantize: pass --llama-quantize "
            '"$(dirname "$(benchmarks/build_llama_server.sh)")/llama-quantize"'
        )
    return found


def make(
    shape: Shape,
    out: Path,
    *,
    kind: str,
    quantizer: str | None,
    tokenizer_from: Path,
    tokenizer_vocab: bool,
    seed: int,
    force: bool,
    keep_float: bool,
    random_blocks: bool = False,
) -> Path:
    """The ``kind`` file of ``shape`` in ``out`` (made unless present, or ``force``), quantised
    with the llama-quantize ``quantizer`` (None for ``kind`` F16, the float file itself); with
    ``random_blocks`` (``kind`` Q4_K_M) written as random blocks instead
    (:func:`write_random_blocks_file`: ``<shape>-random-blocks.Q4_K_M.gguf``)."""
    tokens = len(gguf.GGUFReader(str(tokenizer_from)).fields["tokenizer.ggml.tokens"].data)
    vocab = tokens if tokenizer_vocab else shape.vocab
    stem = (
        f"{shape.name}-random"
        + ("-blocks" if random_blocks else "")
        + (f"-vocab{vocab}" if vocab != shape.vocab else "")
    )
    target = out / f"{stem}.{kind}.gguf"
    floating = out / f"{stem}.F16.gguf"
    if target.exists() and not force:
        print(f"{target} is there (--force makes it again)", file=sys.stderr)
        return target
    if random_blocks:
        start = time.monotonic()
        part = target.with_name(target.name + ".part")
        try:
            write_random_blocks_file(part, shape, tokenizer_from, vocab=vocab, seed=seed)
            os.replace(part, target)
        finally:
            part.unlink(missing_ok=True)
        print(f"{shape.name}: done in {time.monotonic() - start:.0f} s", file=sys.stderr)
        return target
    size = float_bytes(shape, vocab)
    reuse = floating.exists() and not force and target != floating
    need = (0 if reuse else size) + (0 if target == floating else size // 3)
    free = shutil.disk_usage(out).free
    if need > free:
        raise SystemExit(f"{shape.name}: needs about {need / 1e9:.1f} GB, {free / 1e9:.1f} free")
    start = time.monotonic()
    if reuse:
        print(f"{shape.name}: reusing {floating}", file=sys.stderr, flush=True)
    else:
        print(
            f"{shape.name}: writing {floating} ({size / 1e9:.2f} GB, vocab {vocab})",
            file=sys.stderr,
            flush=True,
        )
        part = floating.with_name(floating.name + ".part")
        try:
            write_float_file(part, shape, tokenizer_from, vocab=vocab, seed=seed)
            os.replace(part, floating)
        finally:
            part.unlink(missing_ok=True)
        print(f"  written in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    if quantizer is None:
        return target
    part = target.with_name(target.name + ".part")
    try:
        quantize(quantizer, floating, part, kind)
        os.replace(part, target)
    finally:
        part.unlink(missing_ok=True)
        if not keep_float:
            floating.unlink(missing_ok=True)
    print(f"{shape.name}: done in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shape",
        type=shape_name,
        action="append",
        required=True,
        help=f"a model's shape, repeatable: {', '.join(SHAPES)}, or all",
    )
    parser.add_argument(
        "--type",
        default="Q4_K_M",
        help="llama-quantize's type (Q4_K_M); F16 keeps the float file unquantised",
    )
    parser.add_argument("--out", type=Path, default=Path("/tmp/gguf"), help="directory (/tmp/gguf)")
    parser.add_argument(
        "--llama-quantize",
        help="path to llama.cpp's llama-quantize (default: on PATH, or "
        "benchmarks/build_llama_server.sh's build)",
    )
    parser.add_argument("--force", action="store_true", help="make the files even if present")
    parser.add_argument("--keep-float", action="store_true", help="keep the F16 file")
    parser.add_argument("--seed", type=int, default=0, help="the weights' random seed (0)")
    parser.add_argument(
        "--random-blocks",
        action="store_true",
        help="write the Q4_K_M file directly as random blocks of each matrix's type "
        "(no llama-quantize, no float file; the weights are noise of the float files' scale)",
    )
    parser.add_argument(
        "--tokenizer-vocab",
        action="store_true",
        help="the tokenizer's 49152 rows for every shape instead of its own vocabulary",
    )
    args = parser.parse_args()

    from stoic.model import default_gguf_path

    kind = args.type.upper()
    if args.random_blocks and kind != "Q4_K_M":
        parser.error("--random-blocks writes Q4_K_M files only")
    quantizer = (
        None if kind == "F16" or args.random_blocks else find_llama_quantize(args.llama_quantize)
    )
    names = list(SHAPES) if "all" in args.shape else list(dict.fromkeys(args.shape))
    if args.random_blocks:
        # K-quant blocks hold 256 weights; llama-quantize falls back to other types for a width
        # that is not a multiple, which q4_k_m_type does not follow
        narrow = [n for n in names if SHAPES[n].hidden % 256 or SHAPES[n].ffn % 256]
        if narrow:
            parser.error(f"--random-blocks needs widths that are multiples of 256: not {narrow}")
    args.out.mkdir(parents=True, exist_ok=True)
    for name in names:
        path = make(
            SHAPES[name],
            args.out,
            kind=kind,
            quantizer=quantizer,
            tokenizer_from=default_gguf_path(),
            tokenizer_vocab=args.tokenizer_vocab,
            seed=args.seed,
            force=args.force,
            keep_float=args.keep_float,
            random_blocks=args.random_blocks,
        )
        print(
            f"{path.name}: {path.stat().st_size / 1e9:.2f} GB, {tensor_types(path)}",
            file=sys.stderr,
        )
        print(path, flush=True)


if __name__ == "__main__":
    main()
