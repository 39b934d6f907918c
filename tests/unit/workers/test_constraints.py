"""Per-request constraints in the sampler, against plain-Python oracles: the masked logits
(float64 loops), the tokens a grammar allows (the demo vocabulary's decoded strings checked
with str.startswith / re), and requests without constraints, which must not touch this path
and draw exactly what they drew before."""

import math
import re

import numpy as np
import pytest
import torch

from meshserve.core.checkpoint_files import load_tokenizer
from meshserve.core.sampling_params import SamplingParams
from meshserve.core.structured_outputs import StructuredOutputs
from meshserve.demo_model import DEMO_MODEL_DIR
from meshserve.errors import ConfigError
from meshserve.workers import constraints as constraints_module
from meshserve.workers.constraints import ConstraintBuilder, apply_constraints, unpack_bitmask
from meshserve.workers.sampler import Sampler, SamplingRow

V = 4096  # the demo model's vocabulary
EOS = 1


@pytest.fixture(scope="module")
def builder():
    b = ConstraintBuilder(DEMO_MODEL_DIR, vocab_size=V, eos_token_ids=[EOS])
    yield b
    b.shutdown()


@pytest.fixture(scope="module")
def vocab():
    tok = load_tokenizer(DEMO_MODEL_DIR)
    return [tok.decode([i], skip_special_tokens=False) for i in range(V)]


def _logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed))


def test_rows_without_constraints_take_the_unchanged_path(monkeypatch):
    rows = [SamplingRow(SamplingParams(temperature=0, logprobs=3), [5, 6], [7]),
            SamplingRow(SamplingParams(temperature=0.8, seed=11, top_k=50), [5], []),
            SamplingRow(SamplingParams(temperature=1.0, seed=4, repetition_penalty=1.3), [9, 9], [2, 3])]
    logits = _logits(3)
    before = Sampler(seed=1).draw(logits.clone(), rows).to_host()

    def refuse(*_args, **_kwargs):
        raise AssertionError("a row without constraints reached the constraint path")

    monkeypatch.setattr("meshserve.workers.sampler.apply_constraints", refuse)
    assert Sampler(seed=1).draw(logits.clone(), rows).to_host() == before
    assert Sampler(seed=1).draw(logits.clone(), rows, constrained=False).to_host() == before
    assert constraints_module.apply_constraints is not refuse  # (only the sampler's name was replaced)


def test_bias_bans_and_allowed_ids_match_a_float64_oracle(builder):
    params = [SamplingParams(logit_bias={3: 5.0, 4000: -100.0}),
              SamplingParams(allowed_token_ids=[0, 31, 32, 33, 4095], logit_bias={32: 2.5}),
              SamplingParams(min_tokens=3, stop_token_ids=[7]),
              SamplingParams(min_tokens=1)]
    outputs = [[], [1], [10, 11], [12]]
    logits = _logits(len(params), seed=2)
    got = apply_constraints(logits, [builder.make(p, o) for p, o in zip(params, outputs)])
    want = logits.double().clone()
    want[0, 3] += 5.0
    want[0, 4000] -= 100.0
    keep = torch.zeros(V, dtype=torch.bool)
    keep[[0, 31, 32, 33, 4095]] = True
    want[1, 32] += 2.5
    want[1, ~keep] = -math.inf
    want[2, [EOS, 7]] = -math.inf  # 2 tokens out of min_tokens=3: neither EOS nor the stop id may end it
    assert torch.equal(got.isinf(), want.isinf())
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)  # (float32 sums against float64)
    assert torch.equal(logits, _logits(len(params), seed=2))  # the input is left alone


def test_bad_words_ban_only_the_token_that_completes_them(builder):
    tok = load_tokenizer(DEMO_MODEL_DIR)
    word = " exception handler"
    ids = tok.encode(word, add_special_tokens=False).ids
    assert len(ids) >= 2
    c = builder.make(SamplingParams(bad_words=[word.strip()]), [])
    sequences = c.bad_words
    assert ids in sequences
    c.output_ids.extend(ids[:-1])  # the word's prefix was generated
    assert ids[-1] in c.forbidden_now()
    c.output_ids.append(99)
    assert ids[-1] not in c.forbidden_now() or any(len(s) == 1 and s[0] == ids[-1] for s in sequences)


