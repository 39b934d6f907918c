"""CUDA-graph decode against eager decode on the same checkpoint, skipped without CUDA.

Each run mixes what a serving step sees: prompts sharing a prefix (prefix-cache hits), a token
budget smaller than a prompt (chunked prefill) and a KV pool too small for every request at
once (preemption and recompute), so graph steps alternate with eager prefill steps and the
decode batch moves between buckets. float32 TRITON must give HF transformers' greedy tokens
exactly, graphs or not; bf16 graph runs must give the eager run's tokens.

DeepSeek-V3 and V2 (MLA attention + fused MoE; V2 without a q LoRA, so its query is a strided
view of the stacked q_kv_a_proj output) run the same mix with DeepSeek's real latent shape
(kv_lora_rank 512, rope 64, 16 heads: what FlashInfer's MLA kernels take) on a tiny model, through
the TRITON and FLASHINFER MLA decode backends.
"""

import pytest
import torch

from meshserve import LLM, SamplingParams
from meshserve.attention.backend import AttentionProblem
from meshserve.attention.mla.spec import mla_spec
from meshserve.attention.registry import BackendKind, load_backend
from meshserve.attention.spec import AttentionSpec, MLADims
from tests.deepseek_models import write_deepseek
from tests.gpu import FLASHINFER_HEAD_DIM
from tests.tiny_models import hf_greedy, prompts, write_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
ARCHS = ("llama", "gemma2")  # written by tiny_models; DeepSeek by deepseek_models (in `cases` too)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    root = tmp_path_factory.mktemp("graphs_gpu")
    shared = prompts(1, seed=9, min_len=40, max_len=40)[0]
    batch = [shared + p for p in prompts(10, seed=3, min_len=4, max_len=50)]  # a common 40-token prefix
    assert max(map(len, batch)) > MAX_BATCHED_TOKENS  # some prompts are prefilled in chunks
    out = {}
    for name in ARCHS:
        hf = write_checkpoint(root / name, name, overrides={"head_dim": FLASHINFER_HEAD_DIM})
        out[name] = (root / name, batch, hf)
    for name in DEEPSEEK:  # v2: no q LoRA, so q is a view of the stacked q_kv_a_proj's output
        hf = write_deepseek(root / name, name, **DEEPSEEK_SHAPE)
        out[name] = (root / name, batch, hf)
    return out


# KV blocks of 16 tokens: enough for one max_model_len=128 sequence in each KV layer group (gemma2 has
# three) plus a little, far fewer than the batch needs at once, so requests are preempted.
NUM_BLOCKS = {"llama": 14, "gemma2": 30, "deepseek_v3": 14, "deepseek_v2": 14}
DEEPSEEK = ("deepseek_v3", "deepseek_v2")
MAX_BATCHED_TOKENS = 64
DEEPSEEK_SHAPE = dict(num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, qk_rope_head_dim=64)
DEEPSEEK_DIMS = MLADims(kv_lora_rank=512, qk_nope_head_dim=16, qk_rope_head_dim=64, v_head_dim=16)


def _llm(path, backend, dtype, *, enforce_eager):
    arch = path.name
    return LLM(path, attention_backend=backend, dtype=dtype, device="cuda", block_size=16,
               num_kv_blocks=NUM_BLOCKS[arch], max_model_len=128, max_num_batched_tokens=MAX_BATCHED_TOKENS,
               max_num_seqs=16, enforce_eager=enforce_eager, progress=False)


def _run(llm, batch, params=GREEDY):
    outs = [o.token_ids for o in llm.generate(batch, params)]
    core = llm.core
    graphs = core.executor.worker.runner.decode_graphs
    return outs, graphs, core.scheduler.stats


def _skip_unless_served(backend, dtype, arch="llama"):
    if arch in DEEPSEEK and "=" in backend:
        pytest.skip("a phase split of FLASHINFER is for standard layers (MLA prefill has no FLASHINFER backend)")
    if arch in DEEPSEEK:  # the MLA decode table, asked about the checkpoint's MLA layer
        spec, kind = mla_spec(DEEPSEEK_SHAPE["num_attention_heads"], DEEPSEEK_DIMS), BackendKind.MLA_DECODE
    else:
        spec, kind = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=64), BackendKind.ATTENTION
    problem = AttentionProblem(spec, dtype=dtype, block_size=16, max_model_len=128, device="cuda",
                               compute_capability=torch.cuda.get_device_capability())
    try:
        reasons = load_backend(backend, kind).validate_configuration(problem)
    except ImportError as exc:
        reasons = [str(exc)]
    if reasons:
        pytest.skip("; ".join(reasons))


@pytest.mark.parametrize("arch", [*ARCHS, *DEEPSEEK])
def test_triton_graphs_float32_equal_hf_and_eager(cases, arch):
    path, batch, hf = cases[arch]
    _skip_unless_served("TRITON", "float32", arch)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)  # stops at EOS, as HF's generate
    got, graphs, stats = _run(_llm(path, "TRITON", "float32", enforce_eager=False), batch, params)
    eager, no_graphs, _ = _run(_llm(path, "TRITON", "float32", enforce_eager=True), batch, params)
    assert graphs is not None and graphs.num_steps > 0 and no_graphs is None
    assert stats.num_preemptions > 0 and stats.num_prefix_hit_tokens > 0
    assert got == eager
    for i, (g, p) in enumerate(zip(got, batch)):
        assert g == hf_greedy(hf, p, NEW_TOKENS), f"prompt {i}"



# prefill=FLASHINFER,decode=TRITON: the phase split (attention/backends/phase_split.py); decode
# graphs plan and replay through TRITON, steps with prefills run FLASHINFER's prefill beside it.
@pytest.mark.parametrize("backend", ["TRITON", "FLASHINFER", "prefill=FLASHINFER,decode=TRITON"],
                         ids=["TRITON", "FLASHINFER", "split-FLASHINFER-TRITON"])
@pytest.mark.parametrize("arch", [*ARCHS, *DEEPSEEK])
def test_bf16_graphs_equal_eager(cases, arch, backend):
    path, batch, _ = cases[arch]
    _skip_unless_served(backend, "bfloat16", arch)
    llm = _llm(path, backend, "bfloat16", enforce_eager=False)
    if "=" in backend:
        assert llm.core.info.backend == "FLASHINFER prefill + TRITON decode"
    if arch in DEEPSEEK:  # the MLA decode backend asked for, and MoE experts that run fused
        runner = llm.core.executor.worker.runner
        assert runner.backends[0].decode.name == backend and runner.model.cuda_graph_safe
    got, graphs, stats = _run(llm, batch)
    eager, _, _ = _run(_llm(path, backend, "bfloat16", enforce_eager=True), batch)
    assert graphs is not None and graphs.num_steps > 0
    assert stats.num_preemptions > 0 and stats.num_prefix_hit_tokens > 0
    assert got == eager
