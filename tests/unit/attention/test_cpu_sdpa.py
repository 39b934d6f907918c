"""CPU_SDPA against the float64 oracle over every named scenario it validates for, plus
decode-heavy GQA/MQA batches with shuffled block tables and DCP shards."""

import dataclasses

import pytest
import torch

from meshserve.attention.backends.cpu_sdpa import CpuSdpaBackend
from tests.unit.attention.scenarios import (
    SCENARIO_BY_NAME,
    SCENARIOS,
    Scenario,
    assert_matches,
    make_case,
    oracle,
    run_backend,
)
from tests.unit.attention.test_dcp_reference import DCP_SCENARIOS, shard_run


@pytest.fixture(autouse=True, params=["kernel", "torch_ops"])
def decode_path(request, monkeypatch):
    """Every test runs twice: decodes through the compiled paged decode kernel, and through the
    torch ops that serve when it cannot be built (its op replaced by None, as a failed build gives)."""
    from meshserve.attention.backends import cpu_sdpa

    if request.param == "kernel":
        if cpu_sdpa.paged_decode_op() is None:
            pytest.skip("the paged decode kernel could not be built here (see the logged warning)")
    else:
        monkeypatch.setattr(cpu_sdpa, "paged_decode_op", lambda: None)
    return request.param


def _skip_unless_valid(scenario: Scenario, dtype: str = "float32") -> None:
    reasons = CpuSdpaBackend.validate_configuration(scenario.problem(dtype, needs_lse=True))
    if reasons:
        pytest.skip("; ".join(reasons))


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
@pytest.mark.parametrize("return_lse", [True, False], ids=["lse", "no_lse"])
def test_scenario(scenario, return_lse):
    _skip_unless_valid(scenario)
    case = make_case(scenario)
    ref_out, ref_lse = oracle(case)
    if return_lse:
        out, lse = run_backend(CpuSdpaBackend, case)
        assert out.dtype == torch.float32 and lse.dtype == torch.float32
        assert_matches(out, lse, ref_out, ref_lse, torch.float32)
    else:  # the SDPA path for prefills, decode_bags for decodes (no LSE asked for)
        out, _ = _forward_without_lse(scenario, case)
        assert_matches(out, ref_lse.float(), ref_out, ref_lse, torch.float32)


def _forward_without_lse(scenario: Scenario, case) -> tuple[torch.Tensor, object]:
    backend = CpuSdpaBackend(scenario.problem())
    plan = backend.plan(case.metadata)
    if case.kv_cache is not None and case.key is not None:
        backend.write_kv(case.key, case.value, case.kv_cache, case.metadata.slot_mapping)
    return backend.forward(case.query, case.key, case.value, case.kv_cache, plan, layer=case.layer), plan


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_scenario_half(scenario, dtype):
    name = str(dtype).removeprefix("torch.")
    _skip_unless_valid(scenario, name)
    case = make_case(scenario, dtype=dtype)
    ref_out, ref_lse = oracle(case)
    out, lse = run_backend(CpuSdpaBackend, case, dtype=name)
    assert out.dtype == dtype
    assert_matches(out, lse, ref_out, ref_lse, dtype)


# Decode-heavy batches as a server sees them: many sequences of unequal lengths, one token each,
# a prefill or two in front; make_case shuffles the physical blocks and fills the rest with noise.
DECODE_HEAVY = [
    Scenario("gqa_decode_heavy", (1,) * 24, tuple(range(3, 3 + 24 * 13, 13)), spec=dict(num_heads=8, num_kv_heads=2)),
    Scenario("mqa_decode_heavy", (1,) * 17, tuple((7 * i * i) % 151 + 1 for i in range(17)),
             spec=dict(num_heads=6, num_kv_heads=1, head_size=32)),
    Scenario("gqa_mixed_heavy", (19, 4) + (1,) * 12, (0, 33) + tuple(range(1, 240, 20)),
             spec=dict(num_heads=12, num_kv_heads=4)),
    Scenario("gqa_window_decode_heavy", (1,) * 10, tuple(range(2, 200, 20)),
             spec=dict(num_heads=8, num_kv_heads=2, sliding_window=16, num_sink_tokens=2)),
    Scenario("gqa_sinks_softcap_heavy", (5,) + (1,) * 9, (0,) + tuple(range(4, 180, 20)),
             spec=dict(num_heads=8, num_kv_heads=4, has_sinks=True, logits_soft_cap=8.0), query_gain=4.0),
    Scenario("gqa_alibi_heavy", (1,) * 9, tuple(range(1, 180, 20)), spec=dict(num_heads=8, num_kv_heads=2,
                                                                             use_alibi=True), block_size=8),
]


