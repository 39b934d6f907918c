"""n / best_of and beam search over a real gRPC connection (the `meshserve serve` stack: one
in-process replica of the demo model, float32, TORCH attention).

Beam search equals HF transformers' own `generate(num_beams=...)` on the same checkpoint; n
greedy completions equal the n = 1 greedy one; bad settings are refused with INVALID_ARGUMENT
naming the field; every KV block is free again afterwards.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from meshserve.api.client import InferenceClient
from meshserve.demo_model import DEMO_MODEL_DIR
from meshserve.v1 import inference_pb2 as pb
from tests.integration.api_harness import ServerLoop, demo_service, rpc_error, wait_idle

pytestmark = pytest.mark.timeout(300)
PROMPT = [5, 17, 290, 44, 1023, 8, 77, 301, 12, 9, 400, 31, 2, 66, 900, 13, 250, 3]


@pytest.fixture(scope="module")
def served():
    service = demo_service(max_model_len=256, num_kv_blocks=40, max_num_seqs=8)
    loop = ServerLoop()
    server = loop.serve(service)
    client = InferenceClient(server.address)
    free = client.server_info().stats.num_free_kv_blocks
    yield client, free
    client.close()
    loop.close(service)


def test_n_greedy_completions_equal_the_single_one(served):
    client, free = served
    one = client.generate(PROMPT, max_tokens=8, temperature=0, ignore_eos=True)
    many = client.generate(PROMPT, max_tokens=8, temperature=0, ignore_eos=True, n=3)
    assert sorted(many.choices) == [0, 1, 2]
    for choice in many.choices.values():
        assert choice.token_ids == one.token_ids and choice.text == one.text and choice.finish_reason == "length"
    assert many.usage.completion_tokens == 3 * len(one.token_ids)
    wait_idle(client, free)


def test_best_of_streams_the_n_best_at_the_end(served):
    client, free = served
    responses = list(client.stream(PROMPT, max_tokens=6, temperature=1.0, seed=3, n=2, best_of=4))
    assert [r.index for r in responses] == [0, 1]  # each whole, best first
    assert responses[0].cumulative_logprob >= responses[1].cumulative_logprob
    assert all(r.finish_reason for r in responses) and responses[-1].HasField("usage")
    wait_idle(client, free)


def test_beam_search_equals_hf(served):
    import transformers

    client, free = served
    hf = transformers.AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()
    with torch.no_grad():
        r = hf.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.int64),
                        max_new_tokens=10, num_beams=3, do_sample=False, length_penalty=0.7, early_stopping=True,
                        num_return_sequences=3, eos_token_id=1, pad_token_id=1, return_dict_in_generate=True,
                        output_scores=True)
    want = [s[len(PROMPT):] for s in r.sequences.tolist()]
    want = [s[: s.index(1) + 1] if 1 in s else s for s in want]
    out = client.generate(PROMPT, beam_search=dict(beam_width=3, max_tokens=10, length_penalty=0.7,
                                                   early_stopping=pb.EARLY_STOPPING_ON))
    got = [out.choices[i] for i in sorted(out.choices)]
    assert [c.token_ids for c in got] == want
    scores = [c.cumulative_logprob / len(c.token_ids) ** 0.7 for c in got]
    assert scores == pytest.approx(r.sequences_scores.tolist(), abs=1e-4)
    assert out.usage.completion_tokens == sum(len(c.token_ids) for c in got)
    wait_idle(client, free)


@pytest.mark.parametrize("request_kwargs, fragments", [
    (dict(n=3, best_of=2), ("best_of=2", "[n=3, 256]")),
    (dict(n=0), ("n=0", "[1, 256]")),
    (dict(n=9), ("n=9", "max_num_seqs=8")),
    (dict(beam_search=dict(beam_width=0)), ("beam_width=0", "[1, 10]")),
    (dict(beam_search=dict(beam_width=2, max_tokens=300)), ("max_tokens=300", "[1, 238]")),
    (dict(beam_search=dict(beam_width=2, length_penalty=float("inf"))), ("length_penalty=inf", "finite")),
    (dict(beam_search=dict(beam_width=2), temperature=0.5), ("sampling='set'", "unset when beam_search is set")),
])
def test_bad_settings_are_refused(served, request_kwargs, fragments):
    client, free = served
    exc = rpc_error(client.generate, PROMPT, **request_kwargs)
    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.details()
    for fragment in fragments:
        assert fragment in exc.details(), (fragment, exc.details())
    wait_idle(client, free)
