"""Architectures through stoic's paged runner equal transformers' own ``generate``: greedy tokens
and their logprobs (float32, within 1e-4), each prompt alone, all batched, prefilled in chunks
next to decodes, and over a prefix another sequence cached. Tiny random models built here, with
weights large enough that the output depends on the context; among them the ones whose
``ForCausalLM.forward`` does something after the base model (Granite's ``logits_scaling``,
Cohere's ``logit_scale``, Gemma 2's final soft-cap) or whose attention soft-caps its scores
(Gemma 2's ``attn_logit_softcapping``). Directories that are not causal LMs are refused."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch
from support import greedy_reference

from stoic.errors import ModelUnavailable
from stoic.model import PagedKVCache, load_model
from stoic.request import SamplingParams, SeqChunk, StepBatch
from stoic.worker import ModelRunner

pytestmark = pytest.mark.model

PARAMS = SamplingParams(max_tokens=8, temperature=0, logprobs=True)
STEPS = 8
BLOCK = 4
PROMPTS = [
    [5, 77, 300, 12, 9, 401, 42, 8, 100, 3, 250],
    [5, 77, 300, 12, 9, 401, 42, 8, 17, 460, 81, 2, 66],  # shares two blocks with the first
    [300, 5, 5, 6],
]
_COMMON = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


def _configs() -> dict[str, tuple[Any, Any, dict[str, Any]]]:
    import transformers as t

    return {
        "llama": (t.LlamaConfig, t.LlamaForCausalLM, {}),
        "qwen2": (t.Qwen2Config, t.Qwen2ForCausalLM, {}),
        # a sliding window shorter than the sequence: the paged mask must honour it
        "mistral": (t.MistralConfig, t.MistralForCausalLM, {"sliding_window": 6}),
        # strong caps: the scores and the logits of these weights reach well past them
        "gemma2": (
            t.Gemma2Config,
            t.Gemma2ForCausalLM,
            {
                "head_dim": 16,
                "attn_logit_softcapping": 2.0,
                "final_logit_softcapping": 3.0,
                "sliding_window": 6,
            },
        ),
        "granite": (t.GraniteConfig, t.GraniteForCausalLM, {"logits_scaling": 4.0}),
        "cohere": (t.CohereConfig, t.CohereForCausalLM, {"logit_scale": 0.25}),
    }


def build_tiny(arch: str, target: Path, tokenizer_from: Path) -> Path:
    """A 2-layer random model of ``arch`` in ``target``, its weights drawn with std 0.2 (not
    transformers' 0.02, under which attention is near uniform and the context hardly matters)."""
    config_cls, model_cls, extra = _configs()[arch]
    torch.manual_seed(0)
    config = config_cls(**_COMMON, **extra, initializer_range=0.2, tie_word_embeddings=False)
    model_cls(config).save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, target / name)
    return target


def _reference(path: Path) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy ``generate`` of each prompt alone: tokens and their logprobs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return greedy_reference(model.eval(), PROMPTS, STEPS)


