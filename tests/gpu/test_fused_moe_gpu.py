"""The fused MoE on CUDA in bf16 against each model's torch MoE code, T from 1 to 8192, at the
real layer shapes of GPT-OSS-20B and DeepSeek-V2-Lite; CUDA-graph capture of MoE decode steps.
Skipped without CUDA.

Accuracy: the fused layer (float32 accumulation, one rounding per stored tensor) must be at
least about as close to a float32 computation as the bf16 torch reference is. Both get the
same routing (weights and ids), so a near-tie in the router cannot pick different experts.
"""

import copy

import pytest
import torch

from meshserve import LLM, SamplingParams
from meshserve.workers.models.arch import SwigluExperts
from meshserve.workers.models.deepseek_arch import MoEConfig
from meshserve.workers.models.fused_moe import fused_moe
from meshserve.workers.models.gptoss_moe import SwigluMoE
from meshserve.workers.models.moe import MoE, combine_experts
from tests.deepseek_models import write_deepseek
from tests.tiny_models import hf_greedy, prompts, write_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOKENS = [1, 3, 8, 64, 257, 1024, 4096, 8192]


def _random_(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            scale = 0.02 if "bias" not in name else 0.1
            p.copy_(torch.randn(p.shape, generator=gen, device="cuda", dtype=torch.float32) * scale)


@pytest.fixture(scope="module")
def gpt_oss_layer():
    moe = SwigluMoE(2880, 2880, SwigluExperts(num_experts=32, top_k=4)).to("cuda", torch.bfloat16)
    _random_(moe, 1)
    return moe


@pytest.fixture(scope="module")
def deepseek_layer():
    cfg = MoEConfig(num_experts=64, top_k=6, moe_intermediate_size=1408, num_shared_experts=2, num_groups=1,
                    topk_groups=1, routed_scaling_factor=1.0, scoring="softmax", group_by="none",
                    norm_topk_prob=False, correction_bias=False, first_k_dense_replace=0)  # fmt: skip
    moe = MoE(2048, cfg).to("cuda", torch.bfloat16)
    _random_(moe, 2)
    return moe


def _check(x, weights, ids, run16, run32, packed):
    want16 = combine_experts(x, weights, ids, run16).float()
    want32 = combine_experts(x.float(), weights.float(), ids, run32)
    got = fused_moe(x, weights, ids, packed)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    err_ref = (want16 - want32).abs().max().item()
    err = (got.float() - want32).abs().max().item()
    scale = want32.abs().max().item()
    assert err <= 1.5 * err_ref + 1e-3 * scale, f"fused {err:.3g} vs reference {err_ref:.3g} (scale {scale:.3g})"
    rel = (got.float() - want32).norm() / want32.norm()
    assert rel < 1e-2, rel


def _gpt_oss_case(moe, x):
    weights, ids = moe.route(x)
    bank32 = copy.deepcopy(moe.experts).float()
    return weights, ids, moe.experts.run, bank32.run, moe.experts.packed()


def _deepseek_case(moe, x):
    weights, ids = moe.gate(x)
    experts32 = copy.deepcopy(moe.experts).float()
    packed = copy.deepcopy(moe)
    packed.pack_experts()
    return weights, ids, lambda e, xe: moe.experts[e](xe), lambda e, xe: experts32[e](xe), packed.fused


@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("family", ["gpt_oss", "deepseek"])
def test_layer_matches_torch_reference(request, family, T):
    moe = request.getfixturevalue(f"{family}_layer")
    hidden = 2880 if family == "gpt_oss" else 2048
    x = torch.randn(T, hidden, device="cuda", generator=torch.Generator(device="cuda").manual_seed(T)).bfloat16()
    case = _gpt_oss_case if family == "gpt_oss" else _deepseek_case
    _check(x, *case(moe, x))


@pytest.mark.parametrize("routing", ["one_expert", "dropped"])
def test_skewed_and_dropped_routings(gpt_oss_layer, routing):
    moe, T = gpt_oss_layer, 4096
    x = torch.randn(T, 2880, device="cuda", generator=torch.Generator(device="cuda").manual_seed(9)).bfloat16()
    weights, ids = moe.route(x)
    if routing == "one_expert":  # every token's first slot to expert 5 (one expert gets 4096 rows)
        ids = torch.where(ids == 5, ids[:, :1], ids)
        ids[:, 0] = 5
    else:  # a quarter of the slots belong to another EP rank: they contribute nothing
        ids = torch.where(torch.rand(ids.shape, device="cuda") < 0.25, -1, ids)
    bank32 = copy.deepcopy(moe.experts).float()
    want32 = combine_experts(x.float(), weights.float(), ids, bank32.run, num_experts=32)
    got = fused_moe(x, weights, ids, moe.experts.packed(), may_drop=routing == "dropped")
    rel = (got.float() - want32).norm() / want32.norm()
    assert rel < 1e-2, rel


def test_deepseek_moe_layer_replays_in_a_cuda_graph(deepseek_layer):
    """Routing, sorting, both grouped GEMMs, the combine and the shared experts in one graph:
    replays over new inputs equal eager runs (the same kernels on the same shapes)."""
    moe = copy.deepcopy(deepseek_layer)
    moe.pack_experts()
    static = torch.randn(16, 2048, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: Triton compiles and cuBLAS plans outside the capture
            for _ in range(2):
                moe(static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe(static)
        for seed in range(3):
            x = torch.randn(16, 2048, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))
            static.copy_(x.bfloat16())
            graph.replay()
            torch.testing.assert_close(out, moe(static))


NEW_TOKENS = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_gpu")
    return {
        "gpt_oss": (root / "gpt_oss", write_checkpoint(root / "gpt_oss", "gpt_oss", overrides={"head_dim": 64})),
        "deepseek_v3": (root / "deepseek_v3", write_deepseek(root / "deepseek_v3", "deepseek_v3")),
    }


def _llm(path, dtype, *, enforce_eager, backend=None):
    return LLM(path, dtype=dtype, device="cuda", attention_backend=backend, block_size=16, num_kv_blocks=64,
               max_model_len=128, max_num_seqs=8, enforce_eager=enforce_eager, progress=False)


def test_gpt_oss_decode_graphs_equal_eager(tiny):
    path, _ = tiny["gpt_oss"]
    batch = prompts(6, seed=3, min_len=5, max_len=40)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    graphs = _llm(path, "bfloat16", enforce_eager=False, backend="TRITON")
    worker = graphs.core.executor.worker
    assert worker.runner.model.cuda_graph_safe  # the experts run fused
    assert worker.runner.decode_graphs is not None, "the decode steps did not capture graphs"
    got = [o.token_ids for o in graphs.generate(batch, params)]
    graphs.shutdown()
    eager = _llm(path, "bfloat16", enforce_eager=True, backend="TRITON")
    want = [o.token_ids for o in eager.generate(batch, params)]
    assert got == want


@pytest.mark.parametrize("arch", ["gpt_oss", "deepseek_v3"])
def test_fused_experts_float32_equal_hf_greedy(tiny, arch):
    """The fused path inside the whole model (graphs where the attention allows them)."""
    path, hf = tiny[arch]
    llm = _llm(path, "float32", enforce_eager=False, backend="TRITON" if arch == "gpt_oss" else None)
    model = llm.core.executor.worker.runner.model
    assert all(m.fused is not None for m in model.modules() if hasattr(m, "expert_load"))
    batch = prompts(4, seed=8, min_len=6, max_len=40)
    outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    for i, (o, p) in enumerate(zip(outs, batch)):
        assert o.token_ids == hf_greedy(hf, p, NEW_TOKENS), f"prompt {i}"


@pytest.mark.xfail(reason="DeepSeek decode graphs: the MLA attention layer declares no CUDA-graph plan yet "
                          "(its experts are graph-safe: test_deepseek_moe_layer_replays_in_a_cuda_graph)",
                   strict=True)
def test_deepseek_decode_graphs_equal_eager(tiny):
    path, _ = tiny["deepseek_v3"]
    llm = _llm(path, "bfloat16", enforce_eager=False)
    assert llm.core.executor.worker.runner.decode_graphs is not None
