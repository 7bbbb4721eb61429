"""Two engine replicas on Ray Serve behind one OpenAI endpoint: basics, spreading, migration on
a replica's death or failure, replacement, disconnects.

One local Ray and one deployment for the whole module (Ray starts in ~15-20 s here); the tests
run in order and each leaves two healthy replicas behind.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import pytest_asyncio
from support import http_endpoint

pytest.importorskip("ray")

from stoic import EngineConfig, FaultSpec
from stoic.ray import MigratingStream, RayEngine, ReplicaOptions, run_replicas

pytestmark = pytest.mark.asyncio(loop_scope="module")

#: prompts whose greedy continuations the migration tests compare
PROMPTS = [f"Story number {i}: once upon a time" for i in range(6)]
MAX_TOKENS = 48


@dataclass
class Deployed:
    url: str
    engine: RayEngine

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120
        )

    async def replicas(self) -> dict[str, Any]:
        """Replica id -> its latest stats, read from the board now."""
        return {p.replica: p.stats for p in await self.engine.view.refresh()}

    async def pid_of(self, replica: str) -> int:
        (pid,) = [p.pid for p in await self.engine.view.refresh() if p.replica == replica]
        return pid


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def deployed(tiny_model_dir: Path) -> AsyncIterator[Deployed]:
    config = EngineConfig(
        model=str(tiny_model_dir),
        served_model_name="tiny",
        device="cpu",
        dtype="float32",
        # a worker process per replica: a crash of it is recovered in place (seconds: a cold
        # worker), which must not make Serve replace the replica
        executor="process",
        recovery="resume",
        # a second executor failure within a minute fails the engine (Serve then replaces it)
        max_restarts=1,
        restart_window=60.0,
        num_kv_blocks=128,
        max_model_len=512,
        enable_fault_injection=True,
        drain_timeout=2.0,
    )
    options = ReplicaOptions(
        replicas=2,
        num_cpus=1,
        threads=1,
        health_check_period_s=1.0,
        health_check_timeout_s=10.0,
        max_migrations=3,
    )
    ray_init = {"num_cpus": 2, "include_dashboard": False, "log_to_driver": False}
    async with run_replicas(config, options, ray_init=ray_init) as engine:
        engine.retry_delay = 0.2
        async with http_endpoint(engine) as url:
            yield Deployed(url, engine)


async def wait_for(predicate: Any, within: float, what: str) -> float:
    """Poll ``predicate`` (async) until true; return the seconds it took."""
    started = time.monotonic()
    while not await predicate():
        if time.monotonic() - started > within:
            raise AssertionError(f"not within {within} s: {what}")
        await asyncio.sleep(0.25)
    return time.monotonic() - started


def recording(deployed: Deployed, streams: list[MigratingStream]) -> Any:
    """The engine's ``submit``, also appending each stream it returns to ``streams`` (to find
    the replica that holds the most)."""
    submit = deployed.engine.submit

    async def recording_submit(request: Any) -> MigratingStream:
        stream = await submit(request)
        streams.append(stream)
        return stream

    return recording_submit


async def two_serving(deployed: Deployed, gone: str) -> bool:
    """Two replicas serve, and ``gone`` is not one of them."""
    replicas = await deployed.replicas()
    serving = [r for r, s in replicas.items() if s.state == "serving"]
    return len(serving) == 2 and gone not in replicas


async def stream_text(
    client: openai.AsyncOpenAI, prompt: str, started: asyncio.Event | None = None
) -> tuple[str, str]:
    """Stream a greedy completion; return its text and finish reason."""
    stream = await client.completions.create(
        model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    text, finish = [], ""
    async for chunk in stream:
        choice = chunk.choices[0]
        text.append(choice.text)
        if started is not None and choice.text:
            started.set()
        finish = choice.finish_reason or finish
    return "".join(text), finish


async def reference(client: openai.AsyncOpenAI) -> list[str]:
    out = await asyncio.gather(
        *(
            client.completions.create(model="tiny", prompt=p, max_tokens=MAX_TOKENS, temperature=0)
            for p in PROMPTS
        )
    )
    return [r.choices[0].text for r in out]


async def test_openai_basics_through_the_endpoint(deployed: Deployed) -> None:
    """The official SDK gets chat, completions, streaming and the model list from the Ray
    endpoint exactly as from one server; streamed and whole texts agree."""
    async with deployed.client() as client:
        models = await client.models.list()
        assert [m.id for m in models.data] == [deployed.engine.model_name]
        chat = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=8,
            temperature=0,
        )
        assert chat.usage is not None
        if chat.choices[0].finish_reason == "length":
            assert chat.usage.completion_tokens == 8
        else:
            assert chat.choices[0].finish_reason == "stop"
        whole = await client.completions.create(
            model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0
        )
        streamed, finish = await stream_text(client, PROMPTS[0])
        assert streamed == whole.choices[0].text
        assert finish == whole.choices[0].finish_reason
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(model="tiny", prompt="x", max_tokens=10_000)


async def test_requests_spread_over_both_replicas(deployed: Deployed) -> None:
    """Concurrent requests land on both replicas (each replica generated tokens)."""
    before = await deployed.replicas()
    async with deployed.client() as client:
        await asyncio.gather(
            *(
                client.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0)
                for p in PROMPTS * 2
            )
        )
    await asyncio.sleep(1.5)  # the replicas post every second
    after = await deployed.replicas()
    assert set(after) == set(before)
    gained = {r: after[r].generated_tokens - before[r].generated_tokens for r in after}
    assert all(g > 0 for g in gained.values()), gained


async def test_a_recovering_replica_is_not_replaced(deployed: Deployed) -> None:
    """A replica whose executor worker crashes recovers in place: Serve keeps it (the same
    replica actor, its pid unchanged, never off the board), its engine runs a new executor
    worker, and the streams on it resume there with their fault-free text.

    How long the recovery lasts is not asserted: with the worker's interpreter started early it
    may end within one posting period (1 s), so the board need not ever show ``recovering``;
    that the health check passes in that state is ``test_ray_units``' health verdict test."""
    async with deployed.client() as client:
        expected = await reference(client)
        victim = await deployed.engine.inject_fault_on_replica(
            FaultSpec(kind="crash", after_steps=2)
        )
        before = (await deployed.replicas())[victim]
        replica_pid = await deployed.pid_of(victim)
        seen: set[str] = set()

        async def watch() -> None:
            while True:
                stats = (await deployed.replicas()).get(victim)
                seen.add(stats.state if stats is not None else "gone")
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch())
        try:
            for _ in range(5):  # until a request reaches the armed replica
                results = await asyncio.gather(*(stream_text(client, p) for p in PROMPTS))
                assert [t for t, _ in results] == expected
                if (await deployed.replicas())[victim].restarts:
                    break
            else:
                raise AssertionError("no request reached the armed replica")
            await asyncio.sleep(4.0)  # more than 3 health periods after the recovery
        finally:
            watcher.cancel()
    assert seen <= {"serving", "recovering"}, seen
    replicas = await deployed.replicas()
    assert replicas[victim].state == "serving"
    assert dict(replicas[victim].restarts_by_kind)["crash"] == 1
    assert await deployed.pid_of(victim) == replica_pid
    assert replicas[victim].incarnation == before.incarnation + 1
    assert replicas[victim].executor_pid not in (None, before.executor_pid)


