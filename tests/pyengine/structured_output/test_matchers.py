"""The runner's grammar state against llguidance's own acceptance: random logits are masked and sampled row by
row; every sampled token must be one an independently built matcher (fed the same tokens) accepts, tokens the
mask forbids must be ones it rejects, and each finished row must decode to JSON that ``jsonschema`` accepts."""

from __future__ import annotations

import json
import random
from typing import cast

import jsonschema
import llguidance
import numpy as np
import pytest
import torch

from candle_vllm.pyengine.request import Request
from candle_vllm.pyengine.sampling import Sampler, SamplingBatch, SamplingParams, SamplingRow
from candle_vllm.pyengine.sampling.params import StructuredOutputParams
from candle_vllm.pyengine.structured_output import GrammarMatchers, compiler_for
from candle_vllm.pyengine.structured_output.grammar import grammar_key, grammar_of
from candle_vllm.pyengine.tokenizer import Tokenizer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
        "additionalProperties": False}


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [C, vocab] from packed int32 words (bit j of word w = token 32w + j), with numpy's own unpacking."""
    bits = np.unpackbits(bitmask.numpy().astype("<i4").view(np.uint8), axis=1, bitorder="little")
    return torch.from_numpy(bits[:, :vocab].astype(bool))


def request(rid: str, schema: dict | None, temperature: float = 1.0) -> Request:
    so = None if schema is None else StructuredOutputParams(json_schema=schema)
    return Request(rid, [1, 2, 3], SamplingParams(temperature=temperature, structured_output=so))


def oracle(tokenizer: Tokenizer, schema: dict) -> llguidance.LLMatcher:
    """A matcher built apart from the one under test (own LLTokenizer, same grammar)."""
    ll = llguidance.LLTokenizer(tokenizer.hf.to_str(), n_vocab=tokenizer.vocab_size,
                                eos_token=sorted(tokenizer.stop_token_ids))
    return llguidance.LLMatcher(ll, grammar_of(grammar_key(StructuredOutputParams(json_schema=schema))),
                                log_level=0)


def test_random_walks_agree_with_the_library(smol_tokenizer: Tokenizer) -> None:
    vocab = smol_tokenizer.vocab_size
    schemas = [PERSON, None, FLAG, PERSON, None, PERSON]  # two unconstrained rows in between
    temps = [1.0, 1.0, 0.0, 1.5, 0.7, 0.0]
    requests = [request(f"r{i}", s, t) for i, (s, t) in enumerate(zip(schemas, temps, strict=True))]
    grammars = GrammarMatchers(compiler_for(smol_tokenizer))
    grammars.admit(requests)
    assert len(grammars) == 4
    oracles = {i: oracle(smol_tokenizer, s) for i, s in enumerate(schemas) if s is not None}
    outputs: dict[int, list[int]] = {i: [] for i in oracles}
    stops = smol_tokenizer.stop_token_ids
    rng = random.Random(0)
    sampler = Sampler(torch.Generator().manual_seed(0))
    live = list(range(len(requests)))
    for step in range(300):
        if not any(i in oracles for i in live):
            break
        batch_reqs = [requests[i] for i in live]
        masked = grammars.token_mask(batch_reqs)
        assert masked is not None
        rows, mask = masked
        assert [live[r] for r in rows] == [i for i in live if i in oracles]
        allowed = unpack_bitmask(mask.bitmask, vocab)
        for k, r in enumerate(rows):  # a random sample of the mask against the oracle's own verdicts
            ora = oracles[live[r]]
            allowed_ids = torch.nonzero(allowed[k]).flatten().tolist()
            for t in rng.sample(range(vocab), 40) + rng.sample(allowed_ids, min(10, len(allowed_ids))):
                if t not in stops:
                    assert bool(ora.validate_tokens([t])) == bool(allowed[k, t]), (live[r], t)
        logits = torch.randn(len(live), vocab, generator=torch.Generator().manual_seed(step)) * 3
        rows_in = [SamplingRow(cast(SamplingParams, req.sampling_params), outputs.get(i, []))
                   for i, req in zip(live, batch_reqs, strict=True)]
        out = sampler(logits, SamplingBatch.build(rows_in, vocab, "cpu", token_mask=mask)).sampled_token_ids.tolist()
        grammars.advance(batch_reqs, rows, out)
        for k, (i, tok) in enumerate([(live[r], out[r]) for r in rows]):
            assert allowed[k, tok]
            ora = oracles[i]
            if tok in stops:
                assert ora.is_accepting(), f"row {i} ended with EOS before its JSON was complete"
                text = smol_tokenizer.decode(outputs[i])
                jsonschema.validate(json.loads(text), schemas[i])
                del oracles[i]
                live.remove(i)
                grammars.release([requests[i].request_id])
            else:
                assert ora.consume_token(tok), ora.get_error()
                outputs[i].append(tok)
    assert not oracles, f"rows still open after 300 steps: {sorted(oracles)}"
    assert len(grammars) == 0


