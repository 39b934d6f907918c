"""truncate_prompt_tokens is applied before the length checks (vLLM's order), on every face: a
prompt longer than max_model_len, cut to its last k tokens, is served; what is still too long
gets the same 400 / INVALID_ARGUMENT as before, and leaves nothing behind.

One in-process server (gRPC and HTTP over one demo service, max_model_len 64). The oracle of a
truncated request is the same server given the last k tokens itself (greedy, so the outputs
must be equal token for token); `LLM` is checked against its own short prompt the same way.
"""

from __future__ import annotations

import grpc
import openai
import pytest

from meshserve import LLM, SamplingParams
from meshserve.api.client import InferenceClient
from meshserve.api.http.chat import ChatTemplate
from meshserve.api.http.server import HttpServer
from meshserve.demo_model import DEMO_MODEL_DIR
from tests.integration.api_harness import ServerLoop, demo_service, rpc_error, wait_idle

pytestmark = pytest.mark.timeout(240)

MAX_MODEL_LEN = 64
LONG = [10 + (7 * i) % 3000 for i in range(100)]  # 100 token ids: over max_model_len
TEXT = "The for statement is used to iterate over the elements of a sequence. " * 10  # ~140 tokens


@pytest.fixture(scope="module")
def server():
    service = demo_service(max_model_len=MAX_MODEL_LEN, num_kv_blocks=48)
    loop = ServerLoop()
    grpc_client = InferenceClient(loop.serve(service).address)
    http = HttpServer(loop.front(service), port=0, chat_template=ChatTemplate.load(DEMO_MODEL_DIR))
    loop.run(http.start())
    client = openai.OpenAI(base_url=f"{http.url}/v1", api_key="none", max_retries=0, timeout=120)
    free = grpc_client.server_info().stats.num_free_kv_blocks
    yield {"http": client, "grpc": grpc_client, "free": free}
    grpc_client.close()
    loop.run(http.stop(grace=0))
    loop.close(service)


def _complete(client, prompt, **extra):
    return client.completions.create(model="", prompt=prompt, max_tokens=4, temperature=0,
                                     extra_body=extra or None)


def test_http_token_ids_over_max_model_len_are_cut_then_served(server):
    client = server["http"]
    out = _complete(client, [LONG, LONG[:50]], truncate_prompt_tokens=20)
    want = _complete(client, [LONG[-20:], LONG[30:50]])
    assert [c.text for c in out.choices] == [c.text for c in want.choices]
    assert out.usage.prompt_tokens == 40
    text = _complete(client, TEXT, truncate_prompt_tokens=30)  # a text: cut once tokenized
    assert text.usage.prompt_tokens == 30
    chat = client.chat.completions.create(model="", messages=[{"role": "user", "content": TEXT}], max_tokens=2,
                                          extra_body={"truncate_prompt_tokens": 30})
    assert chat.usage.prompt_tokens == 30
    wait_idle(server["grpc"], server["free"])


@pytest.mark.parametrize("k", [MAX_MODEL_LEN, 99])
def test_http_what_is_still_too_long_gets_the_same_error(server, k):
    with pytest.raises(openai.BadRequestError) as info:
        _complete(server["http"], LONG, truncate_prompt_tokens=k)
    body = info.value.body
    assert body["param"] == "prompt" and f"{k} tokens" in body["message"]
    assert f"fewer than max_model_len={MAX_MODEL_LEN}" in body["message"]
    with pytest.raises(openai.BadRequestError) as info:  # unset: the whole prompt, refused as before
        _complete(server["http"], LONG)
    assert "100 tokens" in info.value.body["message"]
    wait_idle(server["grpc"], server["free"])


def test_grpc_token_ids_are_cut_before_the_length_check(server):
    client = server["grpc"]
    out = client.generate(LONG, max_tokens=4, temperature=0, truncate_prompt_tokens=20)
    want = client.generate(LONG[-20:], max_tokens=4, temperature=0)
    assert out.token_ids == want.token_ids and out.usage.prompt_tokens == 20
    exc = rpc_error(client.generate, LONG, max_tokens=4, truncate_prompt_tokens=MAX_MODEL_LEN)
    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"prompt='{MAX_MODEL_LEN} tokens'" in exc.details() and "fewer than max_model_len" in exc.details()
    exc = rpc_error(client.generate, LONG, max_tokens=4, truncate_prompt_tokens=0)  # the field's range, named
    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT and "truncate_prompt_tokens=0" in exc.details()
    wait_idle(client, server["free"])


def test_llm_cuts_token_ids_before_the_length_check():
    llm = LLM(DEMO_MODEL_DIR, dtype="float32", attention_backend="TORCH", max_model_len=MAX_MODEL_LEN,
              num_kv_blocks=16, progress=False)
    try:
        out, want = llm.generate([LONG, LONG[-20:]], SamplingParams(temperature=0, max_tokens=4,
                                                                   truncate_prompt_tokens=20))
        assert out.prompt_token_ids == LONG[-20:] and out.token_ids == want.token_ids
    finally:
        llm.shutdown()
