"""Structured outputs with decode steps in CUDA graphs, skipped without CUDA.

The demo model, float32: a batch mixing json_schema, regex and free requests decodes in graphs
(the mask is applied to the graph's logits, outside it). Oracles: jsonschema and re for the
constrained outputs; for the free ones, the tokens of the same requests run alone (a
grammar in the batch must not change its neighbours), and the eager engine's tokens.
"""

import json
import re

import jsonschema
import pytest
import torch

from meshserve import LLM, SamplingParams
from meshserve.core.structured_outputs import StructuredOutputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
PROMPTS = ["The for statement is used to", "An exception is raised when", "Python supports", "A module is"]


def _llm(*, enforce_eager: bool) -> LLM:
    return LLM(None, dtype="float32", device="cuda", max_model_len=256, num_kv_blocks=256, max_num_seqs=16,
               enforce_eager=enforce_eager, progress=False)


def _batch():
    prompts, params = [], []
    json_schema, regex = StructuredOutputs.json_schema(SCHEMA), StructuredOutputs.regex(REGEX)
    for i, p in enumerate(PROMPTS):
        prompts += [p, p, p]
        params += [SamplingParams(temperature=0, max_tokens=60, structured_outputs=json_schema),
                   SamplingParams(temperature=0.9, seed=i, max_tokens=20, structured_outputs=regex),
                   SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)]
    return prompts, params


def test_masked_decode_in_graphs_validates_and_leaves_free_rows_alone():
    prompts, params = _batch()
    llm = _llm(enforce_eager=False)
    graphs = llm.core.executor.worker.runner.decode_graphs
    assert graphs is not None, "the decode steps did not capture graphs"
    outs = llm.generate(prompts, params)
    assert graphs.num_steps > 0
    for out, p in zip(outs, params):
        so = p.structured_outputs
        if so is not None and so.kind == "json":
            jsonschema.validate(json.loads(out.text), SCHEMA)
        elif so is not None:
            assert re.fullmatch(REGEX, out.text), out.text
    free = [i for i, p in enumerate(params) if p.structured_outputs is None]
    alone = llm.generate([prompts[i] for i in free], [params[i] for i in free])
    assert [outs[i].token_ids for i in free] == [o.token_ids for o in alone]
    llm.shutdown()
    eager = _llm(enforce_eager=True)
    want = eager.generate(prompts, params)
    assert [o.token_ids for o, p in zip(outs, params) if p.seed is None] == \
        [o.token_ids for o, p in zip(want, params) if p.seed is None]
    eager.shutdown()
