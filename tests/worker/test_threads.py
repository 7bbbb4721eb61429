"""The thread governor: fewer compute threads while others take our CPUs, more when they idle."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from stoic.model import PagedKVCache, load_model
from stoic.request import SamplingParams, SeqChunk, StepBatch
from stoic.worker import ModelRunner, ThreadGovernor
from stoic.worker._threads import HOLD, MAX_HOLD, ContentionProbe


class FakeProbe:
    """Reports the CPU time others used that a test sets, per window."""

    available = True

    def __init__(self, cpus: int) -> None:
        self.cpus = cpus
        self.others = 0.0  # CPUs others used, on average

    def sample(self) -> float:
        return self.others  # over a 1 s window


class Harness:
    def __init__(self, budget: int = 4, adapt: bool = True, cpus: int | None = None) -> None:
        self.now = 0.0
        self.applied: list[int] = []
        self.probe = FakeProbe(cpus or budget)
        self.governor = ThreadGovernor(
            budget,
            adapt=adapt,
            probe=self.probe,  # type: ignore[arg-type]
            clock=lambda: self.now,
            set_threads=self.applied.append,
        )

    def window(self, others: float = 0.0) -> int:
        self.probe.others = others
        self.now += 1.0
        return self.governor.before_step()


def test_the_budget_is_applied_before_the_first_step() -> None:
    h = Harness(budget=3)
    assert h.governor.before_step() == 3
    assert h.applied == [3]
    h.governor.before_step()
    assert h.applied == [3]  # applied once, not at every step


def test_cpus_others_take_shrink_the_pool_to_what_is_left() -> None:
    """Others use ~2 of 4 CPUs: 2 threads; ~3.6: one, never fewer."""
    h = Harness(budget=4)
    h.governor.before_step()
    assert h.window(others=0.3) == 4  # a little kernel work: not worth a thread
    assert h.window(others=2.1) == 2
    assert h.window(others=3.6) == 1
    assert h.window(others=4.0) == 1
    assert h.applied == [4, 2, 1]
    assert h.governor.changes == 2


def test_no_decision_inside_a_window() -> None:
    h = Harness(budget=2)
    h.governor.before_step()
    h.probe.others = 2.0
    h.now += 0.5
    assert h.governor.before_step() == 2


def test_the_pool_grows_back_to_what_is_free_after_the_hold() -> None:
    h = Harness(budget=8)
    assert h.window(others=6.0) == 2
    assert h.window() == 2  # 1 s after shrinking: held
    assert h.window(others=2.9) == 5  # 2 s: grows to the CPUs left
    assert h.window() == 8
    assert h.window() == 8  # never past the budget


def test_the_budget_caps_the_pool_below_the_cpus() -> None:
    """A quota of 2 on 8 CPUs: 2 threads while others use up to 5.5 CPUs."""
    h = Harness(budget=2, cpus=8)
    for others in (0.0, 3.0, 5.4):
        assert h.window(others=others) == 2
    assert h.window(others=7.0) == 1


def test_a_raise_that_is_undone_doubles_the_hold_up_to_a_limit() -> None:
    """A neighbour that keeps coming back whenever we grow: raises grow rarer."""
    h = Harness(budget=2)
    h.window(others=1.0)
    raises = []
    for _ in range(400):
        if h.window() == 2:  # the CPU looked free, so we grew; the neighbour is back
            raises.append(h.now)
            assert h.window(others=1.0) == 1
    gaps = [b - a for a, b in itertools.pairwise(raises)]
    assert gaps[0] < gaps[2] < gaps[4]
    assert max(gaps) <= MAX_HOLD + 3
    assert h.governor._hold == MAX_HOLD


def test_a_raise_that_holds_resets_the_hold() -> None:
    h = Harness(budget=2)
    h.window(others=1.0)
    for _ in range(3):  # three undone raises: the hold grew
        while h.window() != 2:
            pass
        h.window(others=1.0)
    assert h.governor._hold == 8 * HOLD
    while h.window() != 2:
        pass
    for _ in range(12):  # the neighbour left: the width holds
        assert h.window() == 2
    assert h.governor._hold == HOLD


def test_fixed_threads_never_change() -> None:
    h = Harness(budget=2, adapt=False)
    for _ in range(5):
        assert h.window(others=2.0) == 2
    assert h.applied == [2]


def _lay_proc(proc: Path, cpu_busy: tuple[int, int, int], ours: tuple[int, int]) -> None:
    """/proc/stat with 3 CPUs (busy = user + system here), and two processes' stat files."""
    lines = ["cpu  1 2 3 4 5 6 7 8 9 10"]
    lines += [f"cpu{i} {b} 0 0 500 7 0 0 0 0 0" for i, b in enumerate(cpu_busy)]
    (proc / "stat").write_text("\n".join(lines) + "\n")
    for name, ticks in zip(("self", "42"), ours, strict=True):
        (proc / name).mkdir(exist_ok=True)
        rest = " ".join(["S", *["0"] * 10, str(ticks), "3", *["0"] * 30])
        (proc / name / "stat").write_text(f"{name} (python -m x (y)) {rest}\n")


