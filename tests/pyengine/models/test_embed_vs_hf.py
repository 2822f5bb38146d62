"""``LLM.embed`` (vLLM's offline embedding API) against outside oracles: on a random checkpoint, each prompt's
vector is HF transformers' final-normed hidden state of its last token, L2-normalised, whatever the batch, the
prefill chunking or the generation requests running beside it (CPU, and the GPU with its decode graphs); on the shipped SmolLM2 GGUF it is llama.cpp's
last-token-pooled embedding of the same text."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import BASE, make_hf_model, save_hf_model
from tokenizers import Tokenizer, models, pre_tokenizers

from candle_vllm import LLM, SamplingParams

DEVICES = [pytest.param(True, id="cpu"), pytest.param(False, id="cuda", marks=pytest.mark.cuda)]
LENGTHS = (1, 5, 23, 40)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A random tiny Llama saved as an HF checkpoint, with a word-level tokenizer ("t0 t1 ...") over its vocab."""
    path = tmp_path_factory.mktemp("embed_llama")
    model = make_hf_model("llama", seed=5)
    save_hf_model(model, path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(BASE["vocab_size"])}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    return path, model


def prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, BASE["vocab_size"], (n,), generator=g).tolist() for n in LENGTHS]


@torch.inference_mode()
def hf_embedding(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """The oracle: transformers' last hidden state (after the final norm) of the last token, L2-normalised."""
    out = model(torch.tensor([ids]), output_hidden_states=True)
    return torch.nn.functional.normalize(out.hidden_states[-1][0, -1].double(), dim=-1)


@pytest.mark.parametrize("cpu", DEVICES)
def test_embeddings_equal_transformers_last_token_states(checkpoint: tuple[Path, torch.nn.Module], cpu: bool) -> None:
    """A batch of prompts of 1-40 tokens, prefilled in chunks of 16 tokens (so the longer prompts take several
    steps and share steps with the others), against transformers one prompt at a time."""
    path, model = checkpoint
    llm = LLM(model=str(path), dtype="f32", mem=16, cpu=cpu, prefill_chunk_size=16, disable_prefix_cache=True)
    batch = prompts(0)
    outs = llm.embed([{"prompt_token_ids": ids} for ids in batch])
    assert [o.prompt_token_ids for o in outs] == batch
    for ids, out in zip(batch, outs, strict=True):
        got = torch.tensor(out.outputs.embedding, dtype=torch.float64)
        want = hf_embedding(model, ids)
        assert got.shape == want.shape == (BASE["hidden_size"],)
        assert torch.linalg.vector_norm(got).item() == pytest.approx(1.0, abs=1e-6)
        torch.testing.assert_close(got, want, rtol=0, atol=2e-5 if cpu else 2e-4)


@pytest.mark.parametrize("cpu", DEVICES)
def test_embedding_beside_generation_matches_transformers(checkpoint: tuple[Path, torch.nn.Module],
                                                          cpu: bool) -> None:
    """Embedding requests arriving while generation requests decode: a 1-token prompt joins a step of one-token rows
    only (which CUDA runs as a decode graph's replay), a 23-token one a mixed step. Their vectors are transformers' last-token
    states; the generations keep their tokens and carry no vector."""
    path, model = checkpoint
    llm = LLM(model=str(path), dtype="f32", mem=16, cpu=cpu, disable_prefix_cache=True)
    targets = [prompts(1)[0], prompts(1)[2]]
    assert [len(t) for t in targets] == [1, 23]
    gen_params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    others = prompts(2)
    want_text = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in others], gen_params)]
    engine = llm.engine
    for i, ids in enumerate(others):
        engine.add_request(f"g{i}", ids, gen_params)
    done = {}
    for _ in range(3):  # the generations are decoding when the embedding requests arrive
        done.update({out.request_id: out for out in engine.step() if out.finished})
    for j, ids in enumerate(targets):
        engine.add_request(f"e{j}", ids, SamplingParams(max_tokens=1, temperature=0, embed=True))
        done.update({out.request_id: out for out in engine.step() if out.finished})
    while engine.has_unfinished():
        done.update({out.request_id: out for out in engine.step() if out.finished})
    for j, ids in enumerate(targets):
        out = done[f"e{j}"]
        assert out.outputs[0].token_ids == [] and out.outputs[0].text == ""  # its one token is internal
        got = torch.tensor(out.embedding, dtype=torch.float64)
        torch.testing.assert_close(got, hf_embedding(model, ids), rtol=0, atol=2e-5 if cpu else 2e-4)
    assert [done[f"g{i}"].outputs[0].token_ids for i in range(len(others))] == want_text
    assert all(done[f"g{i}"].embedding is None for i in range(len(others)))


def test_embed_params_are_checked() -> None:
    with pytest.raises(ValueError, match="n=1 and max_tokens=1"):
        SamplingParams(embed=True, max_tokens=4)
    with pytest.raises(ValueError, match="n=1 and max_tokens=1"):
        SamplingParams(embed=True, max_tokens=1, n=2)


def test_smollm2_embeddings_agree_with_llama_cpp_last_token_pooling() -> None:
    """The shipped SmolLM2 GGUF against llama.cpp's embeddings of the same text with last-token pooling
    (``llama_cpp.Llama(embedding=True, pooling_type=LAST)``, normalised): both quantize activations per block
    (see test_smollm2_vs_llamacpp.py), so the vectors agree closely, not bit for bit."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from candle_vllm.pyengine.loader.embedded import default_model_path

    texts = ["The lighthouse keeper climbed the spiral stairs.", "Rain hammered the windows all night long."]
    ours = [o.outputs.embedding for o in LLM(mem=64).embed(texts)]
    ref = llama_cpp.Llama(model_path=str(default_model_path()), embedding=True, verbose=False, n_ctx=256,
                          pooling_type=llama_cpp.LLAMA_POOLING_TYPE_LAST)
    theirs = [ref.embed(t, normalize=True) for t in texts]
    a, b = torch.tensor(ours, dtype=torch.float64), torch.tensor(theirs, dtype=torch.float64)
    cos = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
    assert cos.min().item() > 0.999, cos  # 0.99978 and 0.99986 measured (2026-12-06)
    cross = (a[0] * b[1]).sum() / (a[0].norm() * b[1].norm())
    assert cross.item() < cos.min().item() - 0.01  # another text's vector is measurably further away


def test_a_base_model_checkpoint_embeds_as_transformers_does(tmp_path: Path) -> None:
    """Embedding checkpoints are often the base model saved alone (``Qwen3Model``: tensors without the "model."
    prefix, no LM head). They load and embed as transformers' base model does; generation is refused with the
    reason (a head tied in its place would write text the model was never trained to write)."""
    causal = make_hf_model("qwen3_qk_norm", seed=7)
    base = causal.model
    base.config.architectures = ["Qwen3Model"]
    base.config.tie_word_embeddings = False  # as Qwen3-Embedding-8B's config says, with no head in the file
    base.save_pretrained(tmp_path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(BASE["vocab_size"])}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    llm = LLM(model=str(tmp_path), dtype="f32", mem=16, cpu=True)
    for ids in prompts(3):
        got = torch.tensor(llm.embed({"prompt_token_ids": ids})[0].outputs.embedding, dtype=torch.float64)
        with torch.inference_mode():
            state = base(torch.tensor([ids])).last_hidden_state[0, -1].double()
        torch.testing.assert_close(got, torch.nn.functional.normalize(state, dim=-1), rtol=0, atol=2e-5)
    with pytest.raises(ValueError, match="embeddings only"):
        llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2))
