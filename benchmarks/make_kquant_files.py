"""Make the two Q4_K_M files of the K-quant measurement with llama.cpp's llama-quantize.

Into one directory (docs/benchmarks.md, "K-quant files"):

- ``SmolLM2-135M-Instruct.Q4_K_M.gguf``: the default model (its Q4_1 file) requantised,
  ``llama-quantize --allow-requantize <default> <out> Q4_K_M``;
- ``qwen2-135m-random.Q4_K_M.gguf``: a Qwen2 model of the same shape (hidden 576, 30 layers,
  9 heads, 3 KV heads, intermediate 1536, q/k/v biases, tied embeddings) with random weights
  (normal, std 0.02; norms 1), written as an F32 GGUF with gguf-py (tensor names by gguf-py's
  map from the Hugging Face names) and the default model's tokenizer metadata, then quantised.

    python benchmarks/make_kquant_files.py \
        --llama-quantize "$(dirname "$(benchmarks/build_llama_server.sh)")/llama-quantize"

Prints the two files' paths, one a line (for ``single_stream_bench.py --model``), and each
file's tensor types on stderr. A file already there is kept (``--force`` makes it again).
Speed does not depend on training, so random weights measure the architecture's fast path.
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gguf
import harness  # noqa: F401  (offline before anything imports transformers)
import numpy as np

#: the Qwen2 model's shape: SmolLM2-135M's, with Qwen2's q/k/v biases
SHAPE = {"hidden": 576, "layers": 30, "heads": 9, "kv_heads": 3, "ffn": 1536}


def _copy_fields(writer: gguf.GGUFWriter, reader: gguf.GGUFReader, prefix: str) -> None:
    """Every metadata field of ``reader`` whose key starts with ``prefix``, into ``writer``."""
    for key, field in reader.fields.items():
        if key.startswith(prefix):
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), vtype, sub_type=sub)


def _hf_tensors(
    vocab: int, hidden: int, ffn: int, layers: int, heads: int, kv_heads: int
) -> Iterator[tuple[str, tuple[int, ...]]]:
    """``(Hugging Face name, shape)`` of a Qwen2ForCausalLM's parameters, tied embeddings."""
    kv = hidden // heads * kv_heads
    yield "model.embed_tokens.weight", (vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (hidden,)
        for proj, rows in (("q_proj", hidden), ("k_proj", kv), ("v_proj", kv)):
            yield p + f"self_attn.{proj}.weight", (rows, hidden)
            yield p + f"self_attn.{proj}.bias", (rows,)
        yield p + "self_attn.o_proj.weight", (hidden, hidden)
        yield p + "post_attention_layernorm.weight", (hidden,)
        yield p + "mlp.gate_proj.weight", (ffn, hidden)
        yield p + "mlp.up_proj.weight", (ffn, hidden)
        yield p + "mlp.down_proj.weight", (hidden, ffn)
    yield "model.norm.weight", (hidden,)


def write_qwen2_f32(
    path: Path,
    tokenizer_from: Path,
    *,
    shape: dict[str, int] = SHAPE,
    seed: int = 0,
    std: float = 0.02,
) -> Path:
    """A Qwen2 GGUF file of ``shape`` with random float32 weights and the tokenizer (and
    context length, RoPE base, norm epsilon) of the Llama GGUF file ``tokenizer_from``."""
    src = gguf.GGUFReader(str(tokenizer_from))

    def value(key: str) -> Any:
        field = src.get_field(key)
        if field is None:
            raise SystemExit(f"{tokenizer_from} has no {key}")
        return field.contents()

    vocab = len(src.fields["tokenizer.ggml.tokens"].data)
    gen = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_name("qwen2-135m-random")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_block_count(shape["layers"])
    w.add_context_length(int(value("llama.context_length")))
    w.add_embedding_length(shape["hidden"])
    w.add_feed_forward_length(shape["ffn"])
    w.add_head_count(shape["heads"])
    w.add_head_count_kv(shape["kv_heads"])
    w.add_rope_freq_base(float(value("llama.rope.freq_base")))
    w.add_layer_norm_rms_eps(float(value("llama.attention.layer_norm_rms_epsilon")))
    _copy_fields(w, src, "tokenizer.")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, shape["layers"])
    for key, dims in _hf_tensors(vocab, **shape):
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert name is not None, key
        if key.endswith("norm.weight"):
            tensor = np.ones(dims, dtype=np.float32)
        else:
            tensor = gen.normal(0.0, std, size=dims).astype(np.float32)
        w.add_tensor(name, tensor)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def quantize(binary: str, src: Path, dst: Path, kind: str = "Q4_K_M") -> Path:
    """``llama-quantize --allow-requantize src dst kind``; its output goes to stderr."""
    argv = [binary, "--allow-requantize", str(src), str(dst), kind]
    print("$ " + " ".join(argv), file=sys.stderr, flush=True)
    subprocess.run(argv, check=True, stdout=sys.stderr)
    return dst


def tensor_types(path: Path) -> str:
    """``"Q5_0 x121, Q8_0 x31, ..."``: how many tensors of ``path`` have each GGML type."""
    count = collections.Counter(t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors)
    return ", ".join(f"{k} x{n}" for k, n in count.most_common())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--llama-quantize", required=True, help="path to llama.cpp's llama-quantize"
    )
    parser.add_argument(
        "--out", type=Path, default=Path("/tmp/stoic-kquant"), help="directory (/tmp/stoic-kquant)"
    )
    parser.add_argument("--force", action="store_true", help="make the files even if present")
    args = parser.parse_args()

    from stoic.model import default_gguf_path

    default = default_gguf_path()
    args.out.mkdir(parents=True, exist_ok=True)
    smollm = args.out / default.name.replace(".Q4_1.", ".Q4_K_M.")
    if smollm == args.out / default.name:
        smollm = args.out / f"{default.stem}.Q4_K_M.gguf"
    qwen_f32 = args.out / "qwen2-135m-random.F32.gguf"
    qwen = args.out / "qwen2-135m-random.Q4_K_M.gguf"
    if args.force or not smollm.exists():
        quantize(args.llama_quantize, default, smollm)
    if args.force or not qwen.exists():
        write_qwen2_f32(qwen_f32, default)
        quantize(args.llama_quantize, qwen_f32, qwen)
    for path in (smollm, qwen):
        print(f"{path.name}: {tensor_types(path)}", file=sys.stderr)
        print(path)


if __name__ == "__main__":
    main()