def test_the_probe_reads_others_cpu_time_on_our_cpus(tmp_path: Path) -> None:
    """Busy time of the watched CPUs (idle and iowait excluded) less our processes' user and
    system time; CPUs not watched do not count; a process that is gone counts nothing."""
    tick = 1.0 / os.sysconf("SC_CLK_TCK")
    _lay_proc(tmp_path, (100, 100, 100), (10, 20))
    probe = ContentionProbe([0, 1], [42], proc=tmp_path)
    assert probe.available and probe.cpus == 2
    _lay_proc(tmp_path, (250, 180, 900), (60, 70))  # +230 busy on ours, +100 ours
    assert probe.sample() == pytest.approx(130 * tick)
    _lay_proc(tmp_path, (290, 180, 900), (70, 70))
    (tmp_path / "42" / "stat").unlink()  # the server is gone: its past time is not ours now
    assert probe.sample() == pytest.approx(30 * tick)
    _lay_proc(tmp_path, (290, 180, 900), (90, 70))  # a tick mismatch: never negative
    assert probe.sample() == 0.0


def test_without_proc_the_threads_stay_at_the_budget(tmp_path: Path) -> None:
    probe = ContentionProbe([0], proc=tmp_path)  # nothing laid out
    assert not probe.available
    governor = ThreadGovernor(2, probe=probe, set_threads=lambda n: None, interval=0.0)
    assert not governor.adaptive
    assert governor.before_step() == 2


def _spin_pool(stop: threading.Event, governor: ThreadGovernor) -> None:
    """Back-to-back parallel torch work on the governed pool (one thread runs the steps)."""
    a = torch.randn(384, 384)
    while not stop.is_set():
        governor.before_step()
        for _ in range(20):
            a = torch.tanh(a @ a) * 0.5


