"""The server's side of the executor's worker process: start it, feed it steps, see it die.

A :class:`WorkerProcess` is one child interpreter running :mod:`stoic.executor._procworker`. A reader thread per child turns the pipe into an
asyncio queue; when the child dies the pipe's end reaches that thread at once (no polling), which
posts the exit ("killed by SIGKILL", "exited with status 1") and calls ``on_exit``.

A :class:`WorkerPool` outlives executor incarnations: it keeps the current worker (reused after
a failure that left it healthy), ``spares`` warm workers with the weights already loaded, which
take over at once when the current one must be replaced, and one pre-started interpreter that
has imported torch and the model code but loaded nothing, so that a cold replacement pays only
for loading the weights. With ``share_kv`` it also owns the KV pools' memory
(:class:`~stoic.model.KVMemory`), which every worker it starts maps: a replacement finds the
keys and values its predecessor computed, unless the recovery dropped them
(:meth:`WorkerPool.acquire`'s ``drop``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import pickle
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle
from typing import Any

from .. import _prestart as prestart
from .._logging import get_logger
from ..actors import ProgressWatch
from ..config import FaultSpec
from ..errors import InsufficientMemory
from ..kernels import LayoutEntry
from ..model import ComputePath, KVMemory, StepProgress
from ..request import StepBatch, StepOutput
from ..worker import CacheSizing
from ._failures import ExecutorFault
from ._procworker import WorkerSpec

__all__ = ["REPLACEMENT_OOM_WAIT", "WorkerPool", "WorkerProcess", "describe_exit"]

_log = get_logger("stoic.executor")
#: how long a hung worker gets between SIGTERM and SIGKILL
_KILL_GRACE = 1.0
#: how long a worker whose pipe broke is waited for, to learn how it ended
_REAP_WAIT = 0.2
#: after a worker was replaced, how long before the spares and the pre-started interpreter are
#: topped up again
_REPLENISH_DELAY = 5.0
#: what a worker process runs (``python -m``; a test may run a wrapper that injects faults
#: into its start, then calls :func:`~stoic.executor._procworker.worker_main` as this does)
WORKER_MODULE = prestart.WORKER_MODULE
#: how long a worker after the first waits out out-of-memory errors while it starts: a GPU
#: driver frees a killed process's memory a little after the process is gone (seconds at most)
REPLACEMENT_OOM_WAIT = 30.0


def describe_exit(exitcode: int | None) -> str:
    """``"killed by SIGKILL"``, ``"exited with status 1"``..."""
    if exitcode is None:
        return "exited (status unknown)"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with status {exitcode}"


class WorkerProcess:
    """One worker process and its pipe."""

    def __init__(self) -> None:
        """Start the interpreter (or adopt ``stoic serve``'s early one, :mod:`stoic._prestart`)
        and send it its step progress page."""
        self._inbox: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        #: the worker's step progress, in a page of memory it shares with this process: read
        #: by the step watchdog without a message (the worker may be stuck in native code).
        #: Its descriptor is the first thing the worker reads (the kernel holds it in the
        #: socket until then); mapped here, this process's descriptor can go at once. Made
        #: before the process is taken: a failure here leaves no process behind.
        self.progress, page = StepProgress.shared()
        try:
            early = prestart.take(WORKER_MODULE)
            spawned = early or prestart.spawn(WORKER_MODULE)
        except BaseException:
            os.close(page)
            raise
        #: started by ``stoic serve`` before it imported torch itself (:mod:`stoic._prestart`)
        self.early = early is not None
        self._proc = spawned.proc
        self._conn = Connection(spawned.sock.detach())
        try:
            send_handle(self._conn, page, self._proc.pid)
        except OSError:  # the child is already gone: its exit is reported as usual
            pass
        finally:
            os.close(page)
        #: held while the connection is written to or closed. Only the reader thread closes
        #: it (after the child is gone): a close from another thread while it blocks in a
        #: receive would race its own close (EBADF), or close a descriptor number the process
        #: has already handed to something else.
        self._conn_lock = threading.Lock()
        #: while :meth:`load`'s thread sends the spec (holding the connection's lock): what
        #: else is sent meanwhile waits here, and that thread sends it after the spec
        self._queue_lock = threading.Lock()
        self._queued: list[bytes] | None = None
        self.pid: int = self._proc.pid
        self.started = time.monotonic()
        self.ready = False
        #: how the worker's model computes (from its runner's summary), once ready; None if
        #: it sent none this code can read
        self.compute: ComputePath | None = None
        #: how the worker sized its KV cache, once ready
        self.sizing: CacheSizing | None = None
        #: where it packed its int8 layouts in the shared memory, once ready (empty where it
        #: mapped them; None where it was given no such memory)
        self.layout_table: tuple[LayoutEntry, ...] | None = None
        self.exited: str | None = None
        #: killed (or being killed) by us: never handed out again
        self._doomed = False
        #: called on the event loop when the process is gone (with :attr:`exited` set)
        self.on_exit: Callable[[WorkerProcess], None] | None = None
        #: the model it loads; None while it only waits, imports done (see :meth:`load`)
        self.spec: WorkerSpec | None = None
        #: its start's own events are logged at debug (a worker after the server's first)
        self.quiet_start = False
        threading.Thread(target=self._read, name=f"stoic-worker-{self.pid}", daemon=True).start()
        threading.Thread(
            target=self._relay, name=f"stoic-worker-out-{self.pid}", daemon=True
        ).start()

    def load(
        self, spec: WorkerSpec, kv_fd: int | None = None, layouts_fd: int | None = None
    ) -> None:
        """Tell the worker what to load; it answers ``ready`` once it has (:meth:`wait_ready`).
        ``kv_fd``: the KV pools' shared memory it maps (None: it allocates its own);
        ``layouts_fd``: the int8 layouts' (:class:`~stoic.kernels.SharedLayouts`: packed into
        it where ``spec`` has no record of them, else mapped by that record).

        Sent from a thread: the spec (the tokenizer's vocabulary with it: megabytes) fills the
        socket's buffer until the worker reads it, after its imports, seconds later when it
        was started at once, and the event loop (``/health`` among it) must not wait for that.
        The connection's lock is taken here and released by that thread; what is sent
        meanwhile (a spare's role) is queued and sent by it after the spec, so nothing sent
        from the event loop waits for the worker's imports. A worker found gone meanwhile is
        reported as any exit is; one the descriptors cannot be sent to is killed (it would
        wait for them until the ready timeout).
        """
        self.spec = spec
        message = ("spec", spec, kv_fd is not None, layouts_fd is not None)
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self._conn_lock.acquire()
        with self._queue_lock:
            self._queued = []
        try:
            threading.Thread(
                target=self._send_spec,
                args=(data, [fd for fd in (kv_fd, layouts_fd) if fd is not None]),
                name=f"stoic-worker-spec-{self.pid}",
                daemon=True,  # an exit does not wait for a worker that never reads
            ).start()
        except BaseException:
            self._finish_spec()
            raise

    def _send_spec(self, data: bytes, fds: list[int]) -> None:
        """:meth:`load`'s thread: the spec, the shared memories' descriptors, then what was
        queued meanwhile; releases the connection's lock :meth:`load` took."""
        try:
            self._conn.send_bytes(data)
            for fd in fds:
                send_handle(self._conn, fd, self.pid)
        except Exception:  # the pipe broke (the child is dying), or a descriptor did not go
            self.kill()  # either way it cannot load: its exit is reported as usual
        self._finish_spec()

    def _finish_spec(self) -> None:
        """Send what was queued while the spec went, then release the connection."""
        while True:
            with self._queue_lock:
                if not self._queued:
                    self._queued = None
                    self._conn_lock.release()
                    return
                data = self._queued.pop(0)
            with contextlib.suppress(OSError, ValueError):  # the child is gone: reported
                self._conn.send_bytes(data)

    def set_role(self, role: str, incarnation: int | None = None) -> None:
        """Tell the worker what it is now (``"spare"``; ``"serving"`` executor ``incarnation``):
        its process title says so (``stoic: executor 3 (serving)``). No answer; a worker that is
        gone is ignored here (its exit is reported as usual)."""
        with contextlib.suppress(ExecutorFault):
            self._send(("role", role, incarnation))

    @property
    def exitcode(self) -> int | None:
        """How the process ended (``-N``: killed by signal N); None while it runs."""
        return self._proc.returncode

    @property
    def alive(self) -> bool:
        """Neither gone nor being killed (its exit may not have been reported yet)."""
        return self.exited is None and not self._doomed and self._proc.poll() is None

    def _read(self) -> None:
        """The reader thread: every message into the inbox; at the pipe's end, the exit."""
        while True:
            try:
                message = pickle.loads(self._conn.recv_bytes())
            except (EOFError, OSError):
                break
            try:
                self._loop.call_soon_threadsafe(self._inbox.put_nowait, message)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                break
        try:
            code: int | None = self._proc.wait(5.0)
        except subprocess.TimeoutExpired:  # the pipe closed but the process lingers: end it
            self._proc.kill()
            code = self._proc.wait()
        why = describe_exit(code)
        with self._conn_lock:
            self._conn.close()  # one socket per worker: never kept past its process
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
            self._loop.call_soon_threadsafe(self._gone, why)

    def _relay(self) -> None:
        """The output thread: each line the worker prints, as one ``executor.worker_output``."""
        assert self._proc.stdout is not None
        with self._proc.stdout:
            for raw in self._proc.stdout:
                line = raw.decode(errors="replace").rstrip()
                if line:
                    _log.warning("executor.worker_output", pid=self.pid, line=line)

    def _gone(self, why: str) -> None:
        self.exited = why
        self._inbox.put_nowait(("exit", why))
        if self.on_exit is not None:
            self.on_exit(self)

    def _send(self, message: tuple[Any, ...]) -> None:
        """Send ``message``, or queue it behind a spec still being sent (:meth:`load`)."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._queue_lock:
            if self._queued is not None:
                self._queued.append(data)
                return
        try:
            with self._conn_lock:
                self._conn.send_bytes(data)
        except (OSError, ValueError) as exc:  # the pipe broke: the child is dying
            raise self._died() from exc

    def _died(self) -> ExecutorFault:
        """The fault of a worker found dead (its pipe broke, or its exit was reported), with
        how it ended: the recovery keeps the KV cache only for deaths it knows to be clean
        (:func:`~stoic.executor.kv_survives`). A broken pipe can be seen a moment before the
        reader thread has reaped the process, so it is waited for briefly here (the kernel
        closes a dying process's sockets just before it becomes a zombie)."""
        code = self._proc.returncode
        if code is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = self._proc.wait(_REAP_WAIT)
        why = self.exited or (describe_exit(code) if code is not None else "died")
        return ExecutorFault(
            f"executor process {why}",
            "crash",
            pid=self.pid,
            exitcode=code,
        )

    async def _receive(self, limit: float | None) -> tuple[Any, ...]:
        message = await asyncio.wait_for(self._inbox.get(), limit)
        if message[0] == "exit":
            self._inbox.put_nowait(message)  # every later receive sees it too
            raise self._died()
        return message

    async def wait_ready(self, limit: float) -> None:
        """Wait until the model is loaded and the KV cache sized.

        :raises ExecutorFault: if the worker died first.
        :raises InsufficientMemory: the device's memory holds no KV cache after the weights and
            a step's activations (the worker exits: a configuration error, never retried).
        """
        if self.ready:
            return
        deadline = time.monotonic() + limit
        while True:
            try:
                message = await self._receive(max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                self.kill()
                raise ExecutorFault(
                    f"executor process not ready after {limit:.0f}s", "hang", pid=self.pid
                ) from None
            if message[0] != "log":
                break
            # the worker's own start events (its weights read, layouts packed, cache sized),
            # as this process's, with its pid: at info for the server's first worker (the
            # start an operator watches), at debug for a later one (a recovery's lines stay
            # few: executor.worker_ready says how long it took)
            _, name, fields = message
            with contextlib.suppress(Exception):
                event = str(fields.pop("event"))
                fields["pid"] = self.pid
                log = get_logger(name)
                (log.debug if self.quiet_start else log.info)(event, **fields)
        if message[0] == "unfit":
            raise InsufficientMemory(message[1])
        assert message[0] == "ready", message
        self.ready = True
        summary = message[2]
        self.sizing = sizing = message[3]
        self.layout_table = message[4]
        _log.info(
            "executor.worker_ready",
            pid=self.pid,
            seconds=round(time.monotonic() - self.started, 2),
            # a replacement or a spare gets the first worker's blocks, unprofiled
            kv_blocks=sizing.num_blocks,
            profiled=sizing.profiled,
            # the worker's own model.quantized line is not relayed (it logs warnings only)
            quantized=summary,
        )
        if summary:
            try:
                self.compute = ComputePath.from_summary(summary)
            except (KeyError, TypeError, ValueError) as exc:  # a summary this code cannot read
                _log.warning("executor.compute_unknown", pid=self.pid, error=repr(exc))

    async def step(
        self, step_id: int, batch: StepBatch, fault: FaultSpec | None, limit: float
    ) -> StepOutput:
        """Run one step in the worker. However long it takes, it runs as long as its progress
        counter moves (:attr:`progress`, looked at every :attr:`ProgressWatch.interval`).

        :raises ExecutorFault: the step raised there (its kind), the worker died (``crash``), or
            it made no progress for ``limit`` seconds (``hang``: the worker is then killed).
        """
        watch = ProgressWatch(lambda: self.progress.count, limit)
        self._send(("step", step_id, batch, fault))
        message: tuple[Any, ...] | None = None
        while message is None:
            try:
                message = await self._receive(watch.interval)
            except TimeoutError:
                if watch.stalled():
                    await self._hung(step_id, watch)
        match message:
            case ("result", int(done), output) if done == step_id:
                assert isinstance(output, StepOutput)
                return output
            case ("error", _, kind, type_name, text):
                raise ExecutorFault(f"{type_name}: {text}", kind)
            case _:
                raise ExecutorFault(
                    f"unexpected answer from the executor process: {message!r}", "error"
                )

    async def _hung(self, step_id: int, watch: ProgressWatch) -> None:
        """Kill the worker whose step stopped progressing.

        :raises ExecutorFault: always (``hang``).
        """
        fields = watch.fields()
        _log.error(
            "executor.step_hung", pid=self.pid, step=step_id, timeout=watch.timeout, **fields
        )
        await self.terminate()
        raise ExecutorFault(
            f"step {step_id} made no progress for {fields['since_progress']:g}s (step timeout "
            f"{watch.timeout:g}s, {watch.ticks} progress ticks into the step); executor process "
            "killed",
            "hang",
            pid=self.pid,
            exitcode=self._proc.returncode,
        )

    async def reset(self, limit: float) -> None:
        """Drop and recreate the worker's KV pools (after a failure the worker survived)."""
        self._send(("reset",))
        message = await self._receive(limit)
        assert message[0] == "reset", message

    def kill(self) -> None:
        """SIGKILL the worker (idempotent); its exit is reported as usual."""
        self._doomed = True
        if self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()

    async def terminate(self) -> None:
        """SIGTERM, then SIGKILL after a short grace (a step hung in native code ignores the
        first); returns once the process is gone."""
        self._doomed = True
        if self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(self._proc.wait, _KILL_GRACE)
            self.kill()

    def stop(self) -> None:
        """Ask the worker to exit, then make sure it does (kill after a short wait). The reader
        thread sees the pipe's end and closes the connection. A worker whose spec is still
        being sent (it has not read it: importing) is killed at once: it would read a stop only
        after loading the model."""
        with self._queue_lock:
            loading = self._queued is not None
        if loading:
            self.kill()
        else:
            with contextlib.suppress(Exception):
                self._send(("stop",))
        try:
            self._proc.wait(2.0)
        except subprocess.TimeoutExpired:
            self.kill()
            self._proc.wait(2.0)


class WorkerPool:
    """The current worker process, ``spares`` warm ones, and one pre-started interpreter, across
    executor incarnations."""

    def __init__(
        self,
        spec: WorkerSpec,
        *,
        spares: int = 0,
        ready_timeout: float = 600.0,
        share_kv: bool = False,
        share_layouts: bool = False,
    ) -> None:
        """``share_kv``: own the KV pools' memory, so that they outlive a worker (see the
        module); if the kernel refuses the shared memory, each worker owns its pools (logged).
        ``share_layouts``: own the int8 layouts' memory too, which the first worker packs them
        into and every later one maps (:class:`~stoic.kernels.SharedLayouts`)."""
        self._spec = spec
        #: the KV pools' memory, which every worker maps (None: each allocates its own)
        self.kv_memory: KVMemory | None = None
        if share_kv:
            try:
                self.kv_memory = KVMemory()
            except OSError as exc:  # a sandbox without memfd_create, say
                _log.warning("executor.kv_outlives_worker_unavailable", reason=str(exc))
        #: the int8 layouts' memory: given to the first worker (which packs into it) and to a
        #: later one only once the first has said where each layout is (then it maps them)
        self.layout_memory: KVMemory | None = None
        if share_layouts:
            with contextlib.suppress(OSError):  # then each worker packs its own
                self.layout_memory = KVMemory("stoic-layouts")
        self._spares_wanted = spares
        self._ready_timeout = ready_timeout
        self.current: WorkerProcess | None = None
        self._spares: list[WorkerProcess] = []
        #: imports done, nothing loaded: the next worker to load the model
        self._prestarted: WorkerProcess | None = None
        #: every worker started and not yet stopped (close() stops them all)
        self._started: list[WorkerProcess] = []
        self._closed = False
        #: a worker has been handed out before (later acquisitions are replacements)
        self._taken_over = False
        #: the first worker, ready and sized (:meth:`start`), until the first :meth:`acquire`
        self._first: WorkerProcess | None = None

    async def start(self) -> CacheSizing:
        """Start the first worker and wait until it has loaded the model and sized the KV cache;
        every later worker (spares, replacements) gets the same number of blocks: the
        scheduler's allocator is built from it once, and a replacement after an out-of-memory
        failure must not grow the cache.

        :raises ExecutorFault: the worker died or did not get ready.
        :raises InsufficientMemory: no KV cache fits.
        """
        worker = self._start(quiet=False)  # the start an operator watches
        _log.info("executor.worker_starting", pid=worker.pid, source="cold", early=worker.early)
        try:
            await worker.wait_ready(self._ready_timeout)
        except BaseException:  # died, timed out, or we were cancelled (a stop): never orphaned
            worker.kill()
            raise
        assert worker.sizing is not None
        self._spec = dataclasses.replace(
            self._spec,
            budget=dataclasses.replace(self._spec.budget, num_blocks=worker.sizing.num_blocks),
            # a later worker may start before its predecessor's device memory is free
            start_oom_wait=REPLACEMENT_OOM_WAIT,
            layout_table=worker.layout_table,
        )
        if not worker.layout_table and self.layout_memory is not None:
            # nothing packed there (a model without int8 layouts): a later worker must not
            # record into memory the first may map (it maps none: closing it is safe)
            self.layout_memory.close()
            self.layout_memory = None
        self._first = worker
        return worker.sizing

    def _new(self) -> WorkerProcess:
        self._started = [w for w in self._started if w.exited is None]
        worker = WorkerProcess()
        self._started.append(worker)
        return worker

    def _start(self, *, quiet: bool = True) -> WorkerProcess:
        """A worker that loads the model: the pre-started interpreter when it is alive.
        ``quiet``: its start's own events at debug (every worker but the first)."""
        worker, self._prestarted = self._prestarted, None
        if worker is None or not worker.alive:
            worker = self._new()
        kv = self.kv_memory.fd if self.kv_memory is not None else None
        layouts = self.layout_memory.fd if self.layout_memory is not None else None
        worker.quiet_start = quiet
        worker.load(self._spec, kv, layouts)
        return worker

    def _replenish(self) -> None:
        """Top the spares up to the configured number (they load in the background), and keep
        one pre-started interpreter."""
        if self._closed:
            return
        self._spares = [w for w in self._spares if w.alive]
        while len(self._spares) < self._spares_wanted:
            spare = self._start()
            spare.set_role("spare")  # once loaded: the pipe keeps the order
            self._spares.append(spare)
        if self._prestarted is None or not self._prestarted.alive:
            self._prestarted = self._new()

    async def acquire(self, *, drop: bool = True) -> tuple[WorkerProcess, bool]:
        """A ready worker for a new executor incarnation, and whether it is a new process.

        The current worker is kept if it is alive; otherwise a spare takes over (at once if it
        has loaded), or the pre-started interpreter loads the weights (a cold start), or a new
        process is started. ``drop``: the KV cache's contents are gone (the recovery dropped
        them): a kept worker drops its pools, and shared ones are punched out before a new
        worker serves from them. Without ``drop`` (shared pools, a failure that keeps them) a
        new worker serves on from the keys and values its predecessor computed.

        :raises ExecutorFault: if the new worker dies or does not get ready in time.
        """
        current = self.current
        if current is not None and current.alive:
            if drop:
                await current.reset(self._ready_timeout)
            return current, False
        self.current = None
        if drop and self.kv_memory is not None:
            self.kv_memory.drop()  # no worker serves from it now: spares only map it
        spares = [w for w in self._spares if w.alive]
        sized, self._first = self._first, None
        if sized is not None and sized.alive:  # started, and its start logged, by start()
            worker = sized
        else:
            source = "spare" if spares else "cold"
            worker = spares.pop(0) if spares else self._start()
            _log.info("executor.worker_starting", pid=worker.pid, source=source)
        self._spares = spares
        try:
            await worker.wait_ready(self._ready_timeout)
        except BaseException:  # died, timed out, or we were cancelled (a stop): never orphaned
            worker.kill()
            raise
        first = self.current is None and not self._taken_over
        self.current = worker
        self._taken_over = True
        if first:
            self._replenish()
        else:
            # after a replacement the new spare and interpreter load in the background; started
            # at once they would compete for the CPU with the first steps of the new worker
            asyncio.get_running_loop().call_later(_REPLENISH_DELAY, self._replenish)
        return worker, True

    def progress(self) -> int:
        """The current worker's progress counter (0 while there is none): what the scheduler's
        backstop watchdog watches."""
        current = self.current
        return current.progress.count if current is not None else 0

    def close(self) -> None:
        """Stop every worker started (current, spares, pre-started, any still loading)."""
        self._closed = True
        self._first = None
        for worker in self._started:
            worker.stop()
        self.current = None
        self._spares = []
        self._prestarted = None
        self._started = []
        for memory in (self.kv_memory, self.layout_memory):
            if memory is not None:
                memory.close()  # freed once the last worker's mapping is gone
