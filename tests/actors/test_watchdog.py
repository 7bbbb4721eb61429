"""The step watchdog's rule (:class:`ProgressWatch`): hung means no progress for the timeout,
however long the step has run."""

from __future__ import annotations

from stoic.actors import ProgressWatch


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_step_that_keeps_progressing_is_never_stalled_however_long_it_runs() -> None:
    clock, counter = _Clock(), [7]
    watch = ProgressWatch(lambda: counter[0], 2.0, clock=clock)
    for _ in range(100):  # 100 s, ten times the timeout over
        clock.now += 1.0
        counter[0] += 1
        assert not watch.stalled()
    assert watch.ticks == 100
    assert watch.fields() == {"since_progress": 0.0, "step_seconds": 100.0, "ticks": 100}


def test_a_step_without_progress_is_stalled_once_the_timeout_passed_since_its_last_tick() -> None:
    clock, counter = _Clock(), [0]
    watch = ProgressWatch(lambda: counter[0], 2.0, clock=clock)
    clock.now += 1.5
    assert not watch.stalled()
    counter[0] = 3  # progress at 1.5 s (seen at this look)
    clock.now += 0.5
    assert not watch.stalled()
    clock.now += 1.9
    assert not watch.stalled()
    clock.now += 0.1  # 2 s since the progress was seen
    assert watch.stalled()
    assert watch.fields() == {"since_progress": 2.0, "step_seconds": 4.0, "ticks": 3}


def test_the_watcher_looks_every_quarter_timeout_at_most_every_second() -> None:
    assert ProgressWatch(lambda: 0, 1.0).interval == 0.25
    assert ProgressWatch(lambda: 0, 120.0).interval == 1.0
    assert ProgressWatch(lambda: 0, 0.0).interval > 0
