"""Checking a model source before loading it, and turning load failures into one-line errors.

Every check here is cheap (a directory listing, a GGUF header: milliseconds) and raises
:class:`~stoic.errors.ModelUnavailable` with one line that says what is wrong and what to do, so a
bad ``--model`` is reported before anything slow starts. What the checks cannot see (a corrupt
tokenizer file, an architecture transformers does not know) fails later, in transformers; the
loader wraps those exceptions with :func:`model_error`, keeping transformers' reason.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..errors import ModelUnavailable
from ..gguf import GgufError, GgufHeader, read_gguf_header

__all__ = [
    "LOAD_ERRORS",
    "check_causal_lm",
    "check_gguf_file",
    "check_model_dir",
    "check_model_source",
    "load_errors",
    "model_error",
    "one_line",
]

#: what to do when ``--model`` names nothing usable
HINT = "pass 'default', a .gguf file or a local model directory (config.json, weights, tokenizer)"
#: files a transformers tokenizer loads from (one suffices); ``*.tiktoken`` counts too.
#: ``tokenizer_config.json`` alone is enough for byte-level tokenizers: accepted here, and if
#: it does not suffice, the loader reports transformers' reason.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "sentencepiece.model",
    "spm.model",
)
#: what transformers (and safetensors) raise for a model it cannot read: a bad model, not a bug.
#: Deliberately not RuntimeError: that is how torch reports running out of memory.
LOAD_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    ValueError,
    KeyError,
    TypeError,
    ImportError,
)
try:
    from safetensors import SafetensorError

    LOAD_ERRORS = (*LOAD_ERRORS, SafetensorError)
except ImportError:  # pragma: no cover
    pass

_MAX_REASON = 300


def one_line(exc: BaseException) -> str:
    """``exc``'s message on one line (whitespace collapsed, no final period), at most 300
    characters."""
    text = " ".join(str(exc).split()).rstrip(".")
    if not text or isinstance(exc, KeyError):
        text = f"{type(exc).__name__}: {text}".rstrip(": ")
    return text if len(text) <= _MAX_REASON else text[: _MAX_REASON - 3] + "..."


def model_error(what: str, exc: BaseException, todo: str) -> ModelUnavailable:
    """``ModelUnavailable("{what}: {reason}; {todo}")``, the reason being ``exc`` on one line."""
    return ModelUnavailable(f"{what}: {one_line(exc)}; {todo}")


@contextmanager
def load_errors(what: str, todo: str) -> Iterator[None]:
    """Raise what the block raises of :data:`LOAD_ERRORS` as :func:`model_error` (chained)."""
    try:
        yield
    except LOAD_ERRORS as exc:
        raise model_error(what, exc, todo) from exc


def check_gguf_file(path: Path, *, tokenizer: bool = True) -> GgufHeader:
    """Read ``path``'s GGUF header; with ``tokenizer``, require an embedded vocabulary.

    :raises ModelUnavailable: not a GGUF file, unreadable, truncated, or no vocabulary.
    """
    try:
        header = read_gguf_header(path)
    except (GgufError, OSError) as exc:
        raise model_error(
            f"{path} is not a usable GGUF file",
            exc,
            "check the file (an interrupted download?) or pass another --model",
        ) from exc
    if tokenizer and not header.has_tokenizer:
        raise ModelUnavailable(
            f"{path} has no tokenizer (no tokenizer.ggml.tokens in its metadata); "
            "use a GGUF file with an embedded vocabulary, or a model directory"
        )
    return header


def check_model_dir(path: Path, *, weights: bool = True, tokenizer: bool = True) -> None:
    """Require ``config.json`` (valid JSON), and with the flags weights and tokenizer files.

    :raises ModelUnavailable: saying which of them is missing.
    """
    config = path / "config.json"
    if not config.is_file():
        raise ModelUnavailable(f"{path} is not a model directory: it has no config.json; {HINT}")
    try:
        json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise model_error(
            f"{config} is not readable JSON", exc, "restore the model's config.json"
        ) from exc
    names = {child.name for child in path.iterdir()}
    if weights and not any(
        name.endswith(".safetensors") or (name.startswith("pytorch_model") and ".bin" in name)
        for name in names
    ):
        raise ModelUnavailable(
            f"{path} has no weights (no *.safetensors or pytorch_model*.bin file); "
            "copy the model's weight files into it (or run its shape with random weights: "
            "--load-format dummy)"
        )
    if tokenizer and not (
        names.intersection(TOKENIZER_FILES) or any(n.endswith(".tiktoken") for n in names)
    ):
        raise ModelUnavailable(
            f"{path} has no tokenizer (none of tokenizer.json, tokenizer.model, vocab.json, "
            "vocab.txt, ...); copy the model's tokenizer files into it"
        )


def check_model_source(model: str, *, weights: bool = True, tokenizer: bool = True) -> None:
    """Check cheaply that ``model`` (``"default"``, a ``.gguf`` file or a model directory) can be
    loaded: what ``stoic serve`` runs before it logs anything else. ``weights=False``: a
    directory needs no weight files (``--load-format dummy``).

    :raises ModelUnavailable: with one line saying what is wrong and what to do.
    """
    from ._loader import default_gguf_path

    if model == "default":
        check_gguf_file(default_gguf_path(), tokenizer=tokenizer)
        return
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelUnavailable(f"{path} is a file but not a .gguf file; {HINT}")
        check_gguf_file(path, tokenizer=tokenizer)
    elif path.is_dir():
        check_model_dir(path, weights=weights, tokenizer=tokenizer)
    else:
        raise ModelUnavailable(f"model {model!r} not found: no such file or directory; {HINT}")


#: what stoic serves, said in a refusal
_CAUSAL_ONLY = "stoic serves causal language models (decoder-only: a ...ForCausalLM architecture)"


def check_causal_lm(config: Any, path: Path) -> str:
    """The architecture of the model whose (transformers) ``config`` was read from ``path``;
    the model must be a causal language model transformers can load as one.

    :raises ModelUnavailable: naming its architecture and what kind of model it is instead (an
        encoder-decoder, an encoder, a base model without a generation head, another head).
    """
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    model_type = str(getattr(config, "model_type", "") or "")
    listed = [str(a) for a in getattr(config, "architectures", None) or ()]
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    arch = listed[0] if listed else f"{model_type or 'unknown'} model"
    if listed and any(a in causal for a in listed):
        return next(a for a in listed if a in causal)
    if getattr(config, "is_encoder_decoder", False):
        kind = "an encoder-decoder model"
    elif listed and arch.endswith("Model"):
        encoder = model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(
            config, "is_decoder", False
        )
        kind = "an encoder: a base model" if encoder else "a base model"
        kind += " without a generation head"
    elif listed:
        kind = "its head is not a causal language-model head"
    elif model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        kind = "transformers has no causal-LM form of it"
    else:  # no architectures listed, a causal form exists: the weights decide (the loader)
        return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    raise ModelUnavailable(f"{path} holds a {arch} ({kind}), not a causal LM: {_CAUSAL_ONLY}")


def check_head_loaded(model: Any, missing: Any, path: Path) -> None:
    """Refuse a model whose output layer had no weights in ``path`` (``missing``: the keys
    transformers initialised at random): a base model's weights loaded under a causal-LM
    class would generate from a random head.

    :raises ModelUnavailable: naming the architecture and the layer.
    """
    from ._logits import head_name

    head = head_name(model)
    if head is not None and any(str(k).startswith(f"{head}.") for k in missing or ()):
        raise ModelUnavailable(
            f"{path} holds no weights for the output layer ({head}) of its "
            f"{type(model).__name__} (a base model without a generation head?): {_CAUSAL_ONLY}"
        )
