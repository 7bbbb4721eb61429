"""The executor worker processes' titles: ``ps`` tells the serving worker (and its executor
incarnation) from a warm spare and the pre-started interpreter."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
from support import engine_config

import stoic
from stoic import _proctitle
from stoic.errors import ExecutorFailed


def _titles() -> dict[int, str]:
    """This process's children and their command lines (``/proc/<pid>/cmdline``)."""
    titles = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == os.getpid():
                raw = (entry / "cmdline").read_bytes()
                titles[int(entry.name)] = raw.replace(b"\0", b" ").decode().strip()
        except OSError:
            continue  # gone meanwhile
    return titles


async def _until_titles(
    engine: stoic.Engine, incarnation: int, limit: float = 180
) -> dict[int, str]:
    """Wait until the serving worker says so and a spare and a pre-started interpreter are
    ready; the titles then."""
    deadline = time.monotonic() + limit
    while True:
        titles = _titles()
        serving = engine.stats().executor_pid
        wanted = {f"stoic: executor {incarnation} (serving)", "stoic: executor (spare)"}
        wanted.add("stoic: executor (pre-started)")
        if serving is not None and sorted(titles.values()) == sorted(wanted):
            return titles
        assert time.monotonic() < deadline, titles
        await asyncio.sleep(0.2)


def test_titles_read_role_and_incarnation() -> None:
    assert _proctitle.title("spare") == "stoic: executor (spare)"
    assert _proctitle.title("serving", 3) == "stoic: executor 3 (serving)"


def test_without_setproctitle_the_title_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The package is optional at run time: without it nothing is set and nothing fails."""
    calls: list[str] = []
    monkeypatch.setattr(_proctitle, "_setproctitle", calls.append)
    _proctitle.set_title("spare")
    assert calls == ["stoic: executor (spare)"]
    monkeypatch.setattr(_proctitle, "_setproctitle", None)
    _proctitle.set_title("spare")
    assert calls == ["stoic: executor (spare)"]


@pytest.mark.model
async def test_worker_titles_follow_their_roles(tiny_model_dir: Path) -> None:
    """With a spare: the serving worker is ``stoic: executor 0 (serving)``, the others
    ``(spare)`` and ``(pre-started)``; when the serving worker is killed, the spare takes over
    and its title becomes ``stoic: executor 1 (serving)``."""
    config = engine_config(tiny_model_dir, executor="process", executor_spares=1, num_kv_blocks=64)
    async with stoic.Engine.start(config) as engine:
        titles = await _until_titles(engine, 0)
        first = engine.stats().executor_pid
        assert first is not None and titles[first] == "stoic: executor 0 (serving)"
        spare = next(pid for pid, title in titles.items() if title.endswith("(spare)"))
        await engine.inject_fault(stoic.FaultSpec(kind="crash", after_steps=1))
        with pytest.raises(ExecutorFailed):
            await engine.complete("Hello", stoic.SamplingParams(max_tokens=2))
        deadline = time.monotonic() + 60
        while not (engine.health().ok and engine.stats().executor_pid == spare):
            assert time.monotonic() < deadline, engine.health()
            await asyncio.sleep(0.05)
        deadline = time.monotonic() + 10
        while _titles().get(spare) != "stoic: executor 1 (serving)":
            assert time.monotonic() < deadline, _titles()
            await asyncio.sleep(0.05)
