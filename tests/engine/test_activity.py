"""``Engine.activity()``: the sequences in the engine now, and the incident log (each executor
failure with its kind, time to recover and what became of the streams) the console shows."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from support import collect, engine_config, until, wait_idle

import stoic
from stoic.engine._incidents import IncidentLog

# the model tests are marked ``model`` by their fixture (tests/conftest.py); asyncio_mode is auto

LONG = stoic.SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)


async def test_activity_lists_each_running_sequence_with_its_tokens_and_age(
    tiny_model_dir: Path,
) -> None:
    """While a request generates, it is listed as running under its id, with tokens so far at
    most its max_tokens and an age that grows; once it ends the list is empty again."""
    config = engine_config(tiny_model_dir, executor="thread")
    async with stoic.Engine.start(config) as engine:
        assert engine.activity().incidents == ()
        stream = await engine.submit("Once upon a time", LONG, request_id="req-watched")
        async with stream:
            await stream.__anext__()
            first = engine.activity()
            [view] = first.running
            assert (view.request_id, view.status, view.max_tokens) == ("req-watched", "running", 48)
            assert 0 < view.generated <= 48
            assert first.waiting == ()
            await asyncio.sleep(0.05)
            later = engine.activity()
            if later.running:  # still generating: older, and not fewer tokens
                assert later.running[0].age > view.age
                assert later.running[0].generated >= view.generated
            await collect(stream)
        await wait_idle(engine)
        assert engine.activity().running == ()
        assert engine.activity().token_budget_configured == config.step_token_budget("cpu")


@pytest.mark.parametrize(
    ("recovery", "resumed", "failed"), [("fail", 0, 1), ("resume", 1, 0)], ids=["fail", "resume"]
)
async def test_an_executor_failure_is_one_incident_with_its_time_to_recover_and_streams(
    tiny_model_dir: Path, recovery: str, resumed: int, failed: int
) -> None:
    """An injected error mid-stream is logged as one incident: kind ``error``, the failed
    incarnation, a positive time to recover once the next executor serves, and the stream
    failed with its partial output (``fail``) or resumed (``resume``)."""
    config = engine_config(tiny_model_dir, executor="thread", recovery=recovery)
    async with stoic.Engine.start(config) as engine:
        stream = await engine.submit("Once upon a time", LONG)
        await stream.__anext__()
        await engine.inject_fault(stoic.FaultSpec(kind="error", after_steps=2))
        _text, error = await collect(stream)
        assert (error is None) == (recovery == "resume")
        await until(lambda: engine.health().ok and engine.stats().restarts == 1, 10, "restart")
        [incident] = engine.activity().incidents
        assert (incident.kind, incident.incarnation) == ("error", 0)
        assert "injected fault" in incident.error
        assert incident.recovered_after is not None and incident.recovered_after > 0
        assert not incident.recovering
        assert (incident.resumed, incident.failed, incident.isolated) == (resumed, failed, 0)


def test_the_incident_log_keeps_the_last_n_and_closes_only_an_open_one() -> None:
    """A bounded ring: the oldest incidents leave first; an executor ready with no incident
    open changes nothing; the engine failing marks the open incident, never a closed one."""
    log = IncidentLog(kept=3)
    log.ready()  # the first executor: no incident
    assert log.incidents == ()
    for n in range(5):
        log.opened("oom", n, 100 + n, f"failure {n}")
        log.ready()
    assert [i.incarnation for i in log.incidents] == [2, 3, 4]
    assert all(i.recovered_after is not None for i in log.incidents)
    log.engine_failed("too many")  # nothing open: the recovered incident stays recovered
    assert log.incidents[-1].engine_failed is None
    log.opened("crash", 5, None, "killed")
    log.engine_failed("too many")
    last = log.incidents[-1]
    assert (last.engine_failed, last.recovered_after, last.recovering) == ("too many", None, False)
