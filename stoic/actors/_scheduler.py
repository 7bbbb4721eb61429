"""The scheduler actor: a thin shell around :class:`~stoic.scheduler.SchedulerCore`.

It dispatches messages to the core and does the core's I/O: steps to the executor, the step
watchdog and the drain deadline (both timers that message the actor itself). Planning a step
asks nobody: the core looks prefixes up and allocates blocks on its own allocator in the same
call (see :mod:`stoic.scheduler`), so a step is sent as soon as it is planned. The watchdog looks at the executor's progress counter while a step runs: a step is
hung when the counter has not moved for the step timeout, however long the step has run. One
step is in flight at a time. When its result arrives the shell (1) lets the core
apply the sampled tokens, (2) plans and sends the next step, and only then (3) lets the core
detokenise and push deltas, so that text work overlaps the next forward pass.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import assert_never

from ..runtime import Actor, ActorRef, MailboxFull, Reply
from ..scheduler import SchedulerCore, SchedulerStats
from ._faults import FaultInjector
from ._health import EngineHealth
from ._messages import (
    Abort,
    AddSequence,
    Drain,
    DrainDeadline,
    EngineFailedNotice,
    ExecutorDown,
    ExecutorMsg,
    ExecutorReady,
    RunStep,
    SchedulerMsg,
    StepResult,
    StepTimeout,
)
from ._watchdog import ProgressWatch

__all__ = ["Scheduler"]

_PROGRESS_EVERY = 10.0


class Scheduler(Actor[SchedulerMsg]):
    """Forms one batch per step and routes results to each sequence's result stream.

    Invariants: every admitted sequence ends with exactly one terminal outcome on its stream;
    finished and aborted sequences' blocks are freed at once; results from a fenced executor
    incarnation are discarded (and counted).
    """

    def __init__(
        self,
        core: SchedulerCore,
        health: EngineHealth,
        *,
        step_timeout: float,
        faults: FaultInjector | None = None,
        progress: Callable[[], int] | None = None,
    ) -> None:
        self.core = core
        self._faults = faults
        self._health = health
        self._step_timeout = step_timeout
        #: the executor's progress counter (None: one that never moves, so a step is hung once
        #: it outlives the timeout)
        self._read_progress: Callable[[], int] = progress or (lambda: 0)
        self._executor: ActorRef[ExecutorMsg] | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._drain: tuple[Reply[int], asyncio.TimerHandle] | None = None
        self._last_progress = time.monotonic()

    def stats(self) -> SchedulerStats:
        return self.core.stats()

    # -- message handling -----------------------------------------------------------------------
    async def receive(self, message: SchedulerMsg) -> None:
        try:
            await self._handle(message)
        finally:
            self._check_drained()

    async def _handle(self, message: SchedulerMsg) -> None:
        core, log = self.core, self.context.log
        match message:
            case AddSequence(request_id, prompt_ids, params, max_tokens, stream):
                request = message.request
                core.add(
                    request_id,
                    prompt_ids,
                    params,
                    max_tokens,
                    stream,
                    tuple(request.generated),
                    tenant=request.tenant,
                    priority=request.priority,
                    timeout=request.timeout,
                )
                await self._step()
            case Abort(request_id=request_id):
                seq = core.abort(request_id)
                if seq is not None:
                    log.info("sequence.aborted", request_id=request_id, generated=seq.num_generated)
            case StepResult(step_id=step_id, incarnation=incarnation, output=output):
                budget = core.budget.tokens
                touched = core.complete(step_id, incarnation, output)
                if touched is None:
                    log.info(
                        "scheduler.result_fenced", step=step_id, executor_incarnation=incarnation
                    )
                    return
                self._cancel_watchdog()
                self._health.compute_threads(output.threads)
                if core.budget.tokens != budget:
                    self._log_budget("clean_steps")
                await self._step()  # keep the executor busy before the text work
                core.emit(touched)
                self._progress()
            case StepTimeout(step_id=step_id, since_progress=since):
                if core.inflight_step == step_id:
                    log.error(
                        "scheduler.watchdog_fired",
                        step=step_id,
                        timeout=self._step_timeout,
                        since_progress=since,
                        step_seconds=message.step_seconds,
                        ticks=message.ticks,
                    )
                    reason = (
                        f"step {step_id} made no progress for {since:g}s (step timeout "
                        f"{self._step_timeout:g}s; hung executor)"
                    )
                    self._health.fail(reason)
                    self._fail_engine(reason)
            case ExecutorDown(error=error, kind=kind, incarnation=incarnation, reply=reply):
                self._cancel_watchdog()
                budget = core.budget.tokens
                outcome = core.executor_down(
                    error,
                    kind,
                    final=message.final,
                    final_if_charged=message.final_if_charged,
                    keep_kv=message.keep_kv,
                )
                log.debug(  # recovery.executor_failed reports it, with these counts
                    "scheduler.executor_down",
                    kind=kind,
                    executor_incarnation=incarnation,
                    **outcome._asdict(),
                )
                if core.budget.tokens != budget:
                    self._log_budget("out_of_memory")
                reply.send(outcome)
            case ExecutorReady(incarnation=incarnation, executor=executor):
                self._executor = executor
                core.executor_ready(incarnation)
                log.debug("scheduler.executor_ready", executor_incarnation=incarnation)
                await self._step()
            case EngineFailedNotice(reason=reason):
                self._fail_engine(reason)
            case Drain(timeout=timeout, reply=reply):
                core.admitting = False
                if not core.idle:
                    log.info(
                        "scheduler.draining",
                        sequences=len(core.running) + len(core.waiting),
                        timeout=timeout,
                    )
                    timer = asyncio.get_running_loop().call_later(
                        timeout, self._tell_self, DrainDeadline()
                    )
                    self._drain = (reply, timer)
                else:
                    reply.send(0)
            case DrainDeadline():
                count = core.stop()
                log.warning("scheduler.drain_deadline", sequences_stopped=count)
            case _:
                assert_never(message)

    async def on_stop(self) -> None:
        self._cancel_watchdog()
        if self._drain is not None:
            self._drain[1].cancel()
        self.core.stop()

    # -- the step loop --------------------------------------------------------------------------
    async def _step(self) -> None:
        """Plan and send the next step, if none is in flight and there is work that fits."""
        step = self.core.schedule()
        if step is None:
            return
        self._arm_watchdog(step.step_id)
        assert self._executor is not None
        fault = None
        if self._faults is not None and self._faults.matching:
            fault = self._faults.match(self.core.inflight_prompts())
        await self._executor.tell(RunStep(step.step_id, step.incarnation, step.batch, fault))

    def _log_budget(self, reason: str) -> None:
        budget = self.core.budget
        self.context.log.warning(
            "scheduler.step_budget",
            reason=reason,
            tokens=budget.tokens,
            seqs=budget.seqs,
            configured_tokens=budget.max_batched_tokens,
            configured_seqs=budget.max_seqs,
        )

    def _fail_engine(self, reason: str) -> None:
        self._cancel_watchdog()
        count = self.core.fail_engine(reason)
        self.context.log.error("scheduler.engine_failed", reason=reason, sequences_failed=count)

    # -- timers, drain, progress ----------------------------------------------------------------
    def _tell_self(self, message: SchedulerMsg) -> None:
        """Deliver a timer's message; if the mailbox is full, try again shortly."""
        ref = self.context.ref
        try:
            ref.try_tell(message)
        except MailboxFull:
            asyncio.get_running_loop().call_later(0.05, self._tell_self, message)
        except Exception:  # stopped: nothing left to tell
            pass

    def _arm_watchdog(self, step_id: int) -> None:
        """Watch step ``step_id``'s progress until :meth:`_cancel_watchdog`. The timer looks
        at the counter and at its own :class:`ProgressWatch`, nothing of the scheduler's state;
        only the :class:`StepTimeout` it delivers changes that, as a message."""
        self._cancel_watchdog()
        self._watch_step(step_id, ProgressWatch(self._read_progress, self._step_timeout))

    def _watch_step(self, step_id: int, watch: ProgressWatch) -> None:
        self._watchdog = None
        if watch.stalled():
            self._tell_self(StepTimeout(step_id, **watch.fields()))
            return
        self._watchdog = asyncio.get_running_loop().call_later(
            watch.interval, self._watch_step, step_id, watch
        )

    def _cancel_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def _check_drained(self) -> None:
        if self._drain is not None and self.core.idle:
            reply, timer = self._drain
            self._drain = None
            timer.cancel()
            if not reply.done:
                reply.send(0)

    def _progress(self) -> None:
        now = time.monotonic()
        if now - self._last_progress >= _PROGRESS_EVERY:
            self._last_progress = now
            self.context.log.info("scheduler.progress", **self.core.stats()._asdict())