async def test_kill_of_a_replica_mid_stream_migrates_every_stream(
    deployed: Deployed, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kill -9 of a replica's process while streams run on it: every stream completes with its
    fault-free text (greedy float32), the client sees no error, and Serve starts a replacement."""
    streams: list[MigratingStream] = []
    recording_submit = recording(deployed, streams)
    async with deployed.client() as client:
        expected = await reference(client)
        started = [asyncio.Event() for _ in PROMPTS]
        # the victim is the replica Serve gave the most streams (its router may give one
        # replica all of them): a replica chosen beforehand may hold none
        monkeypatch.setattr(deployed.engine, "submit", recording_submit)
        tasks = [
            asyncio.create_task(stream_text(client, p, e))
            for p, e in zip(PROMPTS, started, strict=True)
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        held = Counter(s.replicas[-1] for s in streams)
        assert sum(held.values()) == len(PROMPTS)
        victim = held.most_common(1)[0][0]
        pid = await deployed.pid_of(victim)
        migrated = deployed.engine.view.migrated
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        results = await asyncio.gather(*tasks)
    assert [text for text, _ in results] == expected
    assert deployed.engine.view.migrated > migrated
    back = await wait_for(lambda: two_serving(deployed, victim), 90, "a replacement replica")
    print(
        f"replica back {time.monotonic() - killed_at:.1f} s after the kill ({back:.1f} s after the streams ended)"
    )
    assert victim not in await deployed.replicas()


#: one request of each kind that migrates (the extra fields of a completion): sampled with a
#: seed, constrained by a regex, with logprobs, two choices
KINDS: dict[str, dict[str, Any]] = {
    "seeded": {"temperature": 0.9, "top_p": 0.95, "seed": 7},
    "constrained": {"temperature": 0, "extra_body": {"guided_regex": "[a-z ]+"}},
    "logprobs": {"temperature": 0, "logprobs": 2},
    "n=2": {"temperature": 0.8, "seed": 3, "n": 2},
}


def _choices(choices: Any) -> list[tuple[str, Any]]:
    """(text, logprobs' tokens and values) of each choice, in index order."""
    out = []
    for choice in sorted(choices, key=lambda c: c.index):
        lp = choice.logprobs
        out.append((choice.text, (lp.tokens, lp.token_logprobs) if lp is not None else None))
    return out


async def test_kill_of_a_replica_migrates_every_kind_of_request_exactly(
    deployed: Deployed, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kill -9 of the replica holding most streams while a seeded, a constrained (regex), a
    logprobs and an n=2 request stream, each twice: every one completes with exactly its
    fault-free choices (text, tokens' logprobs to rounding), the constrained ones within their
    grammar."""
    streams: list[MigratingStream] = []
    recording_submit = recording(deployed, streams)
    prompts = [(kind, f"{PROMPTS[i % len(PROMPTS)]} ({kind})") for i, kind in enumerate(KINDS)] * 2

    async def run(kind: str, prompt: str, started: asyncio.Event | None) -> list[Any]:
        stream = await client.completions.create(
            model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, stream=True, **KINDS[kind]
        )
        got: dict[int, list[Any]] = {}
        async for chunk in stream:
            for choice in chunk.choices:
                got.setdefault(choice.index, []).append(choice)
                if started is not None and choice.text:
                    started.set()
        out = []
        for index in sorted(got):
            parts = got[index]
            text = "".join(c.text for c in parts)
            lps = [c.logprobs for c in parts if c.logprobs is not None]
            tokens = [t for lp in lps for t in lp.tokens] if lps else None
            values = [v for lp in lps for v in lp.token_logprobs] if lps else None
            out.append((text, (tokens, values) if lps else None))
        return out

    async with deployed.client() as client:
        expected = []
        for kind, prompt in prompts:
            whole = await client.completions.create(
                model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, **KINDS[kind]
            )
            expected.append(_choices(whole.choices))
        started = [asyncio.Event() for _ in prompts]
        monkeypatch.setattr(deployed.engine, "submit", recording_submit)
        tasks = [
            asyncio.create_task(run(kind, prompt, event))
            for (kind, prompt), event in zip(prompts, started, strict=True)
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        held = Counter(s.replicas[-1] for s in streams)
        victim = held.most_common(1)[0][0]
        migrated = deployed.engine.view.migrated
        os.kill(await deployed.pid_of(victim), signal.SIGKILL)
        results = await asyncio.gather(*tasks)
    assert deployed.engine.view.migrated > migrated
    # the victim held the most streams (n=2 is two): at least half of them moved
    moved = [s for s in streams if s.migrations]
    assert len(moved) >= len(streams) / 2, (len(moved), len(streams))
    for (kind, _prompt), got, want in zip(prompts, results, expected, strict=True):
        assert [text for text, _ in got] == [text for text, _ in want], kind
        for (_, lp_got), (_, lp_want) in zip(got, want, strict=True):
            if lp_want is not None:
                assert lp_got is not None and lp_got[0] == lp_want[0], kind
                assert lp_got[1] == pytest.approx(lp_want[1], abs=1e-4), kind
        if kind == "constrained":
            assert all(set(text) <= set("abcdefghijklmnopqrstuvwxyz ") for text, _ in got)
    await wait_for(lambda: two_serving(deployed, victim), 90, "a replacement replica")


async def test_failed_engine_replica_is_replaced_and_its_streams_migrate(
    deployed: Deployed,
) -> None:
    """A replica whose engine fails (its executor fails more often than --max-restarts allows)
    is replaced by Serve; the streams it held continue on the other replica with their
    fault-free text."""
    async with deployed.client() as client:
        expected = await reference(client)
        victim = await deployed.engine.inject_fault_on_replica(
            FaultSpec(kind="error", probability=1.0)
        )
        texts: list[str] = []
        for _ in range(5):  # until a request reaches the armed replica
            results = await asyncio.gather(*(stream_text(client, p) for p in PROMPTS))
            texts = [t for t, _ in results]
            assert texts == expected
            replicas = await deployed.replicas()
            if replicas.get(victim) is None or replicas[victim].state == "failed":
                break
        else:
            raise AssertionError("no request reached the armed replica")
    await wait_for(lambda: two_serving(deployed, victim), 90, "a replacement replica")
    assert victim not in await deployed.replicas()


async def test_disconnect_mid_stream_frees_the_replicas_kv_blocks(deployed: Deployed) -> None:
    """A client that hangs up mid-stream: the request is aborted on its replica (it stops far
    short of its ``max_tokens``) and the replica's KV blocks return to zero in use."""
    before = sum(s.generated_tokens for s in (await deployed.replicas()).values())
    body = {
        "model": "tiny",
        "prompt": PROMPTS[1],
        "max_tokens": 480,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{deployed.url}/v1/completions", json=body) as response,
    ):
        assert response.status == 200
        chunks = 0
        async for _line in response.content:
            chunks += 1
            if chunks == 6:
                break

    async def idle() -> bool:
        replicas = (await deployed.replicas()).values()
        return sum(s.kv_blocks_used for s in replicas) == 0 and all(
            s.running == 0 for s in replicas
        )

    await asyncio.sleep(1.5)  # a fresh posting from each replica
    await wait_for(idle, 15, "KV blocks freed on the replica")
    after = sum(s.generated_tokens for s in (await deployed.replicas()).values())
    assert 0 < after - before < 240, after - before
