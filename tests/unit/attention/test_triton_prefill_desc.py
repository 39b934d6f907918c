"""TRITON prefill with K/V pages read through tensor descriptors (kernels/kv_pages.py) against
the float64 oracle. CPU: the Triton interpreter emulates descriptors,
so these tests run the same kernel code the GPU runs (tests/gpu/test_prefill_desc_gpu.py runs it
on the hardware in bf16)."""

import dataclasses
import functools

import pytest
import torch

from meshserve.attention.backends.triton_paged import TritonBackend
from meshserve.attention.kernels.config import PrefillConfig
from meshserve.attention.kernels.host_plans import descriptor_reasons
from meshserve.attention.spec import KVCacheDtype
from meshserve.errors import ConfigError
from tests.unit.attention.scenarios import (
    SCENARIO_BY_NAME,
    Scenario,
    assert_matches,
    make_case,
    oracle,
    poison_unowned_slots,
    run_backend,
)


def _cfg(m, n):
    return PrefillConfig(block_m=m, block_n=n, num_warps=4, num_stages=1, kv_desc=True)


# (page, tile): one page per tile, several pages stacked per tile (2, 4), a tile inside a page.
PAGED_TILES = (
    (16, _cfg(16, 16)),
    (16, _cfg(16, 32)),
    (16, _cfg(32, 64)),
    (64, _cfg(16, 16)),
    (32, _cfg(16, 32)),
)
# Long enough for several unmasked tiles per query tile, ragged ends, chunks with cached context.
LONG = Scenario("long_chunks", (70, 33, 5, 1), (45, 100, 0, 60), spec=dict(num_heads=4, num_kv_heads=2))
FEATURES = ("chunked_prefill", "sliding_window", "streaming_sinks", "sinks", "alibi", "softcap", "fp8_e4m3",
            "encoder", "cross", "naive_layout")  # fmt: skip


def check(scenario, cfg, dtype=torch.float32):
    case = make_case(scenario, dtype=dtype, seed=4)
    poison_unowned_slots(case)
    ref_out, ref_lse = oracle(case)
    backend = TritonBackend(scenario.problem(str(dtype).removeprefix("torch.")), prefill_config=cfg)
    assert backend.prefill_descriptor_reasons(cfg, case.kv_cache) == []  # the descriptor path runs
    out, lse = run_backend(
        functools.partial(TritonBackend, prefill_config=cfg), case, dtype=str(dtype).removeprefix("torch.")
    )
    assert_matches(out, lse, ref_out, ref_lse, dtype)


@pytest.mark.parametrize(
    "page,cfg", PAGED_TILES, ids=lambda x: str(x) if isinstance(x, int) else f"{x.block_m}x{x.block_n}"
)
def test_descriptor_pages_match_oracle(page, cfg):
    check(dataclasses.replace(LONG, block_size=page, max_model_len=512), cfg)


@pytest.mark.parametrize("name", FEATURES)
def test_descriptor_pages_with_every_feature(name):
    scenario = SCENARIO_BY_NAME[name]
    check(scenario, _cfg(16, 32))


def test_descriptor_pages_in_float16():
    check(dataclasses.replace(LONG, block_size=32), _cfg(32, 16), torch.float16)


