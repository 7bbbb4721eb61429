"""A decode step's decoder layers in C: three kernel calls a layer (:mod:`stoic.kernels._qkernels`).

On a CPU, one sequence's decode step through :class:`._fused.FusedLlama` ran ~40 torch
operators a layer (norms, rotary, the paged attention's gathers and masks, SiLU, residuals); at
one row each costs its dispatch, not its arithmetic, and together they took as long as all the
quantised matrix products of the step. :class:`CDecoder` runs the same formulas as
``stoic_layer_pre`` (RMSNorm, the fused ``[q; k; v]`` product, rotary), ``stoic_decode_attention``
(the new keys and values written into the paged pools, then attention over each sequence's blocks
in place: no gather) and ``stoic_layer_post`` (output projection, residual, RMSNorm, gated MLP,
residual). With :attr:`CDecoder.every_step` (``--deterministic``) a step's prefill chunks attend
through ``stoic_prefill_attention`` instead: a chunk's rows together, each row bitwise as the
decode kernel computes it alone.

It serves steps of at most :data:`stoic.gguf._quant.MAX_KERNEL_ROWS` tokens (fewer where the
dense products are bfloat16: :data:`stoic.gguf._quant.DENSE_KERNEL_ROWS`): decodes, and prefill
chunks this small (a short prompt, a chunk of draft tokens to verify: ``stoic_prefill_attention``
over float32 pools, a row of the decode attention each over bfloat16 ones), in float32, for
models whose every projection runs on quantised blocks, without attention sliding windows; the
torch path serves everything else. Its results differ from the torch path's by float32 rounding
(``tests/model/test_cdecode.py``); greedy outputs equal transformers' ``generate``
(``tests/engine/test_correctness.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..gguf import MAX_KERNEL_ROWS
from ..kernels import C_POOL_DTYPES, MAX_HEAD_DIM, Kernels, Product
from ._paged import StepMetadata
from ._stepprogress import tick

__all__ = ["CDecoder", "LayerWeights", "attention_runs", "block_tables"]


@dataclass(frozen=True)
class LayerWeights:
    """What the layer kernels read of one layer."""

    norm_in: torch.Tensor
    norm_post: torch.Tensor
    qkv: Product
    o: Product
    gate_up: Product
    down: Product
    #: the layer's index in the KV cache, and its attention scale
    cache_layer: int
    scaling: float
    #: the ``[q; k; v]`` product's float32 bias (Qwen2), or None
    qkv_bias: torch.Tensor | None = None


class CDecoder:
    """Runs a decode-only step's layers with the C kernels."""

    def __init__(
        self,
        kernels: Kernels,
        layers: list[LayerWeights],
        heads: int,
        kv_heads: int,
        head_dim: int,
        eps: float,
        *,
        max_rows: int = MAX_KERNEL_ROWS,
        every_step: bool = False,
    ) -> None:
        self._k = kernels
        #: decode steps of more tokens take the torch path
        self.max_rows = max_rows
        #: every step runs here, prefill chunks too (``--deterministic``: each token's
        #: attention is its own row of the C attention, over its sequence's first ``position +
        #: 1`` keys, so a token computes the same in a decode step or a prefill chunk)
        self.every_step = every_step
        #: with :attr:`every_step`, a step's prefill chunks attend through the rows kernel
        #: (``stoic_prefill_attention``: a chunk's rows together, each bitwise as alone);
        #: False: one row each through the decode kernel (the same results; for comparisons)
        self.prefill_rows = True
        self._layers = layers
        self._heads, self._kv_heads, self._dim = heads, kv_heads, head_dim
        self._eps = eps

    @staticmethod
    def supports(dtype: torch.dtype, head_dim: int, heads: int, kv_heads: int) -> bool:
        """Whether a model of these shapes can run here at all."""
        return (
            dtype == torch.float32
            and head_dim % 8 == 0
            and head_dim <= MAX_HEAD_DIM
            and heads % kv_heads == 0
        )

    def accepts(self, step: StepMetadata, tokens: int) -> bool:
        """Whether this step is one :meth:`forward` runs (few tokens, decodes and prefill
        chunks alike; any with :attr:`every_step`) over a cache the kernels read (float32 or
        bfloat16 pools: a float16 cache keeps torch's layers)."""
        if step.cache.spec.dtype not in C_POOL_DTYPES:
            return False
        if self.every_step:
            return tokens > 0
        # prefill chunks of a step this small (a short prompt, a chunk of draft tokens to
        # verify) attend through the rows kernel: the torch path's ~40 operators a layer cost
        # more than the step's arithmetic (a 5-row draft chunk: 36 ms against 9 ms a token)
        return 0 < tokens <= self.max_rows

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: StepMetadata
    ) -> torch.Tensor:
        """The hidden states after the last layer (before the final norm), ``[1, M, width]``,
        for ``hidden`` ``[1, M, width]`` and ``cos``/``sin`` ``[1, M, head_dim]``.

        :raises RuntimeError: if a kernel fails (out of memory); the cache may be part-written,
            as after any failed step.
        """
        m, width = hidden.shape[1], hidden.shape[2]
        h, kvh, dim = self._heads, self._kv_heads, self._dim
        hidden = hidden.reshape(m, width).contiguous()
        cos, sin = cos.reshape(m, dim).contiguous(), sin.reshape(m, dim).contiguous()
        q = torch.empty(m, h, dim)
        k = torch.empty(m, kvh, dim)
        v = torch.empty(m, kvh, dim)
        out = torch.empty(m, h, dim)
        tables, lens = block_tables(step, m, prefills=True)
        cache = step.cache
        pool_bf16 = int(cache.spec.dtype == torch.bfloat16)  # the pools' type, as C takes it
        # prefill chunks in runs of rows (their tokens share the chunk's first one's tables);
        # over bfloat16 pools (which the rows kernel lacks) each chunk token is a row of the
        # decode kernel, over its first position + 1 keys: it writes every token's key and
        # value before any attends, so a chunk's rows see each other's
        runs = attention_runs(step, m) if self.prefill_rows and not pool_bf16 else None
        write = step.write_index.contiguous()
        threads = torch.get_num_threads()
        eps = self._eps
        pre, post = self._k.layer_pre, self._k.layer_post
        attend = self._k.attention
        if runs is not None:  # the rows kernel: its two arguments more, bound once a step
            attend = functools.partial(_with_runs, self._k.prefill_attention, runs)
        hp, cp, sp = hidden.data_ptr(), cos.data_ptr(), sin.data_ptr()
        qp, kp, vp, op = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
        tp, lp, wp = tables.data_ptr(), lens.data_ptr(), write.data_ptr()
        block = cache.spec.block_size
        max_blocks = tables.shape[2]
        if torch._C._autograd._profiler_enabled():  # each kernel named in torch.profiler's table
            pre, attend, post = (
                _recorded("stoic::layer_pre", pre),
                _recorded("stoic::decode_attention", attend),
                _recorded("stoic::layer_post", post),
            )
        for layer in self._layers:
            tick()  # the step watchdog's progress: one a layer
            qkv, o, gu, down = layer.qkv, layer.o, layer.gate_up, layer.down
            bias = None if layer.qkv_bias is None else layer.qkv_bias.data_ptr()
            rc = pre(
                hp, m, width, layer.norm_in.data_ptr(), eps, qkv.layout, qkv.pointer, bias,
                h, kvh, dim, cp, sp, qp, kp, vp, threads,
            )  # fmt: skip
            if rc == 0:
                rc = attend(
                    qp, kp, vp,
                    cache.keys[layer.cache_layer].data_ptr(),
                    cache.values[layer.cache_layer].data_ptr(),
                    wp, tp, lp, m, h, kvh, dim, block, max_blocks, layer.scaling, op, threads,
                    pool_bf16,
                )  # fmt: skip
            if rc == 0:
                rc = post(
                    hp, op, m, width, h * dim, o.layout, o.pointer,
                    layer.norm_post.data_ptr(), eps, gu.layout, gu.pointer, gu.rows // 2,
                    down.layout, down.pointer, threads,
                )  # fmt: skip
            if rc != 0:
                raise RuntimeError(f"decode kernel failed ({rc}) in layer {layer.cache_layer}")
        return hidden.view(1, m, width)


