"""The model runner: one batched forward over the paged cache per step, then sampling.

It knows nothing of actors; the executor actor calls :meth:`ModelRunner.execute` in its worker
thread. All torch work of a step happens inside that call.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Any

import torch

from .._logging import get_logger
from ..config import Quantization, WeightLayouts
from ..errors import ModelUnavailable
from ..gguf import (
    DENSE_KERNEL_ROWS,
    EVERY_ROW,
    MAX_KERNEL_ROWS,
    QLinear,
    choose_layouts,
    default_cache_dir,
    prepare_quantized,
)
from ..kernels import G8_ALONE_TYPES
from ..model import (
    ATTN_IMPLEMENTATION,
    AttentionBackend,
    ComputePath,
    FusedLlama,
    KVCacheSpec,
    LoadedModel,
    OutputLayer,
    PagedKVCache,
    StepProgress,
    TorchPagedAttention,
    cache_refusal,
    fuse_llama,
    one_line,
    refusal,
    refuse,
    register_attention,
    tick,
)
from ..request import (
    GrammarBackend,
    SampledToken,
    SamplingParams,
    SeqChunk,
    StepBatch,
    StepOutput,
)
from ..sampling import GrammarStates, apply_bitmask, finite_logprobs, sample
from ._inputs import build_inputs
from ._memory import device_memory, release_free_memory
from ._summary import compute_summary
from ._threads import ThreadGovernor

_log = get_logger("stoic.model")

__all__ = ["ModelRunner"]


class ModelRunner:
    """Runs steps of a loaded model over a :class:`PagedKVCache`.

    Any decoder-only transformers model whose attention goes through ``AttentionInterface``
    works (Llama, Qwen2, Mistral, SmolLM2, ...).

    With a grammar ``backend``, constrained rows are sampled under their grammar's mask: the
    masks are computed in a thread of the runner's own while the forward runs (llguidance and
    torch both release the GIL), then applied to those rows' logits before sampling.

    A model of a Llama-family architecture (:data:`stoic.model._fused.FUSED_TYPES`: Llama, Mistral, Qwen2,
    Qwen3, Phi-3) runs through :class:`stoic.model._fused.FusedLlama` (fused projections, the same
    arithmetic) unless ``fused`` is False; any other model through transformers' forward.

    ``quantization`` (``--quantization``, :mod:`stoic.gguf._quant`): with ``"auto"`` a model loaded from a
    GGUF file multiplies steps of few tokens by the file's quantised blocks where this machine
    can; ``"gguf"`` requires it; ``"none"`` keeps the de-quantised weights only.

    ``deterministic`` (``--deterministic``, :mod:`stoic.model._deterministic`): every token's logits
    independent of its batch, chunking and cache; a model that cannot is refused.

    ``progress`` (:attr:`progress`, private by default) counts each step's progress: a tick at
    its start and end and one per decoder layer, for the watchdog that tells a slow step from a
    hung one.

    :raises ModelUnavailable: with ``quantization="gguf"``, if the quantised kernels cannot be
        used for this model here; with ``deterministic``, if the model cannot run so (why).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        grammar: GrammarBackend | None = None,
        *,
        fused: bool = True,
        quantization: Quantization = "auto",
        progress: StepProgress | None = None,
        threads: ThreadGovernor | None = None,
        deterministic: bool = False,
        weight_layouts: WeightLayouts = "auto",
    ) -> None:
        register_attention()
        self.deterministic = deterministic
        #: sizes the compute threads before each step (None: torch's count, untouched)
        self.threads = threads
        #: ticked while a step runs (read by the step watchdog)
        self.progress = progress if progress is not None else StepProgress()
        self.loaded = loaded
        model = loaded.model
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
        else:  # pragma: no cover - older transformers
            model.config._attn_implementation = ATTN_IMPLEMENTATION
        self._base: Any = model.base_model
        head: Any = model.get_output_embeddings()
        if head is None:
            raise ModelUnavailable(
                f"{type(model).__name__} has no output layer: stoic serves causal language models"
            )
        config = (
            model.config.get_text_config()
            if hasattr(model.config, "get_text_config")
            else model.config
        )
        self._config = config
        started = time.monotonic()
        read = loaded.gguf_weights
        blocks, kernels = prepare_quantized(
            loaded.gguf,
            config,
            loaded.device,
            quantization,
            loaded.cache_root or default_cache_dir(),
            read.file if read is not None else None,
        )
        if read is not None and (kernels is None or not fused):
            read.fill()  # the matrices left on blocks, made dense: nothing multiplies on them
        dense = None if deterministic else loaded.dense_dtype
        #: steps of one or two tokens multiply the blocks by int8 activations (``_int8rows.c``),
        #: and bigger ones too (``_gemm8.c``): where the model runs with a fast dense dtype
        #: (``--dtype auto`` chose bfloat16) and the kernels have them (AVX-512 VNNI); with
        #: ``--deterministic`` every step on int8 activations over the G8 layout (each row in one
        #: order: batch-invariant); ``--dtype float32`` keeps its float32 products
        self.int8_rows = (
            loaded.dense_dtype is not None
            and loaded.dense_dtype != torch.float32
            and kernels is not None
            and kernels.int8_rows
        )
        #: ``--weight-layouts`` as resolved here (:func:`stoic.gguf._quant.choose_layouts`): ``fast`` or
        #: ``compact`` (every step on the repacked blocks: no batched layout, no dense copy)
        self.weight_layouts = choose_layouts(
            weight_layouts,
            blocks if read is not None and read.lazy and not deterministic else {},
            batched_bytes=1.5 if self.int8_rows else (dense or loaded.dtype).itemsize,
            available=device_memory(loaded.device).available(),
            alone=G8_ALONE_TYPES if self.int8_rows else frozenset(),
        )
        compact = self.weight_layouts == "compact"
        #: steps of at most this many tokens run on the quantised blocks (if any)
        self.kernel_rows = (
            EVERY_ROW
            if deterministic or compact
            else DENSE_KERNEL_ROWS
            if dense is not None and dense != torch.float32
            else MAX_KERNEL_ROWS
        )
        self._head = QLinear.checked(
            head.weight,
            head.bias,
            blocks.get("head"),
            kernels,
            max_rows=self.kernel_rows,
            dense_dtype=dense,
            fixed=deterministic,
            int8_rows=self.int8_rows,
            batched=not compact,
        )
        #: the model's own forward from stoic's hidden states to logits (:mod:`stoic.model._logits`)
        self._logits = OutputLayer(model, self)
        with torch.inference_mode():
            self._logits.probe(
                int(head.weight.shape[1]), int(head.weight.shape[0]), loaded.dtype, loaded.device
            )
        whole = self._logits.whole_forward
        if whole and read is not None:
            read.fill()  # transformers' own forward multiplies by the model's weights
        self._fused: FusedLlama | None = (
            fuse_llama(
                model,
                config,
                blocks,
                kernels,
                kernel_rows=self.kernel_rows,
                dense_dtype=dense,
                deterministic=deterministic,
                int8_rows=self.int8_rows,
                batched=not compact,
            )
            if fused and not whole
            else None
        )
        why = (
            refusal(self._fused, getattr(self._base, "rotary_emb", None)) if deterministic else None
        )
        if why is None and deterministic and self._head.product is None:
            why = "the output layer has no quantised blocks the kernels compute on"
        if why is None and deterministic:
            why = cache_refusal(loaded.cache_dtype)
        if why is not None:
            raise refuse(why)
        #: the attention backend (:mod:`stoic.model._attention`), chosen at load: the fused decoder's (by
        #: device, dtype and kernels), or torch's for transformers' own layers (soft caps,
        #: windows, any layout)
        self.attention: AttentionBackend = (
            self._fused.attention if self._fused is not None else TorchPagedAttention()
        )
        if self._fused is None:
            _tick_per_layer(self._base)
        if whole:
            self._check_whole_forward()
        self.quantized = self._quantized_summary(quantization, time.monotonic() - started)
        #: the same, as a typed record
        self.compute_path = ComputePath.from_summary(self.quantized)
        self.grammar = GrammarStates(grammar) if grammar is not None else None
        self._masker: concurrent.futures.ThreadPoolExecutor | None = None
        if self._logits.whole_forward:
            self._check_whole_forward()
        if read is not None:  # the layouts are made: the file's pages need not stay mapped
            read.file.release_pages()
        release_free_memory()  # the repacking's transients, back to the system
        _log.info("model.compute_path", **self.quantized)

    def _check_whole_forward(self) -> None:
        """Run a two-token step of the model's whole forward on a scratch cache: a model that
        runs neither way is refused at start, not at its first request.

        :raises ModelUnavailable: if that step fails (one line: both reasons).
        """
        cache = PagedKVCache(self.kv_spec(num_blocks=1, block_size=4))
        cache.zero_blocks((0,))
        chunk = SeqChunk(0, (0, 0), 0, (0,), True, SamplingParams(max_tokens=1, temperature=0))
        try:
            self._execute(StepBatch((chunk,)), cache)
        except Exception as exc:
            raise ModelUnavailable(
                f"{type(self.loaded.model).__name__} cannot be served: "
                f"{self._logits.reason}, and its whole forward fails over stoic's paged "
                f"attention ({one_line(exc)})"
            ) from exc
        finally:
            cache.release()

    def _quantized_summary(self, mode: Quantization, seconds: float) -> dict[str, Any]:
        """What runs on quantised blocks (:func:`._summary.compute_summary`), logged as
        ``model.quantized`` with the seconds the blocks took to read, check and repack.

        :raises ModelUnavailable: with ``mode="gguf"``, if nothing does.
        """
        summary = compute_summary(
            self.loaded,
            self._fused,
            self._head,
            self._logits,
            attention=self.attention.name,
            kernel_rows=self.kernel_rows,
            deterministic=self.deterministic,
            int8_rows=self.int8_rows,
            weight_layouts=self.weight_layouts,
        )
        if summary["projections"] or summary["head"] is not None:
            _log.info("model.quantized", seconds=round(seconds, 2), **summary)
        elif mode == "gguf":
            raise ModelUnavailable(
                "quantization 'gguf' cannot be used: no matrix of the model matched its "
                "quantised blocks"
            )
        return summary

    def _mask_thread(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._masker is None:
            self._masker = concurrent.futures.ThreadPoolExecutor(1, "stoic-grammar")
        return self._masker

    def kv_spec(self, num_blocks: int, block_size: int) -> KVCacheSpec:
        return KVCacheSpec.for_model(
            self._config,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=self.loaded.cache_dtype,
            device=self.loaded.device,
        )

    def execute(self, batch: StepBatch, cache: PagedKVCache) -> StepOutput:
        """Run one step: write the chunks' keys/values into ``cache``, sample where asked;
        :attr:`progress` ticks meanwhile.

        :raises RuntimeError: if ``cache`` was released (the executor was fenced).
        :raises torch.OutOfMemoryError: and anything else the forward pass raises.
        """
        governor = self.threads
        if governor is not None:
            governor.before_step()
        # the governor looks again between layers: a step slowed many times over by a
        # neighbour (each parallel region waiting for a displaced thread: seconds a step) shrinks
        # its pool within a second, not at the next step
        with self.progress.running(governor.before_step if governor is not None else None):
            return self._execute(batch, cache)

    @torch.inference_mode()
    def _execute(self, batch: StepBatch, cache: PagedKVCache) -> StepOutput:
        if cache.released:
            raise RuntimeError("KV cache was released")
        device = self.loaded.device
        step = build_inputs(batch, cache, device)
        if step.zero_rows is not None:
            cache.zero_rows(step.zero_rows)
        input_ids, positions, rows, chunks = step.input_ids, step.positions, step.rows, step.sampled
        constrained = [i for i, c in enumerate(chunks) if c.params.constraint is not None]
        # the constrained chunks themselves: one with drafts has a mask row for each of its
        # sampled rows (after its output, then after each draft: GrammarStates.bitmask)
        grammar_chunks = [c for c in batch.chunks if c.sample and c.params.constraint is not None]
        masks: concurrent.futures.Future[torch.Tensor] | None = None
        if constrained:
            if self.grammar is None:
                raise RuntimeError("a constrained sequence reached a runner without a grammar")
            masks = self._mask_thread().submit(self.grammar.bitmask, grammar_chunks)
        logits: torch.Tensor | None = None
        if self._logits.whole_forward:
            plan = self.attention.plan(step.meta, batch.num_tokens)
            logits = self._logits.whole(input_ids, positions, rows, stoic_step=plan)
        else:
            if self._fused is not None:
                hidden = self._fused.forward(input_ids, positions, step.meta)
            else:
                plan = self.attention.plan(step.meta, batch.num_tokens)
                hidden = self._base(
                    input_ids=input_ids, position_ids=positions, use_cache=False, stoic_step=plan
                ).last_hidden_state
            logits = self._logits(input_ids, hidden, rows) if chunks else None
        sampled: dict[int, Any] = {}
        if chunks:
            assert logits is not None
            if masks is not None:
                logits = apply_bitmask(logits, constrained, masks.result())
            tokens = sample(logits, chunks, self.loaded.eos_token_ids)
            accepted: dict[int, tuple[SampledToken, ...]] = {}
            row = 0  # a chunk with drafts has drafts + 1 rows (build_inputs, draft_rows)
            for chunk in batch.chunks:
                if chunk.sample:
                    sampled[chunk.seq_id] = tokens[row]
                    if chunk.drafts:
                        accepted[chunk.seq_id] = chunk.kept(tokens[row : row + chunk.drafts + 1])
                    row += chunk.drafts + 1
            if masks is not None:
                assert self.grammar is not None
                self._advance_grammars(grammar_chunks, sampled, accepted)
            return StepOutput(sampled, torch.get_num_threads(), accepted)
        return StepOutput(sampled, torch.get_num_threads())

    def _advance_grammars(
        self,
        chunks: list[SeqChunk],
        sampled: dict[int, SampledToken],
        accepted: dict[int, tuple[SampledToken, ...]],
    ) -> None:
        """Advance the constrained ``chunks``' matchers by their tokens of the step (the sampled
        one, then the kept drafts' rows), their logprobs made finite; the token that completes a
        grammar is marked and the kept tokens after it dropped (in place)."""
        assert self.grammar is not None
        got = [(sampled[c.seq_id], *accepted.get(c.seq_id, ())) for c in chunks]
        done = self.grammar.advance(chunks, [[t.token_id for t in g] for g in got])
        for chunk, tokens, complete in zip(chunks, got, done, strict=True):
            out = [finite_logprobs(t) for t in tokens]
            if complete is not None:
                out = out[: complete + 1]
                out[complete] = dataclasses.replace(out[complete], grammar_complete=True)
            sampled[chunk.seq_id] = out[0]
            if chunk.drafts:
                accepted[chunk.seq_id] = tuple(out[1:])


def _tick_per_layer(base: Any) -> None:
    """One progress tick before each decoder layer of transformers' forward (a forward
    pre-hook; registered once per model, whatever the number of runners over it)."""
    for layer in getattr(base, "layers", None) or ():
        if not getattr(layer, "_stoic_ticks", False):
            layer.register_forward_pre_hook(lambda _module, _args: tick())
            layer._stoic_ticks = True