def _cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds the processes ``pids`` used so far."""
    ticks = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def _others(
    probe: ContentionProbe, seconds: float, pids: Sequence[int] = ()
) -> tuple[float, float]:
    """CPU seconds per second others used over the next ``seconds``, as the governor measures
    them; and those the processes ``pids`` used (within the same stretch)."""
    probe.sample()
    start, before = time.monotonic(), _cpu_seconds(pids)
    time.sleep(seconds)
    used = _cpu_seconds(pids) - before
    others = probe.sample()
    elapsed = time.monotonic() - start
    return others / elapsed, used / elapsed


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.slow
def test_busy_neighbours_shrink_a_real_pool_and_their_end_grows_it_back() -> None:
    """As many CPU-bound processes as there are CPUs, each in a session of its own (nice
    cannot shield us from another autogroup): the probe counts their CPU time as others', and
    the pool shrinks; once they end, it grows back as far as the CPUs others leave free.

    On a shared machine the other tenants come and go: what is asserted is measured here, in
    the same run (the neighbours' own CPU time, what the probe sees once they are gone), never
    a quiet machine assumed."""
    cpus = len(os.sched_getaffinity(0))
    if cpus < 2:
        pytest.skip("one CPU: nothing to shrink")
    watch = ContentionProbe(sorted(os.sched_getaffinity(0)))
    if not watch.available:
        pytest.skip("no per-thread scheduler statistics here")
    governor = ThreadGovernor(cpus, interval=0.5)
    stop = threading.Event()
    worker = threading.Thread(target=_spin_pool, args=(stop, governor), daemon=True)
    neighbours = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        for _ in range(cpus)
    ]
    pids = [p.pid for p in neighbours]
    try:
        worker.start()
        # the mechanism: every CPU second the neighbours get is others' to the probe (a tick
        # of rounding per process and read)
        others, used = _others(watch, 2.0, pids)
        assert used > 0.1, "the neighbours never ran"
        assert others >= used - len(pids) / os.sysconf("SC_CLK_TCK")
        deadline = time.monotonic() + 20
        while governor.threads == cpus and time.monotonic() < deadline:
            time.sleep(0.1)
        assert governor.threads < cpus
        shrunk = governor.threads
    finally:
        for p in neighbours:
            p.kill()
            p.wait()
    try:
        deadline = time.monotonic() + 10

        def waiting() -> bool:  # past the deadline and the governor's hold
            now = time.monotonic()
            return now < deadline or now - governor._lowered_at < governor._hold + 1

        while governor.threads <= shrunk and waiting():
            time.sleep(0.1)
        if governor.threads <= shrunk:
            # it did not grow: right only if others still take what a wider pool needs
            # (or it grew meanwhile)
            others, _ = _others(watch, 4.0)
            free = cpus - others
            assert governor.threads > shrunk or free < shrunk + 1, f"{free:.2f} CPUs free"
    finally:
        stop.set()
        worker.join(10)


def test_a_step_slowed_many_times_over_shrinks_its_pool_between_its_layers(
    tiny_model_dir: Path,
) -> None:
    """The governor is consulted between a step's decoder layers, not only before the step: a
    neighbour that arrives while a step runs (its window passes at the first layer) shrinks the
    pool for the step's remaining layers, whose operators then run on the new count; the step
    reports the count it ended on."""
    h = Harness(budget=2, cpus=2)
    applied = h.applied

    def set_threads(n: int) -> None:
        applied.append(n)
        torch.set_num_threads(n)

    h.governor = ThreadGovernor(
        2,
        probe=h.probe,  # type: ignore[arg-type]
        clock=lambda: h.now,
        set_threads=set_threads,
    )
    runner = ModelRunner(
        load_model(str(tiny_model_dir), dtype="float32", device="cpu"), threads=h.governor
    )
    seen: list[int] = []
    layers = runner._fused._layers if runner._fused is not None else []
    assert len(layers) == 2
    original = runner._fused.mlp_block if runner._fused is not None else None

    def mlp_block(*args: object, **kwargs: object) -> object:
        seen.append(torch.get_num_threads())
        h.probe.others, h.now = 1.5, h.now + 1.0  # a neighbour, and a window passes
        assert original is not None
        return original(*args, **kwargs)

    assert runner._fused is not None
    runner._fused.mlp_block = mlp_block  # type: ignore[method-assign]
    cache = PagedKVCache(runner.kv_spec(num_blocks=4, block_size=4))
    params = SamplingParams(max_tokens=4, temperature=0)
    try:
        out = runner.execute(
            StepBatch((SeqChunk(0, (1, 2, 3, 4, 5), 0, (0, 1), True, params),), zero_blocks=(0, 1)),
            cache,
        )
    finally:
        torch.set_num_threads(os.cpu_count() or 1)
    assert seen == [2, 1]  # the first layer on two threads, the second on one
    assert applied == [2, 1] and h.governor.threads == 1
    assert out.threads == 1
