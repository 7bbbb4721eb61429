"""The :class:`Engine`: start and stop, the request API, health, stats, fault administration."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import anyio

from .._logging import get_logger
from ..actors import (
    ASK_TIMEOUT,
    Abort,
    Delta,
    Drain,
    EngineHealth,
    FaultInjector,
    Health,
    ResultStream,
    Submit,
)
from ..config import EngineConfig, FaultSpec
from ..errors import EngineFailed, EngineStopped, InvalidRequest, Overloaded, StoicError
from ..executor import ExecutorFault, make_backend
from ..gguf import default_cache_dir, require_quantized
from ..model import LoadedModel, load_model, require_deterministic, token_codec
from ..request import Request, SamplingParams
from ..runtime import ActorStopped, ActorSystem, AskTimeout, MailboxFull, SupervisorEscalation
from ..worker import CacheSizing
from ._incidents import Activity, IncidentLog, RecordingHealth
from ._stats import EngineStats, collect_stats
from ._stream import CompletionResult, RequestStream
from ._wiring import EngineParts, wire

__all__ = ["Engine"]

_log = get_logger("stoic.engine")

#: how a failure to reach the intake reaches the caller of :meth:`Engine.submit`
_SUBMIT_ERRORS: tuple[tuple[type[Exception], Callable[[], StoicError]], ...] = (
    (MailboxFull, lambda: Overloaded("the engine's intake is saturated; retry later")),
    (AskTimeout, lambda: Overloaded("the engine's intake is saturated; retry later")),
    (ActorStopped, lambda: EngineStopped("engine is not running")),
)


class Engine:
    """The stoic engine: an actor system serving one model. Create it with :meth:`start`."""

    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel,
        parts: EngineParts,
        health: EngineHealth,
        faults: FaultInjector,
        incidents: IncidentLog | None = None,
    ) -> None:
        self.config = config
        self._incidents = incidents or IncidentLog()
        self.loaded = loaded
        self._parts = parts
        self._health = health
        self._faults = faults
        self._codec = token_codec(loaded)

    # -- lifecycle ------------------------------------------------------------------------------
    @classmethod
    @contextlib.asynccontextmanager
    async def start(cls, config: EngineConfig | None = None) -> AsyncIterator[Engine]:
        """Load the model, start the actors, yield the engine; drain and stop on exit.

        Leaving the block stops admitting, lets running requests finish for up to
        ``drain_timeout`` seconds (then ends them with :class:`~stoic.errors.EngineStopped`) and
        stops every actor. The stop is shielded from anyio cancellation; an asyncio
        cancellation that arrives during the drain ends the drain at once (the streams still
        running end with :class:`~stoic.errors.EngineStopped`), but still leaves no actor running.

        :raises ModelUnavailable: if the model cannot be found or loaded locally, or
            ``quantization="gguf"`` or ``deterministic`` cannot be honoured.
        :raises EngineFailed: if the first executor worker process dies or does not get ready
            (``executor="process"``).
        :raises InsufficientMemory: the device's memory holds no KV cache after the weights
            and a step's activations, or warm spares on a GPU have no memory given for them.
        """
        cfg = config or EngineConfig()
        async with contextlib.AsyncExitStack() as stack:
            # where the steps run (stoic.executor). The thread executor loads, builds and runs its
            # model on one thread (every incarnation's): torch's OpenMP pool is per calling thread,
            # and a second pool in the process (the loading thread's) makes libgomp stop spinning
            # between parallel regions when the pools' threads outnumber the cores, each region
            # waiting on a futex: a burst's prefill step 1.8x slower (docs/benchmarks.md, "One
            # OpenMP pool"). With the process executor the weights live in the worker process
            # only; this one loads tokenizer and config. Closed after the actors: no orphans.
            backend = stack.enter_context(make_backend(cfg))
            loaded = await backend.load(
                functools.partial(
                    load_model,
                    cfg.model,
                    device=cfg.device,
                    dtype=cfg.dtype,
                    cache_root=cfg.cache_dir,
                    served_name=cfg.served_model_name,
                    quantization=cfg.quantization,
                    kv_cache_dtype=cfg.kv_cache_dtype,
                    deterministic=cfg.deterministic,
                    load_format=cfg.load_format,
                )
            )
            if cfg.quantization == "gguf":  # refused here, not in a worker process starting
                await anyio.to_thread.run_sync(
                    require_quantized,
                    loaded.gguf,
                    loaded.device,
                    cfg.cache_dir or default_cache_dir(),
                )
            if cfg.deterministic:  # the same: a model that cannot is refused before a worker
                await anyio.to_thread.run_sync(
                    require_deterministic,
                    loaded.gguf,
                    loaded.dtype,
                    loaded.cache_dtype,
                    loaded.device,
                    cfg.quantization,
                    cfg.cache_dir or default_cache_dir(),
                )
            incidents = IncidentLog()
            health = RecordingHealth(incidents)
            faults = FaultInjector(cfg.faults)
            system = await stack.enter_async_context(_actor_system())
            try:
                parts = await wire(system, cfg, loaded, health, faults, backend, incidents)
            except ExecutorFault as exc:  # the first worker process died or hung while loading
                raise EngineFailed(f"the model executor could not start: {exc}") from exc
            engine = cls(cfg, loaded, parts, health, faults, incidents)
            stack.push_async_callback(engine._drain)
            engine._log_started()
            yield engine
        _log.info("engine.stopped")

    async def _drain(self) -> None:
        """Stop admitting and let running requests finish (up to ``drain_timeout``)."""
        with anyio.CancelScope(shield=True):
            self._health.stopping()
            scheduler = self._parts.scheduler
            if scheduler.is_alive:
                with contextlib.suppress(Exception):
                    await scheduler.ask(
                        lambda r: Drain(self.config.drain_timeout, r),
                        timeout=self.config.drain_timeout + 5.0,
                    )

    def _log_started(self) -> None:
        loaded, spec = self.loaded, self._parts.kv_spec
        _log.info(
            "engine.started",
            model=loaded.name,
            device=str(loaded.device),
            dtype=str(loaded.dtype).removeprefix("torch."),
            dense_dtype=str(loaded.dense_dtype or loaded.dtype).removeprefix("torch."),
            kv_blocks=spec.num_blocks,
            block_size=spec.block_size,
            kv_tokens=spec.capacity_tokens,
            kv_mib=round(spec.bytes_per_block * spec.num_blocks / 2**20, 1),
            max_model_len=self.max_model_len,
        )

    # -- requests -------------------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.loaded.name

    @property
    def kv_sizing(self) -> CacheSizing:
        """How the process that runs the model sized the KV cache (blocks; the device's memory,
        the weights and a step's activations peak when it measured them)."""
        return self._parts.kv_sizing

    @property
    def max_model_len(self) -> int:
        return self._parts.max_model_len

    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer

    @property
    def chat_template(self) -> str | dict[str, str] | None:
        """The tokenizer's chat template (named templates as a dict), or None."""
        return self._codec.chat_template

    def tokenize(
        self, request: Request | str | Sequence[int] | None = None, **fields: Any
    ) -> list[int]:
        """The token ids :meth:`submit` would feed the model for ``request`` (a :class:`Request`,
        or a prompt and the request's other fields by name, as :meth:`submit` takes them):
        ``engine.tokenize("Hello")``, ``engine.tokenize(messages=messages)``.

        :raises InvalidRequest: neither prompt nor messages or both, the messages malformed, no
            chat template or the template raising, a token id outside the vocabulary.
        :raises TypeError: a field that a :class:`Request` does not have.
        """
        return self._codec.tokenize(Request.of(request, **fields))

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids`` (special tokens included).

        :raises InvalidRequest: an id that is not a token of the vocabulary.
        """
        return self._codec.detokenize(token_ids)

    async def submit(
        self,
        request: Request | str | Sequence[int] | None = None,
        params: SamplingParams | None = None,
        **fields: Any,
    ) -> RequestStream:
        """Validate and admit ``request``; return its stream.

        ``request`` is a :class:`Request`, or its prompt (text or token ids) with ``params`` and
        the request's other fields by name (``messages=``, ``request_id=``,
        ``chat_template_kwargs=``...): ``engine.submit("Hello", params)``,
        ``engine.submit(messages=messages, params=params)``. Everything wrong with the request is
        raised here, before any output exists.

        :raises InvalidRequest: bad parameters, messages, template error, bad token ids.
        :raises ContextLengthExceeded: prompt plus ``max_tokens`` beyond the context.
        :raises Overloaded: admission limits reached.
        :raises EngineFailed: the engine is failed.
        :raises EngineStopped: the engine is stopping.
        :raises TypeError: a field that a :class:`Request` does not have.
        """
        built = Request.of(request, params, **fields)
        self._health.check_accepting()
        intake = self._parts.intake
        mailbox = intake.statistics()
        if mailbox.current_buffer_used >= mailbox.max_buffer_size:
            raise Overloaded("the engine's intake queue is full; retry later")
        try:
            stream: ResultStream = await intake.ask(lambda r: Submit(built, r), timeout=ASK_TIMEOUT)
        except StoicError:
            raise
        except Exception as exc:
            for kind, make in _SUBMIT_ERRORS:
                if isinstance(exc, kind):
                    raise make() from exc
            raise
        self._incidents.admitted(built.request_id)
        return RequestStream(stream, self.abort)

    async def generate(
        self,
        prompt: Request | str | Sequence[int],
        params: SamplingParams | None = None,
        **fields: Any,
    ) -> AsyncIterator[Delta]:
        """Stream a completion of ``prompt`` (text or token ids; the request's other fields by
        name, as :meth:`submit` takes them). Errors raise before any delta."""
        stream = await self.submit(prompt, params, **fields)
        async with stream:
            async for delta in stream:
                yield delta

    async def chat(
        self,
        messages: Sequence[dict[str, Any]],
        params: SamplingParams | None = None,
        **fields: Any,
    ) -> AsyncIterator[Delta]:
        """Stream a chat completion (the model's own chat template; the request's other fields
        by name, as :meth:`submit` takes them). Errors raise before any delta."""
        stream = await self.submit(None, params, messages=messages, **fields)
        async with stream:
            async for delta in stream:
                yield delta

    async def complete(
        self,
        request: Request | str | Sequence[int] | None = None,
        params: SamplingParams | None = None,
        **fields: Any,
    ) -> CompletionResult:
        """Generate to the end and return the whole result (non-streaming helper; takes what
        :meth:`submit` takes).

        :raises StoicError: what :meth:`submit` raises, and what the stream raises if generation
            fails (each carrying ``partial``).
        """
        stream = await self.submit(request, params, **fields)
        return await stream.collect()

    async def abort(self, request_id: str) -> None:
        """Abort a request (no-op if unknown or finished); its blocks are freed at once."""
        ref = self._parts.scheduler
        if not ref.is_alive:
            return
        try:
            ref.try_tell(Abort(request_id))
        except MailboxFull:
            # wait for room even inside a cancelled scope: a lost abort would let the request
            # run on to max_tokens holding its blocks
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await ref.tell(Abort(request_id))
        except ActorStopped:
            pass

    # -- health, stats, faults ------------------------------------------------------------------
    def health(self) -> Health:
        return self._health.snapshot()

    async def wait_failed(self) -> EngineFailed:
        """Return the engine's failure once it happens (for ``--exit-on-fatal``)."""
        return await self._health.wait_failed()

    def stats(self) -> EngineStats:
        parts = self._parts
        return collect_stats(parts.scheduler_core, self._health, self._faults)

    def activity(self) -> Activity:
        """The sequences running and waiting now (request id, tokens so far and at most, age),
        the last executor failures (kind, when, time to recover, what became of the streams),
        the configured step token budget and warm spares: what the operator's console shows."""
        parts = self._parts
        running, waiting = self._incidents.views(parts.scheduler_core)
        return Activity(
            running,
            waiting,
            self._incidents.incidents,
            self.config.step_token_budget(self.loaded.device.type),
            self.config.executor_spares,
        )

    async def inject_fault(self, spec: FaultSpec) -> None:
        """Arm a fault in the executor's steps.

        :raises InvalidRequest: if fault injection is not enabled in the config, or the fault
            would end the server's own process (``crash``, ``segfault``, ``abort`` with the thread
            executor).
        """
        self._check_fault_injection()
        try:
            self.config.check_fault(spec)
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="kind") from None
        self._faults.add(spec)
        _log.warning(
            "faults.armed",
            kind=spec.kind,
            after_steps=spec.after_steps,
            probability=spec.probability,
        )

    async def clear_faults(self) -> None:
        """Disarm every fault.

        :raises InvalidRequest: if fault injection is not enabled in the config.
        """
        self._check_fault_injection()
        self._faults.clear()
        _log.info("faults.cleared")

    def _check_fault_injection(self) -> None:
        if not self.config.enable_fault_injection:
            raise InvalidRequest(
                "fault injection is disabled (EngineConfig.enable_fault_injection)"
            )


@contextlib.asynccontextmanager
async def _actor_system() -> AsyncIterator[ActorSystem]:
    # the supervisor's escalation was already reported through the engine's health (failed):
    # leaving the engine must not raise it again
    with contextlib.suppress(SupervisorEscalation):
        async with ActorSystem("stoic") as system:
            yield system