def test_caches_descriptors_cannot_read_fall_back_with_reasons():
    """Head 24 (not a power of two) and an FP8 head of 8 bytes per row: the gather path runs,
    the answer is still right, and the reasons say why."""
    cfg = _cfg(16, 16)
    odd = SCENARIO_BY_NAME["odd_head_size"]
    case = make_case(odd, seed=2)
    backend = TritonBackend(odd.problem(), prefill_config=cfg)
    assert any("head_size=24" in r for r in backend.prefill_descriptor_reasons(cfg, case.kv_cache))
    out, lse = run_backend(functools.partial(TritonBackend, prefill_config=cfg), case)
    assert_matches(out, lse, *oracle(case), torch.float32)

    tiny = torch.zeros(4, 2, 16, 1, 8, dtype=torch.float8_e4m3fn)
    assert any("multiple of 16" in r for r in descriptor_reasons(tiny, 8, 16, 16, None))
    strided = torch.zeros(4, 2, 16, 2, 32)[:, :, :, :1]
    assert "the cache is not contiguous" in descriptor_reasons(strided, 32, 32, 16, None)
    assert any(
        "spans more than 8 pages" in r for r in descriptor_reasons(torch.zeros(4, 2, 16, 2, 32), 32, 32, 256, None)
    )
    assert descriptor_reasons(torch.zeros(4, 2, 16, 2, 32), 32, 32, 64, None) == []
    off = TritonBackend(odd.problem(), prefill_config=dataclasses.replace(cfg, kv_desc=False))
    assert "kv_desc=False" in off.prefill_descriptor_reasons(off.prefill_cfg, case.kv_cache)[0]
    assert "no KV cache" in off.prefill_descriptor_reasons(cfg, None)[0]


def test_defaults_use_descriptors_only_for_whole_page_tiles_on_hopper():
    """The H200 sweep's rule (kernels/config.py): descriptors where a 64-key tile is one page."""
    from meshserve.attention.kernels import config

    hopper, ampere = (9, 0), (8, 0)
    desc = config.default_prefill_config(128, "bfloat16", "cuda", False, page=64, compute_capability=hopper)
    assert desc.kv_desc and (desc.block_m, desc.block_n, desc.num_warps) == (128, 64, 4)
    assert config.long_prefill_config(128, "bfloat16", "cuda", False, hopper, page=64) is None
    for page, cc, fp8, head, dtype in [(16, hopper, False, 128, "bfloat16"), (32, hopper, False, 128, "float16"),
                                       (64, ampere, False, 128, "bfloat16"), (64, hopper, True, 128, "bfloat16"),
                                       (64, hopper, False, 256, "bfloat16"), (64, hopper, False, 128, "float32"),
                                       (128, None, False, 128, "bfloat16")]:  # fmt: skip
        assert not config.default_prefill_config(head, dtype, "cuda", fp8, page=page, compute_capability=cc).kv_desc
    assert not config.default_prefill_config(128, "bfloat16", "cpu", False, page=64, compute_capability=None).kv_desc
    long = config.long_prefill_config(128, "bfloat16", "cuda", False, hopper, page=16)
    assert (long.block_m, long.kv_desc) == (256, False)
    problem = dataclasses.replace(LONG.problem(), device="cuda", dtype="bfloat16", compute_capability=hopper,
                                  block_size=64)  # fmt: skip
    assert TritonBackend(problem).prefill_cfg.kv_desc


def test_fp8_cache_through_descriptors():
    scenario = dataclasses.replace(LONG, spec=LONG.spec | dict(kv_cache_dtype=KVCacheDtype.FP8_E5M2))
    case = make_case(scenario, seed=6)
    cfg = _cfg(16, 32)
    assert TritonBackend(scenario.problem(), prefill_config=cfg).prefill_descriptor_reasons(cfg, case.kv_cache) == []
    out, lse = run_backend(functools.partial(TritonBackend, prefill_config=cfg), case)
    assert_matches(out, lse, *oracle(case), torch.float32)


@pytest.mark.parametrize(
    "field,kwargs",
    [("block_m", dict(block_m=24)), ("block_n", dict(block_n=8)), ("num_warps", dict(num_warps=3)),
     ("num_stages", dict(num_stages=0)), ("max_registers", dict(max_registers=300))],
)  # fmt: skip
def test_bad_prefill_config_names_the_field(field, kwargs):
    with pytest.raises(ConfigError, match=field):
        PrefillConfig(**(dict(block_m=16, block_n=16, num_warps=4, num_stages=1) | kwargs))