class _Sequences:
    """Drives a runner as the scheduler would: block tables, prefill chunks, decodes."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.cache = PagedKVCache(runner.kv_spec(num_blocks=64, block_size=BLOCK))
        self.cache.zero_blocks(tuple(range(64)))
        self.next_block = 63  # handed out downwards: tables are never in pool order
        self.tables: dict[int, list[int]] = {}
        self.done: dict[int, int] = {}  # prompt tokens in the cache
        self.out: dict[int, list[tuple[int, float]]] = {}

    def table(self, seq: int, length: int, shared: tuple[int, ...] = ()) -> tuple[int, ...]:
        blocks = self.tables.setdefault(seq, list(shared))
        while len(blocks) * BLOCK < length:
            blocks.append(self.next_block)
            self.next_block -= 1
        return tuple(blocks)

    def step(self, chunks: list[tuple[int, int]]) -> None:
        """One step of ``(seq, prompt tokens to feed, 0 = a decode)`` items."""
        batch = []
        for seq, n in chunks:
            prompt, generated = PROMPTS[seq], self.out.setdefault(seq, [])
            if n:
                start = self.done.get(seq, 0)
                ids = prompt[start : start + n]
                self.done[seq] = start + len(ids)
                sample = self.done[seq] == len(prompt)
            else:
                start = len(prompt) + len(generated) - 1
                ids, sample = [generated[-1][0]], True
            table = self.table(seq, start + len(ids))
            batch.append(SeqChunk(seq, tuple(ids), start, table, sample, PARAMS, len(generated)))
        sampled = self.runner.execute(StepBatch(tuple(batch)), self.cache).sampled
        for seq, token in sampled.items():
            assert token.logprob is not None
            self.out[seq].append((token.token_id, token.logprob))


def _alone(s: _Sequences) -> None:
    for seq, prompt in enumerate(PROMPTS):
        s.step([(seq, len(prompt))])
        for _ in range(STEPS - 1):
            s.step([(seq, 0)])


def _batched(s: _Sequences) -> None:
    s.step([(seq, len(p)) for seq, p in enumerate(PROMPTS)])
    for _ in range(STEPS - 1):
        s.step([(seq, 0) for seq in range(len(PROMPTS))])


def _chunked(s: _Sequences) -> None:
    """Prompts fed 3 tokens a step, the shorter ones decoding meanwhile."""
    while any(len(s.out.get(seq, [])) < STEPS for seq in range(len(PROMPTS))):
        items = []
        for seq, prompt in enumerate(PROMPTS):
            if s.done.get(seq, 0) < len(prompt):
                items.append((seq, 3))
            elif len(s.out[seq]) < STEPS:
                items.append((seq, 0))
        s.step(items)


def _prefix_cached(s: _Sequences) -> None:
    """The first prompt alone; the second reuses its first two blocks (8 tokens) as cached."""
    s.step([(0, len(PROMPTS[0]))])
    s.table(1, 0, shared=tuple(s.tables[0][:2]))
    s.done[1] = 2 * BLOCK
    s.step([(1, len(PROMPTS[1])), (0, 0)])
    for _ in range(STEPS - 1):
        s.step([(1, 0)] + ([(0, 0)] if len(s.out[0]) < STEPS else []))


MODES: dict[str, tuple[Callable[[_Sequences], None], list[int]]] = {
    "alone": (_alone, [0, 1, 2]),
    "batched": (_batched, [0, 1, 2]),
    "chunked": (_chunked, [0, 1, 2]),
    "prefix-cached": (_prefix_cached, [0, 1]),
}


@pytest.fixture(scope="module", params=list(_configs()))
def arch(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    default_model_dir: Path,
) -> tuple[ModelRunner, list[tuple[list[int], list[float]]]]:
    path = build_tiny(request.param, tmp_path_factory.mktemp(request.param), default_model_dir)
    reference = _reference(path)
    # the weights make the output depend on the context: the prompts' continuations differ
    assert len({tuple(tokens) for tokens, _ in reference}) == len(PROMPTS)
    return ModelRunner(load_model(str(path), dtype="float32", device="cpu")), reference


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_tokens_and_logprobs_equal_generate(
    arch: tuple[ModelRunner, list[tuple[list[int], list[float]]]], mode: str
) -> None:
    """Each architecture, in each way the scheduler feeds it, gives ``generate``'s greedy
    tokens and their logprobs within 1e-4."""
    runner, reference = arch
    drive, seqs = MODES[mode]
    sequences = _Sequences(runner)
    drive(sequences)
    for seq in seqs:
        want_tokens, want_logprobs = reference[seq]
        got = sequences.out[seq]
        assert [t for t, _ in got] == want_tokens, f"sequence {seq}"
        assert [lp for _, lp in got] == pytest.approx(want_logprobs, abs=1e-4), f"sequence {seq}"


#: the architectures whose ``ForCausalLM.forward`` changes the output layer's product
POST_PROCESSED = {"Gemma2ForCausalLM", "GraniteForCausalLM", "CohereForCausalLM"}


def test_post_processing_is_the_models_own_forward(
    arch: tuple[ModelRunner, list[tuple[list[int], list[float]]]],
) -> None:
    """The runner maps its hidden states to logits through the model's own forward where that
    forward changes the output layer's product, through the output layer alone where the probe
    found it does not (no architecture runs its whole forward), and says which."""
    runner, _ = arch
    name = type(runner.loaded.model).__name__
    assert runner.compute_path.architecture == name
    want = "own-forward" if name in POST_PROCESSED else "output-layer"
    assert runner.compute_path.logits == want


def _greedy_alone(runner: ModelRunner) -> list[list[tuple[int, float]]]:
    sequences = _Sequences(runner)
    _alone(sequences)
    return [sequences.out[seq] for seq in range(len(PROMPTS))]


def test_a_forward_that_cannot_take_stoics_hidden_states_runs_whole_and_stays_exact(
    tmp_path: Path, default_model_dir: Path
) -> None:
    """A model whose forward works on its inputs before its base model (here: a copy of the
    ids) cannot be given stoic's hidden states: it runs its whole forward over the paged
    attention instead, says why, and still equals ``generate``."""
    path = build_tiny("granite", tmp_path / "granite", default_model_dir)
    loaded = load_model(str(path), dtype="float32", device="cpu")
    own = type(loaded.model)

    class CopiesItsInputs(own):  # type: ignore[misc, valid-type]
        def forward(self, input_ids: Any = None, **kwargs: Any) -> Any:
            return super().forward(input_ids=input_ids.clone(), **kwargs)

    loaded.model.__class__ = CopiesItsInputs
    with structlog.testing.capture_logs() as logs:
        runner = ModelRunner(loaded)
    assert runner.compute_path.logits == "whole-forward"
    assert "inputs" in (runner.compute_path.whole_forward_reason or "")
    # the start logs how the model runs (what stoic serve shows)
    [path_event] = [e for e in logs if e["event"] == "model.compute_path"]
    assert path_event["architecture"] == "CopiesItsInputs"
    assert (path_event["decoder"], path_event["logits"]) == ("transformers", "whole-forward")
    assert path_event["whole_forward_reason"] == runner.compute_path.whole_forward_reason
    got = _greedy_alone(runner)
    for seq, (tokens, logprobs) in enumerate(_reference(path)):
        assert [t for t, _ in got[seq]] == tokens
        assert [lp for _, lp in got[seq]] == pytest.approx(logprobs, abs=1e-4)


def test_a_model_that_runs_neither_way_is_refused_at_start(
    tmp_path: Path, default_model_dir: Path
) -> None:
    """A forward that fails on stoic's hidden states and over the paged attention: the runner
    refuses the model when built, in one line with both reasons."""
    path = build_tiny("llama", tmp_path / "llama", default_model_dir)
    loaded = load_model(str(path), dtype="float32", device="cpu")

    class Broken(type(loaded.model)):  # type: ignore[misc]
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            raise ValueError("this architecture computes something stoic cannot")

    loaded.model.__class__ = Broken
    with pytest.raises(ModelUnavailable) as refused:
        ModelRunner(loaded)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("Broken cannot be served")
    assert message.count("stoic cannot") == 2


def _save(kind: str, target: Path) -> Path:
    import transformers as t

    small = {
        "vocab_size": 64,
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 64,
    }
    models = {
        "BertModel": lambda: t.BertModel(t.BertConfig(**small)),
        "BertForMaskedLM": lambda: t.BertForMaskedLM(t.BertConfig(**small)),
        "T5ForConditionalGeneration": lambda: t.T5ForConditionalGeneration(
            t.T5Config(vocab_size=64, d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16)
        ),
        "LlamaModel": lambda: t.LlamaModel(t.LlamaConfig(**small)),
    }
    models[kind]().save_pretrained(target)
    return target


@pytest.mark.parametrize(
    ("kind", "why"),
    [
        ("BertModel", "an encoder: a base model without a generation head"),
        ("BertForMaskedLM", "its head is not a causal language-model head"),
        ("T5ForConditionalGeneration", "an encoder-decoder model"),
        ("LlamaModel", "a base model without a generation head"),
    ],
)
@pytest.mark.parametrize("weights", [True, False])
def test_a_directory_that_is_not_a_causal_lm_is_refused_naming_its_architecture(
    tmp_path: Path, kind: str, why: str, weights: bool
) -> None:
    """Encoders, encoder-decoders and base models are refused in one line that names the
    architecture and says what it is, by the server (no weights) as by the worker."""
    path = _save(kind, tmp_path / kind)
    with pytest.raises(ModelUnavailable) as refused:
        load_model(str(path), device="cpu", tokenizer=False, weights=weights)
    message = str(refused.value)
    assert message == (
        f"{path} holds a {kind} ({why}), not a causal LM: stoic serves causal language "
        "models (decoder-only: a ...ForCausalLM architecture)"
    )


def test_base_weights_under_a_causal_config_are_refused(tmp_path: Path) -> None:
    """A config without ``architectures`` whose weights lack the output layer (a base model's):
    refused after loading rather than served from a randomly initialised head."""
    import json

    path = _save("LlamaModel", tmp_path / "base")
    config = json.loads((path / "config.json").read_text())
    del config["architectures"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelUnavailable, match=r"no weights for the output layer \(lm_head\)"):
        load_model(str(path), device="cpu", tokenizer=False)


def _small(name: str) -> Any:
    import transformers as t

    small = {
        "vocab_size": 64,
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "pad_token_id": 0,
    }
    configs = {
        "GPT2LMHeadModel": lambda: t.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2),
        "GPTNeoXForCausalLM": lambda: t.GPTNeoXConfig(**small),
        "Phi3ForCausalLM": lambda: t.Phi3Config(**small),
        "Qwen3ForCausalLM": lambda: t.Qwen3Config(**small, head_dim=16),
        "Gemma3ForCausalLM": lambda: t.Gemma3TextConfig(**small, head_dim=16),
        "OlmoForCausalLM": lambda: t.OlmoConfig(**small),
        "MixtralForCausalLM": lambda: t.MixtralConfig(**small),
        "Gemma2ForCausalLM": lambda: t.Gemma2Config(**small, head_dim=16),
        "GraniteForCausalLM": lambda: t.GraniteConfig(**small, logits_scaling=4.0),
        "CohereForCausalLM": lambda: t.CohereConfig(**small),
    }
    torch.manual_seed(0)
    return getattr(t, name)(configs[name]())


@pytest.mark.parametrize(
    "name",
    [
        "GPT2LMHeadModel",
        "GPTNeoXForCausalLM",
        "Phi3ForCausalLM",
        "Qwen3ForCausalLM",
        "Gemma3ForCausalLM",
        "OlmoForCausalLM",
        "MixtralForCausalLM",
        "Gemma2ForCausalLM",
        "GraniteForCausalLM",
        "CohereForCausalLM",
    ],
)
def test_the_logits_probe_takes_every_forward_on_stoics_hidden_states(name: str) -> None:
    """Each architecture's own forward runs on stoic's hidden states (none needs its whole
    forward); the probe finds an output layer alone suffices exactly where the forward adds
    nothing after it, and the logits equal the model's own forward's on its own hidden states."""
    from stoic.model._logits import OutputLayer

    model = _small(name).eval()
    owner = type("Owner", (), {"_head": model.get_output_embeddings()})()
    logits = OutputLayer(model, owner)
    ids = torch.tensor([[3, 9, 27, 5]])
    with torch.inference_mode():
        logits.probe(32, 64, torch.float32, torch.device("cpu"))
        assert not logits.whole_forward, logits.reason
        assert logits.identity == (name not in POST_PROCESSED)
        hidden = model.base_model(input_ids=ids).last_hidden_state
        rows = torch.tensor([1, 3])
        want = model(input_ids=ids).logits[0, rows]
        assert torch.allclose(logits(ids, hidden, rows), want, atol=1e-6, rtol=1e-5)
