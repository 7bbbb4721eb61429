"""A loaded model's token codec: its tokenizer, vocabulary and end-of-sequence ids as the
request side's :class:`~stoic.request.TokenCodec` (which holds no torch)."""

from __future__ import annotations

from ..config import EngineConfig
from ..request import TokenCodec
from ._loader import LoadedModel, load_model

__all__ = ["load_token_codec", "token_codec", "vocab_size"]


def vocab_size(loaded: LoadedModel) -> int:
    """The token ids a request may name: the model's vocabulary (its logits' width), or the
    tokenizer's length when the configuration does not say."""
    return int(getattr(loaded.config, "vocab_size", 0) or len(loaded.tokenizer))


def token_codec(loaded: LoadedModel) -> TokenCodec:
    """The codec of a loaded model."""
    return TokenCodec(loaded.tokenizer, vocab_size(loaded), loaded.eos_token_ids)


def load_token_codec(config: EngineConfig) -> TokenCodec:
    """The tokenizer of ``config.model`` (no weights; blocking: call it off the event loop).

    :raises ~stoic.errors.ModelUnavailable: the model or its tokenizer cannot be found.
    """
    loaded = load_model(
        config.model,
        device="cpu",
        dtype="float32",  # no dtype probe: no weights are loaded
        cache_root=config.cache_dir,
        served_name=config.served_model_name,
        weights=False,
    )
    return token_codec(loaded)