def test_resumed_request_keeps_its_state_and_forks_are_independent(smol_tokenizer: Tokenizer) -> None:
    grammars = GrammarMatchers(compiler_for(smol_tokenizer))
    a, b = request("x#0", FLAG), request("x#1", FLAG)  # n=2 siblings share params, not state
    grammars.admit([a, b])
    ids = smol_tokenizer.encode('{"ok":', add_special_tokens=False)
    for tok in ids:
        rows, _ = grammars.token_mask([a])  # type: ignore[misc]
        grammars.advance([a], rows, [tok])
    _, after = grammars.token_mask([a, b])  # type: ignore[misc]
    allowed = unpack_bitmask(after.bitmask, smol_tokenizer.vocab_size)
    true_id = smol_tokenizer.encode("true", add_special_tokens=False)[0]
    open_id = ids[0]  # '{"': the grammar keeps BPE's canonical tokenization
    assert allowed[0, true_id] and not allowed[0, open_id]
    assert allowed[1, open_id] and not allowed[1, true_id]
    grammars.admit([a])  # resumed after preemption: same state, nothing re-fed
    _, again = grammars.token_mask([a])  # type: ignore[misc]
    assert torch.equal(again.bitmask, after.bitmask[:1])
    grammars.release(["x#0"])
    grammars.admit([a])  # a new request with the same id starts over
    _, fresh = grammars.token_mask([a])  # type: ignore[misc]
    assert torch.equal(fresh.bitmask, after.bitmask[1:2])


def test_no_constrained_rows_no_mask(smol_tokenizer: Tokenizer) -> None:
    grammars = GrammarMatchers(compiler_for(smol_tokenizer))
    plain = [request(f"p{i}", None) for i in range(4)]
    grammars.admit(plain)
    assert len(grammars) == 0 and grammars.token_mask(plain) is None
    grammars.admit([request("c", FLAG)])
    assert grammars.token_mask(plain) is None  # constrained request not in this step


@pytest.mark.parametrize("schema", [FLAG])
def test_stopped_grammar_allows_only_stop_tokens(smol_tokenizer: Tokenizer, schema: dict) -> None:
    grammars = GrammarMatchers(compiler_for(smol_tokenizer))
    req = request("s", schema)
    grammars.admit([req])
    for tok in smol_tokenizer.encode('{"ok":false}', add_special_tokens=False):
        rows, _ = grammars.token_mask([req])  # type: ignore[misc]
        grammars.advance([req], rows, [tok])
    _, mask = grammars.token_mask([req])  # type: ignore[misc]
    allowed = unpack_bitmask(mask.bitmask, smol_tokenizer.vocab_size)[0]
    assert set(torch.nonzero(allowed).flatten().tolist()) == smol_tokenizer.stop_token_ids
    grammars.advance([req], [0], [min(smol_tokenizer.stop_token_ids)])
    grammars.advance([req], [0], [5])  # the wasted token of a plan made before EOS came back: not fed
    _, still = grammars.token_mask([req])  # type: ignore[misc]
    assert torch.equal(still.bitmask, mask.bitmask)