def test_allowed_ids_bitmask_round_trips():
    rng = np.random.default_rng(0)
    for vocab in (V, 4097, 50):
        allowed = sorted(set(rng.integers(0, vocab, 40).tolist()))
        builder = ConstraintBuilder(None, vocab_size=vocab, eos_token_ids=[])
        c = builder.make(SamplingParams(allowed_token_ids=allowed), [])
        mask = unpack_bitmask(torch.from_numpy(c.allowed)[None], vocab)[0]
        assert mask.nonzero().flatten().tolist() == allowed


@pytest.mark.parametrize("spec, is_prefix", [
    (StructuredOutputs.choice(["yes", "no", "not sure"]),
     lambda s: any(c.startswith(s) for c in ("yes", "no", "not sure"))),
    (StructuredOutputs.regex(r"[0-9]{2}-[a-z]+"), lambda s: re.fullmatch(r"[0-9]{1,2}|[0-9]{2}-[a-z]*", s) is not None),
], ids=["choice", "regex"])
def test_grammar_mask_allows_exactly_the_tokens_that_keep_the_output_valid(builder, vocab, spec, is_prefix):
    c = builder.make(SamplingParams(structured_outputs=spec), [])
    logits = torch.zeros(1, V)
    masked = apply_constraints(logits, [c])[0]
    allowed = {i for i in range(V) if masked[i] == 0}
    want = {i for i, s in enumerate(vocab) if s and is_prefix(s)}
    assert allowed == want


def test_grammar_follows_the_output_and_ends_with_eos(builder, vocab):
    c = builder.make(SamplingParams(structured_outputs=StructuredOutputs.choice(["yes", "no"])), [])
    sampler = Sampler(seed=0)
    row = SamplingRow(SamplingParams(temperature=0, structured_outputs=StructuredOutputs.choice(["yes", "no"])),
                      [5], c.output_ids, c)
    for _ in range(6):
        tokens, _ = sampler.draw(_logits(1, seed=len(c.output_ids)), [row]).to_host()
        c.output_ids.append(tokens[0])
        if tokens[0] == EOS:
            break
    assert c.output_ids[-1] == EOS
    assert "".join(vocab[t] for t in c.output_ids[:-1]) in ("yes", "no")


def test_new_fields_are_checked_and_travel_as_plain_types():
    p = SamplingParams(min_tokens=2, logit_bias={5: -1.5}, allowed_token_ids=[1, 2], bad_words=["x"],
                       structured_outputs=StructuredOutputs.json_schema({"type": "object"}), truncate_prompt_tokens=4)
    assert SamplingParams.from_dict(p.to_dict()) == p
    for kwargs, field in [({"min_tokens": 20, "max_tokens": 5}, "min_tokens"), ({"logit_bias": {1: 101}}, "logit_bias"),
                          ({"allowed_token_ids": []}, "allowed_token_ids"), ({"bad_words": [" "]}, "bad_words"),
                          ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens")]:
        with pytest.raises(ConfigError) as err:
            SamplingParams(**kwargs)
        assert err.value.field == field
    with pytest.raises(ConfigError) as err:
        SamplingParams(logit_bias={V: 1.0}).check_vocab(V)
    assert err.value.field == "logit_bias"


def test_batch_fill_writes_the_masks_one_by_one_fill_writes(builder, monkeypatch):
    from meshserve.workers import grammar

    specs = [StructuredOutputs.choice(["yes", "no"]), StructuredOutputs.regex(r"[a-c]{2}[0-9]"),
             StructuredOutputs.json_schema({"type": "object", "properties": {"k": {"type": "boolean"}}})]
    made = [builder.make(SamplingParams(structured_outputs=specs[i % 3]), []) for i in range(12)]
    for k, c in enumerate(made):  # some rows a token into their output
        if k >= 6:
            c.grammar.fill(torch.empty(1, 128, dtype=torch.int32), 0)
            first = {0: "y", 1: "a", 2: "{"}[k % 3]
            c.output_ids.append(next(i for i in range(V) if load_tokenizer(DEMO_MODEL_DIR).decode([i]) == first))
    logits = _logits(len(made), seed=5)
    batched = apply_constraints(logits, made)  # 12 rows: the batch matcher
    monkeypatch.setattr(grammar, "BATCH_FILL_MIN_ROWS", 10**6)
    one_by_one = apply_constraints(logits, made)
    assert torch.equal(batched, one_by_one) and batched.isinf().any()
