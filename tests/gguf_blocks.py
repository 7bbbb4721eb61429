"""GGML blocks and tiny quantised GGUF models for tests.

gguf-py de-quantises Q4_K, Q5_K and Q6_K but cannot quantise them: :func:`quantize` writes their
blocks from float weights with a plain reference quantiser (per sub-block min/max; not
llama.cpp's search, which only changes which nearby values are picked). The layouts are
llama.cpp's ``ggml-quants.c`` (``block_q4_K``, ``block_q5_K``, ``block_q6_K``); gguf-py's
de-quantisation of what is written here is the reference the kernels are checked against.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from stoic.kernels import GGML_TYPES

QK_K = 256


def gguf_py(kind: str, blocks: torch.Tensor) -> torch.Tensor:
    """What transformers' GGUF loader de-quantises ``blocks`` (uint8 rows) to, float32."""
    values = dequantize(blocks.numpy(), GGMLQuantizationType[kind])
    return torch.from_numpy(np.asarray(values, dtype=np.float32))


def random_blocks(kind: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random bytes as ``rows`` x ``cols`` weights of ``kind`` (every bit pattern of the values,
    and of a K-quant's sub-block scales and mins), with finite fp16 block scales."""
    ggml = GGML_TYPES[kind]
    gen = np.random.default_rng(seed)
    blocks = cols // ggml.weights
    raw = gen.integers(0, 256, size=(rows, blocks, ggml.block_bytes), dtype=np.uint8)
    halves = 2 if kind in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else 1  # d (and m) lead; Q6_K: d last
    at = slice(ggml.block_bytes - 2, None) if kind == "Q6_K" else slice(0, 2 * halves)
    limit = 0.05 if ggml.weights == 32 else 0.01
    scales = gen.uniform(-limit, limit, size=(rows, blocks, halves)).astype(np.float16)
    raw[:, :, at] = scales.view(np.uint8).reshape(rows, blocks, 2 * halves)
    return torch.from_numpy(raw.reshape(rows, -1).copy())


def _fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 6-bit scales and mins ``[n, 8]`` into their 12 bytes (inverse of get_scale_min_k4)."""
    s = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    s[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    s[:, 4:8] = (mn[:, 0:4] & 63) | ((mn[:, 4:8] >> 4) << 6)
    s[:, 8:12] = (sc[:, 4:8] & 15) | ((mn[:, 4:8] & 15) << 4)
    return s


def _quantize_q45k(x: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K (bits 4) or Q5_K (bits 5) blocks of ``x`` ``[n, 256]``."""
    levels = (1 << bits) - 1
    sub = x.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(-1), 0.0)
    scale = (sub.max(-1) - lo) / levels
    d = _fp16(scale.max(-1) / 63).astype(np.float32)
    dmin = _fp16(-lo.min(-1) / 63).astype(np.float32)
    safe = lambda a: np.where(a == 0, 1.0, a)  # noqa: E731
    sc = np.clip(np.rint(scale / safe(d)[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(-lo / safe(dmin)[:, None]), 0, 63).astype(np.uint8)
    step = d[:, None] * sc
    q = np.rint((sub + (dmin[:, None] * mn)[..., None]) / safe(step)[..., None])
    q = np.clip(q, 0, levels).astype(np.uint8)  # [n, 8, 32]
    nib = q & 15
    qs = (nib[:, 0::2] | (nib[:, 1::2] << 4)).reshape(-1, 128)
    head = [
        _fp16(d).view(np.uint8).reshape(-1, 2),
        _fp16(dmin).view(np.uint8).reshape(-1, 2),
        _pack_scales(sc, mn),
    ]
    if bits == 5:
        high = (q >> 4) & 1  # bit j of qh[l]: sub-block j's weight l
        qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
        for j in range(8):
            qh |= (high[:, j] << j).astype(np.uint8)
        head.append(qh)
    return np.concatenate([*head, qs], axis=1)


def _quantize_q6k(x: np.ndarray) -> np.ndarray:
    """Q6_K blocks of ``x`` ``[n, 256]``."""
    sub = x.reshape(-1, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = _fp16(scale.max(-1) / 127).astype(np.float32)
    safe = lambda a: np.where(a == 0, 1.0, a)  # noqa: E731
    sc = np.clip(np.rint(scale / safe(d)[:, None]), -128, 127).astype(np.int8)
    step = d[:, None] * sc.astype(np.float32)
    q = np.clip(np.rint(sub / safe(step)[..., None]), -32, 31).astype(np.int16) + 32
    q = q.reshape(-1, 2, 4, 32).astype(np.uint8)  # [n, half, r, l]: weight 128 h + 32 r + l
    ql = np.concatenate(
        [
            (q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4),
            (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4),
        ],
        axis=2,
    ).reshape(-1, 128)  # byte 64 h + 32 (r % 2) + l, nibble r // 2
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4)
    qh = (qh | ((q[:, :, 3] >> 4) << 6)).reshape(-1, 64)
    return np.concatenate(
        [ql, qh, sc.view(np.uint8), _fp16(d).view(np.uint8).reshape(-1, 2)], axis=1
    )


def quantize(kind: str, weight: np.ndarray) -> np.ndarray:
    """``weight`` ``[rows, cols]`` float32 as ``kind`` blocks, uint8 ``[rows, bytes]`` (the
    K-quants here; other types by gguf-py)."""
    if kind in ("Q4_K", "Q5_K", "Q6_K"):
        flat = weight.astype(np.float32).reshape(-1, QK_K)
        blocks = _quantize_q6k(flat) if kind == "Q6_K" else _quantize_q45k(flat, int(kind[1]))
        return blocks.reshape(weight.shape[0], -1)
    out: np.ndarray = gguf.quants.quantize(weight.astype(np.float32), GGMLQuantizationType[kind])
    return out


#: a byte-level vocabulary (GPT-2's byte-to-character map): any text tokenises
def _byte_tokens() -> list[str]:
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


#: the vocabulary size of :func:`_add_byte_tokenizer`'s tokenizer
BYTE_VOCAB = 260


def _add_byte_tokenizer(w: gguf.GGUFWriter) -> None:
    """A byte-level tokenizer of :data:`BYTE_VOCAB` tokens (BOS 256, EOS 257)."""
    tokens = [*_byte_tokens(), "<s>", "</s>", "Ġt", "he"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3, 3, 1, 1])
    w.add_token_merges(["Ġ t", "h e"])
    w.add_bos_token_id(256)
    w.add_eos_token_id(257)


def _llama_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order of a Q or K projection in a ``llama`` file (what transformers'
    loader undoes)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def write_model_gguf(path: Path, model: Any, arch: str, kind: str) -> Path:
    """``model`` (a transformers causal LM of a Llama-family ``arch``: a GGUF architecture,
    ``"llama"`` for Mistral too, named so) as a GGUF file: its 2-D projections and output
    quantised to ``kind``, the rest float32, names by gguf-py's tensor map, and the byte-level
    tokenizer (its vocabulary must be :data:`BYTE_VOCAB`)."""
    cfg = model.config
    layers = int(cfg.num_hidden_layers)
    heads, kv_heads = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{cfg.model_type}")
    w.add_block_count(layers)
    w.add_context_length(int(cfg.max_position_embeddings))
    w.add_embedding_length(int(cfg.hidden_size))
    w.add_feed_forward_length(int(cfg.intermediate_size))
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    rope = cfg.rope_parameters
    rope = rope if "rope_theta" in rope else rope["full_attention"]  # Gemma: one a layer type
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    gemma = arch == "gemma3"
    if gemma:
        w.add_key_length(int(cfg.head_dim))
        w.add_value_length(int(cfg.head_dim))
        w.add_sliding_window(int(cfg.sliding_window))
    _add_byte_tokenizer(w)
    w.add_pad_token_id(0)  # (Phi-3's config defaults to one outside the vocabulary)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], layers)
    for key, value in model.state_dict().items():
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert name is not None, key
        tensor = value.detach().float().numpy()
        if gemma and name.endswith("norm.weight"):  # llama.cpp stores Gemma's 1 + w
            tensor = tensor + 1
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            tensor = _llama_permute(tensor, heads if "attn_q" in name else kv_heads)
        if tensor.ndim == 2 and not name.startswith("token_embd"):
            blocks = quantize(kind, tensor)
            w.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=GGMLQuantizationType[kind])
        else:
            w.add_tensor(name, np.ascontiguousarray(tensor))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_llama_gguf(
    path: Path,
    types: dict[str, str],
    *,
    hidden: int = 256,
    ffn: int = 512,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
) -> Path:
    """A Llama GGUF file with random weights and a byte-level tokenizer (260 tokens): each
    matrix ``blk.{i}.{attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down}`` and
    ``output`` of the GGML type ``types`` gives for its name (``"0.attn_v"``, ``"output"``;
    else ``types["default"]``), norms and the token embedding float32."""
    gen = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-kquant")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    _add_byte_tokenizer(w)

    def matrix(name: str, key: str, rows: int, cols: int) -> None:
        kind = types.get(key, types["default"])
        weight = gen.normal(0.0, 1.0 / np.sqrt(cols), size=(rows, cols)).astype(np.float32)
        if kind == "F32":
            w.add_tensor(name, weight)
            return
        blocks = quantize(kind, weight)
        w.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=GGMLQuantizationType[kind])

    vocab = BYTE_VOCAB
    w.add_tensor("token_embd.weight", gen.normal(0, 1, size=(vocab, hidden)).astype(np.float32))
    dim = hidden // heads
    for i in range(layers):
        ones = (1.0 + 0.1 * gen.normal(size=hidden)).astype(np.float32)
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones.copy())
        for name, rows, cols in (
            ("attn_q", heads * dim, hidden),
            ("attn_k", kv_heads * dim, hidden),
            ("attn_v", kv_heads * dim, hidden),
            ("attn_output", hidden, heads * dim),
            ("ffn_gate", ffn, hidden),
            ("ffn_up", ffn, hidden),
            ("ffn_down", hidden, ffn),
        ):
            matrix(f"blk.{i}.{name}.weight", f"{i}.{name}", rows, cols)
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    matrix("output.weight", "output", vocab, hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
