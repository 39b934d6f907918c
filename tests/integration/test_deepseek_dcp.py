"""DeepSeek-V3 under tensor and decode-context parallelism (gloo) equals HF transformers' greedy
generate, token for token.

Each rank runs the engine (EngineCore + SpmdExecutor, as `meshserve generate --tp --dcp` does) on
the tiny checkpoint: query heads, MLP and experts split over 2 ranks; with dcp=2 the two ranks
each cache every other token of the latent and merge their partial attention by LSE. Blocks of
4 tokens and prefill chunks of 12 tokens, so prompts span many blocks and chunks.
"""

import json

import pytest

from meshserve.cluster.executors.spmd import SpmdExecutor
from meshserve.config import AttentionConfig, CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from meshserve.core.sampling_params import SamplingParams
from meshserve.engine.engine_config import EngineConfig
from meshserve.engine.engine_core import EngineCore
from meshserve.workers.worker import Worker
from tests.deepseek_models import write_deepseek
from tests.integration.distributed import run_ranks
from tests.tiny_models import hf_greedy, prompts

NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)


def rank_main(rank, world, init_method, path, dcp, comm, backend, batch, out_file):
    import torch

    torch.set_num_threads(1)
    config = EngineConfig(
        model=ModelConfig(model=path, dtype="float32", max_model_len=128),
        cache=CacheConfig(block_size=4, num_kv_blocks=96),
        scheduler=SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=8),
        attention=AttentionConfig(backend=backend),
        parallel=ParallelConfig(tp=world, dcp=dcp, dcp_comm=comm),
    )
    worker = Worker(config.model, config.cache, config.attention, config.parallel, rank=rank, device="cpu",
                    progress=False, init_method=init_method)
    core = EngineCore(config, executor=SpmdExecutor(worker))
    try:
        attn = worker.runner.backends[0]
        if dcp > 1:
            attn = attn.inner  # the DCP wrapper around the layer's MLAAttention
        assert attn.problem.spec.num_heads == 2 * dcp  # a rank attends for its whole DCP group's heads
        reqs = [core.add_request(p, GREEDY) for p in batch]
        while core.has_unfinished():
            core.step()
    finally:
        core.shutdown()
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump([list(r.output_ids) for r in reqs], f)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_tp") / "deepseek_v3"
    hf = write_deepseek(path, "deepseek_v3")
    batch = prompts(3, seed=11, min_len=13, max_len=30)
    return path, batch, [hf_greedy(hf, p, NEW_TOKENS) for p in batch]


@pytest.mark.parametrize(("dcp", "comm", "backend"), [(2, "a2a", "TORCH"), (2, "ag_rs", "TRITON"),
                                                      (1, "ag_rs", "TORCH")])
def test_tp2_matches_hf(reference, tmp_path, dcp, comm, backend):
    path, batch, want = reference
    if backend == "TRITON":
        batch, want = batch[:2], want[:2]  # the Triton interpreter is slow on two busy cores
    out_file = tmp_path / "out.json"
    run_ranks(rank_main, 2, str(path), dcp, comm, backend, batch, str(out_file))
    got = json.loads(out_file.read_text())
    assert got == want, f"tp=2 dcp={dcp} {backend}: {got} != HF {want}"
