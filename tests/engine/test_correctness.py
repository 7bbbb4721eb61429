"""stoic's greedy output equals transformers' own ``generate`` on the default model, on its
de-quantised weights and on its GGUF file's quantised ones."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch
from support import wait_idle

import stoic
from stoic.gguf import default_cache_dir
from stoic.model import load_model

pytestmark = [pytest.mark.model, pytest.mark.asyncio(loop_scope="module")]

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Hi",
    "List three primary colours.",
    "Explain in two sentences why the sky is blue, and mention Rayleigh scattering by name.",
    "Translate 'good morning' into Spanish and German.",
    "Tell me a long story about a dragon who loves to read books in the old library of a small "
    "mountain town, and about the librarian who discovers the dragon's secret one winter night.",
    "1, 2, 3, 4,",
    "Write a Python function that returns the square of a number.",
    "What is 12 times 12?",
]
MAX_TOKENS = 24


def _chat_ids(tokenizer: Any, prompt: str) -> list[int]:
    ids: list[int] = tokenizer.encode(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        ),
        add_special_tokens=False,
    )
    return ids


@pytest.fixture(scope="module")
def reference(default_model_dir: Path) -> dict[str, Any]:
    """transformers' greedy ``generate`` for every prompt, one at a time, float32."""
    loaded = load_model(str(default_model_dir), dtype="float32", device="cpu")
    model, tokenizer = loaded.model, loaded.tokenizer
    outputs: dict[int, list[int]] = {}
    prompts = [_chat_ids(tokenizer, p) for p in PROMPTS]
    with torch.inference_mode():
        for i, ids in enumerate(prompts):
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
            )
            outputs[i] = out[0, len(ids) :].tolist()
    return {"model": model, "prompts": prompts, "outputs": outputs, "eos": loaded.eos_token_ids}


@pytest_asyncio.fixture(
    scope="module", loop_scope="module", params=["none", "gguf", "gguf-process"]
)
async def engine(request: pytest.FixtureRequest, default_model_dir: Path) -> Any:
    """The engine on the de-quantised weights (the converted directory), and on the GGUF file
    with ``quantization="gguf"`` (decode steps multiply by the file's 4-/8-bit blocks; the start
    fails if they cannot be used), in a thread and in a worker process."""
    if request.param != "none":
        from stoic.kernels import KernelsUnavailable, load_kernels

        try:
            load_kernels(default_cache_dir())
        except KernelsUnavailable as e:
            pytest.skip(f"quantised kernels unavailable here: {e}")
    config = stoic.EngineConfig(
        model="default" if request.param != "none" else str(default_model_dir),
        quantization="none" if request.param == "none" else "gguf",
        executor="process" if request.param == "gguf-process" else "thread",
        dtype="float32",
        num_kv_blocks=256,
        max_num_batched_tokens=64,
    )
    async with stoic.Engine.start(config) as eng:
        yield eng


def _strip_eos(ids: list[int], eos: frozenset[int]) -> list[int]:
    for i, t in enumerate(ids):
        if t in eos:
            return ids[: i + 1]
    return ids


def _assert_same_or_near_tie(
    reference: dict[str, Any], index: int, got: list[int], margin: float = 1e-3
) -> None:
    """Equal token for token; if not, the first divergence must be a near-tie in the reference."""
    want = _strip_eos(reference["outputs"][index], reference["eos"])
    if got == want:
        return
    prefix = 0
    while prefix < min(len(got), len(want)) and got[prefix] == want[prefix]:
        prefix += 1
    assert prefix < min(len(got), len(want)), f"prompt {index}: lengths differ {got} vs {want}"
    context = reference["prompts"][index] + want[:prefix]
    with torch.inference_mode():
        logits = reference["model"](torch.tensor([context])).logits[0, -1]
    top2 = logits.topk(2).values
    gap = float(top2[0] - top2[1])
    assert gap < margin, (
        f"prompt {index}: diverged at {prefix} with top-2 gap {gap} (not a near-tie)"
    )


async def _run(engine: Any, ids: list[int]) -> list[int]:
    result = await engine.complete(ids, stoic.SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    return list(result.token_ids)


async def test_greedy_matches_generate_one_at_a_time(
    engine: Any, reference: dict[str, Any]
) -> None:
    """Each prompt alone: stoic's greedy tokens equal transformers.generate's."""
    for i, ids in enumerate(reference["prompts"]):
        _assert_same_or_near_tie(reference, i, await _run(engine, ids))


async def test_greedy_matches_generate_all_concurrently(
    engine: Any, reference: dict[str, Any]
) -> None:
    """All prompts at once (batched, chunked prefill interleaved with decodes): same tokens."""
    got = await asyncio.gather(*(_run(engine, ids) for ids in reference["prompts"]))
    for i, ids in enumerate(got):
        _assert_same_or_near_tie(reference, i, ids)
    stats = await wait_idle(engine)
    assert stats.max_batch_size >= 4, "the prompts were not batched together"


async def test_staggered_arrivals_match_generate(engine: Any, reference: dict[str, Any]) -> None:
    """Requests arriving while others decode join the running batch and still match."""

    async def delayed(i: int, ids: list[int]) -> list[int]:
        await asyncio.sleep(0.05 * i)
        return await _run(engine, ids)

    got = await asyncio.gather(*(delayed(i, ids) for i, ids in enumerate(reference["prompts"])))
    for i, ids in enumerate(got):
        _assert_same_or_near_tie(reference, i, ids)
