"""prompt_logprobs against HF transformers' log-softmax of the same checkpoint's logits (float32),
with prompts split into chunks (a small token budget) and a prompt asked twice (the second
would hit the prefix cache: it must not, or its positions would have no logits)."""

import pytest
import torch
import transformers

from meshserve import LLM, SamplingParams
from meshserve.demo_model import DEMO_MODEL_DIR
from meshserve.errors import ConfigError

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


def test_prompt_logprobs_are_refused_with_several_samples():
    with pytest.raises(ConfigError) as err:
        SamplingParams(n=2, prompt_logprobs=1)
    assert err.value.field == "prompt_logprobs"
    assert SamplingParams(max_tokens=2).prompt_logprobs is None
