"""The executor's worker process: the model, its weights and the KV pools, one step at a time.

This module is the child's side of the process boundary: ``python -m stoic._procmain
FD PARENT_PID`` runs :func:`worker_main` (see :mod:`stoic.executor._process`), ``FD`` its end of a socket pair. The protocol,
each message one ``send_bytes`` of a pickled tuple of plain values and frozen dataclasses (token
ids, positions, block tables and sampling parameters in; sampled ids and logprobs out; never a
tensor):

* parent -> child first the descriptor of the worker's step progress page (``SCM_RIGHTS``,
  :func:`multiprocessing.reduction.send_handle`), then ``("spec", WorkerSpec, kv, layouts)``:
  what to load (a worker may be started, and import what it needs, before it is told),
  followed by the KV pools' shared memory's descriptor where ``kv``, and the int8 layouts'
  where ``layouts``;
* child -> parent ``("log", logger, event)`` while it starts: its own info events
  (:class:`_StartEvents`), which the server logs with the worker's pid;
* child -> parent ``("ready", pid, quantized, sizing, layouts)`` once the model is loaded, the
  KV cache sized (:func:`stoic.worker.size_kv_cache`: a profiling forward, then what the memory left
  holds; ``sizing`` a :class:`~stoic.worker.CacheSizing`) and the KV pools exist
  (``quantized``: what runs on quantised blocks, :attr:`ModelRunner.quantized`; ``layouts``:
  the record of the int8 layouts it packed into the server's shared memory,
  :class:`~stoic.kernels.SharedLayouts`: empty where it mapped them, None without it); or
  ``("unfit", message)`` when not even a minimal cache fits, and it exits;
* parent -> child ``("step", step_id, batch, fault)``; child -> parent ``("result", step_id,
  output)`` or ``("error", step_id, kind, type_name, message)``;
* parent -> child ``("reset",)``: drop the KV pools' contents (recreate private pools, or
  punch the shared memory out); child -> parent ``("reset",)``;
* parent -> child ``("role", role, incarnation)``: what the worker is now (``"spare"``, or
  ``"serving"`` executor ``incarnation``), for its process title (:mod:`stoic._proctitle`);
  no answer;
* parent -> child ``("stop",)``, or the pipe's end: the child exits.

The worker's step progress (:class:`stoic.model.StepProgress`) is a page of memory shared with
the server: the server's watchdog reads it without a message. With ``--kv-outlives-worker`` the
KV pools are shared memory too (:class:`stoic.model.KVMemory`): the
worker maps them once it has sized them (the first worker sizes the file), so they outlive it;
it warms up on a private block, never on pools another worker may be serving from.

The child never outlives the server: it asks the kernel for SIGKILL when its parent dies
(``PR_SET_PDEATHSIG``), and a read that finds the pipe closed ends it.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import pickle
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._logging import get_logger
from .._proctitle import set_title
from ..actors import enact_fault
from ..config import FaultSpec, LoadFormat, Quantization, WeightLayouts
from ..errors import InsufficientMemory
from ..kernels import LayoutEntry, SharedLayouts, use_layouts

if TYPE_CHECKING:
    from ..model import StepProgress
    from ..request import GrammarVocab
    from ..worker import CacheBudget, ModelRunner, ThreadGovernor

__all__ = ["WorkerSpec", "worker_main"]

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process needs to load the model and size its KV pools."""

    model: str
    device: str
    dtype: str
    cache_dir: Path | None
    #: what the KV cache is sized within (a fixed ``num_blocks`` once the first worker sized it)
    budget: CacheBudget
    #: the token ids that end generation (the server's, from the tokenizer too)
    eos_token_ids: frozenset[int] = frozenset()
    #: compute threads (the server's CPU budget, ``compute_threads``; None: torch's default)
    threads: int | None = None
    #: fewer threads while other processes take CPUs (:class:`~stoic.worker.ThreadGovernor`)
    adapt_threads: bool = True
    #: the tokenizer, for structured outputs' grammar masks (None: none)
    grammar: GrammarVocab | None = None
    #: the GGUF file ``model`` was converted from (its quantised blocks), and ``--quantization``
    gguf: Path | None = None
    quantization: Quantization = "none"
    #: ``--weight-layouts``
    weight_layouts: WeightLayouts = "auto"
    #: ``--load-format`` (``dummy``: random weights, made in the worker on its device)
    load_format: LoadFormat = "auto"
    #: ``--deterministic`` (:mod:`stoic.model._deterministic`)
    deterministic: bool = False
    #: the dense products' dtype the server resolved (``LoadedModel.dense_dtype``; None: ``dtype``)
    dense_dtype: str | None = None
    #: the KV cache's dtype: the server's resolved one (``LoadedModel.kv_dtype``), or on a GPU
    #: ``--kv-cache-dtype`` itself (``auto`` is the worker's to resolve there, as ``dtype``)
    kv_cache_dtype: str | None = None
    #: seconds a worker's start waits out an out-of-memory error (:mod:`._startoom`): set for
    #: every worker after the first (a replacement, a spare), 0 for the first
    start_oom_wait: float = 0.0
    #: where the first worker packed its int8 layouts in the server's shared memory
    #: (:class:`~stoic.kernels.SharedLayouts`): a later worker given that memory maps them by
    #: this record instead of packing them (None: the first worker, which records)
    layout_table: tuple[LayoutEntry, ...] | None = None


