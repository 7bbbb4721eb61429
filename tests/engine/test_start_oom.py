"""A worker's start waits out out-of-memory errors within its limit (stoic/executor/_startoom.py),
and only those."""

from __future__ import annotations

import pytest
import torch

from stoic.executor._startoom import ride_out_oom


class Clock:
    """A fake clock that moves only when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def _oom() -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_a_start_that_meets_ooms_is_tried_again_after_growing_pauses_until_it_passes() -> None:
    clock, reports, released = Clock(), [], []
    outcomes: list[BaseException | str] = [_oom(), _oom(), _oom(), "started"]

    def start() -> str:
        outcome = outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    got = ride_out_oom(
        start,
        within=30,
        release=lambda: released.append(clock.now),
        report=reports.append,
        sleep=clock.sleep,
        clock=lambda: clock.now,
    )
    assert got == "started" and not outcomes
    assert clock.sleeps == [0.25, 0.5, 1.0]
    assert len(released) == 3 and len(reports) == 3
    assert "out of memory while starting (try 1: CUDA out of memory." in reports[0]
    assert "trying again in 0.25 s (0.0 of 30 s waited)" in reports[0]


def test_an_oom_past_the_limit_is_raised_after_the_retries_that_fit() -> None:
    clock = Clock()
    tries = []

    def start() -> None:
        tries.append(clock.now)
        raise _oom()

    with pytest.raises(torch.OutOfMemoryError):
        ride_out_oom(
            start,
            within=5,
            release=lambda: None,
            report=lambda _: None,
            sleep=clock.sleep,
            clock=lambda: clock.now,
        )
    # pauses 0.25, 0.5, 1, 2 (3.75 s), then 2 more would pass 5 s
    assert tries == [0.0, 0.25, 0.75, 1.75, 3.75]
    assert clock.now <= 5


@pytest.mark.parametrize("within", [0.0, 30.0])
def test_other_errors_and_the_first_worker_are_not_retried(within: float) -> None:
    """Any error but an OOM is raised at once; with no wait (the first worker, whose OOM is the
    configuration's) an OOM is too; nothing is released or reported."""
    clock, reports = Clock(), []
    errors: list[BaseException] = [ValueError("bad config")] + ([_oom()] if not within else [])
    for error in errors:

        def start(error: BaseException = error) -> None:
            raise error

        with pytest.raises(type(error)):
            ride_out_oom(
                start,
                within=within,
                release=lambda: pytest.fail("released"),
                report=reports.append,
                sleep=clock.sleep,
                clock=lambda: clock.now,
            )
    assert clock.sleeps == [] and reports == []
