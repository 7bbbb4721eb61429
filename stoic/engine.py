"""The facade an embedding application uses: start and stop the actor system, submit, stream,
abort, stats, health.

    async with stoic.Engine.start(stoic.EngineConfig(model="default")) as engine:
        async for delta in engine.chat(messages, stoic.SamplingParams(max_tokens=64)):
            print(delta.text, end="")
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import structlog

from .actors import (
    ActorRef,
    ActorStopped,
    ActorSystem,
    AskTimeout,
    Backoff,
    ChildSpec,
    MailboxFull,
    Restart,
    Supervisor,
    SupervisorEscalation,
)
from .actors.engine import (
    CacheManager,
    Delta,
    Executor,
    FaultInjector,
    Guardian,
    Intake,
    IntakeConfig,
    ResultStream,
    Scheduler,
    SchedulerConfig,
    StepWorker,
    classify_failure,
)
from .actors.engine._messages import (
    Abort,
    CacheMsg,
    Drain,
    DropAll,
    EngineFailedNotice,
    ExecutorDown,
    IntakeMsg,
    SchedulerMsg,
    Submit,
)
from .config import EngineConfig, FaultSpec
from .errors import (
    EngineFailed,
    EngineStopped,
    InvalidRequest,
    Overloaded,
    StoicError,
)
from .model import LoadedModel, ModelRunner, SamplingParams, load_model

__all__ = ["CompletionResult", "Engine", "EngineStats", "Health", "RequestStream"]

_log = structlog.get_logger("stoic.engine")
_ASK_TIMEOUT = 30.0
_RECOVERY_TIMEOUT = 30.0

State = Literal["starting", "serving", "recovering", "failed", "stopping"]


@dataclass(frozen=True)
class Health:
    """What the engine can do right now."""

    state: State
    reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.state == "serving"


@dataclass(frozen=True)
class EngineStats:
    """A snapshot read on the event loop (no message round trip)."""

    #: sequences being generated
    running: int
    #: sequences admitted but not yet scheduled
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    #: the executor's incarnation (0 at start, +1 per restart)
    incarnation: int
    #: executor restarts so far
    restarts: int
    #: sequences ended by an executor failure or engine failure
    failed_sequences: int
    #: steps completed
    steps: int
    #: most sequences in one step so far
    max_batch_size: int
    preemptions: int
    #: late results from fenced executor incarnations, discarded
    fenced_results: int
    prompt_tokens: int
    generated_tokens: int
    #: faults injected so far
    faults_injected: int
    state: State
    #: prompt tokens whose keys/values came from the prefix cache (not computed)
    prefix_cached_tokens: int = 0
    #: KV blocks held by the prefix cache (in use or evictable)
    kv_blocks_cached: int = 0

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass(frozen=True)
class CompletionResult:
    """A whole (non-streamed) generation."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    logprobs: tuple[Any, ...] | None


