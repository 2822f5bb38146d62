"""The pooling a checkpoint declares (``loader/pooling.py``): read from a GGUF's ``<arch>.pooling_type`` (written
by the ``gguf`` package) and from a sentence-transformers ``modules.json``; an embedding request to a model that
declares anything but last-token pooling is refused with the reason. Its Matryoshka declaration (config.json or
``--hf-overrides``) decides which ``dimensions`` it takes."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tiny_checkpoints import write_tiny_gguf
from tokenizers import Tokenizer, models, pre_tokenizers

from candle_vllm import LLM, PoolingParams
from candle_vllm.pyengine.loader import ModelLoadError, load_model, resolve_model_source
from candle_vllm.pyengine.pooling_params import embedding_keep

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


def _llm(path: Path, **engine_args: object) -> LLM:
    return LLM(model=str(path), load_format="dummy", dtype="f32", mem=8, cpu=True, seed=3, **engine_args)


def test_dimensions_need_a_model_trained_for_them(tmp_path: Path) -> None:
    """vLLM's rule: ``dimensions`` only for a model that config.json declares Matryoshka (``is_matryoshka``: any
    size; ``matryoshka_dimensions``: those sizes), else a clear refusal; the truncated vector is the full one's
    head, normalised again (computed here from the full vector)."""
    plain = _llm(hf_dir(tmp_path, None))
    with pytest.raises(ValueError, match="does not support matryoshka representation"):
        plain.embed("t1 t2", PoolingParams(dimensions=8))
    full = np.asarray(plain.embed("t1 t2 t3")[0].outputs.embedding, dtype=np.float64)

    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, "is_matryoshka": True}))
    any_size = _llm(tmp_path)
    outs = any_size.embed(["t1 t2 t3", "t4"], [PoolingParams(dimensions=8), PoolingParams()])
    head = full[:8] / np.linalg.norm(full[:8])
    assert np.allclose(outs[0].outputs.embedding, head, atol=1e-6) and len(outs[1].outputs.embedding) == HIDDEN

    listed = _llm(tmp_path, hf_overrides={"matryoshka_dimensions": [16]})  # an override beats config.json
    assert len(listed.embed("t1", PoolingParams(dimensions=16))[0].outputs.embedding) == 16
    with pytest.raises(ValueError, match=r"only supports \[16\] matryoshka dimensions"):
        listed.embed("t1", PoolingParams(dimensions=8))
    with pytest.raises(ValueError, match="2 pooling params for 1 prompts"):
        listed.embed("t1", [PoolingParams(), PoolingParams()])


@pytest.mark.parametrize("bad", [{"normalize": False}, {"truncate_prompt_tokens": 0}, {"dimensions": 0},
                                 {"dimensions": True}])
def test_unbuilt_or_invalid_pooling_params_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=r"not supported|positive integer|must be -1"):
        PoolingParams(**bad)  # type: ignore[arg-type]


def test_hf_overrides_on_a_gguf_declare_only_what_the_file_cannot(tmp_path: Path) -> None:
    """A GGUF's shapes come from its metadata: overriding them would be ignored, so it is refused; the embedding
    declarations are taken (and checked)."""
    path = write_tiny_gguf(tmp_path / "m.gguf", pooling=None)
    source = resolve_model_source(str(path))
    cpu = torch.device("cpu")
    assert load_model(source, torch.float32, cpu, hf_overrides={"is_matryoshka": True}).matryoshka.supported
    assert not load_model(source, torch.float32, cpu).matryoshka.supported
    with pytest.raises(ModelLoadError, match="only is_matryoshka, matryoshka_dimensions can be overridden"):
        load_model(source, torch.float32, cpu, hf_overrides={"rope_theta": 5e5})
    with pytest.raises(ModelLoadError, match="list of positive integers"):
        load_model(source, torch.float32, cpu, hf_overrides={"matryoshka_dimensions": [0]})


def test_hf_overrides_lay_over_config_json(tmp_path: Path) -> None:
    """vLLM's merge: a dict value updates the dict it replaces key by key, anything else replaces."""
    cfg = {**CONFIG, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    source = resolve_model_source(str(tmp_path), load_format="dummy")
    loaded = load_model(source, torch.float32, torch.device("cpu"), load_format="dummy",
                        hf_overrides={"rope_scaling": {"factor": 4.0}, "max_position_embeddings": 128})
    assert loaded.config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert loaded.config.max_position_embeddings == 128


def test_embedding_truncation_leaves_the_internal_tokens_place() -> None:
    """vLLM takes truncate_prompt_tokens up to the context; an embedding here runs one internal token after the
    prompt, so -1 and the whole context keep one token less, and values vLLM refuses pass on to be refused."""
    assert [embedding_keep(k, 64) for k in (None, 5, 63, 64, -1)] == [None, 5, 63, 63, 63]
    assert [embedding_keep(k, 64) for k in (65, 0, -2)] == [65, 0, -2]
