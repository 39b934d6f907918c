"""Proto <-> engine values: defaults, every field, the API's own limits, responses."""

from __future__ import annotations

import pytest

from meshserve.api.convert import (
    ApiLimits,
    Malformed,
    check_text_size,
    lenient_parser,
    prompt_of,
    request_id_of,
    response_of,
    sampling_params_of,
)
from meshserve.core.outputs import CompletionDelta, FinishReason, TokenLogprobs
from meshserve.core.sampling_params import SamplingParams
from meshserve.errors import ConfigError
from meshserve.v1 import inference_pb2 as pb

LIMITS = ApiLimits()


def test_unset_fields_take_the_engine_defaults():
    assert sampling_params_of(pb.SamplingParams(), 100, LIMITS) == SamplingParams()


def test_every_field_arrives():
    msg = pb.SamplingParams(temperature=0.5, top_k=7, top_p=0.8, min_p=0.1, seed=2**63 - 1, repetition_penalty=1.3,
                            presence_penalty=-1.5, frequency_penalty=2.0, max_tokens=9, stop=["a", "bc"],
                            stop_token_ids=[3, 99], ignore_eos=True, logprobs=20, include_stop_str_in_output=True,
                            skip_special_tokens=False)
    assert sampling_params_of(msg, 100, LIMITS) == SamplingParams(
        temperature=0.5, top_k=7, top_p=0.8, min_p=0.1, seed=2**63 - 1, repetition_penalty=1.3,
        presence_penalty=-1.5, frequency_penalty=2.0, max_tokens=9,
        stop=("a", "bc"), stop_token_ids=(3, 99), ignore_eos=True, logprobs=20, include_stop_str_in_output=True,
        skip_special_tokens=False)


def test_fields_set_to_their_zero_value_arrive():
    """Presence, not value, says a field was set: 0 is a setting for these (their defaults differ)."""
    msg = pb.SamplingParams(temperature=0.0, seed=0, logprobs=0, prompt_logprobs=0, min_tokens=0, max_tokens=3,
                            skip_special_tokens=False, logit_bias={7: 0.0}, allowed_token_ids=[0, 7],
                            bad_words=["x"])
    assert sampling_params_of(msg, 100, LIMITS) == SamplingParams(
        temperature=0.0, seed=0, logprobs=0, prompt_logprobs=0, min_tokens=0, max_tokens=3,
        skip_special_tokens=False, logit_bias={7: 0.0}, allowed_token_ids=[0, 7], bad_words=["x"])


@pytest.mark.parametrize("msg, field", [(pb.SamplingParams(logit_bias={100: 1.0}), "logit_bias=[100]"),
                                        (pb.SamplingParams(allowed_token_ids=[3, 100]), "allowed_token_ids=[100]")])
def test_token_ids_out_of_the_vocabulary(msg, field):
    with pytest.raises(ConfigError) as err:
        sampling_params_of(msg, 100, LIMITS)
    assert str(err.value).startswith(field)


@pytest.mark.parametrize("top_k, expected", [(-1, None), (0, None), (1, 1), (50, 50)])
def test_top_k_off_values(top_k, expected):
    assert sampling_params_of(pb.SamplingParams(top_k=top_k), 100, LIMITS).top_k == expected


@pytest.mark.parametrize("msg, field", [
    (pb.SamplingParams(top_k=-7), "top_k=-7"),
    (pb.SamplingParams(stop=["x"] * 3), "stop='3 strings'"),
    (pb.SamplingParams(stop=["abcdef"]), "stop='abcdef'"),
    (pb.SamplingParams(stop_token_ids=[1, 2, 3]), "stop_token_ids='3 ids'"),
    (pb.SamplingParams(stop_token_ids=[100]), "stop_token_ids=[100]"),
])
def test_api_limits(msg, field):
    small = ApiLimits(max_stop_strings=2, max_stop_string_chars=5, max_stop_token_ids=2)
    with pytest.raises(ConfigError) as err:
        sampling_params_of(msg, 100, small)
    assert str(err.value).startswith(field)


