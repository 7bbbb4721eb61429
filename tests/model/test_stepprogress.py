"""The step progress counter: ticks inside a step only, the throttle of the ``slow`` fault, the
counter shared with another process (read there without a message), and the runner's ticks: a
step's start and end and each decoder layer, on every compute path."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import pytest

from stoic.kernels import Kernels
from stoic.model import PagedKVCache, StepProgress, load_model
from stoic.model._cdecode import CDecoder
from stoic.model._stepprogress import tick
from stoic.request import SamplingParams, SeqChunk, StepBatch
from stoic.worker import ModelRunner

#: the child: maps the page named by argv[1], ticks 5 times, blocks on stdin, ticks 3 more
_CHILD = textwrap.dedent(
    """
    import os, sys
    from stoic.model import StepProgress

    progress = StepProgress.attach(int(sys.argv[1]))
    os.close(int(sys.argv[1]))
    for _ in range(5):
        progress.tick()
    sys.stdin.readline()
    for _ in range(3):
        progress.tick()
    """
)


def _until(check: Callable[[], bool], limit: float) -> None:
    deadline = time.monotonic() + limit
    while not check():
        assert time.monotonic() < deadline, f"not within {limit}s"
        time.sleep(0.005)


def test_a_step_ticks_at_its_start_and_end_and_tick_counts_only_inside_a_step() -> None:
    progress = StepProgress()
    tick()  # no step runs on this thread: nothing to count
    assert progress.count == 0
    with progress.running():
        assert progress.count == 1  # the start
        tick()
        tick()
        assert progress.count == 3
    assert progress.count == 4  # the end
    tick()
    assert progress.count == 4


def test_ticks_count_for_the_step_running_on_their_own_thread() -> None:
    """Two counters, a step of each on its own thread: each thread's ticks land in its own."""
    mine, theirs = StepProgress(), StepProgress()

    def other() -> None:
        with theirs.running():
            for _ in range(10):
                tick()

    with mine.running():
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        tick()
    assert (mine.count, theirs.count) == (3, 12)


def test_a_throttled_step_waits_at_every_tick_and_the_throttle_ends_with_the_step() -> None:
    progress = StepProgress()
    progress.throttle(0.05)
    started = time.monotonic()

    def failing_step() -> None:
        with progress.running():
            tick()
            raise RuntimeError("the step failed")

    with pytest.raises(RuntimeError, match="the step failed"):
        failing_step()
    assert time.monotonic() - started >= 0.1  # the start and the layer each waited
    assert progress.count == 2  # no end tick for a step that raised
    started = time.monotonic()
    with progress.running():
        tick()
    assert time.monotonic() - started < 0.05  # the next step is not throttled


def test_a_buffer_too_small_or_read_only_is_refused() -> None:
    with pytest.raises(ValueError, match="writable buffer"):
        StepProgress(bytearray(4))
    with pytest.raises(ValueError, match="writable buffer"):
        StepProgress(bytes(8))


def test_the_shared_counter_is_read_across_the_process_boundary_while_the_child_is_busy() -> None:
    """The parent sees a child process's ticks while the child blocks (no message is sent),
    and the ones after it went on; the page outlives the child."""
    progress, fd = StepProgress.shared()
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(fd)], pass_fds=(fd,), stdin=subprocess.PIPE
    )
    os.close(fd)
    try:
        _until(lambda: progress.count == 5, 60)
        time.sleep(0.1)
        assert progress.count == 5  # blocked on stdin: no progress
        assert child.stdin is not None
        child.stdin.write(b"go\n")
        child.stdin.close()
        assert child.wait(60) == 0
    finally:
        if child.poll() is None:
            child.kill()
    assert progress.count == 8


def _ticks_per_step(runner: ModelRunner) -> list[int]:
    """The progress ticks of a prefill step (5 tokens) and of the decode step after it."""
    kv = PagedKVCache(runner.kv_spec(8, 4))
    params = SamplingParams(max_tokens=2, temperature=0)
    prefill = SeqChunk(0, (1, 2, 3, 4, 5), 0, (0, 1), True, params)
    ticks = []
    before = runner.progress.count
    token = runner.execute(StepBatch((prefill,), zero_blocks=(0, 1)), kv).sampled[0].token_id
    ticks.append(runner.progress.count - before)
    before = runner.progress.count
    runner.execute(StepBatch((SeqChunk(0, (token,), 5, (0, 1), True, params, 1),)), kv)
    ticks.append(runner.progress.count - before)
    return ticks


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "transformers"])
def test_a_step_ticks_at_its_start_at_each_decoder_layer_and_at_its_end(
    tiny_model_dir: Path, fused: bool
) -> None:
    """The tiny model (2 layers): 4 ticks a step, through the fused forward's layer loop and
    through forward pre-hooks on transformers' decoder layers alike."""
    runner = ModelRunner(
        load_model(str(tiny_model_dir), dtype="float32", device="cpu"), fused=fused
    )
    assert _ticks_per_step(runner) == [4, 4]


def test_a_decode_step_in_the_c_layers_ticks_at_each_layer(kernels: Kernels) -> None:
    """The default model (30 layers) on its quantised blocks: a step of few tokens (the
    5-token prefill, the decode after it) runs the C layers (:class:`CDecoder`) and ticks 32
    times, like the torch path's bigger steps (``test_a_step_ticks...``)."""
    runner = ModelRunner(load_model("default", dtype="float32", device="cpu"), quantization="gguf")
    assert runner.quantized["c_layers"]
    with mock.patch.object(CDecoder, "forward", autospec=True, side_effect=CDecoder.forward) as c:
        assert _ticks_per_step(runner) == [32, 32]
    assert c.call_count == 2  # the prefill and the decode step
