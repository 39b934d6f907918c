"""Expert parallelism over real gloo process groups: greedy tokens equal the single-rank run's.

Tiny random GPT-OSS (4 experts, top-2, biased clamped-SwiGLU experts) and DeepSeek-V3/V2 (8
experts, top-2, grouped routing, a shared expert) checkpoints; EP=2 and EP=4 with the experts
whole on each rank (ep = tp) and EP=2 inside tp=4 (two EP groups, each expert split two ways).
Prompts are chunked (small token budget) so steps mix prefill and decode tokens, and the token
count per step is rarely a multiple of ep (padding rows in the dispatch).
"""

import json

import pytest
import torch

from meshserve.cluster.executors.spmd import SpmdExecutor
from meshserve.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from meshserve.core.sampling_params import SamplingParams
from meshserve.engine.engine_config import EngineConfig
from meshserve.engine.engine_core import EngineCore
from meshserve.workers.worker import Worker
from tests.deepseek_models import write_deepseek
from tests.integration.distributed import run_ranks
from tests.tiny_models import prompts, write_checkpoint

NEW_TOKENS = 10
PARAMS = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=2, ignore_eos=True)
NUM_EXPERTS = {"gpt_oss": 4, "deepseek_v3": 8, "deepseek_v2": 8}


def engine_config(path, tp=1, ep=1) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=str(path), dtype="float32", max_model_len=128),
        cache=CacheConfig(block_size=4, num_kv_blocks=120),
        scheduler=SchedulerConfig(max_num_batched_tokens=13, max_num_seqs=8),
        parallel=ParallelConfig(tp=tp, ep=ep),
    )


def generate(core: EngineCore, batch) -> list[dict]:
    reqs = [core.add_request(p, PARAMS) for p in batch]
    while core.has_unfinished():
        core.step()
    return [{"tokens": list(r.output_ids), "logprobs": [lp.logprob for lp in r.output_logprobs]} for r in reqs]


def _moe_layers(model) -> list[torch.nn.Module]:
    return model.expert_layers()


def rank_main(rank, world, init_method, path, ep, num_experts, batch, out_file):
    torch.set_num_threads(1)
    config = engine_config(path, world, ep)
    worker = Worker(config.model, config.cache, config.attention, config.parallel, rank=rank, device="cpu",
                    progress=False, init_method=init_method)
    core = EngineCore(config, executor=SpmdExecutor(worker))
    try:
        layers = _moe_layers(worker.runner.model)
        assert layers and all(m.expert_load.numel() == num_experts // ep for m in layers)  # this rank's experts
        results = generate(core, batch)
        # Rows per expert and MoE layer as the metrics see them: the sum of the ranks' reports.
        load = torch.tensor(worker.expert_load())
        torch.distributed.all_reduce(load)
    finally:
        core.shutdown()
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump({"results": results, "load": load.tolist()}, f)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep")
    out = {}
    for arch in NUM_EXPERTS:
        if arch == "gpt_oss":
            write_checkpoint(root / arch, arch)
        else:
            write_deepseek(root / arch, arch)
        batch = prompts(3, seed=5, min_len=15, max_len=33)
        core = EngineCore(engine_config(root / arch), device="cpu", progress=False)
        layers = _moe_layers(core.executor.worker.runner.model)
        results = generate(core, batch)
        out[arch] = (root / arch, batch, results, torch.stack([m.expert_load for m in layers]).tolist())
        core.shutdown()
    return out


@pytest.mark.parametrize(("arch", "tp", "ep"), [("gpt_oss", 2, 2), ("gpt_oss", 4, 4), ("deepseek_v3", 2, 2),
                                                ("deepseek_v3", 4, 4), ("deepseek_v2", 4, 2)])
def test_expert_parallel_matches_single_rank(references, tmp_path, arch, tp, ep):
    path, batch, want, want_load = references[arch]
    out_file = tmp_path / "out.json"
    run_ranks(rank_main, tp, str(path), ep, NUM_EXPERTS[arch], batch, str(out_file))
    got = json.loads(out_file.read_text())
    for i, (g, w) in enumerate(zip(got["results"], want)):
        assert g["tokens"] == w["tokens"], f"prompt {i}: tp={tp} ep={ep} {g['tokens']} != {w['tokens']}"
        for step, (a, b) in enumerate(zip(g["logprobs"], w["logprobs"])):
            assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), f"prompt {i} step {step}: logprob {a} vs {b}"
    # The same rows reached each expert as on one rank (dispatch padding is not counted).
    assert got["load"] == want_load