def test_prompts():
    assert prompt_of(pb.GenerateRequest(text="hi"), 10) == "hi"
    assert prompt_of(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[0, 9])), 10) == [0, 9]
    for bad, field in [(pb.GenerateRequest(), "prompt=None"), (pb.GenerateRequest(text=""), "text=''"),
                       (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[10, -1])), "token_ids=[10, -1]")]:
        with pytest.raises(ConfigError, match=r"^" + field.replace("[", r"\[").replace("]", r"\]")):
            prompt_of(bad, 10)


@pytest.mark.parametrize("rid, ok", [("", True), ("abc-1.2:3_x", True), ("a" * 128, True), ("a" * 129, False),
                                     ("a b", False), ("ü", False), ("a/b", False)])
def test_request_ids(rid, ok):
    if ok:
        assert request_id_of(rid, LIMITS) == rid
    else:
        with pytest.raises(ConfigError, match="^request_id="):
            request_id_of(rid, LIMITS)


def test_responses():
    lp = TokenLogprobs(5, -0.25, ((5, -0.25), (6, -2.0)))
    mid = response_of(CompletionDelta("r", [5], "x", logprobs=[lp]), "r", None)
    assert (mid.finish_reason, mid.WhichOneof("stop_reason"), mid.HasField("usage")) == (0, None, False)
    assert mid.logprobs[0].token_id == 5 and [(t.token_id, t.logprob) for t in mid.logprobs[0].top] == [(5, -0.25),
                                                                                                     (6, -2.0)]
    usage = pb.Usage(prompt_tokens=3, completion_tokens=4)
    by_string = response_of(CompletionDelta("r", [], "", True, FinishReason.STOP, "END"), "r", usage)
    assert by_string.finish_reason == pb.FINISH_REASON_STOP and by_string.stop_string == "END"
    assert by_string.usage == usage
    by_id = response_of(CompletionDelta("r", [1], "", True, FinishReason.STOP, 1), "r", usage)
    assert by_id.WhichOneof("stop_reason") == "stop_token_id" and by_id.stop_token_id == 1
    assert response_of(CompletionDelta("r", [], "", True, FinishReason.LENGTH), "r", usage).finish_reason == 2
    assert response_of(CompletionDelta("r", [], "", True, FinishReason.ABORT), "r", usage).finish_reason == 3


def test_lenient_parser():
    parse = lenient_parser(pb.GenerateRequest)
    assert parse(pb.GenerateRequest(text="ok").SerializeToString()).text == "ok"
    bad = parse(pb.GenerateRequest(text="ab").SerializeToString().replace(b"ab", b"\xff\xfe"))
    assert isinstance(bad, Malformed) and "UTF-8" in bad.reason
    assert str(bad.error()).startswith("request='<meshserve.v1.GenerateRequest that does not parse>")



def test_encode_ids_is_the_tokenizers_encoding():
    """encode_ids (encode_batch, which releases the GIL) gives what Tokenizer.encode gives."""
    from meshserve.core.checkpoint_files import encode_ids, load_tokenizer
    from meshserve.demo_model import DEMO_MODEL_DIR

    tokenizer = load_tokenizer(DEMO_MODEL_DIR)
    for text in ("Hello, world!", "x" * 5000, "mixed ünïcode and\nnew lines  with  spaces"):
        assert encode_ids(tokenizer, text) == tokenizer.encode(text).ids


def test_text_size_cap_names_the_field_and_the_limit():
    limits = ApiLimits(max_chars_per_token=4)
    check_text_size("x" * 40, max_model_len=10, limits=limits, field="prompt")  # at the cap: allowed
    with pytest.raises(ConfigError, match=r"^prompt='<41 characters>' is not allowed: at most 40 characters "
                                          r"\(max_model_len=10 tokens x 4 characters per token\)$"):
        check_text_size("x" * 41, max_model_len=10, limits=limits, field="prompt")
