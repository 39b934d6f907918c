"""TRITON (the Triton interpreter on CPU) under tensor and decode-context parallelism (gloo):
greedy tokens identical to the TORCH backend on one rank, for tp in {2, 4} with every dcp
dividing tp.

Block size 16 (TRITON's smallest): prompts of 66-70 tokens span several blocks on every DCP
rank, prefill runs in chunks of 24 tokens, and a second round sends prompts that share a
64-token prefix (one logical block at dcp = 4, two at dcp = 2) with the first round's, so DCP
ranks read prefix-cached blocks. tp > 1 at dcp = 1 is not repeated here: TRITON's path there is
unchanged, and test_tensor_parallel.py covers those layouts. The interpreter is slow, so the
layouts are a cover (tp 2 and 4 at dcp = tp, each feature at dcp = 2), not the full product;
tests/unit/attention/test_dcp_reference.py runs the kernels over dcp 2 and 3 shards of every
scenario. Llama has
fewer KV heads than tp=4 ranks; Gemma2 has a 6-token sliding window (alternate layers) and
logit soft-caps; GPT-OSS has learned sinks (counted once in the DCP merge) and a window.
"""

import json

import pytest

from meshserve.config import AttentionConfig, CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from meshserve.core.sampling_params import SamplingParams
from meshserve.engine.engine_config import EngineConfig
from meshserve.engine.engine_core import EngineCore
from tests.integration.distributed import run_on_rank, run_ranks
from tests.tiny_models import prompts, write_checkpoint

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PREFIX = 64  # whole logical blocks (16 * dcp tokens) for every dcp used here


def engine_config(path, tp=1, dcp=1, backend="TORCH") -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=str(path), dtype="float32", max_model_len=128),
        cache=CacheConfig(block_size=16, num_kv_blocks=48),
        scheduler=SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=4),
        parallel=ParallelConfig(tp=tp, dcp=dcp),
        attention=AttentionConfig(backend=backend),
    )


def rounds(arch_seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """First-round prompts, then prompts sharing each one's first PREFIX tokens."""
    first = prompts(2, seed=arch_seed, min_len=66, max_len=70)
    tails = prompts(2, seed=arch_seed + 1, min_len=3, max_len=9)
    return first, [p[:PREFIX] + t for p, t in zip(first, tails)]


def run_rounds(core: EngineCore, batches) -> list[dict]:
    out = []
    for batch in batches:
        reqs = [core.add_request(p, PARAMS) for p in batch]
        while core.has_unfinished():
            core.step()
        out += [{"tokens": list(r.output_ids), "cached": r.num_cached_tokens} for r in reqs]
    return out


def rank_main(rank, world, init_method, path, dcp, batches, out_file):
    def work(core):
        assert core.info.backend == "TRITON"
        return run_rounds(core, batches)

    run_on_rank(engine_config(path, world, dcp, "TRITON"), rank, init_method, work, out_file)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    root = tmp_path_factory.mktemp("triton_dcp")
    out = {}
    for seed, arch in enumerate(("llama", "gemma2", "gpt_oss")):
        write_checkpoint(root / arch, arch)
        batches = rounds(10 + 2 * seed)
        core = EngineCore(engine_config(root / arch), device="cpu", progress=False)
        try:
            out[arch] = (root / arch, batches, run_rounds(core, batches))
        finally:
            core.shutdown()
    return out


@pytest.mark.parametrize(("arch", "tp", "dcp"), [
    ("llama", 2, 2), ("llama", 4, 4), ("gemma2", 2, 2), ("gpt_oss", 2, 2),
])
def test_triton_dcp_matches_torch_single_rank(references, tmp_path, arch, tp, dcp):
    path, batches, want = references[arch]
    out_file = tmp_path / "out.json"
    run_ranks(rank_main, tp, str(path), dcp, batches, str(out_file))
    got = json.loads(out_file.read_text())
    for i, (g, w) in enumerate(zip(got, want)):
        assert g["tokens"] == w["tokens"], f"prompt {i}: TRITON tp={tp} dcp={dcp} {g['tokens']} != {w['tokens']}"
    hits = [g["cached"] for g in got[len(batches[0]):]]
    assert all(h >= PREFIX for h in hits), f"second round: cached prefix tokens {hits}, want >= {PREFIX}"
