"""SamplingParams.to_dict / from_dict: what crosses the msgpack channel between front-end and engine."""

from __future__ import annotations

import dataclasses

import msgpack

from meshserve.core.sampling_params import SamplingParams
from meshserve.core.structured_outputs import StructuredOutputs

EVERY_FIELD = SamplingParams(
    temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, seed=3, repetition_penalty=1.1, presence_penalty=0.5,
    frequency_penalty=-0.5, max_tokens=7, stop=("a", "bc"), stop_token_ids=(4, 5), ignore_eos=True, logprobs=2,
    include_stop_str_in_output=True, skip_special_tokens=False, n=2, best_of=3, min_tokens=1,
    logit_bias={9: 1.5}, allowed_token_ids=[1, 9], bad_words=("x",),
    structured_outputs=StructuredOutputs.choice(["yes", "no"]), truncate_prompt_tokens=4, prompt_logprobs=1)


def _oracle(params: SamplingParams) -> dict:
    """dataclasses.asdict (the deep copy to_dict used to make), tuples as msgpack writes them: lists."""
    out = dataclasses.asdict(params)
    for name in ("stop", "stop_token_ids", "bad_words"):
        out[name] = list(out[name])
    out["logit_bias"] = [list(pair) for pair in out["logit_bias"]]
    out["allowed_token_ids"] = None if out["allowed_token_ids"] is None else list(out["allowed_token_ids"])
    out["structured_outputs"] = None if params.structured_outputs is None else params.structured_outputs.to_dict()
    return out


def test_every_field_as_asdict_gives_it():
    for params in (SamplingParams(), EVERY_FIELD):
        assert params.to_dict() == _oracle(params)


def test_the_round_trip_through_msgpack():
    for params in (SamplingParams(), EVERY_FIELD):
        wire = msgpack.unpackb(msgpack.packb(params.to_dict()))
        assert SamplingParams.from_dict(wire) == params
