"""The Gluon prefill for Hopper (kernels/prefill_gluon.py) as far as a CPU can check it.

Gluon does not run in the Triton interpreter, so its numbers are checked on the GPU only
(tests/gpu/test_fresh_prefill_gpu.py, kind "triton_fresh_gluon", against the reference). Here:
- every variant compiles for sm_90 with the bundled ptxas, with no spills, with wgmma, and with
  warpgroup register counts (setmaxnreg) that fit what the CTA is launched with: an increase
  beyond that pool waits for ever on the GPU;
- a config that asks for Gluon where it does not apply (here: no GPU) runs the portable kernel
  with the same tiles and is right, and says why;
- PrefillConfig refuses Gluon settings it cannot serve.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshserve.attention.backends.triton_paged import TritonBackend
from meshserve.attention.kernels.config import GLUON_FRESH_CONFIG, PrefillConfig
from meshserve.errors import ConfigError
from tests.unit.attention.scenarios import (
    Scenario,
    assert_matches,
    forward_with_fresh_slots_poisoned,
    make_case,
    oracle,
    poison_unowned_slots,
)

GLUON = PrefillConfig(block_m=128, block_n=64, num_warps=4, num_stages=2, kv_desc=True, fresh_kv=True, gluon=True)


def test_config_refuses_gluon_without_fresh_kv_or_with_other_query_tiles():
    with pytest.raises(ConfigError, match="gluon"):
        PrefillConfig(block_m=128, block_n=64, num_warps=4, num_stages=2, gluon=True)
    with pytest.raises(ConfigError, match="block_m.*128 with gluon=True"):
        PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=2, fresh_kv=True, gluon=True)
    with pytest.raises(ConfigError, match="num_stages=4 .*2 or 3 with gluon=True"):
        PrefillConfig(block_m=128, block_n=64, num_warps=4, num_stages=4, fresh_kv=True, gluon=True)


def test_a_gluon_config_off_hopper_runs_the_portable_kernel_and_matches_the_oracle():
    scenario = Scenario("fresh_gluon_fallback", (150, 33, 1), (0, 0, 40), spec=dict(num_heads=8, num_kv_heads=2,
                                                                                     head_size=64))  # fmt: skip
    case = make_case(scenario, seed=3)
    poison_unowned_slots(case)
    backend = TritonBackend(scenario.problem(needs_lse=True), prefill_config=GLUON)
    out, lse, plan = forward_with_fresh_slots_poisoned(backend, case)
    assert_matches(out, lse, *oracle(case), torch.float32)
    assert set(plan.fresh_tile_seq.tolist()) == {0, 1}
    assert any("sm_90" in r and "CPU" in r for r in backend.gluon_prefill_reasons(case.query, case.key, case.value))


@pytest.mark.parametrize("spec,cc,gluon", [
    (dict(num_heads=32, num_kv_heads=8, head_size=128), (9, 0), True),
    (dict(num_heads=16, num_kv_heads=4, head_size=64), (9, 0), True),
    (dict(num_heads=32, num_kv_heads=8, head_size=128), (8, 0), None),  # below sm_90: no fresh tiles at all
    (dict(num_heads=32, num_kv_heads=8, head_size=128), (10, 0), False),  # no wgmma: the portable fresh tiles
    (dict(num_heads=16, num_kv_heads=4, head_size=96), (9, 0), False),
    (dict(num_heads=8, num_kv_heads=2, head_size=128, sliding_window=64), (9, 0), False),
    (dict(num_heads=32, num_kv_heads=8, head_size=128, dtype="float16"), (9, 0), False),  # not run on a GPU in fp16
])  # fmt: skip
def test_fresh_prompts_default_to_gluon_on_sm90_where_it_serves_the_problem(spec, cc, gluon):
    spec = dict(spec)
    dtype = spec.pop("dtype", "bfloat16")
    problem = Scenario("x", (8,), (0,), spec=spec).problem(dtype, device="cuda", compute_capability=cc)
    cfg = TritonBackend(problem).fresh_cfg()
    assert (None if cfg is None else cfg.gluon) is gluon
    if gluon:
        assert cfg == GLUON_FRESH_CONFIG


def test_gluon_refuses_what_its_masks_and_tiles_do_not_cover():
    for extra, word in ((dict(sliding_window=32), "sliding window"), (dict(logits_soft_cap=30.0), "soft cap"),
                        (dict(head_size=96), "head_size=96")):  # fmt: skip
        spec = dict(dict(num_heads=8, num_kv_heads=2, head_size=64), **extra)
        problem = Scenario("x", (8,), (0,), spec=spec).problem(device="cuda", compute_capability=(9, 0))
        x = torch.empty(8, 8, spec["head_size"], dtype=torch.bfloat16)
        assert any(word in r for r in TritonBackend(problem, prefill_config=GLUON).gluon_prefill_reasons(x, x, x))


def test_every_gluon_variant_compiles_for_sm90_without_spills_and_within_the_register_pool():
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from meshserve.attention.kernels import prefill_gluon as pg

    # In a process of its own: under TRITON_INTERPRET (the CPU suite's) Gluon functions do not compile.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-m", "bench.kernel_report", "--gluon"], capture_output=True, text=True,
                         env=env, timeout=600, cwd=Path(__file__).resolve().parents[3])  # fmt: skip
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert res.returncode == 0 and len(rows) == 6, res.stdout[-2000:] + res.stderr[-3000:]
    assert {(r["head"], r["overlap"], r["stages"]) for r in rows} == {(64, True, 2), (64, False, 2), (128, True, 2),
                                                                      (128, False, 2), (128, True, 3)}  # fmt: skip
    assert max(r["shared"] for r in rows) <= 227 * 1024  # sm_90's shared memory per block
    for rep in rows:
        assert rep["kernel"] == "gluon_fresh_prefill_kernel" and rep["refused"] == []
        assert rep["stack"] == 0, rep  # no spills
        assert rep["warps"] == 12, rep  # 4 default + 4 consumer + the loader warp's warpgroup
        # The default partition's, the second consumer's and the loader's register counts come out
        # of the pool the CTA is launched with (registers x 3 warpgroups of 128 threads): an
        # increase beyond it would wait for ever.
        moves = [tuple(m) for m in rep["setmaxnreg"]]
        top = max(n for op, n in moves if op == "inc")
        assert ("inc", pg.CONSUMER_REGS) in moves and ("dec", pg.LOADER_REGS) in moves, rep
        assert top + pg.CONSUMER_REGS + pg.LOADER_REGS <= 3 * rep["registers"], rep
