"""TRITON beyond the shared table: features combined, forced decode splits, block and head sizes,
FP8 write_kv bit-exactness, and the errors a caller can hit. CPU: the Triton interpreter."""

import dataclasses
import functools
import os

import pytest
import torch

from meshserve.attention.backend import KVCache, LayerParams
from meshserve.attention.backends.torch_ref import quantize_fp8
from meshserve.attention.backends.triton_paged import TritonBackend
from meshserve.attention.kernels.host_plans import choose_partition
from meshserve.attention.spec import AttentionType, KVCacheDtype
from meshserve.errors import ConfigError
from tests.unit.attention.scenarios import (
    SCENARIO_BY_NAME,
    Scenario,
    assert_matches,
    make_case,
    oracle,
    run_backend,
)

EVERYTHING = dict(
    num_heads=6, num_kv_heads=2, sliding_window=40, num_sink_tokens=5, has_sinks=True, use_alibi=True,
    logits_soft_cap=4.0,
)  # fmt: skip
EXTRA = (
    Scenario("all_features_decode", (1, 1, 1), (90, 45, 7), spec=EVERYTHING, query_gain=3.0, block_size=32),
    Scenario("all_features_chunks", (37, 20, 1), (45, 0, 60), spec=EVERYTHING, query_gain=3.0, block_size=32),
    Scenario("block_128", (19, 1), (150, 300), block_size=128),
    Scenario("block_256", (3, 1), (270, 100), block_size=256, max_model_len=1024),
    Scenario("head_40_mha", (9, 1), (30, 50), spec=dict(num_heads=3, num_kv_heads=3, head_size=40)),
    Scenario("head_8", (5, 1), (12, 33), spec=dict(head_size=8)),
    Scenario("group_of_20", (4, 1, 1), (10, 40, 70), spec=dict(num_heads=20, num_kv_heads=1)),
    Scenario(
        "fp8_window_sinks",
        (11, 1, 1),
        (30, 60, 9),
        spec=dict(kv_cache_dtype=KVCacheDtype.FP8_E4M3, sliding_window=16, has_sinks=True),
    ),
    Scenario(
        "encoder_only_alibi",
        (13, 7, 1),
        (0, 0, 0),
        spec=dict(attn_type=AttentionType.ENCODER_ONLY, use_alibi=True),
    ),
    Scenario(
        "cross_softcap",
        (5, 3),
        (0, 0),
        spec=dict(attn_type=AttentionType.CROSS, logits_soft_cap=3.0),
        encoder_lens=(33, 70),
        query_gain=4.0,
    ),
)


def check(scenario, dtype, **backend_kwargs):
    case = make_case(scenario, dtype=dtype, seed=1)
    ref_out, ref_lse = oracle(case)
    backend = functools.partial(TritonBackend, **backend_kwargs)
    out, lse = run_backend(backend, case, dtype=str(dtype).removeprefix("torch."))
    assert_matches(out, lse, ref_out, ref_lse, dtype)


@pytest.mark.parametrize("scenario", EXTRA, ids=lambda s: s.name)
def test_extra_scenarios_fp32_many_splits(scenario):
    check(scenario, torch.float32, decode_partition=16)


@pytest.mark.parametrize("scenario", EXTRA, ids=lambda s: s.name)
def test_extra_scenarios_fp16_default_splits(scenario):
    check(scenario, torch.float16)


@pytest.mark.parametrize("name", ["long_decode", "streaming_sinks", "sinks", "fp8_e5m2", "alibi"])
def test_table_scenarios_with_forced_splits(name):
    check(SCENARIO_BY_NAME[name], torch.float32, decode_partition=32)


def test_output_without_lse_equals_output_with_lse():
    scenario = SCENARIO_BY_NAME["long_decode"]
    case = make_case(scenario)
    backend = TritonBackend(scenario.problem(), decode_partition=64)
    plan = backend.plan(case.metadata)
    backend.write_kv(case.key, case.value, case.kv_cache, case.metadata.slot_mapping)
    out_lse, _ = backend.forward(case.query, case.key, case.value, case.kv_cache, plan, return_lse=True)
    out = backend.forward(case.query, case.key, case.value, case.kv_cache, plan)
    assert torch.equal(out, out_lse)


@pytest.mark.parametrize("kv_dtype", [KVCacheDtype.FP8_E4M3, KVCacheDtype.FP8_E5M2])
def test_fp8_write_kv_is_bit_exact_and_saturates(kv_dtype):
    scenario = Scenario("w", (8,), (0,), spec=dict(kv_cache_dtype=kv_dtype))
    spec = scenario.attention_spec()
    fp8 = torch.float8_e4m3fn if kv_dtype is KVCacheDtype.FP8_E4M3 else torch.float8_e5m2
    gen = torch.Generator().manual_seed(3)
    # Normal values, ties, values that round up across a power of two, subnormals, overflow.
    key = torch.randn(8, spec.num_kv_heads, spec.head_size, generator=gen) * 0.3
    key[0, 0, :6] = torch.tensor([7.9, -7.9, 1e-4, -3e-5, 1e6, -1e6]) * 0.05
    value = torch.randn(8, spec.num_kv_heads, spec.head_size, generator=gen) * 2.0
    slots = torch.tensor([5, 0, -1, 17, 3, 30, 12, 9])
    cache = KVCache(torch.zeros(2, 2, 16, spec.num_kv_heads, spec.head_size, dtype=fp8),
                    torch.tensor(0.05), torch.tensor(0.04))  # fmt: skip
    TritonBackend(scenario.problem()).write_kv(key, value, cache, slots)
    flat = cache.data.view(torch.uint8).reshape(2, 2, 16, -1).permute(1, 0, 2, 3).reshape(2, 32, -1)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        want_k = quantize_fp8(key[t], cache.k_scale, fp8).view(torch.uint8).reshape(-1)
        want_v = quantize_fp8(value[t], cache.v_scale, fp8).view(torch.uint8).reshape(-1)
        assert torch.equal(flat[0, slot], want_k), t
        assert torch.equal(flat[1, slot], want_v), t
    written = {s for s in slots.tolist() if s >= 0}
    untouched = [s for s in range(32) if s not in written]
    assert torch.all(flat[:, untouched] == 0)


