"""A request id given back as soon as its request finished: the next plan both forgets the old
request and announces the new one under the same id. The runner must drop the old one first
(else it forgets the new one and the next step fails), and a token of the old request still in
flight must not land in the new one's history (penalties and seeds read it). Oracle: the same
request under a fresh id on the same engine."""

import pytest

from meshserve import LLM, SamplingParams
from meshserve.demo_model import DEMO_MODEL_DIR

PROMPT = "An exception is raised when"


@pytest.fixture(scope="module")
def core():
    llm = LLM(DEMO_MODEL_DIR, dtype="float32", attention_backend="TORCH", max_model_len=128, num_kv_blocks=64,
              progress=False)
    yield llm.core
    llm.shutdown()


def _generate(core, request_id: str, params: SamplingParams) -> list[int]:
    core.add(core.make_request(PROMPT, params, request_id=request_id))
    tokens = []
    while core.has_unfinished():
        for delta in core.step():
            tokens += delta.token_ids
    return tokens


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=6),
    SamplingParams(temperature=0.9, seed=7, repetition_penalty=1.3, max_tokens=6),  # reads its history
], ids=["greedy", "seeded-penalised"])  # fmt: skip
def test_an_id_reused_right_after_its_request_finished_runs_as_a_fresh_one(core, params):
    want = _generate(core, "fresh-" + str(params.seed), params)
    assert len(want) == 6
    free = core.kv.pool.num_free_blocks
    assert _generate(core, "again", params) == want
    assert _generate(core, "again", params) == want  # its forget still unsent: the same plan announces it anew
    assert _generate(core, "again", params) == want
    assert core.kv.pool.num_free_blocks == free