@pytest.mark.parametrize("scenario", DECODE_HEAVY, ids=lambda s: s.name)
@pytest.mark.parametrize("seed", [0, 1])
def test_decode_heavy_batches(scenario, seed):
    _skip_unless_valid(scenario)
    case = make_case(scenario, seed=seed)
    ref_out, ref_lse = oracle(case)
    out, lse = run_backend(CpuSdpaBackend, case)
    assert_matches(out, lse, ref_out, ref_lse, torch.float32)


@pytest.mark.parametrize("scenario", DECODE_HEAVY, ids=lambda s: s.name)
@pytest.mark.parametrize("seed", [0, 1])
def test_decode_heavy_batches_without_lse(scenario, seed, monkeypatch, decode_path):
    """Without the kernel, decodes without the LSE read V in place (decode_bags) unless a
    soft-cap, sinks or ALiBi need the explicit path; with it, decode_bags never runs; either way
    the float64 oracle and the TORCH reference agree."""
    from meshserve.attention.backends import cpu_sdpa
    from meshserve.attention.backends.torch_ref import TorchBackend

    _skip_unless_valid(scenario)
    calls = []
    real = cpu_sdpa.decode_bags
    monkeypatch.setattr(cpu_sdpa, "decode_bags", lambda *a: calls.append(1) or real(*a))
    case = make_case(scenario, seed=seed)
    ref_out, ref_lse = oracle(case)
    out, plan = _forward_without_lse(scenario, case)
    assert_matches(out, ref_lse.float(), ref_out, ref_lse, torch.float32)
    torch_out, _ = run_backend(TorchBackend, make_case(scenario, seed=seed))
    torch.testing.assert_close(out, torch_out.float(), rtol=1e-5, atol=1e-5)
    decodes = plan.groups[-1]
    assert decodes.max_query_len == 1
    by_kernel = decode_path == "kernel" and decodes.table is not None
    assert decodes.kernel_only == by_kernel  # with the kernel the torch path's bags are not built
    assert (decodes.v_bags is not None) == (not by_kernel)
    spec = scenario.problem().spec
    special = spec.has_sinks or spec.logits_soft_cap is not None or spec.use_alibi
    assert len(calls) == (0 if special or by_kernel else 1), (scenario.name, calls)


def test_small_decode_groups_keep_one_sdpa_call():
    """Under BAGS_MIN_KEYS padded keys the plan leaves decode_bags out (SDPA is faster there)."""
    from meshserve.attention.backends.cpu_sdpa_plan import BAGS_MIN_KEYS

    scenario = Scenario("small_decode", (1, 1), (9, 30), spec=dict(num_heads=4, num_kv_heads=2))
    case = make_case(scenario)
    ref_out, ref_lse = oracle(case)
    out, plan = _forward_without_lse(scenario, case)
    assert_matches(out, ref_lse.float(), ref_out, ref_lse, torch.float32)
    g = plan.groups[-1]
    assert g.num_seqs * g.max_kv_len < BAGS_MIN_KEYS and g.v_bags is None


@pytest.mark.parametrize("name", DCP_SCENARIOS)
@pytest.mark.parametrize("dcp", [2, 3])
def test_dcp_shards_merge_to_full_attention(name, dcp):
    """Each rank attends over its shard with global positions; the LSE merge is the oracle."""
    scenario = SCENARIO_BY_NAME[name]
    reasons = CpuSdpaBackend.validate_configuration(dataclasses.replace(scenario.problem(needs_lse=True),
                                                                        dcp_size=dcp))
    if reasons:
        pytest.skip("; ".join(reasons))
    case = make_case(scenario)
    gen = torch.Generator().manual_seed(dcp)
    parts = [shard_run(case, dcp, r, gen, backend_cls=CpuSdpaBackend) for r in range(dcp)]
    outs = torch.stack([o.double() for o, _ in parts])  # [dcp, T, H, D]
    lses = torch.stack([lse.double() for _, lse in parts])  # [dcp, T, H]
    lse = torch.logsumexp(lses, dim=0)
    merged = (torch.nan_to_num(torch.exp(lses - lse), nan=0.0)[..., None] * outs).sum(0)
    ref_out, ref_lse = oracle(case)
    assert_matches(merged, lse, ref_out, ref_lse, torch.float32)