def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def _quiet_logs() -> None:
    """The worker's warnings and errors go to stderr, one line each, which the server relays as
    ``executor.worker_output`` events (the worker is a process of stoic's own: it may configure
    the root logger)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    handler.setLevel(logging.WARNING)  # stoic's info events while starting go to the server
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(logging.WARNING)


class _StartEvents(logging.Handler):
    """stoic's info events while the worker starts (the weights read, the layouts packed, the
    cache sized: each with its MiB and seconds), sent to the server as ``("log", logger,
    event)``, which logs each as its own with the worker's pid: the start an operator watches
    (:meth:`~stoic.executor._process.WorkerProcess.wait_ready`). Warnings keep going to stderr,
    relayed line by line; after the start the worker's info events are dropped again."""

    def __init__(self, conn: Connection) -> None:
        super().__init__(logging.INFO)
        self.addFilter(lambda record: record.levelno < logging.WARNING)
        self._conn = conn

    def emit(self, record: logging.LogRecord) -> None:
        fields = dict(record.msg) if isinstance(record.msg, dict) else None
        if fields is None or "event" not in fields:
            fields = {"event": record.getMessage()}
        with contextlib.suppress(Exception):  # a field that does not pickle: not worth a crash
            _send(self._conn, ("log", record.name, fields))

    @classmethod
    @contextlib.contextmanager
    def relayed(cls, conn: Connection) -> Iterator[None]:
        """While the block runs, stoic's info events go to the server."""
        logger = logging.getLogger("stoic")
        handler, level = cls(conn), logger.level
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        try:
            yield
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)


def _warm_up(runner: Any, block_size: int) -> None:
    """One forward pass of one token before reporting ready, so that the first real step after
    a replacement does not pay for lazy initialisation (kernels, allocator growth). On a
    private one-block cache: the serving pools may be another worker's (shared memory) or hold
    a cache kept across a restart."""
    from ..model import PagedKVCache
    from ..request import SamplingParams, SeqChunk, StepBatch

    scratch = PagedKVCache(runner.kv_spec(1, block_size))
    chunk = SeqChunk(0, (0,), 0, (0,), True, SamplingParams(max_tokens=1, temperature=0.0))
    runner.execute(StepBatch((chunk,), zero_blocks=(0,)), scratch)
    scratch.release()


def _load(spec: WorkerSpec, governor: ThreadGovernor, progress: StepProgress | None) -> ModelRunner:
    """The model of ``spec`` loaded, on its runner."""
    from ..model import load_model
    from ..sampling import LLGuidanceBackend
    from ..worker import ModelRunner

    loaded = load_model(
        spec.model,
        device=spec.device,
        dtype=spec.dtype,
        cache_root=spec.cache_dir,
        dense_dtype=spec.dense_dtype,
        kv_cache_dtype=spec.kv_cache_dtype,
        deterministic=spec.deterministic,
        quantization=spec.quantization,  # which matrices stay on the file's blocks
        load_format=spec.load_format,
        tokenizer=False,  # the server detokenises; the stop ids come with the spec
    )
    loaded = dataclasses.replace(loaded, eos_token_ids=spec.eos_token_ids, gguf=spec.gguf)
    return ModelRunner(
        loaded,
        LLGuidanceBackend(spec.grammar) if spec.grammar else None,
        quantization=spec.quantization,
        deterministic=spec.deterministic,
        weight_layouts=spec.weight_layouts,
        progress=progress,
        threads=governor,
    )