def _with_runs(kernel: Callable[..., int], runs: torch.Tensor, *args: Any) -> int:
    """``stoic_prefill_attention`` called with ``stoic_decode_attention``'s arguments (``args``)
    and ``runs`` (``[n, 2]`` int64: first token, tokens) after the eight pointers."""
    return kernel(*args[:8], runs.data_ptr(), int(runs.shape[0]), *args[8:])


def _recorded(name: str, fn: Callable[..., int]) -> Callable[..., int]:
    def call(*args: Any) -> int:
        with torch.profiler.record_function(name):
            return fn(*args)

    return call


def block_tables(
    step: StepMetadata, tokens: int, *, prefills: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token's pool rows ``[M, kv_heads, max_blocks]`` and context length ``[M]``, in the
    step's token order, from its decode groups (each padded to its own longest); a token of no
    decode group (a prefill chunk's) gets zeros, or with ``prefills`` its sequence's blocks and
    its position + 1 (it attends causally, as a decode token at its position would)."""
    groups = step.decodes
    chunks = step.prefills if prefills else ()
    widest = max([g.max_blocks for g in groups] + [int(c.gather_index.shape[1]) for c in chunks])
    kv_heads = step.cache.spec.num_kv_heads
    tables = torch.zeros(tokens, kv_heads, widest, dtype=torch.int64)
    lens = torch.zeros(tokens, dtype=torch.int64)
    for g in groups:
        tables[g.q_index, :, : g.max_blocks] = g.gather_index
        lens[g.q_index] = g.context_lens.to(torch.int64)
    for c in chunks:
        tables[c.start : c.end, :, : c.gather_index.shape[1]] = c.gather_index
        lens[c.start : c.end] = torch.arange(c.start_pos + 1, c.start_pos + 1 + c.end - c.start)
    return tables, lens


def attention_runs(step: StepMetadata, tokens: int) -> torch.Tensor | None:
    """The step's tokens as runs for ``stoic_prefill_attention``, ``[n, 2]`` int64 (first token,
    tokens): each prefill chunk one run, every other token a run of one; None for a step without
    a prefill chunk (the decode kernel serves it)."""
    if not step.prefills:
        return None
    runs = [(c.start, c.end - c.start) for c in step.prefills]
    alone = torch.ones(tokens, dtype=torch.bool)
    for first, n in runs:
        alone[first : first + n] = False
    singles = alone.nonzero().flatten()
    table = torch.tensor(runs, dtype=torch.int64).reshape(-1, 2)
    if singles.numel():
        table = torch.cat((table, torch.stack((singles, torch.ones_like(singles)), 1)))
    return table.contiguous()


def layer_weights(layers: list[Any]) -> list[LayerWeights] | None:
    """The :class:`LayerWeights` of ``layers`` (:class:`._fused._Layer`), or None when a
    projection has no quantised blocks, or one but ``[q; k; v]`` has a bias (the C layer has
    neither)."""
    out = []
    for layer in layers:
        parts = [layer.qkv.product, layer.o.product, layer.gate_up.product, layer.down.product]
        if any(p is None for p in parts) or any(
            lin.bias is not None for lin in (layer.o, layer.gate_up, layer.down)
        ):
            return None
        bias = layer.qkv.bias
        qkv, o, gu, down = parts
        assert qkv is not None and o is not None and gu is not None and down is not None
        out.append(
            LayerWeights(
                layer.norm_in.detach().contiguous(),
                layer.norm_post.detach().contiguous(),
                qkv,
                o,
                gu,
                down,
                int(getattr(layer.attn, "layer_idx", 0)),
                float(layer.attn.scaling),
                None if bias is None else bias.detach().float().contiguous(),
            )
        )
    return out
