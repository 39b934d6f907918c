"""Tensor and decode-context parallelism over real gloo process groups.

Every (tp, dcp) layout must give the single-rank run's greedy tokens exactly and its
log-probabilities within 1e-4, on a tiny random HF checkpoint with fewer KV heads than ranks,
with prompts spanning many small blocks and prefill split into small chunks. Mistral's sliding
window (7) is shorter than the prompts, so DCP must apply it at global positions.
"""

import json

import pytest

from meshserve.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from meshserve.core.sampling_params import SamplingParams
from meshserve.engine.engine_config import EngineConfig
from meshserve.engine.engine_core import EngineCore
from tests.integration.distributed import run_on_rank, run_ranks
from tests.quant_models import online_fp8_twin
from tests.tiny_models import prompts, write_checkpoint

NEW_TOKENS = 12
PARAMS = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=3, ignore_eos=True)


def engine_config(path, tp=1, dcp=1, comm="ag_rs", **model) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=str(path), dtype="float32", max_model_len=128, **model),
        cache=CacheConfig(block_size=4, num_kv_blocks=160),
        scheduler=SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=8),
        parallel=ParallelConfig(tp=tp, dcp=dcp, dcp_comm=comm),
    )


def generate(core: EngineCore, batch) -> list[dict]:
    reqs = [core.add_request(p, PARAMS) for p in batch]
    while core.has_unfinished():
        core.step()
    return [{"tokens": list(r.output_ids), "logprobs": [lp.logprob for lp in r.output_logprobs],
             "top": [[list(t) for t in lp.top] for lp in r.output_logprobs]} for r in reqs]


def rank_main(rank, world, init_method, path, dcp, comm, batch, out_file):
    def work(core):
        assert core.info.block_size == 4 * dcp  # the scheduler's blocks cover 4 tokens on each DCP rank
        return generate(core, batch)

    run_on_rank(engine_config(path, world, dcp, comm), rank, init_method, work, out_file)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    out = {}
    for arch in ("llama", "mistral"):
        write_checkpoint(root / arch, arch)
        batch = prompts(4, seed=7, min_len=20, max_len=45)
        core = EngineCore(engine_config(root / arch), device="cpu", progress=False)
        out[arch] = (root / arch, batch, generate(core, batch))
        core.shutdown()
    return out


@pytest.mark.parametrize(
    ("arch", "tp", "dcp", "comm"),
    [("llama", 2, 1, "ag_rs"), ("llama", 2, 2, "a2a"), ("llama", 4, 1, "ag_rs"), ("llama", 4, 2, "ag_rs"),
     ("llama", 4, 4, "a2a"), ("mistral", 2, 2, "ag_rs")],
)
def test_parallel_layout_matches_single_rank(references, tmp_path, arch, tp, dcp, comm):
    path, batch, want = references[arch]
    out_file = tmp_path / "out.json"
    run_ranks(rank_main, tp, str(path), dcp, comm, batch, str(out_file))
    got = json.loads(out_file.read_text())
    for i, (g, w) in enumerate(zip(got, want)):
        assert g["tokens"] == w["tokens"], f"prompt {i}: tp={tp} dcp={dcp} {g['tokens']} != {w['tokens']}"
        for step, (a, b) in enumerate(zip(g["logprobs"], w["logprobs"])):
            assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), f"prompt {i} step {step}: logprob {a} vs {b}"
        assert [[t for t, _ in top] for top in g["top"]] == [[t for t, _ in top] for top in w["top"]]


def fp8_rank_main(rank, world, init_method, path, model, batch, out_file):
    run_on_rank(engine_config(path, world, **model), rank, init_method, lambda core: generate(core, batch), out_file)


def test_fp8_lm_head_at_tp2_matches_its_float_twin(tmp_path):
    """Online FP8 with the LM head in FP8 (ModelConfig.quantize_lm_head) on tied embeddings at tp = 2:
    each rank quantizes its vocabulary rows of the embedding into its Fp8ParallelLMHead and the
    logits are all-gathered. The oracle is the same layout serving the checkpoint whose (untied)
    head holds those rows' FP8 round trip in float (tests/quant_models.online_fp8_twin), with the
    projections quantized alike on both sides. (Online FP8 at tp = 2 is not tp = 1's: a
    row-parallel rank scales its own columns, as vLLM's online FP8 does.)"""
    path = tmp_path / "tied"
    write_checkpoint(path, "llama", overrides={"tie_word_embeddings": True})
    twin = online_fp8_twin(path, tmp_path / "twin", projections=False, lm_head=True)
    batch = prompts(2, seed=7, min_len=20, max_len=45)
    runs = {}
    for name, where, model in (("fp8_head", path, {"quantization": "fp8", "quantize_lm_head": True}),
                               ("twin", twin, {"quantization": "fp8"})):
        run_ranks(fp8_rank_main, 2, str(where), model, batch, str(tmp_path / f"{name}.json"))
        runs[name] = json.loads((tmp_path / f"{name}.json").read_text())
    for i, (g, w) in enumerate(zip(runs["fp8_head"], runs["twin"])):
        assert g["tokens"] == w["tokens"], f"prompt {i}: {g['tokens']} != {w['tokens']}"
        for step, (a, b) in enumerate(zip(g["logprobs"], w["logprobs"])):
            assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), f"prompt {i} step {step}: logprob {a} vs {b}"


def test_generate_command_tp2_dcp2_prints_the_single_rank_text():
    import subprocess
    import sys

    def run(*flags):
        cmd = [sys.executable, "-m", "meshserve.cli", "generate", "--max-tokens", "16", "--device", "cpu",
               *flags, "The for statement is used to"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
        return done.stdout

    single = run()
    assert len(single) > len("The for statement is used to") + 20
    assert run("--tp", "2", "--dcp", "2") == single


def test_generate_command_with_ranks_prints_a_refusal_once_without_tracebacks():
    """A configuration every rank refuses: exit status 2 and the reason once, as with one rank."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "meshserve.cli", "generate", "--max-tokens", "4", "--device", "cpu", "--tp", "2",
           "--attention-backend", "FLASHINFER", "Hello"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("meshserve: error: attention backend FLASHINFER cannot serve this configuration") == 1
    assert "Traceback" not in done.stderr and done.stdout == ""
