"""A GGUF model built from the file's own tensors: no float32 model, no converted copy on disk.

:func:`load_gguf_model` builds the transformers model's skeleton without memory (its parameters
on the ``meta`` device, its computed buffers such as the rotary tables real), then fills it
tensor by tensor from the file, mapped read-only:

* the matrices the runner multiplies on their quantised blocks (``lazy``: what
  :func:`lazy_tensors` picks, the projections of a :data:`stoic.model._fused.FUSED_TYPES` model whose types
  the kernels take, and its output layer) stay on ``meta``: the runner reads their blocks from
  the file (:func:`stoic.gguf.read_llama_blocks`) and de-quantises one into a dense copy only where
  a product needs it (:class:`._quant.QLinear`);
* the token embedding of such a model, where its type is one the kernels take, becomes a
  :class:`QuantizedEmbedding`: a step's rows de-quantised from the file's blocks (the pages are
  the file's, shared by every process that maps it: warm spares, a replacement worker);
* every other tensor (norms, biases, a matrix of a type no kernel takes, every tensor of a
  model the fused forward does not run, or of any model with ``--quantization none``, on a
  GPU, without the kernels) is de-quantised once (gguf-py, float32, one tensor at a time) into
  the model's dtype. The tensors' names and transformations (the Q/K row order of a ``llama``
  file, Gemma's ``1 + w`` norms, experts) are transformers' own GGUF mapping.

Peak memory is therefore the dense tensors in the model's dtype plus one tensor in float32, never
a float32 model. The start-up log says what was de-quantised and how many MiB
(``model.weights.read``).
"""

from __future__ import annotations

import contextlib
import mmap
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .._logging import get_logger
from ..errors import ModelUnavailable
from ..kernels import GGML_TYPES, Kernels
from ._header import GgufHeader, GgufTensor, read_gguf_header

__all__ = [
    "GgufFile",
    "GgufWeights",
    "QuantizedEmbedding",
    "kernel_matrix",
    "lazy_tensors",
    "load_gguf_model",
]

_log = get_logger("stoic.model")
#: GGML type id -> the kernels' type name
_KINDS = {ggml.type_id: name for name, ggml in GGML_TYPES.items()}
#: the projections a layer multiplies on blocks, in fusion groups: all of a group or none of it
#: stays on blocks (the fused forward concatenates a group's weights)
_GROUPS = (("attn_q", "attn_k", "attn_v"), ("attn_qkv",), ("attn_output",),
           ("ffn_gate", "ffn_up"), ("ffn_down",))  # fmt: skip
#: the model types whose embedding may be a :class:`QuantizedEmbedding` (Gemma scales its own)
_PLAIN_EMBEDDING = ("llama", "mistral", "qwen2", "qwen3", "phi3")


class GgufFile:
    """A GGUF file's header and its bytes, mapped copy-on-write (never written: the pages stay
    the file's, shared with every other process that maps it)."""

    def __init__(self, path: Path, header: GgufHeader | None = None) -> None:
        self.path = path
        self.header = header or read_gguf_header(path)
        with path.open("rb") as file:
            self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
        #: the whole file as uint8 (views of it share the mapping)
        self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)

    def release_pages(self) -> None:
        """Unmap the file's pages from this process (``MADV_DONTNEED``; they stay in the page
        cache): once the runner has made its layouts the blocks are read again only for a
        step's embedding rows, which map their pages again on first touch (the file's
        contents: the mapping was never written). Resident memory then counts what the process
        made, not the file. Where the platform refuses, nothing changes."""
        advice = getattr(mmap, "MADV_DONTNEED", None)
        if advice is not None:
            with contextlib.suppress(OSError, ValueError):
                self._map.madvise(advice)

    def raw(self, tensor: GgufTensor) -> torch.Tensor:
        """``tensor``'s data: uint8 ``[rows..., bytes a row]`` (a view of the mapping).

        :raises ValueError: if its type is unknown or it runs past the end of the file.
        """
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(tensor.ggml_type)]
        except (KeyError, ValueError):
            raise ValueError(f"tensor {tensor.name} has unknown type {tensor.ggml_type}") from None
        cols = tensor.dims[0] if tensor.dims else 1
        rows = int(np.prod(tensor.dims[1:])) if len(tensor.dims) > 1 else 1
        if cols % block:
            raise ValueError(f"tensor {tensor.name}: {cols} columns in blocks of {block}")
        row_bytes = cols // block * size
        start = self.header.data_start + tensor.offset
        if start + rows * row_bytes > self.bytes.numel():
            raise ValueError(f"tensor {tensor.name} runs past the end of the file")
        shape = (*reversed(tensor.dims[1:]), row_bytes)
        return self.bytes[start : start + rows * row_bytes].view(shape)

    def dequantize(self, tensor: GgufTensor) -> np.ndarray[Any, Any]:
        """``tensor`` de-quantised by gguf-py: float32, shape the GGUF dims reversed.

        :raises ValueError: if gguf-py cannot de-quantise its type.
        """
        from gguf import GGMLQuantizationType
        from gguf import dequantize as gguf_dequantize

        try:
            values = gguf_dequantize(
                self.raw(tensor).numpy(), GGMLQuantizationType(tensor.ggml_type)
            )
        except NotImplementedError as exc:
            raise ValueError(f"tensor {tensor.name}: {exc}") from exc
        return values.reshape(tuple(reversed(tensor.dims)))