def _send(conn: Connection, message: tuple[Any, ...]) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def worker_main(conn: Connection, parent: int) -> None:
    """The worker process's entry point: load, report ready, serve steps until told to stop."""
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server's Ctrl-C is the server's to handle
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # its output is relayed line by line
    _quiet_logs()
    # the imports first: a pre-started worker has paid for them before it is needed. That
    # includes what transformers imports lazily on a model's first load (its model-building
    # machinery pulls in torch's dynamo and distributed tensors): some 2 s of a cold
    # replacement's 3 s on the default model, paid here while nothing waits
    import torch
    import transformers.modeling_utils
    import transformers.models.auto.modeling_auto  # noqa: F401

    from ..model import KVCacheSpec, PagedKVCache, StepProgress, drop_contents
    from ..worker import CacheSizing, ThreadGovernor, size_kv_cache
    from ._failures import classify_failure
    from ._startoom import ride_out_oom

    try:
        # the server's watchdog page first (sent when the server adopts this interpreter)
        page = recv_handle(conn)
        if not conn.poll(0):  # imports done, nothing to load yet
            set_title("pre-started")
        first = pickle.loads(conn.recv_bytes())
        if first[0] == "stop":  # stopped before it was given a model (a server shutting down)
            return
        assert first[0] == "spec", first
        spec: WorkerSpec = first[1]
        kv_fd = recv_handle(conn) if first[2] else None  # the server's KV memory
        layouts_fd = recv_handle(conn) if first[3] else None  # the server's layout memory
    except (EOFError, OSError, RuntimeError):  # the server went first (RuntimeError: no fd)
        return
    set_title("loading")
    progress = StepProgress.attach(page)
    os.close(page)

    governor = ThreadGovernor(
        spec.threads or torch.get_num_threads(),
        adapt=spec.adapt_threads,
        family=(parent,),  # the server's CPU time is the engine's, not a neighbour's
    )
    governor.before_step()  # the load's own operators run on the budget too

    arena: SharedLayouts | None = None

    def start() -> tuple[ModelRunner, CacheSizing, KVCacheSpec, PagedKVCache]:
        """Load (the layouts in the server's shared memory where it gave some), size the cache
        and map its pools, warm up."""
        nonlocal arena
        arena = SharedLayouts(layouts_fd, spec.layout_table) if layouts_fd is not None else None
        with use_layouts(arena):
            runner = _load(spec, governor, progress)
        if arena is not None:  # relayed to the server (_StartEvents)
            get_logger("stoic.model").info(
                "model.layouts_shared", first=spec.layout_table is None, **arena.stats()
            )
        sizing = size_kv_cache(runner, spec.budget)
        kv_spec = runner.kv_spec(sizing.num_blocks, spec.budget.block_size)
        kv = PagedKVCache(kv_spec, memory_fd=kv_fd)
        _warm_up(runner, spec.budget.block_size)
        return runner, sizing, kv_spec, kv

    def release() -> None:  # the allocator's cached blocks of a failed start
        if spec.device != "cpu" and torch.cuda.is_available():
            torch.cuda.empty_cache()

    try:
        with _StartEvents.relayed(conn):
            runner, sizing, kv_spec, kv = ride_out_oom(
                start,
                within=spec.start_oom_wait,
                release=release,
                report=logging.getLogger("stoic.worker").warning,
            )
    except InsufficientMemory as exc:  # a start-up error of the server's, never retried
        _send(conn, ("unfit", exc.message))
        return
    table = arena.table if arena is not None else None  # empty where it mapped them
    _send(conn, ("ready", os.getpid(), runner.quantized, sizing, table))
    serving = False  # a warm spare commits no pages until it serves: it may never
    while True:
        if serving and kv.committing and not conn.poll(0):
            kv.commit_idle()  # no step waiting: commit more of the cache's pages
            continue
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the server is gone
        match message:
            case ("step", step_id, batch, fault):
                try:
                    if isinstance(fault, FaultSpec):
                        enact_fault(fault, runner.progress)
                    output = runner.execute(batch, kv)
                except Exception as exc:
                    kind = classify_failure(exc)
                    _send(conn, ("error", step_id, kind, type(exc).__name__, str(exc)))
                    if kind == "oom" and kv_spec.device.type == "cuda":
                        torch.cuda.empty_cache()
                    continue
                _send(conn, ("result", step_id, output))
            case ("reset",):
                kv.release()
                if kv_fd is not None:
                    drop_contents(kv_fd)
                if kv_spec.device.type == "cuda":
                    torch.cuda.empty_cache()
                kv = PagedKVCache(kv_spec, memory_fd=kv_fd)
                _send(conn, ("reset",))
            case ("role", str(role), incarnation):
                set_title(role, incarnation)
                serving = role == "serving"
            case ("stop",):
                return
            case _:
                raise RuntimeError(f"unknown message to the worker: {message!r}")
