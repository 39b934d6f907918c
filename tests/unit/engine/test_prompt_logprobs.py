"""prompt_logprobs against HF transformers' log-softmax of the same checkpoint's logits (float32),
with prompts split into chunks (a small token budget) and a prompt asked twice (the second
would hit the prefix cache: it must not, or its positions would have no logits)."""

import asyncio

import pytest
import torch
import transformers

from meshserve import LLM, SamplingParams
from meshserve.demo_model import DEMO_MODEL_DIR

PROMPTS = ["The for statement is used to iterate over the elements of a sequence such as a list or a string",
           "An exception is raised when"]


@pytest.fixture(scope="module")
def llm():
    out = LLM(DEMO_MODEL_DIR, dtype="float32", attention_backend="TORCH", max_model_len=256, num_kv_blocks=64,
              max_num_batched_tokens=16, progress=False)
    yield out
    out.shutdown()


@pytest.fixture(scope="module")
def hf():
    return transformers.AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()


def test_prompt_logprobs_equal_hf_through_chunks_and_the_prefix_cache(llm, hf):
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    outs = llm.generate(PROMPTS + PROMPTS[:1], params)  # the third is the first again (a cache hit otherwise)
    for out in outs:
        ids = out.prompt_token_ids
        with torch.no_grad():
            want = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), dim=-1)  # [L, V]
        got = out.prompt_logprobs
        assert len(got) == len(ids) and got[0] is None
        for i in range(1, len(ids)):
            lp = got[i]
            assert lp.token_id == ids[i]
            assert abs(lp.logprob - want[i - 1, ids[i]].item()) < 1e-3, i
            top = torch.topk(want[i - 1], 3)
            assert [t for t, _ in lp.top] == top.indices.tolist(), i
    assert outs[2].num_cached_tokens == 0  # (its prompt's blocks were cached by the first: not looked up)


def _assert_equal_hf(got, ids, hf, n_top):
    """got: per prompt token, None then TokenLogprobs; the oracle: HF's logits in float64."""
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), dim=-1)  # [L, V]
    assert len(got) == len(ids) and got[0] is None
    for i in range(1, len(ids)):
        lp = got[i]
        assert lp.token_id == ids[i]
        assert abs(lp.logprob - want[i - 1, ids[i]].item()) < 1e-3, i
        assert [t for t, _ in lp.top] == torch.topk(want[i - 1], n_top).indices.tolist(), i


@pytest.mark.parametrize("n, best_of", [(3, None), (2, 4)], ids=["n3", "n2-best_of4"])
def test_prompt_logprobs_come_once_with_several_samples(llm, hf, n, best_of):
    """n / best_of > 1: the prompt's logprobs are computed once (by the group's prompt, chunked here)
    and returned once, equal to HF's; every sample still runs."""
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=3, n=n, best_of=best_of, prompt_logprobs=2)
    out, single = llm.generate([PROMPTS[0], [5]], params)
    assert len(out.outputs) == n and all(len(c.token_ids) == 3 for c in out.outputs)
    _assert_equal_hf(out.prompt_logprobs, out.prompt_token_ids, hf, 2)
    assert len(single.prompt_token_ids) == 1 and single.prompt_logprobs == [None]  # nothing predicts a first token
    deltas = []

    async def stream():
        async for delta in llm.stream(PROMPTS[1], params):
            deltas.append(delta)

    asyncio.run(stream())
    carrying = [d for d in deltas if d.prompt_logprobs is not None]
    assert len(carrying) == 1 and carrying[0] is deltas[0]  # once per request, on its first delta
    ids = llm.tokenizer.encode(PROMPTS[1]).ids
    _assert_equal_hf(carrying[0].prompt_logprobs, ids, hf, 2)
    assert {d.index for d in deltas} == set(range(n))
