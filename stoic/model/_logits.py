"""From a step's final hidden states to logits: the model's own ``ForCausalLM.forward``.

stoic runs a model's decoder itself (transformers' base model over the paged attention, or
:class:`._fused.FusedLlama`) and multiplies by the output layer itself (:class:`stoic.gguf._quant.QLinear`,
the GGUF file's blocks where it can). Whatever a model's ``ForCausalLM.forward`` does between its
base model and the logits it returns (Granite divides by ``logits_scaling``, Cohere multiplies by
``logit_scale``, Gemma 2 soft-caps by ``final_logit_softcapping``, a future architecture anything
else) must happen too, and it does by construction: :class:`OutputLayer` calls that very forward,
on a stand-in of the model whose base model returns stoic's hidden states and whose output layer
is stoic's. No list of architectures says what to apply.

Whether the stand-in works for a model is tested when the runner is built
(:meth:`OutputLayer.probe`): the forward must hand its inputs to the base model untouched and
pass the kept rows of its hidden states through the output layer exactly once. A model whose
forward does something else (works on the inputs before the base model, reads its hidden states
another way) runs its whole forward instead, paged attention plugged in and transformers' own
float output layer (:attr:`OutputLayer.whole_forward`); one whose forward cannot run either is
refused at start (:class:`~stoic.errors.ModelUnavailable`, one line). docs/models.md says why.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch

from ._source import one_line

__all__ = ["OutputLayer", "head_name"]


def head_name(model: Any) -> str | None:
    """The attribute name of ``model``'s output layer (``lm_head``, ``embed_out``, ...), or None
    when it has none among its direct children."""
    head = model.get_output_embeddings()
    if head is None:
        return None
    for name, child in model.named_children():
        if child is head:
            return str(name)
    return None


class _Base:
    """The stand-in's base model: returns the hidden states it is given, after checking that
    the forward handed it the ids it was called with."""

    def __init__(self) -> None:
        self.hidden: torch.Tensor | None = None
        self.input_ids: torch.Tensor | None = None
        self.calls = 0
        self.faithful = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        given = kwargs.get("input_ids", args[0] if args else None)
        if given is not self.input_ids or kwargs.get("inputs_embeds") is not None:
            self.faithful = False
        return _outputs_class()(last_hidden_state=self.hidden)


_OUTPUTS: list[type] = []


def _outputs_class() -> type:
    """A base model's output holding only ``last_hidden_state``: every other field a forward
    may read (``past_key_values``, ``cross_attentions``, ``router_logits``, ...) is None."""
    if not _OUTPUTS:
        from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions

        class HiddenOnly(BaseModelOutputWithPastAndCrossAttentions):
            def __getattr__(self, name: str) -> Any:
                if name.startswith("__"):
                    raise AttributeError(name)
                return None

        _OUTPUTS.append(HiddenOnly)
    return _OUTPUTS[0]


class _Head:
    """The stand-in's output layer: stoic's (read from the runner's ``_head`` at each call), on
    the ``[rows, hidden]`` it multiplies."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner
        self.inputs: list[torch.Tensor] = []
        self.record = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.record:
            self.inputs.append(x)
        flat = x.reshape(-1, x.shape[-1])
        out: torch.Tensor = self.owner._head(flat)
        return out.view(*x.shape[:-1], out.shape[-1])


def _stand_in(model: Any, base_name: str, base: _Base, head_attr: str, head: _Head) -> Any:
    """A shallow copy of ``model`` (an instance of its class: ``super()`` in its forward works)
    sharing every attribute and parameter, except that its base model and output layer are
    ``base`` and ``head``: what the class's ``forward`` is called on."""
    shell = copy.copy(model)
    modules = dict(model._modules)
    modules[base_name], modules[head_attr] = base, head
    shell.__dict__["_modules"] = modules
    return shell


class OutputLayer:
    """Logits of chosen rows of a step, computed by the model's own ``forward``.

    ``owner`` holds the output layer stoic multiplies by as ``owner._head`` (a callable on
    ``[rows, hidden]``); it is read at every call, so a test may wrap it.
    """

    def __init__(self, model: Any, owner: Any) -> None:
        self._model = model
        self._forward = type(model).forward
        #: whether the forward takes ``logits_to_keep`` (else stoic keeps the rows itself)
        self._keeps = "logits_to_keep" in inspect.signature(self._forward).parameters
        base_name = getattr(model, "base_model_prefix", "") or ""
        head_attr = head_name(model)
        self._base = _Base()
        self._head = _Head(owner)
        self._stand_in: Any = None
        if base_name and base_name in model._modules and head_attr is not None:
            self._stand_in = _stand_in(model, base_name, self._base, head_attr, self._head)
        #: True: the model's whole forward runs each step (its own decoder and float output
        #: layer), because its forward cannot be called on stoic's hidden states
        self.whole_forward = self._stand_in is None
        #: True: the probe found the forward's logits bitwise its output layer's product (no
        #: post-processing), so a step calls the output layer directly, sparing the forward's
        #: plumbing (~0.2 ms a step measured on a 2-core CPU)
        self.identity = False
        #: why :attr:`whole_forward` (None: it is not)
        self.reason: str | None = None if self._stand_in is not None else "no base model/head"

    def probe(self, hidden_size: int, vocab: int, dtype: torch.dtype, device: torch.device) -> None:
        """Decide :attr:`whole_forward`: call the forward on the stand-in with random hidden
        states of 3 tokens (``dtype`` on ``device``: the model's), keeping rows 0 and 2, and require that the base model got the ids
        untouched, the output layer the kept rows once, and the logits their shape; and whether
        those logits are the output layer's product unchanged (:attr:`identity`)."""
        if self._stand_in is None:
            return
        hidden = torch.randn(1, 3, hidden_size, dtype=dtype, device=device)
        rows = torch.tensor([0, 2], device=device)
        ids = torch.zeros(1, 3, dtype=torch.long, device=device)
        self._head.record, self._head.inputs = True, []
        self._base.calls, self._base.faithful = 0, True
        try:
            logits = self(ids, hidden, rows)
            seen = self._head.inputs
            if self._base.calls != 1 or not self._base.faithful:
                self.reason = "its forward does not hand its inputs to its base model as given"
            elif len(seen) != 1 or not torch.equal(seen[0].reshape(2, -1), hidden[0, rows]):
                self.reason = "its forward does not apply its output layer to the kept rows once"
            elif tuple(logits.shape) != (2, vocab):
                self.reason = f"its forward returned logits of shape {tuple(logits.shape)}"
            else:
                # bitwise the output layer's own product, at two scales (logits of a few units
                # and of hundreds, past any soft cap): nothing happens after it
                self.identity = all(
                    torch.equal(self(ids, h, rows), self._head(h[:, rows]).reshape(2, -1))
                    for h in (hidden, hidden * 100)
                )
        except Exception as exc:
            self.reason = f"its forward failed on stoic's hidden states ({one_line(exc)})"
        finally:
            self._head.record, self._head.inputs = False, []
        self.whole_forward = self.reason is not None

    def __call__(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        """Logits ``[len(rows), vocab]`` of rows ``rows`` of ``hidden`` (``[1, N, width]``, the
        decoder's output for ``input_ids`` ``[1, N]``)."""
        if self.identity:
            head: torch.Tensor = self._head.owner._head(hidden[0].index_select(0, rows))
            return head
        keep: dict[str, Any] = {"logits_to_keep": rows}
        if not self._keeps:
            hidden, keep = hidden.index_select(1, rows), {}
        self._base.hidden, self._base.input_ids = hidden, input_ids
        try:
            out = self._forward(self._stand_in, input_ids=input_ids, return_dict=True, **keep)
        finally:
            self._base.hidden = self._base.input_ids = None
        return _rows(out.logits, rows)

    def whole(
        self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, **step: Any
    ) -> torch.Tensor:
        """Logits ``[len(rows), vocab]`` of the model's whole forward over the paged attention
        (``step``: the keyword arguments its attention needs)."""
        keep: dict[str, Any] = {"logits_to_keep": rows} if self._keeps else {}
        out = self._model(
            input_ids=input_ids,
            position_ids=positions,
            use_cache=False,
            return_dict=True,
            **keep,
            **step,
        )
        logits = out.logits if self._keeps else out.logits.index_select(-2, rows)
        return _rows(logits, rows)


def _rows(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``[rows, vocab]`` from a forward's ``[1, rows, vocab]`` (or ``[rows, vocab]``)."""
    if logits.dim() == 3:
        logits = logits[0]
    if logits.shape[0] != rows.numel():
        raise RuntimeError(
            f"the model's forward returned {logits.shape[0]} rows of logits for {rows.numel()}"
        )
    return logits
