"""Wiring: spawn the engine's actors into a running actor system, in dependency order."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._logging import get_logger
from ..actors import (
    CacheMsg,
    EngineHealth,
    FaultInjector,
    Guardian,
    Intake,
    IntakeConfig,
    IntakeMsg,
    KVCacheManager,
    Scheduler,
    SchedulerMsg,
)
from ..config import EngineConfig
from ..executor import Executor, StepBackend
from ..model import KVCacheSpec, LoadedModel, token_codec, vocab_size
from ..request import GrammarVocab
from ..runtime import ActorRef, ActorSystem, Backoff, ChildSpec, Restart
from ..sampling import LLGuidanceBackend
from ..scheduler import SchedulerConfig, SchedulerCore, TenantPolicy
from ..worker import CacheSizing, cpu_budget
from ._incidents import IncidentLog
from ._recovery import Recovery

__all__ = ["EngineParts", "compute_threads", "kv_cache_spec", "wire"]

_log = get_logger("stoic.engine")


@dataclass(frozen=True)
class EngineParts:
    """The running engine's actors: refs to talk to, and the scheduler's core, whose statistics
    are read directly on the event loop."""

    intake: ActorRef[IntakeMsg]
    scheduler: ActorRef[SchedulerMsg]
    cache: ActorRef[CacheMsg]
    scheduler_core: SchedulerCore
    kv_spec: KVCacheSpec
    #: how the process that runs the model sized the KV cache
    kv_sizing: CacheSizing
    #: the context length requests are checked against
    max_model_len: int


def kv_cache_spec(config: EngineConfig, loaded: LoadedModel, sizing: CacheSizing) -> KVCacheSpec:
    """The KV cache's shape: the blocks the process that runs the model sized it to (after
    loading the weights: :func:`stoic.worker.size_kv_cache`); logged as ``engine.kv_sizing``."""
    _log.info("engine.kv_sizing", device=str(loaded.device), **sizing.describe())
    return KVCacheSpec.for_model(
        loaded.config,
        num_blocks=sizing.num_blocks,
        block_size=config.block_size,
        dtype=loaded.cache_dtype,
        device=loaded.device,
    )


def grammar_vocab(loaded: LoadedModel) -> GrammarVocab | None:
    """What the grammar backend needs of ``loaded``'s tokenizer (None: it has none usable, and
    structured outputs are refused)."""
    try:
        return GrammarVocab.from_tokenizer(
            loaded.tokenizer, vocab_size(loaded), loaded.eos_token_ids
        )
    except TypeError:
        return None


def compute_threads(config: EngineConfig) -> int:
    """The step's compute threads: ``config.threads``, or what this process's CPU budget
    (affinity, cgroup quota) allows; logged as ``engine.cpu_budget``."""
    budget = cpu_budget()
    threads = config.threads or budget.threads
    _log.info(
        "engine.cpu_budget",
        **budget.describe() | {"threads": threads, "adapt_threads": config.adapt_threads},
    )
    return threads


async def wire(
    system: ActorSystem,
    config: EngineConfig,
    loaded: LoadedModel,
    health: EngineHealth,
    faults: FaultInjector,
    backend: StepBackend,
    incidents: IncidentLog | None = None,
) -> EngineParts:
    """Prepare ``backend`` (where the executor's steps run: it sizes the KV cache where the
    weights are), then spawn cache, scheduler, the executor's supervisor (which starts the
    executor), intake and guardian into ``system``; shutdown goes in reverse order.
    ``incidents`` records the executor's failures.

    :raises InsufficientMemory: not even a minimal KV cache fits.
    :raises Exception: what an actor's start raised (the system stops what was started).
    """
    max_len = min(config.max_model_len or loaded.max_model_len, loaded.max_model_len)
    vocab_spec = grammar_vocab(loaded)
    # one backend for the intake (which compiles at admission) and a thread executor: a
    # constraint is compiled once; a process executor's worker builds its own
    grammar = LLGuidanceBackend(vocab_spec) if vocab_spec is not None else None
    sizing = await backend.prepare(
        config, loaded, threads=compute_threads(config), vocab=vocab_spec, grammar=grammar
    )
    spec = kv_cache_spec(config, loaded, sizing)
    cache = await system.spawn(
        KVCacheManager(spec, make_cache=backend.make_cache), name="cache", mailbox_size=16
    )
    core = SchedulerCore(
        SchedulerConfig(
            block_size=config.block_size,
            num_blocks=spec.num_blocks,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.step_token_budget(loaded.device.type),
            eos_token_ids=loaded.eos_token_ids,
            prefix_caching=config.enable_prefix_caching,
            recovery=config.recovery,
            max_resumes=config.max_resumes,
            tenants=TenantPolicy(
                weights=dict(config.tenant_weights),
                max_running=config.tenant_max_running,
                max_queued=config.tenant_max_queued,
            ),
            decode_stretch=config.decode_stretch,
            speculative=config.speculative,
            num_speculative_tokens=config.num_speculative_tokens,
        ),
        loaded.tokenizer.backend_tokenizer,
    )

    def factory() -> Any:
        return Executor(backend, cache, scheduler, faults, health, step_timeout=config.step_timeout)

    # The step watchdog: a step whose progress counter (a tick per decoder layer) stops for
    # step_timeout is hung; one that keeps ticking is never stopped, however slow. With the
    # thread executor the scheduler's watchdog is the only one (a thread cannot be killed: the
    # engine is failed; margin 0). With the process executor the executor kills the worker
    # first; the scheduler's watchdog stays as a backstop on the same counter, later by the
    # backend's margin, rather than going away: it catches a step that never reached the worker
    # or an executor stuck itself, and, watching the counter, it never stops a step that
    # progresses either.
    scheduler = await system.spawn(
        Scheduler(
            core,
            health,
            step_timeout=config.step_timeout + backend.watchdog_margin,
            faults=faults,
            progress=backend.progress,
        ),
        name="scheduler",
        mailbox_size=4096,
    )

    recovery = Recovery(
        health,
        scheduler,
        cache,
        replaces_worker=backend.replaces_worker,
        kv_outlives_worker=backend.kv_outlives_worker,
        max_restarts=config.max_restarts,
        restart_window=config.restart_window,
        incidents=incidents,
    )
    await system.spawn_supervisor(
        "executor-supervisor",
        [
            ChildSpec(
                name="executor",
                factory=factory,
                restart=Restart.PERMANENT,
                shutdown_timeout=2.0,
                mailbox_size=8,
                on_failure=recovery.on_failure,
            )
        ],
        max_restarts=config.max_restarts,
        within=config.restart_window,
        backoff=Backoff(initial=0.0, factor=2.0, maximum=1.0, jitter=0.0),
        on_escalate=recovery.on_escalate,
    )
    intake = await system.spawn(
        Intake(
            IntakeConfig(
                max_model_len=max_len,
                kv_capacity_tokens=spec.capacity_tokens,
                max_waiting=config.max_waiting,
                max_queue_wait=config.max_queue_wait,
                tenant_max_queued=config.tenant_max_queued,
            ),
            token_codec(loaded),
            scheduler,
            health,
            grammar,
            load=core,
        ),
        name="intake",
        mailbox_size=max(64, config.max_waiting),
    )
    # the supervisor's escalation is reported through on_escalate; anything else crashing (a bug
    # in the scheduler, cache manager or intake) must not leave callers waiting
    await system.spawn(
        Guardian([cache, scheduler, intake], health), name="guardian", mailbox_size=16
    )
    return EngineParts(intake, scheduler, cache, core, spec, sizing, max_len)
