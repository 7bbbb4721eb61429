"""The process executor: real worker processes killed, crashed, poisoned and hung, replaced
while the engine keeps serving (no mock of the process boundary)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import structlog
from support import collect, engine_config, wait_idle, wait_replaced

import stoic
from stoic.errors import EngineFailed, ExecutorFailed, InvalidRequest
from stoic.kernels import Kernels
from stoic.model import default_gguf_path

pytestmark = [pytest.mark.model]

PARAMS = stoic.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def _config(model_dir: Path, **overrides: Any) -> stoic.EngineConfig:
    return engine_config(model_dir, **{"executor": "process", **overrides})


def _prompts(n: int) -> list[str]:
    topics = ["the sea", "a cat", "winter", "bread", "a robot", "the moon", "tea", "trains"]
    return [f"Write about {topics[i % len(topics)]} (#{i})." for i in range(n)]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie still answers signal 0: look at its state
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] == "Z"


@pytest.mark.asyncio
async def test_the_model_runs_in_a_worker_process_and_matches_the_thread_executor(
    tiny_model_dir: Path,
) -> None:
    """The worker is another process; greedy outputs equal the thread executor's."""
    prompts = _prompts(4)
    async with stoic.Engine.start(_config(tiny_model_dir, executor="thread")) as engine:
        expected = [(await engine.complete(p, PARAMS)).text for p in prompts]
    async with stoic.Engine.start(_config(tiny_model_dir)) as engine:
        pid = engine.stats().executor_pid
        assert pid is not None and pid != os.getpid()
        assert engine.loaded.model is None  # no weights in the server process
        got = await asyncio.gather(*(engine.complete(p, PARAMS) for p in prompts))
        assert [r.text for r in got] == expected


@pytest.mark.asyncio
async def test_kill_9_of_the_worker_fails_every_stream_with_its_prefix_and_a_new_worker_serves(
    tiny_model_dir: Path,
) -> None:
    """kill -9 of the worker while 16 streams run: each ends with ExecutorFailed (kind crash,
    the message names SIGKILL) whose partial is a prefix of its fault-free text; a new worker
    process serves, no KV block stays used, and the next greedy answer equals the one before."""
    prompts = _prompts(16)
    async with stoic.Engine.start(_config(tiny_model_dir)) as engine:
        reference = [(await engine.complete(p, PARAMS)).text for p in prompts]
        streams = [await engine.submit(p, PARAMS) for p in prompts]
        await streams[0].__anext__()  # generation is under way
        pid = engine.stats().executor_pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        outcomes = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 30)
        for (text, error), ref in zip(outcomes, reference, strict=True):
            if error is None:  # it finished before the kill landed
                assert text == ref
                continue
            assert isinstance(error, ExecutorFailed) and error.kind == "crash"
            assert "SIGKILL" in error.message
            assert error.partial is not None and ref.startswith(error.partial.text)
        assert any(error is not None for _, error in outcomes)
        await wait_replaced(engine, pid)
        stats = await wait_idle(engine)
        assert stats.kv_blocks_used == 0
        assert dict(stats.restarts_by_kind) == {"crash": 1}
        assert (await engine.complete(prompts[0], PARAMS)).text == reference[0]


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["segfault", "abort", "fatal", "hang"])
async def test_each_process_fault_is_survived(tiny_model_dir: Path, kind: str) -> None:
    """A real SIGSEGV, an abort, a poisoned-device error and a hung step (short step timeout)
    each fail the running streams with their prefix, the worker is replaced (a new pid), and
    the next request is served correctly."""
    prompts = _prompts(4)
    config = _config(tiny_model_dir, step_timeout=2.0)
    async with stoic.Engine.start(config) as engine:
        reference = [(await engine.complete(p, PARAMS)).text for p in prompts]
        pid = engine.stats().executor_pid
        await engine.inject_fault(stoic.FaultSpec(kind=kind, after_steps=3, seconds=60))  # type: ignore[arg-type]
        streams = [await engine.submit(p, PARAMS) for p in prompts]
        outcomes = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 60)
        expected_kind = {"segfault": "crash", "abort": "crash"}.get(kind, kind)
        for (text, error), ref in zip(outcomes, reference, strict=True):
            if error is None:  # it had not started: it waited for the new worker
                assert text == ref
                continue
            assert isinstance(error, ExecutorFailed), error
            assert error.kind == expected_kind
            assert error.partial is not None and ref.startswith(error.partial.text)
        assert any(error is not None for _text, error in outcomes)
        await wait_replaced(engine, pid)
        assert pid is not None and _gone(pid)
        assert (await wait_idle(engine)).kv_blocks_used == 0
        assert (await engine.complete(prompts[1], PARAMS)).text == reference[1]