def test_missing_layer_tensors_name_the_field():
    scenario = SCENARIO_BY_NAME["sinks"]
    case = make_case(scenario)
    backend = TritonBackend(scenario.problem())
    plan = backend.plan(case.metadata)
    with pytest.raises(ConfigError, match="layer.sinks"):
        backend.forward(case.query, case.key, case.value, case.kv_cache, plan, layer=LayerParams())
    with pytest.raises(ConfigError, match="plan"):
        backend.forward(case.query, case.key, case.value, case.kv_cache, case.metadata)


def test_declared_limits_are_reasons(monkeypatch):
    scenario = SCENARIO_BY_NAME["small_decode"]
    assert any("bf16" in r for r in TritonBackend.validate_configuration(scenario.problem("bfloat16")))
    fp8 = SCENARIO_BY_NAME["fp8_e4m3"].problem("float16", device="cuda", compute_capability=(8, 0))
    assert any("8.9" in r for r in TritonBackend.validate_configuration(fp8))
    monkeypatch.setitem(os.environ, "TRITON_INTERPRET", "0")
    assert any("TRITON_INTERPRET" in r for r in TritonBackend.validate_configuration(scenario.problem()))
    odd = Scenario("v", (1,), (3,), block_size=512, max_model_len=4096)
    assert any("block_size=512" in r for r in TritonBackend.validate_configuration(odd.problem()))


@pytest.mark.parametrize(
    "max_keys,decodes,kv_heads", [(32768, 8, 8), (4096, 64, 8), (2048, 256, 8), (100, 1, 1), (1, 3, 2)]
)
def test_choose_partition_covers_keys_with_whole_tiles(max_keys, decodes, kv_heads):
    partition, splits = choose_partition(max_keys, decodes, kv_heads, 132 * 8, 64, 256)
    assert partition % 64 == 0 and splits >= 1
    assert splits * partition >= max_keys > (splits - 1) * partition
    if splits > 1:
        assert partition >= 256


def test_long_prefills_plan_the_long_prefill_tiles():
    """On CUDA a step whose longest prefill reaches LONG_PREFILL_QUERIES gets long_prefill_config's
    tiles (and a tile list cut to its block_m); shorter steps and explicit configs keep theirs."""
    from meshserve.attention.kernels.config import LONG_PREFILL_QUERIES, PrefillConfig
    from meshserve.attention.metadata import AttentionMetadata

    def plan(backend, query_len, cached=16):
        """A prefill of query_len after `cached` tokens (0: a fresh prompt, in the fresh tiles), and a decode."""
        blocks = [list(range(1, 2 + (cached + query_len) // 16))]
        meta = AttentionMetadata.build(query_lens=[query_len, 1], seq_lens=[cached + query_len, 40],
                                       block_tables=blocks + [[0, 0, 0]], block_size=16)
        return backend.plan(meta)

    problem = Scenario("long", (1,), (1,), spec=dict(num_heads=8, num_kv_heads=2, head_size=128),
                       max_model_len=2 * LONG_PREFILL_QUERIES).problem("bfloat16", device="cuda",
                                                                       compute_capability=(9, 0))
    backend = TritonBackend(problem, num_sms=132)
    long_plan = plan(backend, LONG_PREFILL_QUERIES)
    assert long_plan.prefill == backend.long_prefill_cfg and backend.long_prefill_cfg.block_m == 256
    assert long_plan.tile_seq.numel() == LONG_PREFILL_QUERIES // 256 and long_plan.fresh_tile_seq is None
    fresh = plan(backend, LONG_PREFILL_QUERIES, cached=0)  # a fresh prompt: the fresh tiles, whatever its length
    assert fresh.tile_seq.numel() == 0 and fresh.fresh_prefill == backend.fresh_cfg()
    assert fresh.fresh_tile_seq.numel() == LONG_PREFILL_QUERIES // backend.fresh_cfg().block_m
    assert plan(backend, LONG_PREFILL_QUERIES - 1).prefill == backend.prefill_cfg != backend.long_prefill_cfg
    fixed = PrefillConfig(64, 32, 4, 2)
    assert plan(TritonBackend(problem, prefill_config=fixed), LONG_PREFILL_QUERIES).prefill == fixed
    assert TritonBackend(Scenario("long", (1,), (1,)).problem("float32")).long_prefill_cfg is None  # CPU
    ampere = dataclasses.replace(problem, compute_capability=(8, 0))  # measured on Hopper only
    assert TritonBackend(ampere).long_prefill_cfg is None
