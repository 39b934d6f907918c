"""Piecewise CUDA graphs for steps with prefill tokens (workers/piecewise_graphs.py), skipped
without CUDA.

The batch mixes what a serving step sees: prompts sharing a prefix (prefix-cache hits), a token
budget smaller than some prompts (chunked prefill, chunks beside decodes) and a piecewise limit
below the budget (so some steps with prefill tokens replay graphs and others run eager). float32
TRITON must give HF transformers' greedy tokens exactly; bf16 runs (llama, gemma2 and DeepSeek-V3
with its MLA layers) must give the tokens of the same engine with piecewise graphs off (decode
graphs on in both).
"""

import pytest
import torch

from meshserve import LLM, SamplingParams
from tests.deepseek_models import write_deepseek
from tests.gpu import FLASHINFER_HEAD_DIM
from tests.gpu.test_decode_graphs_gpu import DEEPSEEK_SHAPE, _skip_unless_served
from tests.tiny_models import hf_greedy, prompts, write_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

NEW_TOKENS = 24
MAX_BATCHED_TOKENS = 96
PIECEWISE_TOKENS = 64  # below the step budget: larger steps run eager


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    root = tmp_path_factory.mktemp("piecewise_gpu")
    shared = prompts(1, seed=9, min_len=40, max_len=40)[0]
    batch = [shared + p for p in prompts(10, seed=4, min_len=4, max_len=70)]  # a common 40-token prefix
    assert max(map(len, batch)) > MAX_BATCHED_TOKENS  # some prompts are prefilled in chunks
    out = {arch: (root / arch, batch, write_checkpoint(root / arch, arch, overrides={"head_dim": FLASHINFER_HEAD_DIM}))
           for arch in ("llama", "gemma2")}  # fmt: skip
    out["deepseek_v3"] = (root / "deepseek_v3", batch, write_deepseek(root / "deepseek_v3", "deepseek_v3",
                                                                      **DEEPSEEK_SHAPE))  # fmt: skip
    return out


def _run(path, backend, dtype, tokens, batch, params):
    llm = LLM(path, attention_backend=backend, dtype=dtype, device="cuda", block_size=16, num_kv_blocks=96,
              max_model_len=256, max_num_batched_tokens=MAX_BATCHED_TOKENS, max_num_seqs=8, progress=False,
              piecewise_graph_tokens=tokens, warmup=False)
    try:
        runner = llm.core.executor.worker.runner
        outs = [o.token_ids for o in llm.generate(batch, params)]
        graphs = runner.piecewise_graphs
        return outs, (graphs.num_steps if graphs else 0), llm.core.scheduler.stats
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_piecewise_float32_equals_hf(cases, arch):
    path, batch, hf = cases[arch]
    _skip_unless_served("TRITON", "float32")
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)  # stops at EOS, as HF's generate
    got, steps, stats = _run(path, "TRITON", "float32", PIECEWISE_TOKENS, batch, params)
    assert steps > 0 and stats.num_prefix_hit_tokens > 0
    for i, (g, p) in enumerate(zip(got, batch)):
        assert g == hf_greedy(hf, p, NEW_TOKENS), f"prompt {i}"


@pytest.mark.parametrize("backend", ["TRITON", "FLASHINFER"])
@pytest.mark.parametrize("arch", ["llama", "gemma2", "deepseek_v3"])
def test_piecewise_bf16_equals_eager_prefill(cases, arch, backend):
    """deepseek_v3: MLA layers split at their latent write + attention; MoE fused in the graphs."""
    path, batch, _ = cases[arch]
    _skip_unless_served(backend, "bfloat16", arch)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    got, steps, _ = _run(path, backend, "bfloat16", PIECEWISE_TOKENS, batch, params)
    eager, none, _ = _run(path, backend, "bfloat16", 0, batch, params)
    assert steps > 0 and none == 0
    assert got == eager
