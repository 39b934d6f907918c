"""tp=2 overlap scheduling through the step channel over NCCL (two GPUs; skipped with fewer).

With overlap a row whose token is still being drawn takes it from the previous step's draw on
the device; at tp > 1 rank 0 broadcasts that draw in the TP group (ModelRunner._previous_draw),
which the CPU suite checks over gloo only. Oracle: the same tp=2 replica without overlap (the
same all-reduce order, so the same tokens bit for bit), greedy and seeded-sampled requests in
bf16 and float32.
"""

import dataclasses

import pytest
import torch

from meshserve.cluster.executors.multiproc import MultiprocExecutor
from meshserve.config import ParallelConfig
from meshserve.engine.engine_core import EngineCore
from tests.tiny_models import prompts, write_checkpoint
from tests.unit.cluster.test_channel_overlap import PARAMS, Spy, engine_config, run

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA devices")]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_tp2_overlap_over_nccl_gives_the_tokens_of_tp2_without_overlap(tmp_path, dtype):
    path = tmp_path / "llama"
    write_checkpoint(path, "llama", seed=4)
    requests = [(f"r{i}", p, PARAMS[i % len(PARAMS)]) for i, p in enumerate(prompts(6, seed=3, min_len=3, max_len=40))]
    outs = {}
    for overlap in (False, True):
        base = engine_config(str(path), overlap=overlap)
        cfg = dataclasses.replace(base, model=dataclasses.replace(base.model, dtype=dtype),
                                  attention=dataclasses.replace(base.attention, backend="TRITON"),
                                  parallel=ParallelConfig(tp=2))
        executor = MultiprocExecutor(cfg, device="cuda")
        core = EngineCore(cfg, executor=executor)
        try:
            assert core.overlap is overlap
            spy = Spy(executor)
            outs[overlap] = run(core, requests)
            if overlap:
                assert spy.max_outstanding == 2 and spy.rows_from_last_step > 0
        finally:
            core.shutdown()
    assert outs[True] == outs[False]