@pytest.mark.asyncio
async def test_an_error_keeps_the_worker_process(tiny_model_dir: Path) -> None:
    """A step that raises (the worker survives) restarts the executor on the same process with
    fresh KV pools: no cold start."""
    async with stoic.Engine.start(_config(tiny_model_dir)) as engine:
        pid = engine.stats().executor_pid
        await engine.inject_fault(stoic.FaultSpec(kind="error", after_steps=1))
        _text, error = await collect(await engine.submit("hello", PARAMS))
        assert isinstance(error, ExecutorFailed) and error.kind == "error"
        await wait_replaced(engine, None, restarts=1)
        assert engine.stats().executor_pid == pid
        assert (await engine.complete("hello", PARAMS)).completion_tokens == 40


@pytest.mark.asyncio
async def test_a_spare_takes_over_and_restart_intensity_still_fails_the_engine(
    tiny_model_dir: Path,
) -> None:
    """With a warm spare, a killed worker is replaced by the spare; more than ``max_restarts``
    failures within the window still fail the engine (503 for new requests, nothing hangs)."""
    config = _config(tiny_model_dir, executor_spares=1, max_restarts=1, restart_window=60.0)
    async with stoic.Engine.start(config) as engine:
        first = engine.stats().executor_pid
        assert first is not None
        await asyncio.sleep(0.5)  # the spare starts loading once the first worker is ready
        os.kill(first, signal.SIGKILL)
        await wait_replaced(engine, first)
        second = engine.stats().executor_pid
        assert second is not None and second != first
        os.kill(second, signal.SIGKILL)
        failure = await asyncio.wait_for(engine.wait_failed(), 30)
        assert "exited 2 times" in str(failure)
        with pytest.raises(EngineFailed):
            await engine.submit("hello", PARAMS)


@pytest.mark.asyncio
async def test_closing_the_engine_ends_every_worker_reader_cleanly(tiny_model_dir: Path) -> None:
    """After close, each worker's reader thread (current, spare and pre-started interpreter)
    has ended and closed its socket, and none raised: one thread closes the connection."""
    raised: list[threading.ExceptHookArgs] = []
    previous = threading.excepthook
    threading.excepthook = raised.append
    try:
        for _ in range(2):
            async with stoic.Engine.start(_config(tiny_model_dir, executor_spares=1)) as engine:
                assert (await engine.complete("hello", PARAMS)).completion_tokens == 40
                readers = [t for t in threading.enumerate() if t.name.startswith("stoic-worker-")]
                assert len(readers) >= 2  # the current worker and at least one more
            deadline = time.monotonic() + 10
            while any(t.is_alive() for t in readers):
                assert time.monotonic() < deadline, [t.name for t in readers if t.is_alive()]
                await asyncio.sleep(0.02)
    finally:
        threading.excepthook = previous
    assert raised == []


@pytest.mark.asyncio
async def test_process_ending_faults_are_refused_with_the_thread_executor(
    tiny_model_dir: Path,
) -> None:
    """crash, segfault and abort would kill the server itself: refused when armed (and at start)."""
    for kind in ("crash", "segfault", "abort"):
        spec = stoic.FaultSpec(kind=kind, after_steps=1)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="process executor"):
            _config(tiny_model_dir, executor="thread", faults=(spec,))
    async with stoic.Engine.start(_config(tiny_model_dir, executor="thread")) as engine:
        with pytest.raises(InvalidRequest, match="process executor"):
            await engine.inject_fault(stoic.FaultSpec(kind="crash", after_steps=1))