def kernel_matrix(tensor: GgufTensor | None) -> str | None:
    """The kernels' type name of ``tensor`` if they can multiply by it as it is (a matrix of a
    type in :data:`stoic.kernels._qkernels.GGML_TYPES`, whole blocks a row), else None."""
    if tensor is None or len(tensor.dims) != 2:
        return None
    kind = _KINDS.get(tensor.ggml_type)
    if kind is None or tensor.dims[0] % GGML_TYPES[kind].weights:
        return None
    return kind


def lazy_tensors(header: GgufHeader, layers: int) -> set[str]:
    """The names of the GGUF tensors the runner multiplies on their blocks (the model keeps no
    dense copy of them): each layer's projection groups whose every part the kernels take
    (:data:`_GROUPS`), and the output layer (``output.weight``, else the tied
    ``token_embd.weight``) where they take it."""
    tensors = header.tensors
    lazy: set[str] = set()
    for i in range(layers):
        for group in _GROUPS:
            names = [f"blk.{i}.{part}.weight" for part in group]
            found = [tensors.get(n) for n in names]
            if any(t is not None for t in found) and all(kernel_matrix(t) for t in found):
                lazy.update(names)
    head = tensors.get("output.weight") or tensors.get("token_embd.weight")
    if kernel_matrix(head):
        assert head is not None
        lazy.add("output.weight")  # the model's head, tied or not
    return lazy


