"""The fused MoE on CUDA in bf16 against each model's torch MoE code, T from 1 to 8192, at the
real layer shapes of GPT-OSS-20B and DeepSeek-V2-Lite (the default dispatch, and the sorted
path's tiles passed explicitly at small T); the routing kernel against the torch routing for both families
(GPT-OSS, V2-Lite, V2 with groups, V3 with bias and top-2-sum groups); CUDA-graph capture of MoE
layers (routing kernel + experts) and of GPT-OSS and DeepSeek (MLA) decode steps. Skipped without CUDA.

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
from meshserve.workers.models.fused_moe import fused_moe, tile_config
from meshserve.workers.models.gptoss_moe import SwigluMoE
from meshserve.workers.models.moe import MoE, combine_experts, select_experts
from meshserve.workers.models.moe_routing import RoutingSpec, route_torch
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


def _check(x, weights, ids, run16, run32, packed, *, sorted_path=False):
    want16 = combine_experts(x, weights, ids, run16).float()
    want32 = combine_experts(x.float(), weights.float(), ids, run32)
    config = tile_config(ids.numel(), packed.num_experts) if sorted_path else None
    got = fused_moe(x, weights, ids, packed, config=config)
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


@pytest.mark.parametrize("T, sorted_path", [(T, False) for T in TOKENS] + [(T, True) for T in (1, 8, 16)])
@pytest.mark.parametrize("family", ["gpt_oss", "deepseek"])
def test_layer_matches_torch_reference(request, family, T, sorted_path):
    """Default dispatch, and the sorted path with its tiles passed explicitly at small T."""
    moe = request.getfixturevalue(f"{family}_layer")
    hidden = 2880 if family == "gpt_oss" else 2048
    x = torch.randn(T, hidden, device="cuda", generator=torch.Generator(device="cuda").manual_seed(T)).bfloat16()
    case = _gpt_oss_case if family == "gpt_oss" else _deepseek_case
    _check(x, *case(moe, x), sorted_path=sorted_path)


@pytest.mark.parametrize("T", [5, 4096])  # small (the smallest tiles), large
@pytest.mark.parametrize("routing", ["one_expert", "dropped"])
def test_skewed_and_dropped_routings(gpt_oss_layer, routing, T):
    moe = gpt_oss_layer
    x = torch.randn(T, 2880, device="cuda", generator=torch.Generator(device="cuda").manual_seed(9)).bfloat16()
    weights, ids = moe.route(x)
    if routing == "one_expert":  # every token's first slot to expert 5 (one expert gets 4096 rows)
        ids = torch.where(ids == 5, ids[:, :1], ids)
        ids[:, 0] = 5
    else:  # a quarter of the slots belong to another EP rank: they contribute nothing
        ids = torch.where(torch.rand(ids.shape, device="cuda") < 0.25, -1, ids)
    bank32 = copy.deepcopy(moe.experts).float()
    want32 = combine_experts(x.float(), weights.float(), ids, bank32.run, num_experts=32)
    load = torch.zeros(32, dtype=torch.int64, device="cuda")
    got = fused_moe(x, weights, ids, moe.experts.packed(), may_drop=routing == "dropped", expert_load=load)
    rel = (got.float() - want32).norm() / want32.norm()
    assert rel < 1e-2, rel
    flat = ids.reshape(-1)
    assert torch.equal(load, torch.bincount(flat[flat >= 0], minlength=32))  # the load statistics (from the alignment)


ROUTINGS = {  # (spec, correction bias scale, logits dtype)
    "gpt_oss": (RoutingSpec(32, 4, scoring="topk_softmax"), None, torch.bfloat16),
    "v2_lite": (RoutingSpec(64, 6, scoring="softmax"), None, torch.float32),
    "v2": (RoutingSpec(160, 6, scoring="softmax", group_by="max", num_groups=8, topk_groups=3,
                       routed_scaling_factor=16.0), None, torch.float32),
    "v3": (RoutingSpec(256, 8, scoring="sigmoid", group_by="top2_sum", num_groups=8, topk_groups=4,
                       norm_topk_prob=True, routed_scaling_factor=2.5), 0.1, torch.float32),
}  # fmt: skip


@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("name", list(ROUTINGS))
def test_routing_kernel_matches_torch_routing(name, T):
    """ids equal torch's. float32 scores from two exp/sigmoid implementations (torch's expf, Triton's
    exp2-based) can order a near-tie (a few ulps apart) differently: above T = 8 at most 0.1 % of
    the tokens may differ (a rough estimate for 256 experts: 1e-5 per token). bf16 logits (GPT-OSS) compare
    the same values in both, ties included: always equal."""
    spec, bias_scale, dtype = ROUTINGS[name]
    gen = torch.Generator(device="cuda").manual_seed(T)
    logits = (torch.randn(T, spec.num_experts, generator=gen, device="cuda") * 2).to(dtype)
    bias = None if bias_scale is None else torch.randn(spec.num_experts, generator=gen, device="cuda") * bias_scale
    want_w, want_ids = route_torch(logits, spec, bias)
    got_w, got_ids = select_experts(logits, spec, bias)
    assert got_ids.dtype == torch.int64 and got_w.dtype == dtype
    differ = (got_ids != want_ids).any(dim=1)
    if dtype == torch.bfloat16 or T <= 8:
        assert not differ.any(), differ.nonzero()[:5]
    else:
        assert differ.float().mean() <= 1e-3, differ.float().mean()
    tol = dict(atol=8e-3, rtol=1.6e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_w[~differ].float(), want_w[~differ].float(), **tol)


@pytest.mark.parametrize("T", [1, 16, 64])
@pytest.mark.parametrize("family", ["gpt_oss", "deepseek"])
def test_moe_layer_with_routing_kernel_replays_in_a_cuda_graph(request, family, T):
    """Router matmul, routing kernel, experts (sorted path), load counters (+ shared
    experts) in one graph: replays over new inputs equal eager runs, and the counters advance by
    T * k per replay."""
    moe = copy.deepcopy(request.getfixturevalue(f"{family}_layer"))
    moe.pack_experts()
    hidden, k = (2880, 4) if family == "gpt_oss" else (2048, 6)
    static = torch.randn(T, hidden, device="cuda", dtype=torch.bfloat16)
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
            x = torch.randn(T, hidden, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))
            static.copy_(x.bfloat16())
            before = moe.expert_load.sum().item()
            graph.replay()
            torch.cuda.synchronize()
            assert moe.expert_load.sum().item() == before + T * k
            torch.testing.assert_close(out, moe(static))


@pytest.mark.parametrize("T, real", [(4, 3), (64, 41)])
@pytest.mark.parametrize("family", ["gpt_oss", "deepseek"])
def test_moe_layer_drops_padding_rows_in_a_cuda_graph(request, family, T, real):
    """A graph bucket of T rows whose first `real` are tokens (num_real_tokens, a static buffer
    written before each replay): the real rows equal an eager run without the count, the padding
    rows' routed output is 0 (DeepSeek: the shared experts' alone), and the counters advance by
    real * k (the eager references count too: read before them)."""
    moe = copy.deepcopy(request.getfixturevalue(f"{family}_layer"))
    moe.pack_experts()
    hidden, k = (2880, 4) if family == "gpt_oss" else (2048, 6)
    static = torch.randn(T, hidden, device="cuda", dtype=torch.bfloat16)
    count = torch.full((1,), T, dtype=torch.int32, device="cuda")
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                moe(static, num_real_tokens=count)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe(static, num_real_tokens=count)
        shared = moe.shared_experts if family == "deepseek" else None
        for n in (real, T, 0):
            static.copy_(torch.randn(T, hidden, device="cuda", generator=torch.Generator(device="cuda").manual_seed(n)))
            count.fill_(n)
            before = moe.expert_load.sum().item()
            graph.replay()
            torch.cuda.synchronize()
            assert moe.expert_load.sum().item() == before + n * k
            # References over the same T rows (the same router GEMM: no near-tie flips between shapes).
            torch.testing.assert_close(out[:n], moe(static)[:n])
            pad = out[n:]
            assert torch.isfinite(pad).all()
            torch.testing.assert_close(pad, torch.zeros_like(pad) if shared is None else shared(static)[n:])


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


@pytest.mark.parametrize("arch", ["gpt_oss", "deepseek_v3"])
def test_moe_decode_graphs_equal_eager(tiny, arch):
    """Attention (DeepSeek: MLA, TRITON decode) and the fused experts in one decode graph per bucket.
    6 sequences fill bucket 8 with 2 padding rows: they run on no expert, so each MoE layer counts
    k rows per real token, as the eager run does (and start-up's warm-ups count nothing)."""
    path, _ = tiny[arch]
    batch = prompts(6, seed=3, min_len=5, max_len=40)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)

    def routed_rows(llm) -> list[int]:  # per MoE layer (sums: near-tie choices may differ, counts may not)
        return [int(m.expert_load.sum()) for m in llm.core.executor.worker.runner.model.expert_layers()]

    graphs = _llm(path, "bfloat16", enforce_eager=False, backend="TRITON")
    worker = graphs.core.executor.worker
    assert worker.runner.model.cuda_graph_safe  # the experts run fused
    assert worker.runner.decode_graphs is not None, "the decode steps did not capture graphs"
    assert set(routed_rows(graphs)) == {0}  # the warm-ups and the activation probe counted nothing
    got = [o.token_ids for o in graphs.generate(batch, params)]
    assert worker.runner.decode_graphs.num_steps > 0
    got_rows = routed_rows(graphs)
    graphs.shutdown()
    eager = _llm(path, "bfloat16", enforce_eager=True, backend="TRITON")
    want = [o.token_ids for o in eager.generate(batch, params)]
    assert got == want
    want_rows = routed_rows(eager)
    assert got_rows == want_rows and want_rows[0] > 0


@pytest.mark.parametrize("arch", ["gpt_oss", "deepseek_v3"])
def test_fused_experts_float32_equal_hf_greedy(tiny, arch):
    """The fused path inside the whole model, decode steps in graphs (DeepSeek: the platform's
    first MLA decode backend for float32 and a 32 + 8 latent, TRITON)."""
    path, hf = tiny[arch]
    llm = _llm(path, "float32", enforce_eager=False, backend="TRITON" if arch == "gpt_oss" else None)
    model = llm.core.executor.worker.runner.model
    assert model.expert_layers() and all(m.fused is not None for m in model.expert_layers())
    assert llm.core.executor.worker.runner.decode_graphs is not None
    batch = prompts(4, seed=8, min_len=6, max_len=40)
    outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    for i, (o, p) in enumerate(zip(outs, batch)):
        assert o.token_ids == hf_greedy(hf, p, NEW_TOKENS), f"prompt {i}"
