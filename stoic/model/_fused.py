"""A lean forward pass for Llama-family models: fused projections, few ops per layer.

transformers' own forward works for every model but pays, per layer and per step, for its
generic plumbing (keyword routing, output capture, one linear per projection). For a model of
a ``model_type`` in :data:`FUSED_TYPES` (Llama: SmolLM2, Llama 2/3, TinyLlama; Mistral; Qwen2 and
Qwen2.5; Qwen3; Phi-3) :class:`FusedLlama` runs the same arithmetic with:

* one ``[q; k; v]`` projection and, below :data:`SPLIT_MLP_ROWS` tokens in the step, one
  ``[gate; up]`` projection per layer (5 matrix products per layer instead of 7; 6 in steps of
  more tokens, where the double-width product measured slower). The fused weights are
  concatenated once, and the model's own ``q_proj``, ``k_proj``, ... are then pointed at row
  slices of them: no weight is held twice, and the transformers forward still runs on the same
  numbers;
* RMSNorm as one ``rms_norm`` call (bitwise equal to transformers' five ops in float32);
* the rotary tables computed once per step by the model's own rotary module (every rope type it
  supports), applied to q and k in the layout the paged attention reads.

Attention itself is the runner's attention backend's (:mod:`._attention`), planned once a step.

The families differ from Llama only by configuration of the one layer (:class:`_Layer`): biases
on q, k and v (Qwen2; any projection's bias is its :class:`QLinear`'s), an RMSNorm of each
query and key head before the rotary (Qwen3), a sliding attention window per layer (Mistral,
Qwen2's ``use_sliding_window``, Phi-3), projections the model already fuses (Phi-3's
``qkv_proj`` and ``gate_up_proj``). Other architectures (Gemma's scaled embeddings and
``1 + w`` norms, GELU, soft-capping; partial rotary) keep transformers' forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..gguf import EVERY_ROW, MAX_KERNEL_ROWS, QLinear, QuantizedMatrix
from ..kernels import Kernels, PrefillOps
from ._attention import AttentionBackend, choose_attention
from ._cdecode import CDecoder, layer_weights
from ._deterministic import RotaryTable
from ._layers import attention_inputs, mlp_block
from ._paged import StepMetadata
from ._stepprogress import tick

__all__ = ["FUSED_TYPES", "FusedLlama", "fuse_llama", "fused_config"]

#: the ``model_type`` values that run here (any other keeps transformers' forward)
FUSED_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text")
#: of those, the Gemma layout: norms of ``1 + weight``, norms after attention and after the
#: MLP too, GELU (tanh), a rotary table per layer type
_GEMMA_TYPES = ("gemma3_text",)


@dataclass(frozen=True)
class _Layer:
    attn: Any  # the layer's attention module (for ``layer_idx`` and ``scaling``)
    norm_in: torch.Tensor
    norm_post: torch.Tensor
    qkv: QLinear
    o: QLinear
    gate_up: QLinear
    down: QLinear
    #: the per-head RMSNorm weights of queries and keys (Qwen3), or None
    qk_norm: tuple[torch.Tensor, torch.Tensor] | None = None
    #: keys at least this many positions before a query are not attended (None: all are)
    window: int | None = None
    #: Gemma's norms of the attention's and the MLP's outputs (before their residuals)
    post_attn: torch.Tensor | None = None
    post_mlp: torch.Tensor | None = None
    #: the layer's rotary table (Gemma's layer type; None: the model's one table)
    rope: str | None = None


def _fuse_rows(linears: list[Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of ``linears`` by rows; point each module's
    parameters at its slice of the result, so the memory is not doubled."""
    weight = torch.cat([m.weight.data for m in linears])
    biases = [m.bias for m in linears]
    bias = torch.cat([b.data for b in biases]) if all(b is not None for b in biases) else None
    if bias is None and any(b is not None for b in biases):
        raise ValueError("some fused projections have a bias and some do not")
    start = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight.data = weight[start : start + rows]
        if bias is not None:
            m.bias.data = bias[start : start + rows]
        start += rows
    return weight, bias


