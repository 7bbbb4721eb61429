"""Wiring: spawn the engine's actors into a running actor system, in dependency order."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..actors import (
    CacheManager,
    CacheMsg,
    EngineHealth,
    Executor,
    FaultInjector,
    Guardian,
    Intake,
    IntakeConfig,
    IntakeMsg,
    Scheduler,
    SchedulerConfig,
    SchedulerCore,
    SchedulerMsg,
    StepWorker,
)
from ..config import EngineConfig
from ..model import KVCacheSpec, LoadedModel, ModelRunner
from ..runtime import ActorRef, ActorSystem, Backoff, ChildSpec, Restart
from ._recovery import Recovery

__all__ = ["EngineParts", "wire"]


@dataclass(frozen=True)
class EngineParts:
    """The running engine's actors: refs to talk to, and the two objects whose statistics are
    read directly on the event loop."""

    intake: ActorRef[IntakeMsg]
    scheduler: ActorRef[SchedulerMsg]
    cache: ActorRef[CacheMsg]
    scheduler_core: SchedulerCore
    cache_manager: CacheManager
    kv_spec: KVCacheSpec
    #: the context length requests are checked against
    max_model_len: int


async def wire(
    system: ActorSystem,
    config: EngineConfig,
    loaded: LoadedModel,
    health: EngineHealth,
    faults: FaultInjector,
    worker: StepWorker,
) -> EngineParts:
    """Spawn cache, scheduler, the executor's supervisor (which starts the executor), intake and
    guardian into ``system``; shutdown goes in reverse order.

    :raises Exception: what an actor's start raised (the system stops what was started).
    """
    runner = ModelRunner(loaded)
    num_blocks = config.num_kv_blocks or _size_kv_cache(config, runner)
    spec = runner.kv_spec(num_blocks, config.block_size)
    max_len = min(config.max_model_len or loaded.max_model_len, loaded.max_model_len)

    cache_manager = CacheManager(spec)
    cache = await system.spawn(cache_manager, name="cache", mailbox_size=1024)
    core = SchedulerCore(
        SchedulerConfig(
            block_size=config.block_size,
            num_blocks=num_blocks,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.step_token_budget(loaded.device.type),
            eos_token_ids=loaded.eos_token_ids,
            prefix_caching=config.enable_prefix_caching,
        ),
        loaded.tokenizer.backend_tokenizer,
    )
    scheduler = await system.spawn(
        Scheduler(core, cache, health, step_timeout=config.step_timeout),
        name="scheduler",
        mailbox_size=4096,
    )
    recovery = Recovery(health, scheduler, cache)
    executor: ChildSpec[Any] = ChildSpec(
        name="executor",
        factory=lambda: Executor(runner, cache, scheduler, faults, health, worker),
        restart=Restart.PERMANENT,
        shutdown_timeout=2.0,
        mailbox_size=8,
        on_failure=recovery.on_failure,
    )
    await system.spawn_supervisor(
        "executor-supervisor",
        [executor],
        max_restarts=config.max_restarts,
        within=config.restart_window,
        backoff=Backoff(initial=0.0, factor=2.0, maximum=1.0, jitter=0.0),
        on_escalate=recovery.on_escalate,
    )
    text_config = loaded.model.config.get_text_config()
    vocab = int(getattr(text_config, "vocab_size", 0) or len(loaded.tokenizer))
    intake = await system.spawn(
        Intake(
            IntakeConfig(
                max_model_len=max_len,
                kv_capacity_tokens=spec.capacity_tokens,
                max_waiting=config.max_waiting,
                vocab_size=vocab,
            ),
            loaded.tokenizer,
            scheduler,
            health,
        ),
        name="intake",
        mailbox_size=max(64, config.max_waiting),
    )
    # the supervisor's escalation is reported through on_escalate; anything else crashing (a bug
    # in the scheduler, cache manager or intake) must not leave callers waiting
    await system.spawn(
        Guardian([cache, scheduler, intake], health), name="guardian", mailbox_size=16
    )
    return EngineParts(intake, scheduler, cache, core, cache_manager, spec, max_len)


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
