"""A GGUF model built from the file's own tensors (:mod:`stoic.gguf._weights`): the same
weights as transformers' de-quantisation, no float32 model, no converted copy on disk."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from stoic.errors import ModelUnavailable
from stoic.gguf import (
    QuantizedEmbedding,
    lazy_tensors,
    load_gguf_model,
    read_gguf_header,
    write_gguf_metadata,
)
from stoic.gguf import _weights as gw
from stoic.model import default_gguf_path, load_model
from stoic.model._loader import gguf_metadata_dir
from stoic.worker import ModelRunner

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def reference(default_model_dir: Path) -> dict[str, torch.Tensor]:
    """The default model's weights as transformers de-quantises them (float32), by name."""
    out: dict[str, torch.Tensor] = {}
    for file in sorted(default_model_dir.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


@pytest.fixture(scope="module")
def config() -> Any:
    return AutoConfig.from_pretrained(str(gguf_metadata_dir(default_gguf_path())))


def _equal_to_reference(model: Any, reference: dict[str, torch.Tensor]) -> int:
    """How many of ``model``'s parameters were compared; each must equal its reference bitwise
    (a tied output layer has none of its own in the reference: the embedding's)."""
    compared = 0
    for name, param in model.named_parameters(remove_duplicate=False):
        want = reference.get(name, reference.get("model.embed_tokens.weight"))
        if name not in reference:
            assert name == "lm_head.weight", name
        assert want is not None and torch.equal(param.detach(), want), name
        compared += 1
    return compared


def test_the_name_map_is_transformers_own(config: Any) -> None:
    """The map from GGUF names to the model's, built once, is what transformers' per-module
    mapping gives (it builds gguf-py's map once a module: seconds)."""
    from transformers.modeling_gguf_pytorch_utils import (
        LlamaTensorProcessor,
        get_gguf_hf_weights_map,
    )

    model = gw._skeleton(config, torch.float32)
    processor = LlamaTensorProcessor(config=config.to_dict())
    mine = gw._names(model, processor, "llama", int(config.num_hidden_layers))
    assert mine == get_gguf_hf_weights_map(model, processor)
    assert mine["blk.0.attn_q.weight"] == "model.layers.0.self_attn.q_proj.weight"


def test_a_dense_load_is_transformers_dequantisation_bitwise(
    config: Any, reference: dict[str, torch.Tensor]
) -> None:
    """Every tensor de-quantised by the direct loader (Q/K rows of a ``llama`` file un-permuted,
    the tied output layer) equals transformers' float32 de-quantisation bitwise."""
    weights = load_gguf_model(default_gguf_path(), config, torch.float32)
    assert not weights.lazy
    assert _equal_to_reference(weights.model, reference) == len(reference) + 1  # + tied head
    # the token embedding and each layer's 7 matrices, made dense
    assert len(weights.dense_matrices) == 7 * int(config.num_hidden_layers)


def test_the_default_load_keeps_projections_on_the_file_and_builds_no_float_model(
    reference: dict[str, torch.Tensor],
) -> None:
    """``load_model`` of a GGUF file on the CPU: every projection and the output layer stay on
    the file's blocks (no values: ``meta``), the embedding looks rows up in the file's blocks
    (bitwise transformers' rows), only norms are dense, and the model's directory holds its
    tokenizer and configuration but no weights."""
    loaded = load_model("default", dtype="float32", device="cpu")
    read = loaded.gguf_weights
    assert read is not None and loaded.gguf == default_gguf_path()
    layers = int(loaded.config.num_hidden_layers)
    assert len(read.lazy) == 7 * layers + 1
    assert read.dense_matrices == [] and read.dense_mib < 1.0
    model = loaded.model
    metas = {name for name, p in model.named_parameters(remove_duplicate=False) if p.is_meta}
    assert "model.layers.0.self_attn.q_proj.weight" in metas and "lm_head.weight" in metas
    assert len(metas) == 7 * layers + 1
    embedding = model.get_input_embeddings()
    assert isinstance(embedding, QuantizedEmbedding)
    ids = torch.tensor([[0, 1, 17, 49151, 17]])
    rows = embedding(ids)
    assert rows.shape == (1, 5, embedding.embedding_dim) and rows.dtype == torch.float32
    assert torch.equal(rows[0], reference["model.embed_tokens.weight"][ids[0]])
    with pytest.raises(IndexError):
        embedding(torch.tensor([[49152]]))
    files = list(loaded.path.iterdir())
    assert not [f for f in files if f.suffix in (".safetensors", ".bin")]
    assert sum(f.stat().st_size for f in files) < 16 * 2**20


def test_filling_makes_every_weight_dense_and_transformers_own(
    reference: dict[str, torch.Tensor],
) -> None:
    """A runner that cannot multiply on the blocks (``fused=False``: transformers' forward)
    fills the model first: then every weight holds transformers' de-quantised values."""
    loaded = load_model("default", dtype="float32", device="cpu")
    runner = ModelRunner(loaded, fused=False)
    assert runner.quantized["decoder"] == "transformers"
    model = loaded.model
    assert not any(p.is_meta for p in model.parameters())
    assert loaded.gguf_weights is not None and not loaded.gguf_weights.lazy
    head = model.get_output_embeddings().weight
    assert torch.equal(head, reference["model.embed_tokens.weight"])
    q = model.model.layers[3].self_attn.q_proj.weight
    assert torch.equal(q, reference["model.layers.3.self_attn.q_proj.weight"])


def test_a_file_that_lacks_a_tensor_is_refused_naming_it(
    config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tensor the model needs missing from the file: ModelUnavailable naming the weight (no
    model half made of random values)."""
    header = read_gguf_header(default_gguf_path())
    del header.tensors["blk.1.ffn_norm.weight"]
    monkeypatch.setattr(gw, "read_gguf_header", lambda path: header)
    with pytest.raises(ModelUnavailable) as raised:
        load_gguf_model(default_gguf_path(), config, torch.float32)
    assert "model.layers.1.post_attention_layernorm.weight" in raised.value.message
    assert "\n" not in raised.value.message


def test_lazy_tensors_keep_a_fusion_group_together(config: Any) -> None:
    """Q, K and V (and gate and up) stay on the blocks together or not at all: the fused forward
    concatenates them. A V of a type the kernels lack keeps the whole group dense."""
    header = read_gguf_header(default_gguf_path())
    layers = int(config.num_hidden_layers)
    everything = lazy_tensors(header, layers)
    assert {"blk.0.attn_q.weight", "blk.0.attn_v.weight", "output.weight"} <= everything
    v = header.tensors["blk.0.attn_v.weight"]
    header.tensors[v.name] = type(v)(v.name, v.dims, 11, v.offset)  # Q3_K: no kernel
    fewer = lazy_tensors(header, layers)
    assert everything - fewer == {f"blk.0.attn_{p}.weight" for p in ("q", "k", "v")}


def test_the_metadata_build_is_transformers_own_and_patches_nothing_after(
    tmp_path: Path,
) -> None:
    """The configuration and tokenizer the build writes (read once, over plain arrays) are what
    transformers builds from the file itself; gguf-py and transformers are left as they were."""
    import gguf.gguf_reader
    import transformers.modeling_gguf_pytorch_utils as hf_gguf
    from transformers import AutoTokenizer

    source = default_gguf_path()
    before = (gguf.gguf_reader.np, hf_gguf.load_gguf_checkpoint)
    write_gguf_metadata(source, tmp_path)
    assert (gguf.gguf_reader.np, hf_gguf.load_gguf_checkpoint) == before
    theirs = AutoConfig.from_pretrained(str(source.parent), gguf_file=source.name).to_dict()
    mine = AutoConfig.from_pretrained(str(tmp_path)).to_dict()
    assert mine.pop("_name_or_path") == str(tmp_path)
    assert theirs.pop("_name_or_path") == str(source.parent)
    assert mine == theirs
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    reference = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    text = "Name three colours. <|im_start|>user\nÉté, 東京 🙂 1234"
    assert tokenizer.encode(text) == reference.encode(text)
    assert len(tokenizer) == len(reference)