def test_cached_value_head_size_other_than_key_is_refused_as_data():
    from meshserve.attention.backend import AttentionProblem
    from meshserve.attention.spec import AttentionSpec, AttentionType

    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, head_size_v=16)
    assert any("head_size_v" in r for r in CpuSdpaBackend.validate_configuration(AttentionProblem(spec=spec)))
    uncached = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, head_size_v=16,
                             attn_type=AttentionType.ENCODER_ONLY)
    assert CpuSdpaBackend.validate_configuration(AttentionProblem(spec=uncached)) == []


def test_encoder_only_with_value_head_size_other_than_key():
    scenario = Scenario("encoder_only_dv", (9, 4), (0, 0), spec=dict(attn_type="encoder_only", head_size_v=8))
    case = make_case(scenario)
    ref_out, ref_lse = oracle(case)
    out, lse = run_backend(CpuSdpaBackend, case)
    assert_matches(out, lse, ref_out, ref_lse, torch.float32)


@pytest.mark.parametrize("skip", [False, True], ids=["all_slots", "some_skipped"])
def test_write_kv_matches_the_shared_scatter(skip):
    from meshserve.attention.backend import KVCache
    from meshserve.attention.backends.torch_ref import scatter_kv

    gen = torch.Generator().manual_seed(3)
    data = torch.randn(7, 2, 4, 2, 8, generator=gen)
    key, value = torch.randn(5, 2, 8, generator=gen), torch.randn(5, 2, 8, generator=gen)
    slots = torch.tensor([5, 27, 0, 13, -1 if skip else 22])
    ours, ref = KVCache(data.clone()), KVCache(data.clone())
    CpuSdpaBackend(SCENARIO_BY_NAME["small_decode"].problem()).write_kv(key, value, ours, slots)
    scatter_kv(key, value, ref, slots)
    assert torch.equal(ours.data, ref.data)


@pytest.mark.parametrize("name", ["small_decode", "mixed_prefill_decode", "chunked_prefill", "gqa"])
@pytest.mark.parametrize("dcp_rank", [None, 1])
def test_write_kv_with_the_steps_plan_matches_the_shared_scatter(name, dcp_rank):
    """The plan's precomputed write rows (once per step) store exactly what the masked scatter
    stores, on the shared scenarios' shuffled block tables; under DCP (slots of other ranks are
    -1) the plan has no rows and the scatter runs."""
    from meshserve.attention.backend import KVCache
    from meshserve.attention.backends.torch_ref import scatter_kv

    case = make_case(SCENARIO_BY_NAME[name])
    meta = case.metadata
    if dcp_rank is not None:  # the same step seen from rank 1 of 2: every other token is not stored here
        slots = meta.slot_mapping.clone()
        slots[dcp_rank::2] = -1
        meta = dataclasses.replace(meta, slot_mapping=slots)
    backend = CpuSdpaBackend(case.scenario.problem())
    plan = backend.plan(meta)
    assert (plan.write_rows is None) == (dcp_rank is not None)
    ours, ref = KVCache(case.kv_cache.data.clone()), KVCache(case.kv_cache.data.clone())
    backend.write_kv(case.key, case.value, ours, meta.slot_mapping, plan=plan)
    scatter_kv(case.key, case.value, ref, meta.slot_mapping)
    assert torch.equal(ours.data, ref.data)
    assert not torch.equal(ours.data, case.kv_cache.data)  # something was written


@pytest.mark.parametrize("lens", [(5, 5, 7, 3, 3, 3, 1, 9), (64,) * 4, (1, 2, 2)], ids=["runs", "equal", "one_token"])
def test_whole_prompts_of_one_length_share_a_call(lens, monkeypatch):
    """Neighbouring prompts of one length go through one batched SDPA call: the float64 oracle
    holds, and the output is bit for bit what one call per prompt gives."""
    import torch.nn.functional as F

    from meshserve.attention.backends import cpu_sdpa_math

    scenario = Scenario("fresh_prompts", lens, (0,) * len(lens))
    case = make_case(scenario, seed=4)
    ref_out, ref_lse = oracle(case)
    calls = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(cpu_sdpa_math.F, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    out, plan = _forward_without_lse(scenario, case)
    assert plan.groups[0].fresh
    assert_matches(out, ref_lse.float(), ref_out, ref_lse, torch.float32)
    runs = 1 + sum(a != b for a, b in zip(lens, lens[1:]))
    assert len(calls) == runs
    spec = scenario.attention_spec()
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    one_each = torch.cat([cpu_sdpa_math.sdpa_per_sequence(spec, case.query, case.key, case.value, starts[i : i + 2])
                          for i in range(len(lens))])
    assert torch.equal(out, one_each)