def test_the_worker_dies_with_the_server(tiny_model_dir: Path, tmp_path: Path) -> None:
    """kill -9 of the server process: its worker process is gone within 5 seconds."""
    script = tmp_path / "server.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import asyncio, sys
            import stoic

            async def main():
                config = stoic.EngineConfig(model={str(tiny_model_dir)!r}, executor="process",
                                            num_kv_blocks=64)
                async with stoic.Engine.start(config) as engine:
                    print("worker", engine.stats().executor_pid, flush=True)
                    await asyncio.sleep(120)

            asyncio.run(main())
            """
        )
    )
    server = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        assert server.stdout is not None
        line = ""
        while not line.startswith("worker "):  # stoic's own log lines come first
            line = server.stdout.readline()
            assert line, "the server ended before it started"
        worker = int(line.split()[1])
        assert not _gone(worker)
        server.kill()
        server.wait(10)
        deadline = time.monotonic() + 5.0
        while not _gone(worker):
            assert time.monotonic() < deadline, "the worker outlived its server"
            time.sleep(0.05)
    finally:
        server.kill()
        server.wait(10)
        if server.stdout is not None:
            server.stdout.close()


@pytest.mark.asyncio
async def test_a_replacement_that_meets_an_oom_at_start_waits_for_the_memory_and_serves(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kill -9 of the worker; its replacement's load raises torch's out-of-memory error twice
    (a GPU whose driver has not yet freed the killed process's memory): the start is tried
    again after a short wait, each retry is logged, the replacement serves the same greedy text
    and the recovery counts one crash, no failed start."""
    from stoic.executor import _process

    counter = tmp_path / "ooms"
    counter.write_text("2")
    monkeypatch.setenv("STOIC_TEST_OOM_STARTS", str(counter))
    here = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setattr(_process, "WORKER_MODULE", "oom_start_worker")
    with structlog.testing.capture_logs() as logs:
        async with stoic.Engine.start(_config(tiny_model_dir)) as engine:
            before = (await engine.complete("Hello", PARAMS)).text
            pid = engine.stats().executor_pid
            assert pid is not None
            stream = await engine.submit("Write about the sea.", PARAMS)
            await stream.__anext__()  # generation is under way
            os.kill(pid, signal.SIGKILL)
            await collect(stream)
            await wait_replaced(engine, pid, restarts=1)
            assert (await engine.complete("Hello", PARAMS)).text == before
            assert dict(engine.stats().restarts_by_kind) == {"crash": 1}
    assert counter.read_text() == "0"
    retries = [
        e for e in logs if "out of memory while starting" in str(e.get("line", e.get("output")))
    ]
    assert len(retries) == 2, [e for e in logs if e["event"] == "executor.worker_output"]


@pytest.mark.model
@pytest.mark.asyncio
async def test_a_spare_and_a_replacement_map_the_layouts_the_first_worker_packed(
    kernels: Kernels,
) -> None:
    """The default GGUF model with int8 layouts (AVX-512 VNNI): the first worker packs them
    into the server's shared memory; the warm spare that takes over after kill -9 and the
    worker replacing it after a second kill map all of them (none packed privately), and each
    serves the greedy text the first did."""
    if not kernels.int8_rows:
        pytest.skip("this CPU has no AVX-512 VNNI: no int8 layouts to share")
    config = stoic.EngineConfig(
        model=str(default_gguf_path()), executor="process", dtype="auto", num_kv_blocks=256
    )
    config = dataclasses.replace(config, executor_spares=1)
    params = stoic.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    texts = []
    with structlog.testing.capture_logs() as logs:
        async with stoic.Engine.start(config) as engine:
            texts.append((await engine.complete("Hello", params)).text)
            for restarts in (1, 2):
                pid = engine.stats().executor_pid
                assert pid is not None
                os.kill(pid, signal.SIGKILL)
                await wait_replaced(engine, pid, restarts=restarts)
                texts.append((await engine.complete("Hello", params)).text)
    assert texts == [texts[0]] * 3
    first, *later = [e for e in logs if e["event"] == "model.layouts_shared"]
    assert first["first"] and first["shared_packed_mib"] > 50 and first["private_mib"] == 0
    assert len(later) >= 2, later
    for event in later:
        assert not event["first"] and event["private_mib"] == 0, event
        assert event["shared_mapped_mib"] == first["shared_packed_mib"], event


@pytest.mark.asyncio
async def test_a_spare_starting_never_stalls_the_event_loop(tiny_model_dir: Path) -> None:
    """The warm spare starts as a fresh interpreter while the engine starts; its spec (with
    the tokenizer's vocabulary: megabytes, more than the socket holds) and its role wait for
    its imports in a thread, never on the event loop: the loop ticks on every 50 ms, no gap
    reaching a second, through the start and the spare's load."""
    loop = asyncio.get_running_loop()
    gaps: list[float] = []

    async def tick() -> None:
        last = loop.time()
        while True:
            await asyncio.sleep(0.05)
            now = loop.time()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    try:
        async with stoic.Engine.start(_config(tiny_model_dir, executor_spares=1)) as engine:
            await asyncio.sleep(4.0)  # the spare imports and loads meanwhile
            assert (await engine.complete("Hello", PARAMS)).text
    finally:
        ticker.cancel()
    assert gaps and max(gaps) < 1.0, max(gaps)