class RequestStream:
    """An admitted request's output: an async iterator of :class:`Delta`.

    Iteration raises :class:`~stoic.errors.ExecutorFailed`, :class:`~stoic.errors.EngineFailed`
    or :class:`~stoic.errors.EngineStopped` (each carrying ``partial``) when generation ends
    early. Leaving ``async with`` or calling :meth:`aclose` before the end aborts the request and
    frees its KV blocks at once.
    """

    def __init__(self, engine: Engine, stream: ResultStream) -> None:
        self._engine = engine
        self._stream = stream
        self.request_id = stream.request_id
        self.prompt_tokens = stream.prompt_tokens

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache (0 until the request is scheduled)."""
        return self._stream.cached_tokens

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Delta:
        return await self._stream.__anext__()

    @property
    def done(self) -> bool:
        return self._stream.done

    async def aclose(self) -> None:
        """Abort the request if it has not ended (idempotent)."""
        if not self._stream.done:
            await self._engine.abort(self.request_id)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class Engine:
    """The stoic engine: an actor system serving one model. Create it with :meth:`start`."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._state: State = "starting"
        self._reason: str | None = "loading the model"
        self._failed = asyncio.Event()
        self._failure: EngineFailed | None = None
        self._restarts = 0
        self._faults = FaultInjector(config.faults)
        self._system: ActorSystem | None = None
        self._intake: ActorRef[IntakeMsg] | None = None
        self._scheduler_ref: ActorRef[SchedulerMsg] | None = None
        self._cache_ref: ActorRef[CacheMsg] | None = None
        self._scheduler: Scheduler | None = None
        self._cache: CacheManager | None = None
        self._intake_actor: Intake | None = None
        self._supervisor: Supervisor | None = None
        self._executor_incarnation = 0
        self._worker: StepWorker | None = None
        self.loaded: LoadedModel | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    @classmethod
    @contextlib.asynccontextmanager
    async def start(cls, config: EngineConfig | None = None) -> AsyncIterator[Engine]:
        """Load the model, start the actors, yield the engine; drain and stop on exit.

        :raises ModelNotFound: if the model cannot be found locally.
        """
        engine = cls(config or EngineConfig())
        await engine._start()
        try:
            yield engine
        finally:
            await engine._stop()

    async def _start(self) -> None:
        cfg = self.config
        loaded = await anyio.to_thread.run_sync(
            lambda: load_model(
                cfg.model,
                device=cfg.device,
                dtype=cfg.dtype,
                cache_root=cfg.cache_dir,
                served_name=cfg.served_model_name,
            )
        )
        self.loaded = loaded
        runner = ModelRunner(loaded)
        worker = StepWorker("stoic-executor")
        self._worker = worker
        num_blocks = cfg.num_kv_blocks or _size_kv_cache(cfg, runner)
        spec = runner.kv_spec(num_blocks, cfg.block_size)
        max_len = min(cfg.max_model_len or loaded.max_model_len, loaded.max_model_len)
        system = ActorSystem("stoic")
        await system.__aenter__()
        self._system = system
        self._cache = CacheManager(spec)
        cache_ref: ActorRef[CacheMsg] = await system.spawn(
            self._cache, name="cache", mailbox_size=1024
        )
        self._cache_ref = cache_ref
        holder: list[Supervisor] = []
        self._scheduler = Scheduler(
            SchedulerConfig(
                block_size=cfg.block_size,
                num_blocks=num_blocks,
                max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=cfg.step_token_budget(loaded.device.type),
                step_timeout=cfg.step_timeout,
                eos_token_ids=loaded.eos_token_ids,
                prefix_caching=cfg.enable_prefix_caching,
            ),
            loaded.tokenizer,
            cache_ref,
            lambda: holder[0].child("executor"),
            self._on_fatal,
        )
        scheduler_ref: ActorRef[SchedulerMsg] = await system.spawn(
            self._scheduler, name="scheduler", mailbox_size=4096
        )
        self._scheduler_ref = scheduler_ref
        executor_spec: ChildSpec[Any] = ChildSpec(
            name="executor",
            factory=lambda: Executor(
                runner, cache_ref, scheduler_ref, self._faults, self._executor_ready, worker
            ),
            restart=Restart.PERMANENT,
            shutdown_timeout=2.0,
            mailbox_size=8,
            on_failure=self._recover,
        )
        supervisor = await system.spawn_supervisor(
            "executor-supervisor",
            [executor_spec],
            max_restarts=cfg.max_restarts,
            within=cfg.restart_window,
            backoff=Backoff(initial=0.0, factor=2.0, maximum=1.0, jitter=0.0),
            on_escalate=self._escalated,
        )
        holder.append(supervisor)
        self._supervisor = supervisor
        vocab = int(
            getattr(loaded.model.config.get_text_config(), "vocab_size", 0) or len(loaded.tokenizer)
        )
        self._intake_actor = Intake(
            IntakeConfig(
                max_model_len=max_len,
                kv_capacity_tokens=spec.capacity_tokens,
                max_waiting=cfg.max_waiting,
                vocab_size=vocab,
            ),
            loaded.tokenizer,
            scheduler_ref,
            self._check_health,
        )
        self._intake = await system.spawn(
            self._intake_actor, name="intake", mailbox_size=max(64, cfg.max_waiting)
        )
        # the supervisor's escalation is reported through on_escalate; anything else crashing
        # (a bug in the scheduler, cache manager or intake) must not leave callers waiting
        guarded: list[ActorRef[Any]] = [cache_ref, scheduler_ref, self._intake]
        await system.spawn(Guardian(guarded, self._on_fatal), name="guardian", mailbox_size=16)
        self.max_model_len = max_len
        _log.info(
            "engine.started",
            model=loaded.name,
            device=str(loaded.device),
            dtype=str(loaded.dtype).removeprefix("torch."),
            kv_blocks=num_blocks,
            block_size=cfg.block_size,
            kv_tokens=spec.capacity_tokens,
            kv_mib=round(spec.bytes_per_block * num_blocks / 2**20, 1),
            max_model_len=max_len,
        )

    async def _stop(self) -> None:
        """Drain, then stop every actor. Shielded: cancelling the caller (an anyio scope, say)
        must not leave actor tasks running behind a half-stopped engine."""
        with anyio.CancelScope(shield=True):
            await self._shutdown()

    async def _shutdown(self) -> None:
        if self._system is None:
            return
        if self._state not in ("failed",):
            self._state, self._reason = "stopping", "engine is shutting down"
        if self._scheduler_ref is not None and self._scheduler_ref.is_alive:
            with contextlib.suppress(Exception):
                await self._scheduler_ref.ask(
                    lambda r: Drain(self.config.drain_timeout, r),
                    timeout=self.config.drain_timeout + 5.0,
                )
        system, self._system = self._system, None
        # an escalation was already reported through health() and wait_failed()
        with contextlib.suppress(SupervisorEscalation):
            await system.__aexit__(None, None, None)
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        self._state = "failed" if self._failure is not None else "stopping"
        _log.info("engine.stopped")

    # -- requests -------------------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        assert self.loaded is not None
        return self.loaded.name

    @property
    def tokenizer(self) -> Any:
        assert self.loaded is not None
        return self.loaded.tokenizer

    async def submit(
        self,
        prompt: str | Sequence[int] | None = None,
        params: SamplingParams | None = None,
        *,
        messages: Sequence[dict[str, Any]] | None = None,
        request_id: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> RequestStream:
        """Validate and admit a request; return its stream.

        Everything wrong with the request is raised here, before any output exists.

        :raises InvalidRequest: bad parameters, messages, template error, bad token ids.
        :raises ContextLengthExceeded: prompt plus ``max_tokens`` beyond the context.
        :raises Overloaded: admission limits reached.
        :raises EngineFailed: the engine is failed.
        :raises EngineStopped: the engine is stopping.
        """
        self._check_health()
        intake = self._intake
        if intake is None:
            raise EngineStopped("engine is not running")
        mailbox = intake.statistics()
        if mailbox.current_buffer_used >= mailbox.max_buffer_size:
            raise Overloaded("the engine's intake queue is full; retry later")
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
        ptoks: str | tuple[int, ...] | None = (
            prompt if isinstance(prompt, str) or prompt is None else tuple(prompt)
        )
        msgs = tuple(messages) if messages is not None else None
        try:
            stream: ResultStream = await intake.ask(
                lambda r: Submit(
                    rid, ptoks, msgs, params or SamplingParams(), chat_template_kwargs, r
                ),
                timeout=_ASK_TIMEOUT,
            )
        except StoicError:
            raise
        except Exception as exc:
            if isinstance(exc, MailboxFull | AskTimeout):
                raise Overloaded("the engine's intake is saturated; retry later") from exc
            if isinstance(exc, ActorStopped):
                raise EngineStopped("engine is not running") from exc
            raise
        return RequestStream(self, stream)

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
    ) -> AsyncIterator[Delta]:
        """Stream a completion of ``prompt`` (text or token ids). Errors raise before any delta."""
        stream = await self.submit(prompt, params, request_id=request_id)
        async with stream:
            async for delta in stream:
                yield delta

    async def chat(
        self,
        messages: Sequence[dict[str, Any]],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> AsyncIterator[Delta]:
        """Stream a chat completion (the model's own chat template). Errors raise before any delta."""
        stream = await self.submit(
            None,
            params,
            messages=messages,
            request_id=request_id,
            chat_template_kwargs=chat_template_kwargs,
        )
        async with stream:
            async for delta in stream:
                yield delta

    async def complete(
        self,
        prompt: str | Sequence[int] | None = None,
        params: SamplingParams | None = None,
        *,
        messages: Sequence[dict[str, Any]] | None = None,
        request_id: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> CompletionResult:
        """Generate to the end and return the whole result (non-streaming helper).

        :raises StoicError: what :meth:`submit` raises, and what the stream raises if generation
            fails (each carrying ``partial``).
        """
        stream = await self.submit(
            prompt,
            params,
            messages=messages,
            request_id=request_id,
            chat_template_kwargs=chat_template_kwargs,
        )
        text: list[str] = []
        ids: list[int] = []
        logprobs: list[Any] | None = None
        finish = "stop"
        completion = 0
        async with stream:
            async for delta in stream:
                text.append(delta.text)
                ids.extend(delta.token_ids)
                completion = delta.completion_tokens
                if delta.logprobs is not None:
                    logprobs = logprobs if logprobs is not None else []
                    logprobs.extend(delta.logprobs)
                if delta.finish_reason is not None:
                    finish = delta.finish_reason
        return CompletionResult(
            stream.request_id,
            "".join(text),
            tuple(ids),
            finish,
            stream.prompt_tokens,
            completion,
            tuple(logprobs) if logprobs is not None else None,
        )

    async def abort(self, request_id: str) -> None:
        """Abort a request (no-op if unknown or finished); its blocks are freed at once."""
        ref = self._scheduler_ref
        if ref is None or not ref.is_alive:
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
        return Health(self._state, self._reason)

    async def wait_failed(self) -> EngineFailed:
        """Return the engine's failure once it happens (for ``--exit-on-fatal``)."""
        await self._failed.wait()
        assert self._failure is not None
        return self._failure

    def stats(self) -> EngineStats:
        sched = self._scheduler.stats() if self._scheduler is not None else None
        cache = self._cache.stats() if self._cache is not None else None
        return EngineStats(
            running=sched.running if sched else 0,
            waiting=sched.waiting if sched else 0,
            kv_blocks_used=cache.blocks_used if cache else 0,
            kv_blocks_total=cache.blocks_total if cache else 0,
            incarnation=self._executor_incarnation,
            restarts=self._restarts,
            failed_sequences=sched.failed_sequences if sched else 0,
            steps=sched.steps if sched else 0,
            max_batch_size=sched.max_batch_size if sched else 0,
            preemptions=sched.preemptions if sched else 0,
            fenced_results=sched.fenced_results if sched else 0,
            prompt_tokens=sched.prompt_tokens if sched else 0,
            generated_tokens=sched.generated_tokens if sched else 0,
            faults_injected=self._faults.injected,
            state=self._state,
            prefix_cached_tokens=sched.prefix_cached_tokens if sched else 0,
            kv_blocks_cached=cache.cached_blocks if cache else 0,
        )

    async def inject_fault(self, spec: FaultSpec) -> None:
        """Arm a fault in the executor's steps.

        :raises InvalidRequest: if fault injection is not enabled in the config.
        """
        if not self.config.enable_fault_injection:
            raise InvalidRequest(
                "fault injection is disabled (EngineConfig.enable_fault_injection)"
            )
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
        if not self.config.enable_fault_injection:
            raise InvalidRequest(
                "fault injection is disabled (EngineConfig.enable_fault_injection)"
            )
        self._faults.clear()
        _log.info("faults.cleared")

    # -- supervision ----------------------------------------------------------------------------
    def _check_health(self) -> None:
        if self._state == "failed":
            raise EngineFailed(f"engine failed: {self._reason}")
        if self._state == "stopping":
            raise EngineStopped()

    def _executor_ready(self, incarnation: int) -> None:
        if incarnation > self._executor_incarnation:
            self._restarts += 1  # counted when the restart happened, not when it was decided
        self._executor_incarnation = incarnation
        if self._state in ("starting", "recovering"):
            self._state, self._reason = "serving", None

    async def _recover(self, error: BaseException, incarnation: int) -> None:
        """The executor's recovery procedure, run by its supervisor before the restart."""
        started = time.monotonic()
        kind = classify_failure(error)
        log = _log.bind(kind=kind, executor_incarnation=incarnation)
        log.error("recovery.executor_failed", error=f"{type(error).__name__}: {error}")
        if self._state == "serving":
            self._state, self._reason = "recovering", f"executor failed ({kind}); recovering"
        assert self._scheduler_ref is not None and self._cache_ref is not None
        failed: int = await self._scheduler_ref.ask(
            lambda r: ExecutorDown(error, kind, incarnation, r), timeout=_RECOVERY_TIMEOUT
        )
        log.info("recovery.fenced_and_streams_failed", sequences_failed=failed)
        freed: int = await self._cache_ref.ask(lambda r: DropAll(r), timeout=_RECOVERY_TIMEOUT)
        log.info(
            "recovery.cache_dropped",
            blocks_freed=freed,
            seconds=round(time.monotonic() - started, 4),
        )
        if kind == "fatal":
            raise EngineFailed(f"unrecoverable device error: {error}")

    async def _escalated(self, escalation: SupervisorEscalation) -> None:
        cause = escalation.__cause__
        reason = (
            f"executor failed {escalation} (last error: {type(cause).__name__}: {cause})"
            if cause
            else str(escalation)
        )
        self._on_fatal(reason)
        if self._scheduler_ref is not None and self._scheduler_ref.is_alive:
            await self._scheduler_ref.tell(EngineFailedNotice(reason))

    def _on_fatal(self, reason: str) -> None:
        if self._failure is not None:
            return
        self._state, self._reason = "failed", reason
        self._failure = EngineFailed(f"engine failed: {reason}")
        self._failed.set()
        _log.error("engine.failed", reason=reason)


def _size_kv_cache(cfg: EngineConfig, runner: ModelRunner) -> int:
    """Blocks from the memory budget: a fraction of free GPU memory, or ``kv_cache_memory_gib``."""
    per_block = runner.kv_spec(1, cfg.block_size).bytes_per_block
    device = runner.loaded.device
    if device.type == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info(device)
        budget = int(free * cfg.gpu_memory_utilization)
    else:
        budget = int(cfg.kv_cache_memory_gib * 2**30)
    return max(1, budget // per_block)