def _supported(config: Any, base: Any) -> bool:
    if not fused_config(config):
        return False
    layers = getattr(base, "layers", None)
    return bool(layers) and hasattr(base, "rotary_emb") and hasattr(base, "embed_tokens")


def fused_config(config: Any) -> bool:
    """Whether a model of ``config`` (transformers') runs here, judged by its configuration
    alone: what the loader asks before it builds the model (:func:`fuse_llama` then checks the
    modules too)."""
    kind = getattr(config, "model_type", None)
    if kind not in FUSED_TYPES:
        return False
    if kind in _GEMMA_TYPES:
        if getattr(config, "hidden_activation", None) != "gelu_pytorch_tanh":
            return False
        # bidirectional attention is not the paged attention's here (soft-capping: below)
        if getattr(config, "use_bidirectional_attention", False):
            return False
    elif getattr(config, "hidden_act", None) != "silu":
        return False
    if getattr(config, "mlp_bias", False):
        return False
    rope = getattr(config, "rope_parameters", None) or {}
    partial = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):  # the rotary here turns the whole head
        return False
    # attention soft-capping: the C attention kernels have none; transformers' layers over the
    # paged attention (which honours it) run such a model
    return not getattr(config, "attn_logit_softcapping", None)


def _fused_projections(
    attn: Any, mlp: Any, i: int
) -> tuple[tuple[torch.Tensor, torch.Tensor | None, list[str]], tuple[torch.Tensor, list[str]]]:
    """A layer's ``[q; k; v]`` weight, bias and block keys, and its ``[gate; up]`` weight and
    block keys: the model's own fused projections (Phi-3; a GGUF file's ``attn_qkv`` and
    ``ffn_up``), or its separate ones concatenated (:func:`_fuse_rows`)."""
    if hasattr(attn, "qkv_proj"):
        qkv = (attn.qkv_proj.weight, attn.qkv_proj.bias, [f"{i}.qkv"])
    else:
        weight, bias = _fuse_rows([attn.q_proj, attn.k_proj, attn.v_proj])
        qkv = (weight, bias, [f"{i}.q", f"{i}.k", f"{i}.v"])
    if hasattr(mlp, "gate_up_proj"):
        return qkv, (mlp.gate_up_proj.weight, [f"{i}.up"])
    gate_up, _ = _fuse_rows([mlp.gate_proj, mlp.up_proj])
    return qkv, (gate_up, [f"{i}.gate", f"{i}.up"])


def _window(attn: Any, config: Any) -> int | None:
    """The layer's sliding attention window, as transformers' attention passes it: the
    module's own (Qwen2, Qwen3: per layer type), else the config's (Mistral, Phi-3)."""
    if hasattr(attn, "sliding_window"):
        window = attn.sliding_window
    else:
        window = getattr(config, "sliding_window", None)
    return int(window) if window else None


def fuse_llama(
    model: Any,
    config: Any,
    quantized: dict[str, QuantizedMatrix] | None = None,
    kernels: Kernels | None = None,
    *,
    kernel_rows: int = MAX_KERNEL_ROWS,
    dense_dtype: torch.dtype | None = None,
    deterministic: bool = False,
    int8_rows: bool = False,
    batched: bool = True,
) -> FusedLlama | None:
    """The lean forward of ``model`` (a transformers causal LM), or None when its architecture is
    not one this module implements (the caller then keeps transformers' forward).

    With ``quantized`` blocks (:func:`stoic.gguf.read_llama_blocks`) and ``kernels``, a projection
    whose blocks all match the model's weights runs steps of at most ``kernel_rows`` tokens on
    them (:class:`QLinear`); bigger ones multiply by weights in ``dense_dtype`` (None: the
    model's). ``deterministic``: every step on the blocks in the fixed order and through the C
    layers (:mod:`._deterministic`; ``kernel_rows`` and ``dense_dtype`` are then not used).
    ``int8_rows``: steps multiply the blocks by int8 activations where the kernels can
    (:class:`QLinear`; with ``deterministic``, every step in the fixed order of the G8 layout).
    ``batched`` False: no batched int8 layout (:class:`QLinear`; ``--weight-layouts compact``).

    Mutates ``model``: its q/k/v and gate/up weights become views of the fused tensors (same
    values, same outputs).
    """
    base = model.base_model
    if not _supported(config, base):
        return None
    return FusedLlama(
        base,
        config,
        quantized or {},
        kernels,
        kernel_rows=kernel_rows,
        dense_dtype=dense_dtype,
        deterministic=deterministic,
        int8_rows=int8_rows,
        batched=batched,
    )


