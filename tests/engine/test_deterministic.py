"""``deterministic=True`` in the fast dtype (``dtype="auto"``, the default model's quantised
weights): every request's tokens and their logprobs are bitwise the same alone, in a batch of
16, with its prompt chunked by a small step budget, with its prompt from the prefix cache,
continued from its first tokens (``Request.generated``, a Ray migration's continuation) and
resumed after a ``kill -9`` of the worker process; greedy and seeded sampling alike."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch
from support import engine_config, wait_idle

import stoic
from stoic.errors import ModelUnavailable
from stoic.gguf import default_cache_dir
from stoic.kernels import _build
from stoic.model import resolve_dtype

pytestmark = [pytest.mark.model, pytest.mark.asyncio(loop_scope="module")]

TOKENS = 128
#: a shared start (several KV blocks) and a different end: prompts of different lengths
_SYSTEM = (
    "You are a careful assistant. Answer in plain English, with complete sentences, and keep to "
    "the subject you are given. "
)
_TOPICS = ("the sea", "a cat", "winter", "bread", "a robot", "the moon", "tea", "trains")

#: what one request gave: its token ids and each token's logprob
Outcome = tuple[tuple[int, ...], tuple[float, ...]]


def _requests() -> list[tuple[str, stoic.SamplingParams]]:
    """16 requests of 128 tokens: 8 greedy, 8 seeded (temperature 0.9, top-p 0.95)."""
    out = []
    for i in range(16):
        prompt = f"{_SYSTEM}Write about {_TOPICS[i % 8]}{' in detail' * (i // 8)} (#{i})."
        if i % 2 == 0:
            params = stoic.SamplingParams(
                max_tokens=TOKENS, temperature=0, ignore_eos=True, logprobs=True
            )
        else:
            params = stoic.SamplingParams(
                max_tokens=TOKENS, temperature=0.9, top_p=0.95, seed=7 + i, ignore_eos=True,
                logprobs=True,
            )  # fmt: skip
        out.append((prompt, params))
    return out


def _config(**overrides: Any) -> stoic.EngineConfig:
    base = {"model": "default", "dtype": "auto", "deterministic": True}
    return engine_config(Path("default"), **{**base, **overrides})


def _outcome(result: stoic.CompletionResult) -> Outcome:
    assert result.logprobs is not None and len(result.token_ids) == TOKENS
    return result.token_ids, tuple(t.logprob for t in result.logprobs)


async def _batched(engine: stoic.Engine, requests: list[Any]) -> list[Outcome]:
    results = await asyncio.gather(*(engine.complete(p, params) for p, params in requests))
    return [_outcome(r) for r in results]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def reference() -> tuple[list[Outcome], list[Outcome]]:
    """What the 16 requests give each alone, one after another, then all at once, on one engine
    without a prefix cache (every prompt computed whole)."""
    cfg = _config(enable_prefix_caching=False, enable_fault_injection=False)
    async with stoic.Engine.start(cfg) as engine:
        compute = engine.stats().compute
        assert compute is not None and compute.deterministic and compute.c_layers
        # its products on int8 activations (the G8 layout) where the CPU has AVX-512 VNNI and
        # --dtype auto measured bfloat16 faster here (the probe the engine used, cached), else
        # in bfloat16 where it has AVX512_BF16, else float32 on the blocks
        flags = _build.cpu_flags()
        fast = resolve_dtype("auto", torch.device("cpu"), default_cache_dir()) == torch.bfloat16
        vnni = fast and "avx512f" in flags and all(f in flags for f in _build.VNNI_CPU_FLAGS)
        bf16 = "avx512_bf16" in flags and "avx512f" in flags and not vnni
        assert compute.dense_dtype == ("bfloat16" if bf16 else "float32")
        assert compute.row_activations == ("int8" if vnni else "float32")
        int8 = compute.int8_batched_projections
        assert int8 == (compute.quantized_projections if vnni else 0)
        alone = [_outcome(await engine.complete(p, params)) for p, params in _requests()]
        return alone, await _batched(engine, _requests())


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def chunking_engine() -> AsyncIterator[tuple[stoic.Engine, list[Outcome]]]:
    """The process executor with ``recovery="resume"`` and a 16-token step budget (every
    prompt chunked, its chunks batched with other sequences' decodes), and what the 16 requests
    gave on it, all at once, the first time (their prompts computed, then cached)."""
    cfg = _config(
        executor="process",
        recovery="resume",
        max_num_seqs=16,
        max_num_batched_tokens=16,
        enable_fault_injection=False,
    )
    async with stoic.Engine.start(cfg) as engine:
        yield engine, await _batched(engine, _requests())


@pytest.mark.timeout(900)  # 16 x 128 tokens one request at a time: slow on a loaded machine
async def test_alone_equals_batched_bitwise(reference: Any) -> None:
    """16 requests (greedy and seeded) alone give the tokens and logprobs they give batched."""
    alone, batched = reference
    assert batched == alone


@pytest.mark.timeout(900)
async def test_chunked_equals_alone_bitwise(
    reference: Any, chunking_engine: tuple[stoic.Engine, list[Outcome]]
) -> None:
    """With every prompt cut into chunks of at most 16 tokens, batched with other sequences'
    decode tokens, the 16 requests give the tokens and logprobs they give alone."""
    assert chunking_engine[1] == reference[0]


@pytest.mark.timeout(900)
async def test_prefix_cached_equals_alone_bitwise(
    reference: Any, chunking_engine: tuple[stoic.Engine, list[Outcome]]
) -> None:
    """Again with every prompt's blocks from the prefix cache: the same tokens and logprobs."""
    engine = chunking_engine[0]
    before = engine.stats().prefix_cached_tokens
    assert await _batched(engine, _requests()) == reference[0]
    assert engine.stats().prefix_cached_tokens - before >= 16 * 16


#: where the continuations of the first four requests (two greedy, two seeded) start
_SPLITS = (1, 37, 80, TOKENS - 1)


@pytest.mark.timeout(900)
async def test_continued_from_generated_equals_alone_bitwise(
    reference: Any, chunking_engine: tuple[stoic.Engine, list[Outcome]]
) -> None:
    """Requests 0-3 sent again with ``generated=`` the first k of their reference tokens (a Ray
    migration's continuation), in one batch with requests 4-7 sent afresh, their contexts
    prefilled in 16-token chunks: each continuation streams exactly the rest of its reference
    tokens and logprobs, greedy and seeded, and the fresh ones their own. What makes a Ray
    migration exact in the fast dtype with ``deterministic``."""
    engine, alone = chunking_engine[0], reference[0]
    requests = _requests()
    streams = [
        await engine.submit(p, params, generated=alone[i][0][:k])
        for i, (k, (p, params)) in enumerate(zip(_SPLITS, requests, strict=False))
    ] + [await engine.submit(p, params) for p, params in requests[4:8]]
    got = await asyncio.wait_for(asyncio.gather(*(_Reader(s).until(None) for s in streams)), 600)
    for i, k in enumerate(_SPLITS):
        assert got[i] == (alone[i][0][k:], alone[i][1][k:]), (i, k)
    assert got[4:] == alone[4:8]


@pytest.mark.timeout(900)
async def test_resumed_after_kill_9_equals_alone_bitwise(
    reference: Any, chunking_engine: tuple[stoic.Engine, list[Outcome]]
) -> None:
    """The worker process is killed (SIGKILL) a third of the way through the 16 streams; every
    stream resumes on a new worker, its context re-prefilled in other chunks than the first
    time, and ends with the tokens and logprobs it gives alone."""
    engine = chunking_engine[0]
    streams = [await engine.submit(p, params) for p, params in _requests()]
    read = [_Reader(s) for s in streams]
    await read[0].until(40)
    victim = engine.stats().executor_pid
    assert victim is not None
    restarts = engine.stats().restarts
    os.kill(victim, signal.SIGKILL)
    resumed = await asyncio.wait_for(asyncio.gather(*(r.until(None) for r in read)), 600)
    assert resumed == reference[0]
    stats = await wait_idle(engine, 10.0)
    assert stats.restarts == restarts + 1 and stats.requests_resumed >= 15
    assert stats.executor_pid != victim
    # the KV pools outlived the worker: the resumed streams went on from their kept keys and
    # values (bitwise the same as computing them again)
    assert stats.resume_reused_tokens > 0


class _Reader:
    """A request stream's tokens and logprobs, read in parts."""

    def __init__(self, stream: stoic.RequestStream) -> None:
        self._stream = stream
        self._ids: list[int] = []
        self._logprobs: list[float] = []

    async def until(self, tokens: int | None) -> Outcome:
        """Read until ``tokens`` tokens came (None: the end); what came so far."""
        while tokens is None or len(self._ids) < tokens:
            try:
                delta = await anext(self._stream)
            except StopAsyncIteration:
                break
            self._ids += delta.token_ids
            self._logprobs += [t.logprob for t in delta.logprobs or ()]
        return tuple(self._ids), tuple(self._logprobs)


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        ({"dtype": "bfloat16"}, "compute in float32, not bfloat16"),
        ({"kv_cache_dtype": "bfloat16"}, "reads a float32 KV cache, not bfloat16"),
        ({"quantization": "none"}, "--quantization none keeps no quantised blocks"),
        ({"executor": "process", "model": "tiny"}, "does not run on the C layers here"),
    ],
)
async def test_a_model_off_the_c_layers_is_refused_at_start_saying_why(
    tiny_model_dir: Path, overrides: dict[str, Any], why: str
) -> None:
    """A model that cannot run deterministically (bfloat16 activations, a bfloat16 KV cache, no
    quantised blocks, a model directory) is refused at start with one line naming why, before any worker process
    starts."""
    if overrides.get("model") == "tiny":
        overrides = {**overrides, "model": str(tiny_model_dir)}
    with pytest.raises(ModelUnavailable, match=r"^--deterministic cannot be used: ") as caught:
        async with stoic.Engine.start(_config(**overrides)):
            pass
    assert why in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.timeout(900)
async def test_drafts_change_no_bit_of_the_output(reference: Any) -> None:
    """Four of the requests (two greedy, two seeded) alone with ``--speculative off`` and with
    ``ngram``: the tokens and logprobs of the reference (whose engine runs the default,
    ``auto``), bitwise, and drafts were kept: a chunk of drafts verifies through the same
    fixed-order products and row attention a decode takes."""
    requests = _requests()[:4]
    for mode in ("off", "ngram"):
        async with stoic.Engine.start(_config(speculative=mode)) as engine:
            got = [_outcome(await engine.complete(p, params)) for p, params in requests]
            stats = await wait_idle(engine)
        assert got == reference[0][:4], mode
        assert (stats.spec_accepted_tokens > 0) == (mode == "ngram")
