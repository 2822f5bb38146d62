"""The pooling a checkpoint declares (``loader/pooling.py``): read from a GGUF's ``<arch>.pooling_type`` (written
by the ``gguf`` package) and from a sentence-transformers ``modules.json``; an embedding request to a model that
declares anything but last-token pooling is refused with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch
from tiny_checkpoints import write_tiny_gguf
from tokenizers import Tokenizer, models, pre_tokenizers

from candle_vllm import LLM
from candle_vllm.pyengine.loader import load_model, resolve_model_source

VOCAB, HIDDEN = 32, 64
CONFIG: dict[str, object] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": 128,
    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": VOCAB,
    "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "torch_dtype": "float32"}


def hf_dir(path: Path, pooling_config: dict[str, bool] | None) -> Path:
    """A config-only checkpoint (dummy weights) with a tokenizer, and a sentence-transformers Pooling module when
    ``pooling_config`` is given."""
    (path / "config.json").write_text(json.dumps(CONFIG))
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    if pooling_config is not None:
        (path / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": HIDDEN, **pooling_config}))
    return path


@pytest.mark.parametrize(("kind", "want"), [(gguf.PoolingType.MEAN, "mean"), (gguf.PoolingType.LAST, "last"),
                                            (gguf.PoolingType.CLS, "cls"), (None, None)])
def test_gguf_pooling_type(tmp_path: Path, kind: gguf.PoolingType | None, want: str | None) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", pooling=kind)
    loaded = load_model(resolve_model_source(str(path)), torch.float32, torch.device("cpu"))
    assert loaded.pooling == want


@pytest.mark.parametrize(("pooling_config", "want"), [
    ({"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False}, "last"),
    ({"pooling_mode_mean_tokens": True}, "mean"),
    (None, None),
])
def test_sentence_transformers_pooling(tmp_path: Path, pooling_config: dict[str, bool] | None,
                                       want: str | None) -> None:
    path = hf_dir(tmp_path, pooling_config)
    loaded = load_model(resolve_model_source(str(path), load_format="dummy"), torch.float32, torch.device("cpu"),
                        load_format="dummy")
    assert loaded.pooling == want


def test_embedding_requests_to_a_mean_pooled_model_are_refused(tmp_path: Path) -> None:
    """Vectors pooled another way than the model was trained for would be silently wrong: a clear error instead,
    while generation still runs; a last-token model embeds."""
    (tmp_path / "mean").mkdir()
    mean = LLM(model=str(hf_dir(tmp_path / "mean", {"pooling_mode_mean_tokens": True})), load_format="dummy",
               dtype="f32", mem=8, cpu=True)
    with pytest.raises(ValueError, match="declares mean pooling"):
        mean.embed("t1 t2 t3")
    assert len(mean.generate("t1 t2")[0].outputs[0].token_ids) > 0
    (tmp_path / "last").mkdir()
    last = LLM(model=str(hf_dir(tmp_path / "last", {"pooling_mode_lasttoken": True})), load_format="dummy",
               dtype="f32", mem=8, cpu=True)
    vector = last.embed("t1 t2 t3")[0].outputs.embedding
    assert len(vector) == HIDDEN and sum(x * x for x in vector) == pytest.approx(1.0, abs=1e-5)


def test_a_dense_projection_after_the_pooling_is_declared(tmp_path: Path) -> None:
    """sentence-transformers models with a Dense module project the pooled vector: not last-token vectors."""
    path = hf_dir(tmp_path, {"pooling_mode_lasttoken": True})
    modules = json.loads((path / "modules.json").read_text())
    modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (path / "modules.json").write_text(json.dumps(modules))
    loaded = load_model(resolve_model_source(str(path), load_format="dummy"), torch.float32, torch.device("cpu"),
                        load_format="dummy")
    assert loaded.pooling == "last + a Dense projection"
