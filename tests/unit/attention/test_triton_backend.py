"""TRITON against the float64 oracle over every named scenario (CPU: the Triton interpreter)."""

import pytest
import torch

from meshserve.attention.backends.triton_paged import TritonBackend
from tests.unit.attention.scenarios import SCENARIOS, Scenario, assert_matches, make_case, oracle, run_backend


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_scenario(scenario, dtype):
    name = str(dtype).removeprefix("torch.")
    reasons = TritonBackend.validate_configuration(scenario.problem(name))
    assert reasons == [], reasons
    case = make_case(scenario, dtype=dtype)
    ref_out, ref_lse = oracle(case)
    out, lse = run_backend(TritonBackend, case, dtype=name)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_matches(out, lse, ref_out, ref_lse, dtype)


GRAPH_SCENARIOS = [s for s in SCENARIOS if all(q == 1 for q in s.query_lens) and min(s.context_lens) > 0] + [
    Scenario("graph_window_sink_tokens", (1, 1, 1), (40, 90, 6), spec=dict(sliding_window=8, num_sink_tokens=4)),
    Scenario("graph_learned_sinks_gqa", (1, 1), (25, 300), spec=dict(has_sinks=True, num_heads=8, num_kv_heads=2)),
    Scenario("graph_softcap", (1, 1), (14, 200), spec=dict(logits_soft_cap=5.0), query_gain=6.0),
]


@pytest.mark.parametrize("scenario", GRAPH_SCENARIOS, ids=lambda s: s.name)
def test_graph_plan_splits_each_sequence_by_its_own_length(scenario):
    """plan_for_graph: planned for max_model_len, run on shorter sequences (the CUDA-graph case).
    Each sequence's keys are cut into the plan's split count in the kernel (partition 0)."""
    import dataclasses

    case = make_case(scenario, dtype=torch.float32)
    ref_out, ref_lse = oracle(case)
    backend = TritonBackend(scenario.problem("float32", needs_lse=True))
    meta = case.metadata
    longest = dataclasses.replace(meta, seq_lens_host=(scenario.max_model_len,) * meta.num_seqs)
    plan = backend.plan_for_graph(longest)
    assert plan.partition == 0
    if scenario.attention_spec().sliding_window is None:
        assert plan.num_splits > 1  # planned for max_model_len: more splits than these sequences need
    backend.write_kv(case.key, case.value, case.kv_cache, meta.slot_mapping)
    if plan.partial_o is not None:
        plan.partial_o.fill_(float("nan"))  # splits past a sequence's keys write no output: never read
    out, lse = backend.forward(case.query, case.key, case.value, case.kv_cache, plan, layer=case.layer,
                               return_lse=True)
    assert_matches(out, lse, ref_out, ref_lse, torch.float32)