class QuantizedEmbedding(torch.nn.Module):
    """A token embedding looked up in the GGUF file's blocks: each step's rows de-quantised by
    the kernels (bitwise gguf-py's de-quantisation, :meth:`stoic.kernels._qkernels.Kernels.dequantize`) into
    ``dtype``. Holds no copy of the table: its blocks are the mapped file's pages."""

    def __init__(
        self, blocks: torch.Tensor, kind: str, cols: int, kernels: Kernels, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.blocks, self.kind, self.embedding_dim = blocks, kind, cols
        self.num_embeddings = int(blocks.shape[0])
        self._kernels, self._dtype = kernels, dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # (CPU tensors only: the kernels run there; an id outside the table raises IndexError
        # in index_select, with no read of the ids here)
        flat = input_ids.reshape(-1).to(torch.long)
        rows = self._kernels.dequantize(
            self.kind, self.blocks.index_select(0, flat), self.embedding_dim
        )
        out = rows if self._dtype == torch.float32 else rows.to(self._dtype)
        return out.view(*input_ids.shape, self.embedding_dim)


class GgufWeights:
    """A model built from a GGUF file by :func:`load_gguf_model`, and what it read.

    :meth:`fill` de-quantises what was left on the blocks (a runner that cannot multiply on
    them after all: transformers' own forward, ``fused=False``)."""

    def __init__(self, model: Any, file: GgufFile, config: Any, dtype: torch.dtype) -> None:
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

        self.model = model
        #: the mapped file (the runner's blocks are views of it)
        self.file = file
        self.dtype = dtype
        self._tie = bool(getattr(config, "tie_word_embeddings", False))
        arch = file.header.architecture or ""
        processor: Any = TENSOR_PROCESSORS.get(arch, TensorProcessor)
        self._processor: Any = processor(config=config.to_dict())
        self._mapping = _names(model, self._processor, arch, int(config.num_hidden_layers))
        self._parsed: dict[str, Any] = {"tensors": {}, "config": config.to_dict()}
        #: GGUF tensors left on their blocks (the model's parameters for them are on ``meta``)
        self.lazy: frozenset[str] = frozenset()
        #: bytes of dense tensors made in the model's dtype
        self.dense_bytes = 0
        #: the GGUF matrices de-quantised into dense weights (norms and biases not listed)
        self.dense_matrices: list[str] = []

    @property
    def dense_mib(self) -> float:
        return round(self.dense_bytes / 2**20, 1)

    def wants(self, tensor: GgufTensor) -> bool:
        """Whether ``tensor`` is one of the model's (or one its processor renames itself)."""
        return tensor.name in self._mapping or _processed(self._processor)

    def read(self, tensor: GgufTensor) -> None:
        """De-quantise ``tensor`` into the model's parameter(s), in the model's dtype.

        :raises ValueError: if gguf-py cannot de-quantise it, or its shape is not the model's.
        """
        values = self.file.dequantize(tensor)
        result = self._processor.process(
            weights=values,
            name=tensor.name,
            tensor_key_mapping=self._mapping,
            parsed_parameters=self._parsed,
        )
        found = dict(self._parsed["tensors"])
        self._parsed["tensors"].clear()
        if result.name is not None and result.name in self._mapping:
            found[self._mapping[result.name]] = result.weights
        for name, array in found.items():
            value = torch.from_numpy(np.array(array, dtype=np.float32, copy=True)).to(self.dtype)
            try:
                _set_tensor(self.model, name, value)
            except AttributeError as exc:
                raise ValueError(f"tensor {tensor.name}: {exc}") from exc
            self.dense_bytes += value.numel() * value.element_size()
            if value.dim() >= 2 and tensor.name != "token_embd.weight":
                self.dense_matrices.append(tensor.name)

    def fill(self) -> None:
        """De-quantise every tensor left on the blocks into the model (then none is).

        :raises ModelUnavailable: as :func:`load_gguf_model`.
        """
        if not self.lazy:
            return
        started = time.monotonic()
        before = self.dense_bytes
        for name in sorted(self.lazy):
            tensor = self.file.header.tensors.get(name)
            if tensor is None:  # "output.weight" of a tied model: the embedding's
                continue
            self._read_or_raise(tensor)
        self.lazy = frozenset()
        self.tie()
        self.check_complete()
        _log.info(
            "model.weights.filled",
            seconds=round(time.monotonic() - started, 2),
            dense_mib=round((self.dense_bytes - before) / 2**20, 1),
            reason="the runner multiplies by dense weights",
        )

    def tie(self) -> None:
        """Tie the output layer to the embedding where the model does and it is not on the
        blocks (nor the embedding a :class:`QuantizedEmbedding`)."""
        embedding = self.model.get_input_embeddings()
        if self._tie and "output.weight" not in self.lazy:
            if isinstance(embedding, QuantizedEmbedding):
                head = self.model.get_output_embeddings()
                blocks = self.file.header.tensors["token_embd.weight"]
                values = torch.from_numpy(self.file.dequantize(blocks).copy()).to(self.dtype)
                head.weight = torch.nn.Parameter(values, requires_grad=False)
                self.dense_bytes += values.numel() * values.element_size()
            else:
                self.model.tie_weights()

    def _read_or_raise(self, tensor: GgufTensor) -> None:
        try:
            self.read(tensor)
        except ValueError as exc:
            raise ModelUnavailable(f"cannot load {self.file.path}: {exc}; {_TODO}") from exc

    def check_complete(self) -> None:
        """Every parameter of the model holds the file's values, but those left on blocks.

        :raises ModelUnavailable: naming the first missing ones.
        """
        left = {self._mapping.get(name) for name in self.lazy}
        head = self.model.get_output_embeddings()
        head_params = [] if head is None else list(head.parameters())
        missing = [
            name
            for name, param in self.model.named_parameters(remove_duplicate=False)
            if param.is_meta
            and name not in left
            and not ("output.weight" in self.lazy and any(param is p for p in head_params))
        ]
        if missing:
            shown = ", ".join(missing[:4]) + (", ..." if len(missing) > 4 else "")
            raise ModelUnavailable(
                f"{self.file.path} has no tensor for {len(missing)} of the model's weights "
                f"({shown}); {_TODO}"
            )


_TODO = "check the file, or pass another --model"


def _skeleton(config: Any, dtype: torch.dtype) -> Any:
    """The causal LM of ``config`` in ``dtype``, its parameters on ``meta`` (no memory), its
    buffers (rotary tables) computed on the CPU."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)  # type: ignore[no-untyped-call]
    return model


def _set_tensor(model: Any, name: str, value: torch.Tensor) -> None:
    """Replace parameter (or buffer) ``name`` of ``model`` by ``value`` (shapes must match).

    :raises ValueError: if the shapes differ.
    """
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    current = getattr(owner, attr)
    if tuple(current.shape) != tuple(value.shape):
        raise ValueError(
            f"tensor for {name} has shape {tuple(value.shape)}, the model wants "
            f"{tuple(current.shape)}"
        )
    if isinstance(current, torch.nn.Parameter):
        owner._parameters[attr] = torch.nn.Parameter(value, requires_grad=False)
    else:
        owner._buffers[attr] = value


def load_gguf_model(
    gguf: Path | GgufFile,
    config: Any,
    dtype: torch.dtype,
    *,
    lazy: Iterable[str] = (),
    embedding_kernels: Kernels | None = None,
) -> GgufWeights:
    """The transformers causal LM of ``config`` with its weights from ``gguf``, in ``dtype``.

    ``lazy`` (GGUF names, :func:`lazy_tensors`): left on ``meta``, for the runner's blocks.
    ``embedding_kernels``: the token embedding becomes a :class:`QuantizedEmbedding` where its
    type is one they take (a model of :data:`_PLAIN_EMBEDDING` types).

    :raises ModelUnavailable: if the file lacks a tensor the model needs, has one of another
        shape, or of a type gguf-py cannot de-quantise (one line: which, what to do).
    """
    started = time.monotonic()
    file = gguf if isinstance(gguf, GgufFile) else GgufFile(gguf)
    source = file.path
    header = file.header
    weights = GgufWeights(_skeleton(config, dtype), file, config, dtype)
    weights.lazy = frozenset(lazy)
    embed = header.tensors.get("token_embd.weight")
    embed_kind = kernel_matrix(embed)
    quantized_embedding = (
        embedding_kernels is not None
        and embed_kind is not None
        and getattr(config, "model_type", None) in _PLAIN_EMBEDDING
    )
    for tensor in header.tensors.values():
        if tensor.name in weights.lazy or not weights.wants(tensor):
            continue
        if quantized_embedding and tensor.name == "token_embd.weight":
            continue
        weights._read_or_raise(tensor)
    if quantized_embedding:
        assert embed is not None and embed_kind is not None and embedding_kernels is not None
        module = QuantizedEmbedding(
            file.raw(embed), embed_kind, embed.dims[0], embedding_kernels, dtype
        )
        weights.model.set_input_embeddings(module)
    weights.tie()
    weights.check_complete()
    _log.info(
        "model.weights.read",
        source=str(source),
        seconds=round(time.monotonic() - started, 2),
        on_blocks=len(weights.lazy),
        dense_mib=weights.dense_mib,
        dense_matrices=len(weights.dense_matrices),
        quantized_embedding=quantized_embedding,
        dtype=str(dtype).removeprefix("torch."),
    )
    if weights.dense_matrices:
        _log.info(
            "model.weights.dense",
            tensors=weights.dense_matrices[:16],
            count=len(weights.dense_matrices),
        )
    return weights


def _names(model: Any, processor: Any, arch: str, layers: int) -> dict[str, str]:
    """GGUF tensor name -> the model's parameter name, by gguf-py's name map of the file's
    architecture: transformers' ``get_gguf_hf_weights_map`` (each parameter tried by its whole
    name, then as a submodule's), with the map built once instead of once a module (8 s for
    SmolLM2's 400 modules).

    :raises ValueError: if gguf-py does not know the architecture.
    """
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    found = [key for key, value in MODEL_ARCH_NAMES.items() if value == arch]
    if not found:
        raise ValueError(f"gguf-py has no tensor names for the architecture {arch!r}")
    name_map = get_tensor_name_map(found[0], layers)
    out: dict[str, str] = {}
    for hf_name in model.state_dict():
        name = processor.preprocess_name(hf_name)
        stem, suffix = name, ""
        if name.endswith((".weight", ".bias")):
            stem, _, tail = name.rpartition(".")
            suffix = "." + tail
        parts = stem.split(".")
        for start in range(len(parts)):
            gguf_name = name_map.get_name(".".join(parts[start:]))
            if gguf_name is not None:
                out.setdefault(gguf_name + suffix, hf_name)
                break
        else:
            processor.perform_fallback_tensor_mapping(out, suffix, "", name)
    return out


def _processed(processor: Any) -> bool:
    """Whether ``processor`` renames tensors itself (MoE experts: names the map lacks)."""
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor

    return type(processor).perform_fallback_tensor_mapping is not (
        TensorProcessor.perform_fallback_tensor_mapping
    )