class FusedLlama:
    """The decoder stack of a Llama-architecture model, run with fused projections.

    :meth:`forward` takes what transformers' base model takes on stoic's path (one packed row of
    token ids, their positions, the step's metadata) and returns the final hidden states.
    """

    def __init__(
        self,
        base: Any,
        config: Any,
        quantized: dict[str, QuantizedMatrix] | None = None,
        kernels: Kernels | None = None,
        *,
        kernel_rows: int = MAX_KERNEL_ROWS,
        dense_dtype: torch.dtype | None = None,
        deterministic: bool = False,
        int8_rows: bool = False,
        batched: bool = True,
    ) -> None:
        if deterministic:  # every step on the blocks, no dense copy (:mod:`._deterministic`;
            # with int8_rows on the G8 layout's fixed-order int8 products)
            kernel_rows, dense_dtype = EVERY_ROW, None
        #: each position's rotary values computed once (deterministic mode; None: per step)
        self._fixed_rotary = RotaryTable(base.rotary_emb) if deterministic else None
        #: Gemma's embedding module scales by sqrt(hidden) itself
        self._embed = base.embed_tokens
        self._rotary = base.rotary_emb
        gemma = config.model_type in _GEMMA_TYPES
        self._gelu = gemma

        def norm(weight: torch.Tensor) -> torch.Tensor:
            # Gemma multiplies by 1 + weight (in float32, as its RMSNorm does)
            return (1.0 + weight.detach().float()).to(weight.dtype) if gemma else weight

        self._final_norm = norm(base.norm.weight)
        self._eps = float(config.rms_norm_eps)
        self._heads = int(config.num_attention_heads)
        self._kv_heads = int(getattr(config, "num_key_value_heads", None) or self._heads)
        self._head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self._heads)
        #: the two halves of a layer around attention (swappable, e.g. for compiled ones)
        self.attention_inputs: Callable[..., tuple[torch.Tensor, ...]] = attention_inputs
        self.mlp_block: Callable[..., torch.Tensor] = mlp_block
        self._layers: list[_Layer] = []
        blocks = quantized or {}

        def linear(
            weight: torch.Tensor, bias: torch.Tensor | None, *keys: str, parts: int = 1
        ) -> QLinear:
            found = QuantizedMatrix.stack([blocks.get(k) for k in keys])
            return QLinear.checked(
                weight,
                bias,
                found,
                kernels,
                max_rows=kernel_rows,
                dense_dtype=dense_dtype,
                pack_parts=parts,
                fixed=deterministic,
                int8_rows=int8_rows,
                batched=batched,
            )

        for i, layer in enumerate(base.layers[: config.num_hidden_layers]):
            attn, mlp = layer.self_attn, layer.mlp
            (qkv, qkv_bias, qkv_keys), (gate_up, gate_up_keys) = _fused_projections(attn, mlp, i)
            q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            qk_norm = (
                None
                if q_norm is None or k_norm is None
                else (norm(q_norm.weight), norm(k_norm.weight))
            )
            post = layer.post_attention_layernorm.weight
            self._layers.append(
                _Layer(
                    attn=attn,
                    norm_in=norm(layer.input_layernorm.weight),
                    norm_post=norm(layer.pre_feedforward_layernorm.weight) if gemma else post,
                    qkv=linear(qkv, qkv_bias, *qkv_keys),
                    o=linear(attn.o_proj.weight, attn.o_proj.bias, f"{i}.o"),
                    # packed as its two halves: the many-row steps multiply them apart
                    gate_up=linear(gate_up, None, *gate_up_keys, parts=2),
                    down=linear(mlp.down_proj.weight, None, f"{i}.down"),
                    qk_norm=qk_norm,
                    window=_window(attn, config),
                    post_attn=norm(post) if gemma else None,
                    post_mlp=norm(layer.post_feedforward_layernorm.weight) if gemma else None,
                    rope=getattr(attn, "layer_type", None) if gemma else None,
                )
            )
        self._ropes = sorted({lay.rope for lay in self._layers}, key=str)
        # the C layers and operators have no q/k norms (nor Gemma's norms, GELU or tables)
        qk_norms = gemma or any(lay.qk_norm is not None for lay in self._layers)
        windows = [lay.window for lay in self._layers if lay.window is not None]
        #: steps with a position this far in or further run every layer on the torch path (the
        #: C attention has no window; below it, a window hides nothing)
        self._window = min(windows) if windows else None
        #: whether some layer has a sliding window (deterministic mode refuses such a model)
        self.has_window = bool(windows)

        #: decode-only steps' layers in C (:mod:`._cdecode`), when every projection runs on
        #: quantised blocks and the shapes allow; None: the torch path for every step
        self.c_decoder: CDecoder | None = None
        #: the layers' attention on the torch path (:mod:`._attention`)
        self.attention: AttentionBackend = choose_attention(
            kernels,
            heads=self._heads,
            kv_heads=self._kv_heads,
            head_dim=self._head_dim,
            device=self._final_norm.device,
            dtype=self._final_norm.dtype,
        )
        self._kernel_rows = kernel_rows
        #: the bfloat16 steps' norms, rotary and SiLU x up in C (:mod:`stoic.kernels._cops`)
        self._ops = (
            PrefillOps(kernels)
            if kernels is not None
            and not qk_norms
            and PrefillOps.supports(int(config.hidden_size), self._head_dim)
            else None
        )
        # the C layer has no q/k norms (nor biases but q/k/v's: :func:`layer_weights` checks)
        weights = layer_weights(self._layers) if kernels is not None and not qk_norms else None
        dtype = self._final_norm.dtype
        if weights is not None and CDecoder.supports(
            dtype, self._head_dim, self._heads, self._kv_heads
        ):
            assert kernels is not None
            self.c_decoder = CDecoder(
                kernels,
                weights,
                self._heads,
                self._kv_heads,
                self._head_dim,
                self._eps,
                max_rows=kernel_rows,
                every_step=deterministic,
            )

    @property
    def quantized_projections(self) -> tuple[int, int]:
        """(projections with quantised blocks, all projections): 4 a layer."""
        linears = [p for lay in self._layers for p in (lay.qkv, lay.o, lay.gate_up, lay.down)]
        return sum(p.quantized is not None for p in linears), len(linears)

    @property
    def nbytes(self) -> int:
        """Bytes the projections hold of their own (:attr:`stoic.gguf._quant.QLinear.nbytes`)."""
        return sum(
            p.nbytes for lay in self._layers for p in (lay.qkv, lay.o, lay.gate_up, lay.down)
        )

    @property
    def int8_batched_projections(self) -> int:
        """Projections whose products of more than ``kernel_rows`` rows take int8 activations
        (:attr:`stoic.gguf._quant.QLinear.batched_int8`), of :attr:`quantized_projections`' total."""
        linears = [p for lay in self._layers for p in (lay.qkv, lay.o, lay.gate_up, lay.down)]
        return sum(p.batched_int8 for p in linears)

    @property
    def quantized_kinds(self) -> set[str]:
        """The block types of the projections that run on quantised blocks."""
        linears = [p for lay in self._layers for p in (lay.qkv, lay.o, lay.gate_up, lay.down)]
        return {p.quantized.kind for p in linears if p.quantized is not None}

    def _table(
        self, hidden: torch.Tensor, positions: torch.Tensor, rope: str | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary ``cos``, ``sin`` ``[1, 1, N, D]`` (broadcast over the heads of ``[1,
        heads, N, D]``) by the model's own rotary module, of layer type ``rope`` (Gemma)."""
        args = (hidden, positions) if rope is None else (hidden, positions, rope)
        cos, sin = self._rotary(*args)
        return cos[:, None], sin[:, None]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, step: StepMetadata
    ) -> torch.Tensor:
        """Hidden states ``[1, N, hidden]`` after the final norm, for ``input_ids`` ``[1, N]``."""
        hidden = self._embed(input_ids)
        if self._fixed_rotary is not None and self.c_decoder is not None:
            cos, sin = self._fixed_rotary(hidden, positions, step.max_position)
            hidden = self.c_decoder.forward(hidden, cos, sin, step)
            return F.rms_norm(hidden, (hidden.shape[-1],), self._final_norm, self._eps)
        tables = {rope: self._table(hidden, positions, rope) for rope in self._ropes}
        cos, sin = tables[self._ropes[0]]  # the C decoder's (a model of one table)
        windowed = self._window is not None and step.max_position >= self._window
        if (
            self.c_decoder is not None
            and not windowed
            and self.c_decoder.accepts(step, hidden.shape[1])
        ):
            hidden = self.c_decoder.forward(hidden, cos, sin, step)
            return F.rms_norm(hidden, (hidden.shape[-1],), self._final_norm, self._eps)
        dim = self._head_dim
        sizes = [self._heads * dim, self._kv_heads * dim, self._kv_heads * dim]
        # with a bfloat16 dense dtype, the products' results stay bfloat16 between products
        # (rotary, attention, SiLU) as in a bfloat16 model; the residual stream, the norms and
        # the KV cache stay float32
        work = self._layers[0].qkv.out_dtype(hidden, native=True) if self._layers else cos.dtype
        # the C operators take float32 residuals and bfloat16 values between products: the
        # split's steps of more rows than any projection runs on blocks (a bfloat16 model, or
        # a step where some projections return the blocks' float32, keeps torch's operators)
        ops = (
            self._ops
            if work == torch.bfloat16
            and hidden.dtype == torch.float32
            and hidden.device.type == "cpu"
            and hidden.shape[1] > self._kernel_rows
            else None
        )
        if ops is not None:  # float32 [N, D] tables for the C rotary
            tables = {
                r: (c.reshape(-1, dim).float(), s.reshape(-1, dim).float())
                for r, (c, s) in tables.items()
            }
        elif cos.dtype != work:
            tables = {r: (c.to(work), s.to(work)) for r, (c, s) in tables.items()}
        attend = self.attention.plan(step, hidden.shape[1], windowed=windowed)
        for layer in self._layers:
            tick()  # the step watchdog's progress: one a layer
            cos, sin = tables[layer.rope]
            q, k, v = self.attention_inputs(
                hidden, layer.norm_in, layer.qkv, cos, sin, sizes, self._eps, ops, layer.qk_norm
            )
            out = attend.forward(
                layer.attn, q, k, v, scaling=layer.attn.scaling, sliding_window=layer.window
            )
            hidden = self.mlp_block(
                hidden,
                out,
                layer.o,
                layer.norm_post,
                layer.gate_up,
                layer.down,
                self._eps,
                ops,
                post=(layer.post_attn, layer.post_mlp),
                gelu=self._gelu,
            )
        width = hidden.shape[-1]
        return F.rms_norm(hidden, (width,), self._final_norm, self._eps)
